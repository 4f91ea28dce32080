"""The Kubernetes API permissions h5ngff needs: one list for docs, the Helm chart and the tests.

``OPERATOR_RULES`` are the operator's (a ClusterRole, or a Role per served namespace);
``RUNNER_RULES`` are the runner pod's (its ``spec.pod.serviceAccountName``). Each rule says why.
``exercised=True`` rules are exactly the calls the KMock tests record the operator and the runner
making (``tests/test_operator_kmock.py`` and ``tests/test_operator_kubecluster.py`` fail on any
difference). The others are needed only on paths the tests do not take: namespaced peering,
namespace patterns, blockOwnerDeletion admission, a busy output, and a scheduler that fails to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ...jobspec import GROUP


@dataclass(frozen=True)
class Rule:
    api_group: str
    resource: str  #: "plural" or "plural/subresource"
    verbs: tuple[str, ...]
    why: str
    exercised: bool = True


OPERATOR_RULES: tuple[Rule, ...] = (
    Rule(
        GROUP,
        "conversionjobs",
        ("list", "watch", "patch"),
        "kopf watches ConversionJobs and patches its finalizer and annotations",
    ),
    # Only when an output is busy, which no recording test sets up; tests/test_operator_lease_keys.py makes this call.
    Rule(
        GROUP,
        "conversionjobs",
        ("get",),
        "a busy output's Lease counts as abandoned once its holder ConversionJob is gone (a force-deleted namespace)",
        exercised=False,
    ),
    Rule(GROUP, "conversionjobs/status", ("patch",), "phase, attempts, conditions, failure reasons"),
    Rule(
        "batch",
        "jobs",
        ("get", "list", "watch", "create", "delete"),
        "one runner Job per attempt; watched through a kopf index (a Job missing there is looked up before it counts as deleted); deleted with the ConversionJob",
    ),
    Rule(
        "",
        "pods",
        ("list",),
        "why a runner pod failed or does not start; a new attempt waits until the previous one's pods have exited",
    ),
    Rule(
        "",
        "events",
        ("create", "list"),
        "Kubernetes Events for key transitions; the Job controller's FailedCreate events of a runner Job",
    ),
    Rule(
        "coordination.k8s.io",
        "leases",
        ("get", "list", "create", "delete"),
        "one writer per output: a Lease per output, held while a job runs, in the operator's namespace (listed to find nested outputs; in served namespaces for Leases of earlier builds)",
    ),
    Rule(
        "rbac.authorization.k8s.io",
        "roles",
        ("create",),
        "a Role per ConversionJob letting its runner patch that job's status only (RUNNER_JOB_RULES)",
    ),
    Rule(
        "rbac.authorization.k8s.io", "rolebindings", ("create",), "binds that Role to the runner pod's service account"
    ),
    Rule(
        "kubernetes.dask.org",
        "daskclusters",
        ("list", "watch", "delete"),
        "removes a DaskCluster left by a failed attempt or a deleted job; checks every DaskCluster against the tenant policy and deletes one that asks for more (operator/controller/guard.py)",
    ),
    Rule(
        "apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "kopf discovers the resources it serves"
    ),
    Rule("", "namespaces", ("list", "watch"), "kopf, when serving namespaces by pattern", exercised=False),
    Rule("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"), "kopf peering between replicas (cluster-wide)"),
    Rule(
        "kopf.dev",
        "kopfpeerings",
        ("list", "watch", "patch"),
        "kopf peering between replicas (with --namespace)",
        exercised=False,
    ),
    Rule(
        GROUP,
        "conversionjobs/finalizers",
        ("update",),
        "runner Jobs' ownerReferences set blockOwnerDeletion",
        exercised=False,
    ),
    # ConversionBatches: kopf watches them in every run; the rest only where a batch exists
    # (tests/test_operator_batch.py checks its calls against these rules).
    Rule(GROUP, "conversionbatches", ("list", "watch"), "kopf watches ConversionBatches"),
    Rule(
        GROUP,
        "conversionbatches",
        ("get", "patch"),
        "kopf patches a ConversionBatch's finalizer and annotations; a busy output's Lease "
        "counts as abandoned once its holder ConversionBatch is gone",
        exercised=False,
    ),
    Rule(GROUP, "conversionbatches/status", ("patch",), "phase, counts, items, conditions", exercised=False),
    Rule(
        GROUP,
        "conversionbatches/finalizers",
        ("update",),
        "runner Jobs' ownerReferences set blockOwnerDeletion",
        exercised=False,
    ),
)

#: The runner's permission on its own ConversionJob, granted per job: the operator creates a Role
#: with ``resourceNames: [<job>]`` and a RoleBinding to the runner pod's service account, both
#: owned by the ConversionJob (garbage-collected with it). A namespace-wide grant would let one
#: team's runner (any image the policy allows) rewrite every other job's status. The operator
#: may create this Role because it holds the same permission itself (RBAC's escalation check).
RUNNER_JOB_RULES: tuple[Rule, ...] = (
    Rule(
        GROUP,
        "conversionjobs/status",
        ("patch",),
        "plan, progress, result and the attempt's outcome, of its own job only",
    ),
)

#: The same for a ConversionBatch's runner: its per-item reports, of its own batch only.
RUNNER_BATCH_RULES: tuple[Rule, ...] = (
    Rule(
        GROUP, "conversionbatches/status", ("patch",), "each item's report (status.itemReports), of its own batch only"
    ),
)

RUNNER_RULES: tuple[Rule, ...] = (
    # RBAC cannot limit create to some pod specs: the operator re-checks every DaskCluster
    # against the tenant policy and its ConversionJob, and deletes one that asks for more.
    Rule(
        "kubernetes.dask.org",
        "daskclusters",
        ("get", "list", "create", "delete"),
        "dask-kubernetes' KubeCluster creates the run's cluster and deletes it after; the operator re-checks every DaskCluster's pods "
        "against the tenant policy and deletes one that asks for more (operator/controller/guard.py)",
    ),
    Rule("kubernetes.dask.org", "daskworkergroups", ("list",), "KubeCluster looks up the cluster's worker groups"),
    Rule("", "pods", ("get", "list"), "KubeCluster waits for the scheduler pod"),
    Rule("", "services", ("get", "list"), "KubeCluster finds the scheduler's service"),
    Rule("", "pods/log", ("get",), "KubeCluster fetches the scheduler's logs when it fails to start", exercised=False),
)


def calls(rules: Iterable[Rule], exercised_only: bool = True) -> set[tuple[str, str, str, str]]:
    """(verb, apiGroup, resource, subresource) tuples, the form the tests record."""
    out: set[tuple[str, str, str, str]] = set()
    for rule in rules:
        if exercised_only and not rule.exercised:
            continue
        resource, _, sub = rule.resource.partition("/")
        out.update((verb, rule.api_group, resource, sub) for verb in rule.verbs)
    return out


def role_rules(rules: Iterable[Rule], resource_names: list[str] | None = None) -> list[dict[str, Any]]:
    """As RBAC ``rules:`` entries (one per rule, so each keeps its reason in docs), limited to
    ``resource_names`` when given."""
    names = {"resourceNames": list(resource_names)} if resource_names else {}
    return [{"apiGroups": [r.api_group], "resources": [r.resource], **names, "verbs": list(r.verbs)} for r in rules]
