"""The SLURM job script of one worker, built from the plan: pure, so ``h5ngff plan --backend
slurm`` shows exactly what will be submitted and tests check it without a cluster.

The plan's pod-limit terms are the job-memory terms: SLURM's ``task/cgroup`` with
``ConstrainRAMSpace=yes`` puts the job (batch shell, nanny and worker) in one memory cgroup, which
counts what a pod's cgroup counts (anonymous memory and the page cache of written chunks). So:

* ``#SBATCH --mem`` = the planned pod limit (Dask's terminate threshold + nanny + page cache and
  overshoot room), in MiB, as sbatch reads ``M``;
* ``#SBATCH --cpus-per-task`` = the worker's threads, ``-n 1``: one nanny+worker per job;
* the worker gets ``--memory-limit`` = the planned Dask limit (never ``auto``: inside a job Dask
  would read the node's RAM) and Dask's thresholds as ``DASK_*`` variables;
* the allocator environment is set in the job, where the library is (or is not) on the node.
"""

from __future__ import annotations

import math
import shlex

from ..planner.model import Plan
from ..spec import SlurmSpec
from ..units import MiB
from .allocator import GLIBC_ENV, JEMALLOC_CONF, JEMALLOC_PATHS
from .base import JobScript, dask_env, dask_memory_config

#: Seconds a worker waits for a lost scheduler before it exits, ending its job. A client killed
#: with SIGKILL takes the scheduler with it; the reaper (backends/slurmreaper.py) cancels the jobs
#: at once, and this is the fallback should the reaper die too.
DEATH_TIMEOUT = 60
SCHEDULER_PLACEHOLDER = "tcp://SCHEDULER:8786"
WORKER_PLACEHOLDER = "WORKER"


def job_mem_mib(limit_bytes: int) -> int:
    """``--mem`` in MiB (sbatch's ``M``), rounded up: SLURM must never grant less than planned."""
    return math.ceil(limit_bytes / MiB)


def build_header(plan: Plan, slurm: SlurmSpec, job_name: str, mem_bytes: int) -> tuple[str, ...]:
    lines = [
        f"-J {job_name}",
        "-n 1",
        f"--cpus-per-task={plan.threads_per_worker}",
        f"--mem={job_mem_mib(mem_bytes)}M",
        f"-t {slurm.walltime}",
    ]
    if slurm.partition:
        lines.append(f"-p {slurm.partition}")
    if slurm.account:
        lines.append(f"-A {slurm.account}")
    if slurm.qos:
        lines.append(f"--qos={slurm.qos}")
    # %j is the job id: one .out and one .err per worker job, read back for oom-kill events.
    lines.append(f"-o {slurm.log_directory}/{job_name}-%j.out")
    lines.append(f"-e {slurm.log_directory}/{job_name}-%j.err")
    lines.extend(d.strip().removeprefix("#SBATCH").strip() for d in slurm.directives or ())
    return tuple(f"#SBATCH {line}" for line in lines)


def allocator_lines(allocator: str, library: str | None = None) -> tuple[str, ...]:
    """Shell lines choosing the worker's malloc on the node. The plan's allocator terms assume
    ``allocator``; a node without libjemalloc gets the tuned glibc and says so in the job's .err."""
    glibc = " ".join(f"{k}={shlex.quote(v)}" for k, v in GLIBC_ENV.items())
    if allocator != "jemalloc":
        return ("# allocator: glibc, tuned to return freed slabs (the plan assumes glibc)", f"export {glibc}")
    candidates = " ".join(shlex.quote(p) for p in dict.fromkeys([*(p for p in [library] if p), *JEMALLOC_PATHS]))
    return (
        "# allocator: jemalloc where libjemalloc.so.2 is on the node (the plan assumes jemalloc)",
        "H5NGFF_JEMALLOC=",
        f'for lib in {candidates}; do [ -e "$lib" ] && {{ H5NGFF_JEMALLOC=$lib; break; }}; done',
        'if [ -n "$H5NGFF_JEMALLOC" ]; then',
        f'  export LD_PRELOAD="$H5NGFF_JEMALLOC" MALLOC_CONF={shlex.quote(JEMALLOC_CONF)}',
        "else",
        f"  export {glibc}",
        '  echo "h5ngff: libjemalloc.so.2 not found on $(hostname); the worker uses glibc, the plan assumed jemalloc (apt-get install libjemalloc2)" >&2',
        "fi",
    )


def build_command(plan: Plan, slurm: SlurmSpec, python: str, scheduler: str, name: str) -> str:
    args = [
        shlex.quote(python),
        "-m",
        "distributed.cli.dask_worker",
        shlex.quote(scheduler),
        "--name",
        shlex.quote(name),
        "--nthreads",
        str(plan.threads_per_worker),
        "--nworkers",
        "1",
        "--memory-limit",
        str(plan.memory.memory_limit),
        "--nanny",
        "--no-dashboard",
        "--death-timeout",
        str(DEATH_TIMEOUT),
        # Not quoted as a word: the scratch path may name job variables ($TMPDIR, $SLURM_JOB_ID).
        "--local-directory",
        f'"{slurm.scratch}"',
    ]
    # exec: the batch shell leaves no process of its own in the job's cgroup beside the nanny.
    return "exec " + " ".join(args)


def build_job_script(
    plan: Plan,
    slurm: SlurmSpec,
    python: str,
    *,
    job_name: str = "h5ngff",
    scheduler: str = SCHEDULER_PLACEHOLDER,
    worker_name: str = WORKER_PLACEHOLDER,
    job_mem: int | None = None,
    allocator_library: str | None = None,
) -> JobScript:
    """The script of one worker job. ``job_mem`` replaces the planned ``--mem`` (experiments and
    negative controls only: below the plan, the job's cgroup kills the worker)."""
    mem = job_mem or plan.memory.pod_limit
    override = "" if job_mem is None else f"overridden: the plan says {job_mem_mib(plan.memory.pod_limit)}M"
    env = dask_env(dask_memory_config(plan))
    environment = (
        "# Dask's memory thresholds from the plan (fractions of --memory-limit)",
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
        *allocator_lines(plan.allocator, allocator_library),
    )
    return JobScript(
        header=build_header(plan, slurm, job_name, mem),
        environment=environment,
        prologue=tuple(slurm.prologue or ()),
        command=build_command(plan, slurm, python, scheduler, worker_name),
        mem_bytes=job_mem_mib(mem) * MiB,
        mem_terms=plan.memory.pod_terms,
        mem_override=override,
    )
