"""What SLURM says about our jobs, through its own commands (``scontrol``, ``squeue``, ``scancel``),
and the pure readings of their output and of the jobs' ``.err`` files.

Only ``scontrol show job`` is used for states: sites without slurmdbd have no ``sacct``, and
``scontrol`` keeps a finished job for ``MinJobAge`` seconds (300 by default).
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: slurmstepd's line when the job's memory cgroup OOM-killed something, e.g. "slurmstepd-vm:
#: error: Detected 1 oom-kill event(s) in StepId=12.batch. Some of your processes may have been
#: killed by the cgroup out-of-memory handler." It is written when the step ends.
OOM_EVENTS = re.compile(r"Detected (\d+) oom-kill event\(s\)")
#: The same enforcement by slurmd's sampling (JobAcctGatherParams=OverMemoryKill).
OVER_MEMORY = re.compile(r"exceeded (?:job )?memory limit")
#: Job states after which a job holds no resources.
FINISHED = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "OUT_OF_MEMORY",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
COMMAND_TIMEOUT = 30


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str
    #: SLURM's reason: why it pends (Resources, Priority, QOSMaxMemoryPerJob, ...) or ended.
    reason: str
    exit_code: str = ""
    mem: str = ""

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


def parse_scontrol_job(text: str) -> JobState | None:
    """``scontrol show job -o ID`` (one line of Key=Value pairs) -> JobState."""
    fields: dict[str, str] = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", text)}
    if "JobId" not in fields:
        return None
    return JobState(
        fields["JobId"],
        fields.get("JobState", "UNKNOWN"),
        fields.get("Reason", "None"),
        fields.get("ExitCode", ""),
        fields.get("MinMemoryNode", "") or fields.get("MinMemoryCPU", ""),
    )


def pending_advice(reason: str) -> str | None:
    """What to do about jobs pending for ``reason`` when waiting will not start them, or None
    where it may (Resources, Priority, ...). SLURM's reasons: squeue(1), "JOB REASON CODES"."""
    if reason.startswith("Invalid") or reason.endswith("NotAllowed"):
        return (
            "SLURM will not run these jobs as submitted: the account, QOS or partition is not one you may use "
            "(sacctmgr show assoc user=$USER lists yours); fix slurm.account, slurm.qos or slurm.partition"
        )
    if reason.startswith(("Assoc", "QOS")):
        return (
            "the jobs are held by a limit of the account or QOS: a per-job limit (…PerJob, …MaxWall…) never lifts, a group "
            "limit (…Grp…) only as the account's other jobs end; plan smaller jobs (resources.memoryPerWorker, resources.workers, "
            "slurm.walltime) or use another slurm.account or slurm.qos (sacctmgr show qos lists the limits)"
        )
    if reason.startswith("Partition"):
        return (
            "the partition refuses jobs like these (scontrol show partition lists its MaxTime, MaxNodes and state): "
            "lower slurm.walltime or choose another slurm.partition"
        )
    if reason.startswith("JobHeld"):
        return "the jobs are held: scontrol release them, or drop --hold from slurm.directives"
    if reason in ("BeginTime", "Dependency", "DependencyNeverSatisfied"):
        return "the jobs wait for their --begin time or dependency (slurm.directives), not for room"
    return None


def oom_events(err_text: str) -> int:
    """How many times the job's cgroup OOM-killed a process, as slurmstepd reports it."""
    kills = sum(int(n) for n in OOM_EVENTS.findall(err_text))
    return kills + len(OVER_MEMORY.findall(err_text))


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)


#: Seconds ``sinfo`` may take for a plan's notice: a controller that does not answer must not hold
#: up ``h5ngff plan`` (its own message comes at submission).
SINFO_TIMEOUT = 5


def largest_node_memory(partition: str | None) -> int | None:
    """The most memory (bytes) any node of ``partition`` (default: every partition) offers a job,
    as sinfo reports RealMemory, or None when SLURM cannot be asked."""
    args = ["sinfo", "-h", "-o", "%m"] + (["-p", partition] if partition else [])
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=SINFO_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = [int(m.group()) for m in (re.match(r"\d+", line.strip()) for line in proc.stdout.splitlines()) if m]
    return max(sizes) * (1 << 20) if proc.returncode == 0 and sizes else None


def job_state(job_id: str) -> JobState | None:
    """The job as ``scontrol`` sees it, or None once SLURM forgot it (or cannot be asked)."""
    try:
        proc = _run(["scontrol", "show", "job", "-o", str(job_id)])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s failed: %s", job_id, exc)
        return None
    return parse_scontrol_job(proc.stdout) if proc.returncode == 0 else None


