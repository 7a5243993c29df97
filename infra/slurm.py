"""A trainer as a Slurm batch job (`launcher.kind: slurm`): the batch script, submitting it, following it.

srun starts every rank itself (RANK, WORLD_SIZE, LOCAL_RANK from Slurm's task ids), with no torchrun
agent in between, so Slurm's signals reach the ranks: USR1 `signal_s` before the time limit and
SIGTERM on preemption or `scontrol requeue` both make the trainer checkpoint and exit with
PREEMPTED (model/train.py). The job is `--requeue`able; on PREEMPTED (or its mark) the script requeues it itself,
and a requeued job resumes from its newest complete checkpoint. Output is appended to one file per
job, which the task streams into its log while it polls the job's state.

A job outlives the task that submitted it (no tether): a relaunched task finds the step's job by its
name and follows it instead of submitting a second one. An interrupted or cancelled task scancels it.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.errors import SmolflowError, Stopped
from infra.launch import stream_lines
from infra.procs import PREEMPTED, PREEMPTED_MARK, STOPPING, detached
from infra.recipe import LauncherCfg

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --partition={partition}
#SBATCH --time={time}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={nproc}
#SBATCH --cpus-per-task={threads}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=USR1@{signal_s}
#SBATCH --output={log}
{extra}
set -uo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) OMP_NUM_THREADS={threads}{loopback}
echo "smolflow: job $SLURM_JOB_ID start ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
# USR1 ignored until the trainer installs its handler (an ignored signal stays ignored across exec)
srun --kill-on-bad-exit=1 bash -c 'trap "" USR1; RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID \\
  exec {python} -m {module} {args}'
code=$?
if [ "$code" -eq {preempted} ] || [ -e {mark} ]; then  # the mark: srun may report the kill of a rank that exited later
  rm -f {mark}
  echo "smolflow: the ranks checkpointed on a signal ($code); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
"""


def job_name(out: Path) -> str:
    """One name per step folder: how a relaunched task finds the job its predecessor submitted."""
    return f"smolflow-{out.name}-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:8]}"


def script_path(path: Path) -> Path:
    """PATH as it may stand in a batch script: an #SBATCH line cannot quote, so a newline in a run dir would
    become a shell line of the job, and a space would cut the path short."""
    if bad := sorted({c for c in str(path) if c.isspace() or not c.isprintable() or c in "\"'`$;&|<>*?#"}):
        said = ", ".join(map(repr, bad))
        raise SmolflowError(f"{str(path)!r}: cannot stand in a Slurm batch script (it contains {said}); choose a run dir without them")
    return path


def batch_script(cfg: LauncherCfg, name: str, log: Path, module: str, args: list[str], out: Path) -> str:
    """The job of a trainer whose step folder is OUT (where its ranks leave PREEMPTED_MARK)."""
    slurm, log, out = cfg.slurm, script_path(log), script_path(out)
    extra = [f"#SBATCH --gpus-per-node={slurm.gpus_per_node}"] if slurm.gpus_per_node else []
    extra += [f"#SBATCH --{key}={value}" if value else f"#SBATCH --{key}" for key, value in slurm.sbatch_args.items()]
    return TEMPLATE.format(
        name=name,
        partition=slurm.partition,
        time=slurm.time,
        nodes=slurm.nodes,
        nproc=cfg.nproc,
        threads=cfg.threads_per_rank,
        signal_s=slurm.signal_s,
        log=log,
        extra="\n".join(extra),
        loopback=" GLOO_SOCKET_IFNAME=lo" if slurm.nodes == 1 else "",
        python=shlex.quote(sys.executable),
        module=module,
        args=" ".join(shlex.quote(a) for a in args),
        preempted=PREEMPTED,
        mark=shlex.quote(str(out / PREEMPTED_MARK)),
    )


class SlurmError(SmolflowError):
    """sbatch, squeue or scontrol failed (no controller, bad partition); retried: the controller may be back."""

    retryable = True


def _run(*cmd: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SlurmError(f"`{' '.join(cmd[:2])}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def find(name: str) -> str | None:
    """The id of our queued or running job called `name` (another user's job of that name is not ours to follow)."""
    ids = _run("squeue", "--me", "--noheader", f"--name={name}", "--format=%i").split()
    return ids[0] if ids else None


def submit(script: Path, env: dict[str, str]) -> str:
    """The job's id; the job is not reaped with the flow process (a relaunch follows it by name)."""
    return _run("sbatch", "--parsable", str(script), env=detached(env)).strip().split(";")[0]


def cancel(job: str, wait_s: float = 120) -> None:
    """scancel, then wait until the job has left the queue (its ranks no longer write)."""
    subprocess.run(["scancel", job], capture_output=True, timeout=60)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if state(job).name in ENDED | {"GONE"}:
                return
        except SlurmError:  # a busy controller: ask again until the deadline
            pass
        time.sleep(1)


class SlurmPending(SmolflowError):
    """A job that did not start within its deadline: a retry would wait in the same queue for the same reason."""


@dataclass(frozen=True)
class JobState:
    name: str  # PENDING, RUNNING, COMPLETED, ... ; GONE when the controller no longer knows it
    exit_code: int | None = None
    restarts: int = 0
    reason: str = ""


def state(job: str) -> JobState:
    proc = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return JobState("GONE")
        raise SlurmError(f"scontrol show job {job} failed: {proc.stderr.strip()[-500:]}")
    fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
    code = fields.get("ExitCode", "0:0").split(":")[0]
    exit_code = int(code) if code.isdigit() else None
    return JobState(fields.get("JobState", "UNKNOWN"), exit_code, int(fields.get("Restarts", 0)), fields.get("Reason", ""))


def follow(job: str, log: Path, on_line: Callable[[str], None], pending_s: float, poll_s: float = 2.0) -> JobState:
    """Stream the job's output to `on_line` until it ends (requeues included). A failed state lookup (a busy
    controller: "Socket timed out on send/recv operation") is asked again with backoff and never cancels the job;
    a job waiting to start, or to restart, longer than PENDING_S is cancelled and fails the task with Slurm's
    reason, as is an interrupted task's job."""
    offset, restarts, last, failures, waiting_since = 0, 0, "", 0, time.monotonic()
    try:
        while True:
            if STOPPING.is_set():  # a signal this thread's exception does not reach (an ablation's run)
                raise Stopped(f"Slurm job {job}: this process is stopping; the job is cancelled (its ranks checkpoint)")
            try:
                current = state(job)
                failures = 0
            except SlurmError as err:
                failures += 1
                pause = min(60.0, poll_s * 2**failures)
                on_line(f"slurm: {err}; asking again in {pause:.0f} s (the job is left alone)")
                time.sleep(pause)
                continue
            offset = stream_lines(log, offset, on_line)
            if current.restarts != restarts:
                on_line(f"slurm: job {job} requeued (restart {current.restarts})")
                restarts = current.restarts
            if current.name != last:
                on_line(f"slurm: job {job} {current.name}{f' ({current.reason})' if current.reason not in ('', 'None') else ''}")
                last = current.name
            if current.name in ENDED | {"GONE"}:
                stream_lines(log, offset, on_line)
                return current
            if current.name != "PENDING":
                waiting_since = time.monotonic()
            elif (waited := time.monotonic() - waiting_since) > pending_s:
                raise SlurmPending(
                    f"Slurm job {job} has waited {waited / 3600:.2f} h to start (reason: {current.reason or 'none given'}); "
                    f"cancelled (launcher.slurm.pending_hours: {pending_s / 3600:g})"
                )
            time.sleep(poll_s)
    except BaseException:
        cancel(job)
        raise
