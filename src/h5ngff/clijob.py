"""The ConversionJob commands of the CLI: ``run JOB.yaml``, ``operator`` and the hidden ``runner``.

Kept out of ``cli.py`` so that file stays about local conversions; ``cli.build_parser`` calls
``add_job_commands``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import yaml
from rich.console import Console

log = logging.getLogger(__name__)

EPILOG_RUN = """\
examples:
  h5ngff demo                                           # writes h5ngff-demo/sample.h5
  h5ngff run manifests/examples/conversionjob.yaml      # convert it as the manifest says
  h5ngff run job.yaml --json > status.json

Runs one attempt on this machine (the operator retries up to spec.backoffLimit) and prints the
.status the operator would write: phase, plan, progress, result, reason. The spec.pod section
(image, volumes, placement) only matters on Kubernetes. Relative paths resolve against the
current directory. Exit status: 0 Succeeded, 1 failed, 2 bad manifest or input, 3 output refused
(the table: h5ngff --help).
"""


def add_job_commands(sub: Any, common_run_flags) -> None:
    r = sub.add_parser(
        "run",
        help="Run a ConversionJob manifest locally and print the status the operator would write.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG_RUN,
        description="Run a ConversionJob manifest (the file you would kubectl apply) on a local Dask cluster.",
    )
    r.add_argument(
        "manifest",
        metavar="JOB.yaml",
        help="A ConversionJob manifest (apiVersion h5ngff.dev/v1alpha1); a ConversionBatch runs with h5ngff batch.",
    )
    common_run_flags(r, convert=True)
    r.set_defaults(func=cmd_run)

    o = sub.add_parser(
        "operator",
        help="Run the Kubernetes operator (kopf) that reconciles ConversionJobs.",
        description="Watch ConversionJobs and run each as a runner Job with a Dask cluster sized by its plan.",
    )
    o.add_argument(
        "--image",
        default=os.environ.get("H5NGFF_IMAGE"),
        help="Image for runner and Dask pods when a job names none (default $H5NGFF_IMAGE).",
    )
    o.add_argument(
        "--runner-service-account",
        default=os.environ.get("H5NGFF_RUNNER_SERVICE_ACCOUNT"),
        metavar="NAME",
        help="Service account of runner pods when a job names none (needs the runner RBAC; the Helm chart creates h5ngff-runner).",
    )
    _policy_flags(o)
    o.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="Serve only this namespace (repeatable; default: the whole cluster).",
    )
    o.add_argument(
        "--interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="Seconds between reconcile passes of each ConversionJob (default 5; finished jobs too, without API calls).",
    )
    o.add_argument(
        "--peering",
        default="h5ngff",
        metavar="NAME",
        help="kopf peering object name, so replicas take turns (default h5ngff).",
    )
    o.add_argument("--standalone", action="store_true", help="No peering: run as the only operator replica.")
    o.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "default",
        metavar="NS",
        help="Namespace of the output Leases (one writer per output, cluster-wide; default $POD_NAMESPACE, the "
        "operator's own in the Helm chart, else default).",
    )
    o.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="Peering priority (default: random per process, so replicas never tie; the highest live one acts).",
    )
    o.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="Serve the operator's Prometheus metrics on this port."
    )
    o.add_argument("--liveness", metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz.")
    o.set_defaults(func=cmd_operator)
    _add_render(o)

    # The runner Job's container command; not for people, hence no help entry.
    # Everything it runs comes from its runner contract (operator/contract.py), the container's
    # environment; the flags override the contract's identity, for running a runner by hand.
    x = sub.add_parser("runner")
    x.add_argument("--namespace")
    x.add_argument("--name")
    x.add_argument("--uid")
    x.add_argument("--attempt", type=int)
    x.set_defaults(func=cmd_runner)
    _hide(sub, "runner")


EPILOG_RENDER = """\
examples:
  h5ngff operator render job.yaml > rendered.yaml
  h5ngff operator render job.yaml --image registry.example.org/lab/h5ngff:0.2.0 \\
      --runner-service-account h5ngff-runner --allowed-volume-type csi
  h5ngff operator render job.yaml --plan      # opens the HDF5 file: adds the DaskCluster
  h5ngff operator render job.yaml --plan | kubectl apply --dry-run=server -f -
  h5ngff operator render manifests/examples/conversionbatch.yaml   # a batch: every item in attempt 1

