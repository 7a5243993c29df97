"""A trainer as a Ray task (`launcher.kind: ray`): joining the cluster, running the launch command on a worker,
following its output.

The task runs `infra.launch.run_streaming` on a Ray worker, with `launcher.nproc x threads_per_rank` CPUs
reserved, so Ray places as many trainers at once as the cluster has cores for (a swarm's proxies). Its
output goes to `ray.log` in the step folder, which this process follows into the task's log. Nothing
outlives the task: cancelled, the Ray task is interrupted (its ranks get SIGTERM and `stop_grace_s` to
checkpoint, as in `run_streaming`) and then force-killed; when this process dies without a word, Ray
ends the tasks its driver owned and the tether on that worker stops the trainer (SIGTERM, the grace). A relaunch resumes
from the step's checkpoints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from infra.errors import SmolflowError, Stopped
from infra.launch import POLL_S, run_streaming, stream_lines
from infra.procs import STOPPING


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address`, else the one $RAY_ADDRESS or this machine's last `ray start` names."""
    import ray

    if ray.is_initialized():
        return
    try:
        setup = {"worker_process_setup_hook": f"{__name__}.{pools_fork_from_a_server.__name__}"}
        ray.init(address=address or "auto", log_to_driver=False, configure_logging=False, runtime_env=setup)
    except ConnectionError as err:
        raise SmolflowError(
            f"no Ray cluster at {address or 'auto (RAY_ADDRESS, or the last one started here)'}: {err}; "
            "start one with `smolflow cluster ray start` or set the recipe's ray_address (its head wants its token: "
            "`source .smolflow/env` exports RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH)"
        ) from err


def pools_fork_from_a_server() -> None:
    """Run by each Ray worker of this driver as it starts. A worker runs threads from its start, and a fork of a
    threaded process can hang for good (a lock held at the fork stays held in the child). datatrove's Ray actor runs
    its job's shards in a process pool: forked from the actor, 6 of a pool's 14 processes once never ran, and the actor
    waited on them with every shard complete. Its pools fork from a forkserver instead, which runs no threads and has
    datatrove's executor imported once for them."""
    import multiprocess

    multiprocess.set_start_method("forkserver", force=True)
    multiprocess.set_forkserver_preload(["datatrove.executor.ray"])


def run_task(
    command: list[str], env: dict[str, str], log: Path, cpus: int, name: str, on_line: Callable[[str], None], grace_s: float
) -> int:
    """Run COMMAND as a Ray task reserving CPUS, its output appended to LOG and passed to ON_LINE; its exit code."""
    import ray

    task = ray.remote(_run).options(num_cpus=cpus, name=name, max_retries=0)
    ref = task.remote(command, env, os.getcwd(), str(log), grace_s)
    offset = 0
    try:
        while not ray.wait([ref], timeout=POLL_S)[0]:
            offset = stream_lines(log, offset, on_line)
            if STOPPING.is_set():  # a signal this thread's exception does not reach (an ablation's run)
                raise Stopped(f"Ray task {name}: this process is stopping; the task is interrupted (its ranks checkpoint)")
        stream_lines(log, offset, on_line)
        return ray.get(ref)
    except BaseException:
        _stop(ref, grace_s)
        raise


def _stop(ref, grace_s: float) -> None:
    """Interrupt the task (its ranks checkpoint within GRACE_S), then kill its worker if it is still there."""
    import ray

    ray.cancel(ref)
    try:
        ray.wait([ref], timeout=grace_s + 30)
    finally:
        ray.cancel(ref, force=True)


def _run(command: list[str], env: dict[str, str], cwd: str, log: str, grace_s: float) -> int:
    """On the worker: the launch command, tethered to this worker, each output line appended to LOG."""
    with open(log, "a", buffering=1) as out:
        start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        out.write(f"ray: {start} task on {os.uname().nodename}, pid {os.getpid()}\n")
        return run_streaming(command, env, lambda line: out.write(line + "\n"), cwd=cwd, grace_s=grace_s)
