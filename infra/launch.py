"""Starting trainer processes: the launcher command, streaming their output, and killing the whole tree.

No rank may outlive the task that launched it longer than its grace, or a relaunch would train beside it. torchrun starts
its workers in new sessions, so killing the launcher or its process group leaves ranks running;
`run_streaming` therefore starts the command under a tether (infra/procs.py) and stops the whole tree
when the command ends badly or the task is cancelled: the ranks first get SIGTERM and a grace period to
checkpoint, as Slurm gives a preempted job. The tether enforces that grace itself, so it holds when the
task process is SIGKILLed mid-way (no `finally` runs: the tether sees its owner die), and the step lock
records the tether so the next holder stops a tree that still lives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from infra.env import thread_count
from infra.errors import DiskFull, Stopped, TrainerFailed, full_disk
from infra.locks import lease_env, record_child
from infra.procs import GRACE_ENV, PREEMPTED, REAP_GRACE_S, STOPPING, kill_tree, tethered, unseen_lines
from infra.recipe import AccelerateCfg, LauncherCfg
from infra.storage import write_text_atomic

POLL_S = 0.5  # how often a loop that waits on a job or trainer looks at STOPPING
# the file a trainer rank leaves in its step folder when it stopped for want of disk: torchrun, accelerate and srun
# report any failed rank as their own exit code, so the reason travels beside the exit, as PREEMPTED_MARK's does
DISK_FULL_MARK = "disk_full"


class Tail:
    """An `on_line` that passes each line on and keeps the last few, so an error can quote why a process failed:
    `f"... exited with code {code}{tail}"` (nothing when it said nothing)."""

    def __init__(self, on_line: Callable[[str], None], lines: int = 15):
        self.on_line, self.lines = on_line, deque(maxlen=lines)

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.on_line(line)

    def __str__(self) -> str:
        return ". Its last lines:\n" + "\n".join(self.lines) if self.lines else ""


def mark_disk_full(err: BaseException, out: Path, folders: list[Path]) -> None:
    """On a rank whose training raised ERR: when ERR is a full disk, leave OUT/DISK_FULL_MARK naming the folder and its
    free space. If even that cannot be written, the folder is left with next to nothing, which `check_disk` sees."""
    if (said := full_disk(folders, err)) is None:
        return
    try:
        write_text_atomic(out / DISK_FULL_MARK, said + "\n")
    except OSError as failed:
        print(f"error: out of disk ({said}); {out / DISK_FULL_MARK} could not be written either: {failed}", flush=True)


def check_disk(what: str, out: Path, folders: list[Path]) -> None:
    """In the task, after its trainer failed: raise DiskFull (not retried: a retry would fill the same disk) when a rank
    left DISK_FULL_MARK in OUT or one of FOLDERS is left full. `before_launch` removes an earlier attempt's mark."""
    mark = out / DISK_FULL_MARK
    if (said := mark.read_text().strip() if mark.is_file() else full_disk(folders)) is not None:
        raise DiskFull(
            f"{what}: the trainer ran out of disk: {said}. The checkpoints it committed are kept: once there is room, "
            "a rerun resumes from the newest"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lone_rank(module: str, args: list[str]) -> list[str]:
    """One rank with no launcher: `python -m module args` (its tether still stops it)."""
    return [sys.executable, "-m", module, *args]


def launch_command(cfg: LauncherCfg, module: str, args: list[str], port: int) -> list[str]:
    """The command that starts `python -m module args` on `cfg.nproc` ranks per node."""
    if cfg.kind == "python":
        if cfg.nproc != 1:
            raise ValueError("launcher.kind python runs one process; use torchrun or deepspeed for nproc > 1")
        return lone_rank(module, args)
    if cfg.kind == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(cfg.nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            module,
            *args,
        ]
    command = [os.path.join(os.path.dirname(sys.executable), "deepspeed")]
    if cfg.hostfile:
        command += ["--hostfile", cfg.hostfile]
    # on CPU the deepspeed launcher must be told the rank count explicitly
    return [*command, "--num_gpus", str(cfg.nproc), "--master_port", str(port), "--module", module, *args]


def accelerate_command(cfg: AccelerateCfg, module: str, args: list[str], config: Path, port: int, bf16: bool) -> list[str]:
    """`accelerate launch` of `python -m module args` on `cfg.nproc` ranks, DeepSpeed ZeRO when `cfg.zero_stage` > 0.

    Every setting goes into CONFIG (written here, kept beside the step's output), so a user's default
    accelerate config is never read and the launch can be repeated by hand. A lone rank without ZeRO is
    `python -m module args` itself, no CONFIG: accelerate's launcher would only start it (3.7 CPU s of imports on a
    Zen 3 core, to set what the trainer's TRL arguments set again: mixed precision, no dynamo), as pretraining's `python` kind.
    """
    if cfg.nproc == 1 and not cfg.zero_stage:
        return lone_rank(module, args)
    kind = "DEEPSPEED" if cfg.zero_stage else "MULTI_GPU"  # MULTI_GPU on CPU: DDP over gloo
    settings = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "num_processes": cfg.nproc,
        "num_machines": 1,
        "machine_rank": 0,
        "main_process_ip": "127.0.0.1",
        "main_process_port": port,
        "mixed_precision": "bf16" if bf16 else "no",
    }
    if cfg.zero_stage:  # ZeRO-3 gathers the full weights when saving, so checkpoints and `final` are HF models
        settings["deepspeed_config"] = {"zero_stage": cfg.zero_stage, "zero3_save_16bit_model": True}
    config.write_text(json.dumps(settings, indent=2))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--module", module, *args]