def queued_ids(job_name: str, states: str | None = None) -> list[str]:
    """Ids of this run's jobs still in the queue (pending, running or completing), or only those
    in ``states`` (squeue's ``-t``, e.g. "RUNNING,COMPLETING")."""
    try:
        proc = _run(["squeue", "-h", "-n", job_name, *(["-t", states] if states else []), "-o", "%i"])
    except (OSError, subprocess.TimeoutExpired):
        return []
    return proc.stdout.split()


#: Seconds the run's nannies get to close after SIGTERM before ``stop_by_name`` kills them: an
#: idle nanny closes its worker and exits in about a second; one whose worker is still running a
#: slab (a Ctrl-C, a failed run) waits 8 s for it (``dask worker`` closes its nanny with a 10 s
#: timeout, 0.8 of it for the worker) and then terminates it.
STOP_GRACE = 12.0


def stop_by_name(job_name: str) -> None:
    """End every job of this run, leaving nothing on its node: pending jobs are cancelled, each
    running job's nanny (``exec``'d as the batch shell) gets SIGTERM and closes its worker, and a
    job still running after ``STOP_GRACE`` seconds gets SIGKILL.

    Why not SIGKILL straight away: the nanny hands its worker queues backed by named POSIX
    semaphores (``/dev/shm/sem.mp-*``, 6 per worker start). A nanny that closes unlinks them; one
    killed leaves them to multiprocessing's resource tracker, which slurmstepd kills with the
    rest of the job, and the names stay in the node's shared memory until it reboots. Only the
    nanny is signalled: a second SIGTERM would end it before its close, and a worker killed under
    it leaves what it registered itself. Signalling is not cancelling, so SIGKILL can still
    follow. Pending jobs are cancelled first and the signal names only running ones: a pending
    job named in a signal makes scancel retry for 30 s ("Job can not be altered now")."""
    for args in (["--state=PENDING"], ["--state=RUNNING", "--batch", "--signal=TERM"]):
        try:
            _run(["scancel", "--name", job_name, *args])
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("scancel --name %s %s failed: %s", job_name, " ".join(args), exc)
    deadline = time.monotonic() + STOP_GRACE
    while queued_ids(job_name, "RUNNING,COMPLETING") and time.monotonic() < deadline:  # processes may still run
        time.sleep(0.1)
    cancel_by_name(job_name, kill=True)


def cancel_by_name(job_name: str, kill: bool = False) -> None:
    """Cancel every job of this run, by its unique job name: this also catches a job whose
    submission was answered after the client stopped listening. ``kill``: only SIGKILL the batch
    shell of every running job and its children (the nanny is the batch shell, ``exec``, and the
    worker its child); the job ends at once. A plain cancel sends SIGTERM and waits SLURM's
    KillWait (30 s by default) for a nanny that does not stop; ``--signal=KILL`` without
    ``--batch`` is turned into that same cancel, and a job being cancelled can no longer be
    signalled, so this must come first."""
    try:
        proc = _run(["scancel", "--name", job_name, *(["--batch", "--signal=KILL"] if kill else [])])
        if proc.returncode and not kill:  # kill: pending jobs cannot be signalled, and need not be
            log.warning("scancel --name %s: %s", job_name, proc.stderr.strip())
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scancel --name %s failed: %s", job_name, exc)


#: sbatch's words when it cannot reach slurmctld, or cannot read the configuration at all.
UNREACHABLE = "Unable to contact slurm controller"
NO_CONFIGURATION = (
    "Unable to process configuration file",
    "Could not establish a configuration source",
    "s_p_parse_file",
)


def sbatch_refusal(script_text: str) -> str | None:
    """``sbatch --test-only``: SLURM's own verdict on the job script, without submitting it. None
    when SLURM would accept it, else its message (an unknown partition, --mem above every node's)."""
    try:
        proc = subprocess.run(
            ["sbatch", "--test-only"],
            input=script_text,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        return "sbatch is not installed here (run h5ngff where SLURM's client commands are, e.g. a login node)"
    except subprocess.TimeoutExpired as exc:  # e.g. a missing SLURM_CONF: sbatch retries for 60 s; keep what it said
        said = _lines(exc.stderr) or _lines(exc.stdout)
        return f"sbatch --test-only gave no verdict within {COMMAND_TIMEOUT} s" + (f"; it said: {said}" if said else "")
    except OSError as exc:
        return f"sbatch --test-only failed: {exc}"
    text = _lines(proc.stderr) or _lines(proc.stdout) or f"exit {proc.returncode}"
    return None if proc.returncode == 0 else text


def _lines(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return "; ".join(line.strip() for line in (output or "").splitlines() if line.strip())
