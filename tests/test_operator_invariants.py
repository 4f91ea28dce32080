"""One writer per output, as an invariant: a hypothesis state machine over the controller.

The controller's passes (jobpass.reconcile_job, batchpass.reconcile_batch_once, the finalizers'
children.remove_children: the pure reconcile, the Lease logic and the order the decisions are
carried out in) run over an in-memory API (tests/memory_api.py) while the machine plays
everyone else, in any order: users apply, edit and delete ConversionJobs and ConversionBatches
that share outputs; runners start, make their Dask clusters, report and exit; pods terminate
slowly; Kubernetes refuses a runner Job or loses the answer; a finished runner Job's TTL removes
it; the operator restarts between passes or dies in the middle of one.

After every step it asserts (issue 41):

1. at most one attempt able to write uses each output key (a live runner or Dask pod of it), and
   that attempt's object holds the output's Lease;
2. no finished conversion runs again unless its conversion changed (compared normalised: a
   default written out is no change): a runner Job is never created for a job, or a batch item,
   whose runner reported success for the conversion its spec still asks for.

Profiles: ``H5NGFF_PROPERTY_PROFILE=ci`` (default, about a minute on 2 cores) or ``long``
(docs/operator.md, "Tests"). Each failure it found is pinned as a named replay in
tests/test_operator_invariant_regressions.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from properties import PROFILE, examples
from hypothesis import HealthCheck, event, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from memory_api import Crash, MemoryApi, live

from h5ngff.jobspec import API_VERSION, BATCH_KIND, BATCH_PLURAL, KIND, PLURAL, Owner, parse_job_spec
from h5ngff.k8s import LABEL_ATTEMPT, dask_cluster_name
from h5ngff.operator.controller.batchpass import reconcile_batch_once
from h5ngff.operator.controller.children import remove_children
from h5ngff.operator.controller.diagnose import job_summary
from h5ngff.operator.controller.jobpass import reconcile_job
from h5ngff.operator.controller.lease import KEY_ANNOTATION, LeaseScope, holder_identity, output_key
from h5ngff.operator.controller.state import ControllerState, OperatorConfig
from h5ngff.operator.kube import KubeError
from h5ngff.operator.schema.batchspec import parse_batch_spec
from h5ngff.operator.schema.policy import TenantPolicy
from h5ngff.spec import ConversionSpec

NS, LEASES = "team", "h5ngff"
IMAGE = "registry.example/h5ngff:1"
#: Jobs and batches share these outputs (a batch item's output is /data/o/<stem>.ome.zarr).
OUTPUTS = ("/data/o/a.ome.zarr", "/data/o/b.ome.zarr")
STEMS = ("a", "b")
#: "j2" names a job and a batch: a pair of one name (NameTaken).
JOB_NAMES, BATCH_NAMES = ("j1", "j2"), ("b1", "j2")
IMAGES = (None, "registry.example/h5ngff:2", "evil.example/miner:1")  # default, allowed, denied

#: The profiles every property test shares (tests/properties.py); H5NGFF_PROPERTY_EXAMPLES
#: overrides the example count of either.
SETTINGS = settings(
    max_examples=int(os.environ.get("H5NGFF_PROPERTY_EXAMPLES", str(examples(ci=2000, long=20000)))),
    stateful_step_count=examples(ci=50, long=80),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def note(text: str) -> None:
    """A hypothesis event (how deep the examples go: ``--hypothesis-show-statistics``), also when
    a regression test replays the steps outside hypothesis."""
    if currently_in_test_context():
        event(text)


def normalised(spec: Any) -> str:
    """The conversion a spec asks for, defaults left out: the test's own oracle (not the
    operator's hash), so a default written out is the same conversion by construction."""
    dump = spec.model_dump(by_alias=True, exclude_defaults=True, exclude_none=True, mode="json")
    fields = {f.alias or n for n, f in ConversionSpec.model_fields.items()}
    conversion = {k: v for k, v in dump.items() if k in fields}
    conversion["output"] = {k: v for k, v in conversion.get("output", {}).items() if k != "overwrite"}
    where = {k: v for k, v in dump.get("pod", {}).items() if k in ("volumes", "volumeMounts", "workingDir")}
    return json.dumps([conversion, where], sort_keys=True)