def launch_env(cfg: LauncherCfg | AccelerateCfg, extra: dict[str, str] | None = None) -> dict[str, str]:
    threads = str(thread_count(cfg.threads_per_rank))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", **lease_env(), **(extra or {})}
    if not getattr(cfg, "hostfile", None):  # one node: collectives listen on loopback only
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if isinstance(cfg, LauncherCfg) and cfg.kind == "python":  # a lone process still needs a rendezvous, or DeepSpeed tries MPI discovery
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def before_launch(out: Path, *done: Path) -> None:
    """Remove what an earlier attempt's trainer left in OUT to say how it ended (its DISK_FULL_MARK and the DONE files it
    writes once finished), so that `check_exit` reads only this launch's."""
    for mark in (out / DISK_FULL_MARK, *done):
        mark.unlink(missing_ok=True)


def check_exit(what: str, code: int | None, out: Path, folders: list[Path], done: Path, tail: Tail) -> None:
    """After a trainer's launch in OUT: return when it exited 0 and left DONE, else raise the error that decides the
    retry: Stopped (this process stops), TrainerFailed after a checkpointing signal (retried: it resumes), DiskFull
    (not retried) when a rank marked OUT or one of FOLDERS is full, TrainerFailed quoting TAIL otherwise."""
    raise_if_stopped(what, code)
    if code == PREEMPTED:
        raise TrainerFailed(f"{what}: the trainer was signalled (cancel, preemption), checkpointed and exited; a retry resumes")
    if code != 0:
        check_disk(what, out, folders)
    if code != 0 or not done.is_file():
        raise TrainerFailed(
            f"{what}: the trainer exited with code {code} before finishing; a retry resumes from its newest checkpoint{tail}"
        )


def raise_if_stopped(what: str, code: int | None) -> None:
    """End the task of a launch that ended because this process is stopping (`STOPPING`: a thread's launch, an
    ablation's run, a swarm's proxy) as Stopped, which is not retried: its ranks checkpointed (PREEMPTED) or were
    killed once their grace ran out, and a relaunch resumes from the newest checkpoint."""
    if code != 0 and STOPPING.is_set():
        how = "checkpointed and exited" if code == PREEMPTED else f"was stopped (exit {code})"
        raise Stopped(f"{what}: this process is stopping; the trainer {how}: a relaunch resumes")


def run_streaming(
    command: list[str],
    env: dict[str, str],
    on_line: Callable[[str], None],
    cwd: str | None = None,
    grace_s: float = 0,
    log: Path | None = None,
) -> int:
    """Run `command`, passing each line of its output (stdout and stderr) to `on_line`; returns the exit code.
    Cancelled or interrupted, its ranks get SIGTERM and GRACE_S to checkpoint and exit before the tree is killed;
    so too, in a thread beside the main one (where no signal's exception reaches), once the process is STOPPING.
    LOG (the step's launch log) keeps every line, those said after this process was gone too, which the next
    launch with that LOG passes to its `on_line` first (`infra.procs.unseen_lines`)."""
    if log is not None:
        for line in unseen_lines(log):
            on_line(line)
    env = {**env, GRACE_ENV: str(grace_s)}
    proc = subprocess.Popen(
        tethered(command, log), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    ended = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        threading.Thread(target=_stop_when_stopping, args=(proc, grace_s, on_line, ended), daemon=True).start()
    try:
        record_child(proc.pid)
        for line in proc.stdout:
            on_line(line.rstrip())
        return proc.wait()
    finally:
        ended.set()
        if proc.poll() is None:  # cancelled or interrupted: no rank may survive the task
            drain = threading.Thread(target=_drain, args=(proc.stdout, on_line), daemon=True)
            drain.start()  # the ranks' last lines (their checkpoint) still reach the log, and a full pipe never blocks them
            _stop(proc, grace_s)
            drain.join(timeout=5)
        proc.stdout.close()
        if STOPPING.is_set():  # the process may end (a worker's SIGTERM) before its log handlers' next batch
            flush_logs()  # ... and with it the ranks' last lines, which say where they checkpointed


def flush_logs() -> None:
    """Send every log line this process has queued now (Prefect's API handler ships them in batches)."""
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger))]
    for handler in {h for x in loggers for h in x.handlers}:
        with contextlib.suppress(Exception):  # a handler whose stream is closed: what the others send still counts
            handler.flush()


def _stop(tether: subprocess.Popen, grace_s: float) -> None:
    """Ask the tether to stop its tree (it gives the ranks GRACE_S), and kill the tree if it has not within that."""
    tether.terminate()
    try:
        tether.wait(grace_s + REAP_GRACE_S)
    except subprocess.TimeoutExpired:
        kill_tree(tether.pid)


def _stop_when_stopping(proc: subprocess.Popen, grace_s: float, on_line: Callable[[str], None], ended: threading.Event) -> None:
    while not ended.is_set():
        if STOPPING.wait(POLL_S):
            if not ended.is_set() and proc.poll() is None:
                on_line("this process is stopping (a signal)")
                _stop(proc, grace_s)
            return


def stream_lines(log: Path, offset: int, on_line: Callable[[str], None]) -> int:
    """Pass the complete lines a job appended to LOG since byte OFFSET (its file, followed); returns the new offset."""
    if not log.exists():
        return offset
    with open(log, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode(errors="replace").splitlines():
        on_line(line)
    return offset + end


def _drain(stream, on_line: Callable[[str], None]) -> None:
    try:
        for line in stream:
            on_line(line.rstrip())
    except Exception:  # noqa: BLE001  the log of a task being cancelled: nothing left to tell
        pass
