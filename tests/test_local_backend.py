"""The embedded LocalCluster: a worker's baseline memory must not depend on who called h5ngff.

Dask's nanny spawns workers, and multiprocessing's spawn re-imports the parent's ``__main__`` in
each of them. The console script, a benchmark harness or a notebook helper would each add their
own imports to every worker (pytest added 7 MiB), and the plan's interpreter term, one number,
could not hold for all of them. Found when the bench harness's workers were terminated by the
nanny: they carried the harness's imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import write_h5

pytestmark = pytest.mark.integration

#: The caller's main module imports a module of its own, then runs a conversion's cluster through
#: the real LocalBackend (sized by a real plan) and asks each worker whether that module is loaded.
CALLER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import callers_own_module  # the caller's import: it must stay out of the workers

    from h5ngff.backends import local
    from h5ngff.runner import plan_job
    from h5ngff.spec import parse_spec

    def loaded():
        import sys
        return "callers_own_module" in sys.modules

    if __name__ == "__main__":
        if sys.argv[4] == "negative-control":
            local.workers_skip_main_module = __import__("contextlib").nullcontext
        spec = parse_spec({"source": {"path": sys.argv[2], "dataset": "/volume/data"}, "output": {"path": sys.argv[3]},
                           "resources": {"workers": 2}})
        backend = local.LocalBackend()
        job = plan_job(spec, backend)
        with backend.session(job.plan) as session:
            in_workers = sorted(session.client.run(loaded).values())
            file_during = "__file__" in globals()
        print(json.dumps({"in_workers": in_workers, "file_during": file_during, "file_after": __file__}))
""")


def _run_caller(tmp_path, mode: str) -> dict:
    (tmp_path / "callers_own_module.py").write_text("PAYLOAD = bytearray(1 << 20)\n")
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    h5 = write_h5(tmp_path / "in.h5", np.zeros((16, 32, 32), np.uint16))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), h5, str(tmp_path / "out.ome.zarr"), mode],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_workers_do_not_import_the_callers_main_module(tmp_path):
    result = _run_caller(tmp_path, "real")
    assert result["in_workers"] == [False, False]
    # Hidden from spawn only while the cluster lives; the caller gets its __file__ back.
    assert result["file_during"] is False
    assert result["file_after"].endswith("caller.py")


@pytest.mark.slow
def test_negative_control_without_the_guard_workers_import_the_callers_main(tmp_path):
    result = _run_caller(tmp_path, "negative-control")
    assert result["in_workers"] == [True, True]


#: A spawned worker-like child (the same spawn path as the nanny's: the real guard, so the child
#: runs ``worker_main`` as its main module) whose exit must keep its code and its unflushed output.
EXITER = textwrap.dedent("""
    import json, multiprocessing, sys
    sys.path.insert(0, sys.argv[1])
    import exit_targets
    from h5ngff.backends import local

    if __name__ == "__main__":
        codes = {}
        with local.workers_skip_main_module():
            ctx = multiprocessing.get_context("spawn")
            for name in ("returns", "exits_3", "raises", "hard_exit_unflushed"):
                p = ctx.Process(target=getattr(exit_targets, name))
                p.start()
                p.join(60)
                codes[name] = p.exitcode
        sys.stdout.write("\\n" + json.dumps(codes) + "\\n")
""")

EXIT_TARGETS = textwrap.dedent("""
    import os, sys

    def returns():
        sys.stdout.write("tail-of-returns")  # no newline: still in the buffer at exit

    def exits_3():
        sys.stdout.write("tail-of-exits_3")
        sys.exit(3)

    def raises():
        raise RuntimeError("boom")

    def hard_exit_unflushed():  # the control: leaving by os._exit without a flush loses the tail
        sys.stdout.write("tail-of-hard-exit")
        os._exit(0)
""")


@pytest.mark.slow
def test_spawned_workers_exit_fast_with_their_code_and_output(tmp_path):
    (tmp_path / "exit_targets.py").write_text(EXIT_TARGETS)
    script = tmp_path / "exiter.py"
    script.write_text(EXITER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as in a user's shell
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert codes == {"returns": 0, "exits_3": 3, "raises": 1, "hard_exit_unflushed": 0}
    assert "tail-of-returns" in proc.stdout and "tail-of-exits_3" in proc.stdout
    assert "RuntimeError: boom" in proc.stderr
    # Negative control: a child that skips the flush loses its tail, so the check above can fail.
    assert "tail-of-hard-exit" not in proc.stdout