def job_spec(output: str, dataset: str, default_written: bool, overwrite: bool, image: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"path": output, "overwrite": overwrite}
    if default_written:
        out["checksums"] = True  # the default, written out
    spec: dict[str, Any] = {
        "source": {"path": "/data/in/x.h5", "dataset": dataset},
        "output": out,
        "backoffLimit": 1,
        "retry": {"intervalSeconds": 0},
    }
    if image:
        spec["pod"] = {"image": image}
    return spec


def batch_spec(stems: tuple[str, ...], dataset: str, default_written: bool, image: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"path": "/data/o/{stem}.ome.zarr"}
    if default_written:
        out["checksums"] = True
    items = [{"source": {"path": f"/data/in/{s}.h5", "dataset": dataset}} for s in stems]
    spec: dict[str, Any] = {"items": items, "output": out, "backoffLimit": 1}
    if image:
        spec["pod"] = {"image": image}
    return spec


class OperatorWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.api = MemoryApi()
        self.cfg = OperatorConfig(
            image=IMAGE, policy=TenantPolicy(allowed_images=("registry.example/*",)), lease_namespace=LEASES
        )
        self.state = self._fresh_state()
        #: Pod name -> (holder identity, attempt, output keys it may write).
        self.writes: dict[str, tuple[str, int, frozenset[str]]] = {}
        #: (object uid, item id or "") -> the conversion its runner reported converted.
        self.finished: dict[tuple[str, str], str] = {}
        self.jobs_seen: set[str] = set()
        #: Runner Jobs whose runner has given its last word (a runner reports an outcome once).
        self.reported: set[str] = set()
        self.reruns: list[str] = []

    def _fresh_state(self) -> ControllerState:
        return ControllerState(self.api, LeaseScope(LEASES))

    def teardown(self) -> None:
        self.loop.close()
        note(f"runner Jobs created: {min(len(self.jobs_seen), 4)}{'+' * (len(self.jobs_seen) >= 4)}")

    # -- what is there --------------------------------------------------------------------------

    def _objects(self) -> dict[tuple[str, str], dict[str, Any]]:
        out = {}
        for plural, kind in ((PLURAL, KIND), (BATCH_PLURAL, BATCH_KIND)):
            for name, obj in self.api.of(API_VERSION, NS, plural).items():
                out[kind, name] = obj
        return out

    def _runner_jobs(self) -> dict[str, dict[str, Any]]:
        return self.api.of("batch/v1", NS, "jobs")

    def _pods(self) -> dict[str, dict[str, Any]]:
        return self.api.of("v1", NS, "pods")

    def _runner_pod(self, job: str) -> dict[str, Any] | None:
        pod = self._pods().get(f"{job}-pod")
        return pod if pod is not None and live(pod) and "deletionTimestamp" not in pod["metadata"] else None

    # -- the users ------------------------------------------------------------------------------

    def _apply(self, kind: str, name: str, spec: dict[str, Any]) -> None:
        plural = PLURAL if kind == KIND else BATCH_PLURAL
        current = self._objects().get((kind, name))
        if current is None:
            body = {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
            self.api.put(API_VERSION, NS, plural, body)
        elif "deletionTimestamp" not in current["metadata"] and current["spec"] != spec:
            current["spec"] = spec
            current["metadata"]["generation"] += 1

    @initialize(
        job_output=st.sampled_from(OUTPUTS),
        stems=st.sampled_from((("a",), ("b",), ("a", "b"))),
        batch_first=st.booleans(),
    )
    def a_job_and_a_batch_share_an_output(self, job_output, stems, batch_first):
        """Most examples start where the rules matter: two objects wanting one output."""
        applies = [
            lambda: self._apply(KIND, "j1", job_spec(job_output, "/d", False, True, None)),
            lambda: self._apply(BATCH_KIND, "b1", batch_spec(stems, "/d", False, None)),
        ]
        for apply in applies[::-1] if batch_first else applies:
            apply()

    @rule(
        name=st.sampled_from(JOB_NAMES),
        output=st.sampled_from(OUTPUTS),
        dataset=st.sampled_from(("/d", "/e")),
        default_written=st.booleans(),
        overwrite=st.booleans(),
        image=st.sampled_from(IMAGES),
    )
    def apply_job(self, name, output, dataset, default_written, overwrite, image):
        self._apply(KIND, name, job_spec(output, dataset, default_written, overwrite, image))

    @rule(
        name=st.sampled_from(BATCH_NAMES),
        stems=st.sampled_from((("a",), ("b",), ("a", "b"))),
        dataset=st.sampled_from(("/d", "/e")),
        default_written=st.booleans(),
        image=st.sampled_from(IMAGES),
    )
    def apply_batch(self, name, stems, dataset, default_written, image):
        self._apply(BATCH_KIND, name, batch_spec(stems, dataset, default_written, image))

    @precondition(lambda self: self._objects())
    @rule(data=st.data())
    def write_the_default_out_or_remove_it(self, data):
        kind, name = data.draw(st.sampled_from(sorted(self._objects())))
        spec = json.loads(json.dumps(self._objects()[kind, name]["spec"]))
        output = spec["output"]
        output.pop("checksums") if "checksums" in output else output.update(checksums=True)
        self._apply(kind, name, spec)

    @precondition(lambda self: self._objects())
    @rule(data=st.data())
    def delete(self, data):
        key = data.draw(st.sampled_from(sorted(self._objects())))
        self._objects()[key]["metadata"].setdefault("deletionTimestamp", "now")

    # -- the operator ---------------------------------------------------------------------------

    def _pass(self, kind: str, name: str) -> None:
        obj = self._objects().get((kind, name))
        if obj is None:
            return
        body = json.loads(json.dumps(obj))
        if "deletionTimestamp" in body["metadata"]:
            self._finalize(kind, body)
            return
        index: dict[tuple[str, str], list[Any]] = {}
        for job in self._runner_jobs().values():
            label = job["metadata"]["labels"]["h5ngff.dev/conversionjob"]
            index.setdefault((NS, label), []).append(job_summary(job))
        other = BATCH_KIND if kind == KIND else KIND
        names = {
            (NS, n): [(o["metadata"]["uid"], o["metadata"]["creationTimestamp"])]
            for (k, n), o in self._objects().items()
            if k == other
        }
        run = reconcile_job if kind == KIND else reconcile_batch_once
        self._run(run(self.cfg, self.state, body, index, names))

    def _finalize(self, kind: str, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        owner = Owner(NS, meta["name"], meta["uid"], kind=kind)
        ran = bool(int((body.get("status") or {}).get("attempts") or 0))
        left = self._run(remove_children(self.api, owner, ran, LEASES))
        note(f"a finalizer waits for {min(len(left or ()), 2)} pod(s)")
        if left == []:  # the finalizer lets go
            self.api.objects.pop((API_VERSION, NS, PLURAL if kind == KIND else BATCH_PLURAL, meta["name"]), None)

    def _run(self, coro: Any) -> Any:
        try:
            return self.loop.run_until_complete(coro)
        except KubeError:
            return None  # kopf retries it in a later pass

    @precondition(lambda self: self._objects())
    @rule(data=st.data())
    def reconcile(self, data):
        self._pass(*data.draw(st.sampled_from(sorted(self._objects()))))

    @precondition(lambda self: self._objects())
    @rule(data=st.data())
    def reconcile_all(self, data):
        """One timer interval: a pass over every object, in an order of kopf's choosing."""
        for key in data.draw(st.permutations(sorted(self._objects()))):
            self._pass(*key)

    @rule()
    def restart_the_operator(self):
        self.state = self._fresh_state()

    @precondition(lambda self: self._objects())
    @rule(data=st.data(), calls=st.integers(0, 12))
    def the_operator_dies_mid_pass(self, data, calls):
        self.api.crash_after = calls
        try:
            self._pass(*data.draw(st.sampled_from(sorted(self._objects()))))
        except Crash:
            pass
        self.api.crash_after = None
        self.state = self._fresh_state()

    @rule(fault=st.sampled_from(("refused", "lost", "lost-created")))
    def the_next_runner_job_create_fails(self, fault):
        self.api.job_create_fault = fault

    # -- the runners, kubelets and the garbage collector -----------------------------------------

    def _contract(self, job: dict[str, Any]) -> tuple[str, int, frozenset[str], dict[str, str]]:
        """(holder identity, attempt, output keys, item id or "" -> its conversion) of a runner Job."""
        env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
        ref = job["metadata"]["ownerReferences"][0]
        holder = holder_identity(NS, ref["name"], ref["uid"])
        attempt = int(job["metadata"]["labels"][LABEL_ATTEMPT])
        spec = json.loads(env["H5NGFF_SPEC"])
        if env.get("H5NGFF_KIND") == BATCH_KIND:
            planned = {p.id: p for p in parse_batch_spec(spec).planned_items()}
            items = [i for i in env.get("H5NGFF_ITEMS", "").split(",") if i in planned]
            keys = frozenset(output_key(planned[i].spec, NS) for i in items)
            return holder, attempt, keys, {i: normalised(planned[i].spec) for i in items}
        parsed = parse_job_spec(spec)
        return holder, attempt, frozenset({output_key(parsed, NS)}), {"": normalised(parsed)}

    @precondition(lambda self: any(f"{j}-pod" not in self._pods() for j in self._runner_jobs()))
    @rule(data=st.data())
    def a_runner_pod_starts(self, data):
        job_name = data.draw(st.sampled_from(sorted(j for j in self._runner_jobs() if f"{j}-pod" not in self._pods())))
        job = self._runner_jobs()[job_name]
        if (job.get("status") or {}).get("conditions"):
            return  # it ended before its pod started
        labels = {**job["spec"]["template"]["metadata"]["labels"], "job-name": job_name}
        pod = {"metadata": {"name": f"{job_name}-pod", "labels": labels}, "status": {"phase": "Running"}}
        self.api.put("v1", NS, "pods", pod)
        self.writes[f"{job_name}-pod"] = self._contract(job)[:3]
        job["status"] = {"active": 1}
        note(
            f"a runner pod of attempt {min(self.writes[f'{job_name}-pod'][1], 3)}{'+' * (self.writes[f'{job_name}-pod'][1] >= 3)} starts"
        )

    def _running_runners(self) -> list[str]:
        return sorted(j for j in self._runner_jobs() if self._runner_pod(j) is not None)

    def _unreported_runners(self) -> list[str]:
        return [j for j in self._running_runners() if j not in self.reported]

    @precondition(lambda self: self._running_runners())
    @rule(data=st.data())
    def a_runner_makes_its_dask_cluster(self, data):
        job_name = data.draw(st.sampled_from(self._running_runners()))
        job = self._runner_jobs()[job_name]
        cluster = dask_cluster_name(job["metadata"]["ownerReferences"][0]["name"])
        self.api.remove(("kubernetes.dask.org/v1", NS, "daskclusters", cluster))  # a stale one first
        self.api.put("kubernetes.dask.org/v1", NS, "daskclusters", {"metadata": {"name": cluster}})
        for i in range(2):
            name = f"{cluster}-{job_name}-worker-{i}"
            pod = {
                "metadata": {"name": name, "labels": {"dask.org/cluster-name": cluster}},
                "status": {"phase": "Running"},
            }
            if ("v1", NS, "pods", name) not in self.api.objects:
                self.api.put("v1", NS, "pods", pod)
                self.writes[name] = self.writes[f"{job_name}-pod"]

    @precondition(lambda self: self._unreported_runners())
    @rule(data=st.data(), outcome=st.sampled_from(("Succeeded", "OOMKilled", "SourceUnreadable")))
    def a_runner_reports(self, data, outcome):
        job_name = data.draw(st.sampled_from(self._unreported_runners()))
        self.reported.add(job_name)
        job = self._runner_jobs()[job_name]
        holder, attempt, _, conversions = self._contract(job)
        ref = job["metadata"]["ownerReferences"][0]
        report: dict[str, Any] = {"attempt": attempt, "outcome": "Succeeded"}
        if outcome != "Succeeded":
            report = {"attempt": attempt, "outcome": "Failed", "reason": outcome, "message": "m"}
        if ref["kind"] == BATCH_KIND:
            patch = {"itemReports": {i: report for i in conversions}}
            path = f"/apis/{API_VERSION}/namespaces/{NS}/{BATCH_PLURAL}/{ref['name']}/status"
        else:
            patch = {"phase": "Running", "runner": report}
            path = f"/apis/{API_VERSION}/namespaces/{NS}/{PLURAL}/{ref['name']}/status"
        self._run(self.api.patch_merge(path, {"status": patch}))
        if outcome == "Succeeded":
            for item, conversion in conversions.items():
                self.finished[ref["uid"], item] = conversion

    @precondition(lambda self: self._running_runners())
    @rule(data=st.data(), code=st.sampled_from((0, 1)), cleans_up=st.booleans())
    def a_runner_exits(self, data, code, cleans_up):
        job_name = data.draw(st.sampled_from(self._running_runners()))
        pod = self._runner_pod(job_name)
        assert pod is not None
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        self._job_ended(job_name, code == 0)
        if cleans_up:  # KubeCluster(shutdown_on_close=True): a runner that was killed cannot
            owner = self._runner_jobs()[job_name]["metadata"]["ownerReferences"][0]["name"]
            self.api.remove(("kubernetes.dask.org/v1", NS, "daskclusters", dask_cluster_name(owner)))

    def _job_ended(self, job_name: str, ok: bool) -> None:
        job = self._runner_jobs().get(job_name)
        if job is not None and not (job.get("status") or {}).get("conditions"):
            kind = "Complete" if ok else "Failed"
            job["status"] = {
                "active": 0,
                "succeeded" if ok else "failed": 1,
                "conditions": [{"type": kind, "status": "True"}],
            }

    def _terminating(self) -> list[str]:
        return sorted(n for n, p in self._pods().items() if live(p) and "deletionTimestamp" in p["metadata"])

    @precondition(lambda self: self._terminating())
    @rule(data=st.data())
    def a_terminating_pod_exits(self, data):
        name = data.draw(st.sampled_from(self._terminating()))
        pod = self._pods()[name]
        del self.api.objects["v1", NS, "pods", name]
        job = (pod["metadata"].get("labels") or {}).get("job-name")
        if job is not None:
            self._job_ended(job, False)  # its Job fails (backoffLimit 0), if it is still there

    def _finished_jobs(self) -> list[str]:
        return sorted(n for n, j in self._runner_jobs().items() if (j.get("status") or {}).get("conditions"))

    @precondition(lambda self: self._finished_jobs())
    @rule(data=st.data())
    def a_finished_runner_job_s_ttl_runs_out(self, data):
        self.api.remove(("batch/v1", NS, "jobs", data.draw(st.sampled_from(self._finished_jobs()))))

    # -- what must hold -------------------------------------------------------------------------

    @invariant()
    def at_most_one_attempt_writes_each_output_and_holds_its_lease(self):
        writers: dict[str, set[tuple[str, int]]] = {}
        for name, pod in self._pods().items():
            if live(pod) and name in self.writes:
                holder, attempt, keys = self.writes[name]
                for key in keys:
                    writers.setdefault(key, set()).add((holder, attempt))
        leases = {
            (lease["metadata"].get("annotations") or {}).get(KEY_ANNOTATION): lease["spec"]["holderIdentity"]
            for lease in self.api.of("coordination.k8s.io/v1", LEASES, "leases").values()
        }
        for key, attempts in writers.items():
            assert len(attempts) == 1, f"two attempts may write {key}: {sorted(attempts)}"
            ((holder, attempt),) = attempts
            assert leases.get(key) == holder, (
                f"attempt {attempt} of {holder} may write {key} without its Lease (held by {leases.get(key)})"
            )

    @invariant()
    def no_finished_conversion_runs_again_unless_it_changed(self):
        objects = {o["metadata"]["uid"]: (k, o) for k, o in self._objects().items()}
        for name, job in self._runner_jobs().items():
            uid = job["metadata"]["uid"]
            if uid in self.jobs_seen:
                continue
            self.jobs_seen.add(uid)
            owner_uid = job["metadata"]["ownerReferences"][0]["uid"]
            if owner_uid not in objects:
                continue
            (kind, _), obj = objects[owner_uid]
            _, _, _, conversions = self._contract(job)
            now = self._conversions_now(kind, obj)
            for item, conversion in conversions.items():
                done = self.finished.get((owner_uid, item))
                assert done is None or now.get(item) != done, (
                    f"runner Job {name} runs {item or 'the job'} again though its runner reported that "
                    f"conversion done and the spec still asks for it"
                )
                if conversion != done:  # it may write another conversion over the finished one
                    self.finished.pop((owner_uid, item), None)

    def _conversions_now(self, kind: str, obj: dict[str, Any]) -> dict[str, str]:
        if kind == KIND:
            return {"": normalised(parse_job_spec(obj["spec"]))}
        return {p.id: normalised(p.spec) for p in parse_batch_spec(obj["spec"]).planned_items()}


OperatorWorld.TestCase.settings = SETTINGS
# The long profile runs as long as it takes (the suite's 300 s timeout is for the CI profile).
TestOperatorWorld = pytest.mark.property(
    pytest.mark.slow(pytest.mark.timeout(0 if PROFILE == "long" else 300)(OperatorWorld.TestCase))
)