Prints, as YAML, what the operator would create for the manifest with these settings (pass the
same flags as the operator Deployment: the Helm chart's jobDefaults.image, runner.serviceAccount
and policy.* values): the runner Job of attempt 1, and the Role and RoleBinding that let that
runner patch its own job's status. With --plan, the DaskCluster the runner would create, its
worker pods sized by the plan (source.path is read from this machine, relative to the current
directory). A ConversionBatch gives the same three objects, its runner Job running every item
(no --plan: its runner sizes the DaskCluster by its largest item at run time). ownerReferences
carry metadata.uid if the manifest has one, else a placeholder.
Exit status: 0 printed, 2 invalid manifest or refused by the policy (PolicyDenied).
"""


def _add_render(o: argparse.ArgumentParser) -> None:
    sub = o.add_subparsers(dest="operator_command", metavar="render")
    r = sub.add_parser(
        "render",
        help="Print the objects the operator would create for a ConversionJob or ConversionBatch manifest.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG_RENDER,
        description="Print the runner Job (and with --plan the DaskCluster) the operator would create, for review and GitOps diffs.",
    )
    r.add_argument(
        "manifest",
        metavar="JOB.yaml",
        help="A ConversionJob or ConversionBatch manifest (apiVersion h5ngff.dev/v1alpha1).",
    )
    r.add_argument(
        "--plan",
        action="store_true",
        help="Plan the conversion (opens the HDF5 file) and add the DaskCluster with its planned pod limits.",
    )
    r.add_argument(
        "--image",
        default=os.environ.get("H5NGFF_IMAGE"),
        help="The operator's --image (default $H5NGFF_IMAGE, else the built-in default).",
    )
    r.add_argument(
        "--runner-service-account",
        default=os.environ.get("H5NGFF_RUNNER_SERVICE_ACCOUNT"),
        metavar="NAME",
        help="The operator's --runner-service-account (default $H5NGFF_RUNNER_SERVICE_ACCOUNT, else the chart's h5ngff-runner).",
    )
    r.add_argument(
        "--namespace",
        default="default",
        metavar="NS",
        help="Namespace of a manifest that names none (default: default).",
    )
    _policy_flags(r)
    r.set_defaults(func=cmd_render)


def cmd_render(args: argparse.Namespace, console: Console) -> int:
    from .errors import SpecError
    from .job import KIND, load_document, manifest_head, parse_manifest, parse_spec_of
    from .clirender import RenderOptions, render_batch_objects, render_objects
    from .jobspec import BATCH_KIND
    from .operator.controller.manifests import CHART_RUNNER_ACCOUNT, DEFAULT_IMAGE
    from .operator.schema.batchspec import parse_batch_spec

    opts = RenderOptions(
        image=args.image or DEFAULT_IMAGE,
        runner_service_account=args.runner_service_account or CHART_RUNNER_ACCOUNT,
        policy=policy_from_args(args),
        namespace=args.namespace,
        plan=args.plan,
    )
    doc = load_document(args.manifest, (KIND, BATCH_KIND))
    if doc.get("kind") == BATCH_KIND:
        if args.plan:
            raise SpecError(
                "--plan",
                "Expected --plan with a ConversionJob. Got a ConversionBatch instead: its runner sizes the "
                "DaskCluster by its largest item at run time (h5ngff batch BATCH.yaml shows that plan locally).",
            )
        name, namespace = manifest_head(doc)
        uid = (doc.get("metadata") or {}).get("uid")
        objects = render_batch_objects(parse_spec_of(doc, parse_batch_spec), name, namespace, uid, opts)
    else:
        objects = render_objects(parse_manifest(doc, args.manifest), opts)
    sys.stdout.write(
        f"# h5ngff operator render {args.manifest}{' --plan' if args.plan else ''}: what the operator would create\n"
    )
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=120, explicit_start=True))
    return 0


def _policy_flags(p: argparse.ArgumentParser) -> None:
    """The tenant policy (operator/schema/policy.py); the Helm chart sets these from its policy.* values."""
    from .operator.schema.policy import DEFAULT_VOLUME_TYPES

    g = p.add_argument_group(
        "tenant policy",
        "What a ConversionJob's spec.pod may ask for; a job asking for more fails with reason PolicyDenied.",
    )
    g.add_argument(
        "--allowed-image",
        action="append",
        default=[],
        metavar="PATTERN",
        help="An image pattern (shell glob, e.g. 'registry.example.org/lab/*') spec.pod.image may name; repeatable. --image is always allowed.",
    )
    g.add_argument(
        "--allowed-service-account",
        action="append",
        default=[],
        metavar="NAME",
        help="A service account spec.pod.serviceAccountName may name; repeatable. --runner-service-account is always allowed.",
    )
    g.add_argument(
        "--allowed-volume-type",
        action="append",
        metavar="TYPE",
        help=f"A volume type (PodSpec field, e.g. csi) spec.pod.volumes may use; repeatable; replaces the default {', '.join(DEFAULT_VOLUME_TYPES)}.",
    )
    g.add_argument(
        "--allowed-toleration-key",
        action="append",
        default=[],
        metavar="PATTERN",
        help="A taint key (shell glob, e.g. 'dedicated' or 'nvidia.com/*') spec.pod.tolerations may tolerate; repeatable. Default none; '*' allows any, and a toleration without a key.",
    )


def policy_from_args(args: argparse.Namespace):
    from .operator.schema.policy import DEFAULT_VOLUME_TYPES, TenantPolicy

    return TenantPolicy(
        tuple(args.allowed_image),
        tuple(args.allowed_service_account),
        tuple(args.allowed_volume_type) if args.allowed_volume_type else DEFAULT_VOLUME_TYPES,
        tuple(args.allowed_toleration_key),
    )


def _hide(sub: Any, name: str) -> None:
    # argparse has no hidden subcommands; drop the entry from the help listing.
    sub._choices_actions[:] = [a for a in sub._choices_actions if a.dest != name]


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    """``h5ngff run``'s input and output around one attempt (``operator.runner.attempt``, the run sequence)."""
    from .cliargs import backend_from_args, constants_from_args
    from .console import make_console, print_notices, print_warning
    from .engine.progress import Listener
    from .job import load_job
    from .operator.runner.attempt import AttemptOptions, run_locally
    from .report import ProgressBar, plan_renderable, plan_summary_renderable
    from .runner import Linger, PlannedJob

    job = load_job(args.manifest)
    if args.memory_report:
        from .metrics.timeline import check_report_path

        check_report_path(args.memory_report)
    metrics = None
    if getattr(args, "metrics_port", None) is not None:
        from .metrics.exporter import MetricsExporter

        # Labelled as the operator's runner would label it: the ConversionJob's name and namespace.
        metrics = MetricsExporter(args.metrics_port, job.name, job.namespace or "local")
    spec = job.spec
    if args.overwrite:
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"overwrite": True})})

    notes = make_console(stderr=True)  # as for convert: the plan and the results on stdout, the bar on stderr

    def show_plan(planned: PlannedJob) -> None:
        if args.json:
            return
        if args.verbose:
            console.print(plan_renderable(planned, notices=False))
        else:
            console.print(plan_summary_renderable(planned, args.manifest), highlight=False, soft_wrap=True)
        print_notices(planned.notices)

    bar: list[Listener] = [] if args.json or args.no_progress else [ProgressBar(notes)]
    options = AttemptOptions(
        constants_from_args(args), bar, show_plan, metrics=metrics, linger=Linger(args.metrics_linger)
    )
    status, result = run_locally(job.name, spec, backend_from_args(args, spec.slurm), options)
    if args.memory_report and result.summary is not None:
        from .metrics.timeline import report_failure

        if (failure := report_failure(result.summary, args.memory_report)) is not None:
            print_warning(failure)
    document = {
        "apiVersion": job.raw["apiVersion"],
        "kind": job.raw["kind"],
        "metadata": {"name": job.name},
        "status": status,
    }
    if args.json:
        print(json.dumps(document, indent=1, default=str))
    else:
        console.print(yaml.safe_dump(document, sort_keys=False, width=120), highlight=False, markup=False)
    return result.exit_code


def cmd_operator(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from .operator.controller.handlers import OperatorConfig, run_operator
    from .operator.controller.manifests import DEFAULT_IMAGE

    metrics = None
    if args.metrics_port:
        from .metrics.operator import OperatorMetrics

        metrics = OperatorMetrics()
        metrics.serve(args.metrics_port)
    cfg = OperatorConfig(
        image=args.image or DEFAULT_IMAGE,
        runner_service_account=args.runner_service_account,
        interval=args.interval,
        namespaces=tuple(args.namespace),
        policy=policy_from_args(args),
        peering=None if args.standalone else args.peering,
        metrics=metrics,
        lease_namespace=args.lease_namespace,
    )
    if args.priority is not None:
        cfg.priority = args.priority
    asyncio.run(run_operator(cfg, liveness=args.liveness))
    return 0


def cmd_runner(args: argparse.Namespace, console: Console) -> int:
    from .operator.runner.main import main

    logging.getLogger("h5ngff").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    return main(namespace=args.namespace, name=args.name, uid=args.uid, attempt=args.attempt)
