"""Processes by identity (pid *and* start time), killing whole trees, and children that die with their owner.

A pid alone names a process only while it lives: after it exits the kernel may give the number
to another, so anything recorded to kill or wait for later is a `Proc` (host, pid, start time).

`python -m infra.procs OWNER [--log FILE] -- COMMAND...` is the tether (`tethered`): it runs COMMAND (a launcher:
torchrun, deepspeed, or a lone rank) as its child and stops it when the thread that started the tether
dies (PR_SET_PDEATHSIG) or when it is sent SIGTERM: the ranks get SIGTERM and the grace in SMOLFLOW_GRACE_S
to checkpoint, then the tree is killed (`stop_tree`). So a cancel's grace holds even when the task process
is SIGKILLed before it ends (Prefect's runner does, 30 s after its SIGTERM). The ranks watch the tether,
named in SMOLFLOW_OWNER (`watch_owner`), because launchers start them in sessions and processes of their
own where no signal follows; the launcher dies with the tether. The tether relays their output to the task
and to the step's launch log (`Relay`), so what ranks say while they checkpoint after the task died is kept,
and never meets the task's broken pipe. `--while PID:START` runs COMMAND until
a process that is not its parent exits (`guarded`).

A flow process marks its tree: every process started after `reap_when_gone()` inherits SMOLFLOW_TREE
through its environment, however deep and in whatever session (Prefect's temporary API server, pool
workers, eval and vLLM children), and a reaper (`python -m infra.procs --reap PID:START`, in a
session of its own) kills what still carries the mark once the flow process is gone, SIGKILL included;
a launched tree (it carries SMOLFLOW_GRACE_S) is its tether's to stop, and killed only after that grace.
A fork that does not exec (datatrove's `multiprocess.Manager` server) shows no mark, since /proc/PID/environ
is what its parent was exec'd with, so it is not left to the reaper: it dies with the thread that forked it.
Daemons meant to outlive it (the local server, worker, Slurm and Ray, Slurm jobs a relaunch follows) are
started with `detached(env)`, which drops the mark.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

PREEMPTED = 75  # a trainer's exit after a checkpoint forced by SIGTERM/SIGUSR1 (EX_TEMPFAIL): the task retries, it resumes
# ... and the file rank 0 leaves in the step folder beside that exit: the first rank to exit with PREEMPTED makes srun
# kill the others, and srun then reports their signal, not PREEMPTED; the Slurm script requeues on either
PREEMPTED_MARK = "preempted"

TREE_ENV = "SMOLFLOW_TREE"  # "PID:START" of the flow process whose tree a process belongs to (see module doc)
OWNER_ENV = "SMOLFLOW_OWNER"  # "PID:START" of the tether that owns a launched tree (see module doc)
GRACE_ENV = "SMOLFLOW_GRACE_S"  # seconds a launched tree's ranks have, after SIGTERM, to checkpoint and exit
REAP_GRACE_S = 5.0  # what any other process has, after SIGTERM, before it is killed
HOST = socket.gethostname()

# Set when this process is told to stop (SIGTERM: a scheduler, a cancel; SIGINT): Prefect turns the signal into
# an exception in the main thread only, so the threads beside it (an ablation's runs, eval followers, trainers
# they launched) read this to stop too: trainers checkpoint, followers score nothing new, queued runs never start.
STOPPING = threading.Event()


def stop_on_signals() -> None:
    """Set STOPPING on SIGTERM and SIGINT, then run the handler in place before (Prefect's, which raises in the
    main thread). Called at the top of flow bodies: Prefect installs its handler when a flow starts. Only the
    main thread may install handlers: elsewhere this does nothing. A flow starting in the main thread is no stop
    in progress, so an earlier one's (a notebook's Ctrl-C) is cleared. What the flow starts is reaped with it
    (`reap_when_gone`). The handler may set an Event (see `received`) since the main thread never waits on STOPPING."""
    if threading.current_thread() is not threading.main_thread():
        return
    reap_when_gone()
    STOPPING.clear()
    for sig in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(sig)
        if getattr(before, "sets_stopping", False):
            continue

        def handler(signum: int, frame: Any, before: Any = before) -> None:
            STOPPING.set()
            if callable(before):
                before(signum, frame)
            elif before == signal.SIG_DFL:  # the default: the process ends as it would have
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        handler.sets_stopping = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)


@dataclass(frozen=True)
class Proc:
    host: str
    pid: int
    started: int  # `start_ticks`: with the pid, names one process for good

    @classmethod
    def of(cls, pid: int | None = None) -> Proc:
        pid = os.getpid() if pid is None else pid
        return cls(HOST, pid, start_ticks(pid))

    @classmethod
    def load(cls, data: dict[str, Any]) -> Proc:
        return cls(str(data.get("host", "")), int(data.get("pid", -1)), int(data.get("started", 0)))

    def dump(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def token(self) -> str:
        """ "PID:START": how this process is named to another on this host (SMOLFLOW_OWNER, SMOLFLOW_TREE, --while)."""
        return f"{self.pid}:{self.started}"

    @classmethod
    def parse(cls, token: str) -> Proc:
        pid, started = token.split(":")
        return cls(HOST, int(pid), int(started))

    def process(self) -> psutil.Process | None:
        """The live process on this host, or None (gone, another host's, or its pid reused)."""
        if self.host != HOST:
            return None
        try:
            proc = psutil.Process(self.pid)
            return proc if start_ticks(self.pid) == self.started and proc.status() != psutil.STATUS_ZOMBIE else None
        except (psutil.Error, OSError):
            return None


def start_ticks(pid: int) -> int:
    """When PID started, in clock ticks since boot (/proc/PID/stat). Not psutil's create_time: that adds the boot
    time as /proc/stat gives it at each call, whole seconds that step when the wall clock is adjusted, so a live
    process would one day look gone (and its lock taken over, its tree reaped)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces


def kill_tree(pid: int | psutil.Process) -> None:
    """SIGKILL a process and every descendant (children first), and reap them."""
    try:
        parent = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def watch_owner(poll_s: float = 1.0) -> None:
    """In a rank: exit at once when the tether that launched it is gone (see module doc): it stops the ranks
    with a grace first, so this is the last resort when the tether itself was killed."""
    value = os.environ.get(OWNER_ENV)
    if not value:
        return
    owner = Proc.parse(value)

    def watch() -> None:
        while owner.process() is not None:
            time.sleep(poll_s)
        try:
            print(f"the task process {owner.pid} that launched this job is gone: exiting", flush=True)
        except OSError:
            pass  # its output went to the task's pipe, gone with it
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-owner").start()


def detached(env: Mapping[str, str]) -> dict[str, str]:
    """ENV without the tree mark: for a daemon or job meant to outlive the flow process that starts it."""
    return {k: v for k, v in env.items() if k != TREE_ENV}


def census(token: str) -> list[psutil.Process]:
    """This user's live processes that carry the tree mark TOKEN ("PID:START")."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real == os.getuid() and proc.environ().get(TREE_ENV) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass  # gone, or not ours to read
    return found


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded here: a fork's hook must not dlopen (another thread may hold the loader lock)
_forked_by = 0  # the pid that forks: set in the parent before each fork, read in the child


def _before_fork() -> None:
    global _forked_by
    _forked_by = os.getpid()


def _fork_dies_with_its_thread() -> None:
    """In a fork (without exec) of a marked process: SIGKILL when the thread that forked it ends, whatever ends it;
    exit now if the forker is gone already. Subprocesses do not run this (subprocess forks and execs in C)."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _forked_by:
        os._exit(1)


def reap_when_gone() -> None:
    """Mark the processes this one starts from now on, and have them killed when it is gone (see module doc).
    Once per process: a second call, or one in a process whose reaper runs already, does nothing."""
    token = Proc.of().token
    if os.environ.get(TREE_ENV) == token:
        return
    import subprocess

    os.environ[TREE_ENV] = token
    os.register_at_fork(before=_before_fork, after_in_child=_fork_dies_with_its_thread)
    reaper = [sys.executable, "-m", "infra.procs", "--reap", token]
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: `-m infra.procs` resolves there
    subprocess.Popen(
        reaper,
        env=detached(os.environ),
        cwd=cwd,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def reap(token: str, poll_s: float = 0.5) -> None:
    """Wait until the process TOKEN names is gone, then stop what carries its mark (`stop`)."""
    owner = Proc.parse(token)
    while owner.process() is not None:
        time.sleep(poll_s)
    stop(census(token))


def grace_of(proc: psutil.Process) -> float | None:
    """The grace of the launched tree PROC belongs to (GRACE_ENV), or None when it is not in one."""
    try:
        value = proc.environ().get(GRACE_ENV)
        return None if value is None else float(value)
    except (psutil.Error, ValueError):
        return None


def stop(procs: list[psutil.Process]) -> None:
    """SIGTERM each of PROCS and kill its tree REAP_GRACE_S later; a process of a launched tree is not signalled
    (its tether stops it: a SIGTERM to the launcher would kill the ranks at once) and is killed only once its
    grace is over too."""
    now, deadline = time.monotonic(), {}
    for proc in procs:
        grace = grace_of(proc)
        deadline[proc] = now + REAP_GRACE_S + (grace or 0.0)
        if grace is None:
            try:
                proc.terminate()
            except psutil.Error:
                pass
    alive = list(procs)
    while alive:
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, min(deadline[p] for p in alive) - time.monotonic()))
        for proc in [p for p in alive if deadline[p] <= time.monotonic()]:
            kill_tree(proc)
            alive.remove(proc)


def stop_tree(pid: int, command: list[str], grace_s: float, say: Callable[[str], None]) -> int | None:
    """SIGTERM the ranks under PID (the deepest processes running COMMAND's module, below any launcher), wait up to
    GRACE_S for them to checkpoint and exit, then kill the whole tree. The launchers in between are not signalled:
    their death would kill the ranks at once. Returns PID's exit code when PID is this process's child: psutil's
    wait reaps it, and `Popen.wait` can then only say 0 (a rank that checkpointed and exited PREEMPTED read as done)."""
    flags = [i for i, arg in enumerate(command[:-1]) if arg in ("-m", "--module")]
    module = command[flags[-1] + 1] if flags else None  # the last: torchrun is itself `-m torch.distributed.run`
    try:
        root = psutil.Process(pid)
        tree = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return None
    runs = [p for p in tree if module and _runs(p, module)]
    ranks = [p for p in runs if not any(_runs(c, module) for c in _children(p))]
    if ranks and grace_s > 0:
        say(f"stopping: SIGTERM to {len(ranks)} rank(s) of {module}, {grace_s:.0f} s to checkpoint and exit")
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(ranks, timeout=grace_s)
        if alive:
            say(f"stopping: {len(alive)} rank(s) still running after {grace_s:.0f} s: killed")
    kill_tree(root)  # the same object: the exit code its wait took is kept on it
    try:
        return root.wait(0)
    except psutil.TimeoutExpired:
        return None


def _runs(proc: psutil.Process, module: str) -> bool:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    return module in cmd


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send SIG (SIGKILL: die) to this process when its parent thread dies; exit now if it already has."""
    _LIBC.prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() == 1 or (expected_parent is not None and os.getppid() != expected_parent):
        sys.exit(f"{' '.join(sys.argv)}: the process that started it is gone (its parent is pid {os.getppid()}): not run")


def exit_without_teardown(main: Callable[[], None]) -> None:
    """Run a trainer rank's MAIN (model.train, postrain.run), then exit with its code once the atexit handlers ran,
    skipping the interpreter's teardown and C++'s static destructors. DeepSpeed keeps its gloo process groups referenced
    past `destroy_process_group`, so their threads (pt_gloo_runloop, gloo_tcp_loop) live on into that teardown; a
    pretraining rank aborted there after a clean last step (SIGABRT, "terminate called without an active exception"),
    failing the launch. An exception other than SystemExit propagates as before (its traceback, exit 1)."""
    import atexit

    try:
        main()
        code = None
    except SystemExit as stop:
        code = stop.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): said on stderr, exit 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # logging's flush, trackio's connections, weakref finalizers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def received(*signals: int) -> list[int]:
    """A list each of SIGNALS is appended to when it arrives, for a loop that sleeps to poll it. Python runs a handler
    in the main thread between two of its bytecodes, so a handler must take no lock: `Event.set` there never returns
    when the signal lands while the main thread is inside that Event's `wait` (which holds its lock), as a loaded
    tether's SIGTERM once did, and its trainer outlived the flow process."""
    got: list[int] = []
    for sig in signals:
        signal.signal(sig, lambda signum, _: got.append(signum))
    return got


def tethered(command: list[str], log: Path | None = None) -> list[str]:
    """COMMAND, run so that it is stopped when the calling thread dies, its output also appended to LOG (module doc)."""
    return [sys.executable, "-m", "infra.procs", str(os.getpid()), *(["--log", str(log)] if log else []), "--", *command]


# How the tether's own lines in a launch log begin: each launch's first, and a last one counting the lines the task
# never received (`Relay`, `unseen_lines`)
TETHER_MARK = "[smolflow tether]"
SHOWN_UNSEEN = 100  # at most this many of them are passed on by the next launch


class Relay:
    """The tether's copy of its command's output: to its own stdout, the task's pipe, and to LOG if given. Once the
    task is gone (a broken pipe: Prefect's runner SIGKILLs a cancelled flow's process while its ranks still
    checkpoint) the lines go on to LOG alone, counted by a last line for the next launch to pass on; the ranks, which
    write to the tether, never meet the broken pipe (a rank's print would raise there)."""

    def __init__(self, log: Path | None, command: list[str]) -> None:
        self.file = open(log, "a", encoding="utf-8") if log else None  # noqa: SIM115  closed by `close`
        self.to_task, self.unseen = True, 0
        self._mutex = threading.Lock()
        if self.file:  # each launch's lines under a line of its own: a step's retries append to one log
            self.file.write(f"{TETHER_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')} launched: {' '.join(command)}\n")
            self.file.flush()

    def __call__(self, line: str) -> None:
        with self._mutex:
            self._to_task(line)
            if self.file:
                try:
                    self.file.write(line + "\n")
                    self.file.flush()
                except OSError as err:  # a full disk: the ranks' output still flows, and the task hears why the log stops
                    self.file = None
                    self._to_task(f"{TETHER_MARK} the launch log stops here: {err}")

    def _to_task(self, line: str) -> None:
        if self.to_task:
            try:
                os.write(1, (line + "\n").encode(errors="replace"))
            except OSError:  # EPIPE: the task is gone; what would still write there (a traceback) goes nowhere
                self.to_task = False
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
        self.unseen += not self.to_task

    def copy(self, stream) -> None:
        for line in stream:
            self(line.rstrip("\n"))

    def close(self, code: int) -> None:
        """The log's last line counts the lines the task never received; a stray process still writing is not logged."""
        with self._mutex:
            file, self.file = self.file, None
        if file:
            with contextlib.suppress(OSError):
                if self.unseen:
                    file.write(f"{TETHER_MARK} {self.unseen} line(s) above never reached the task; exit code {code}\n")
                file.close()


def unseen_lines(log: Path) -> list[str]:
    """The lines the last launch that logged to LOG wrote after its task was gone, led by one that says so (its tether
    counted them, `Relay`); [] when its task received every line, or there was no such launch."""
    if not log.is_file():
        return []
    with open(log, encoding="utf-8", errors="replace") as f:
        tail = [line.rstrip("\n") for line in deque(f, maxlen=SHOWN_UNSEEN + 1)]
    counted = re.match(rf"{re.escape(TETHER_MARK)} (\d+) line", tail[-1]) if tail else None
    if counted is None:
        return []
    count = int(counted.group(1))
    shown = tail[-1 - min(count, SHOWN_UNSEEN) : -1]
    return [f"the previous launch's last {count} line(s) never reached its task (it was gone); from {log}:", *shown]


def tether(owner_pid: int, command: list[str], poll_s: float = 0.5, log: Path | None = None) -> int:
    """Run COMMAND as a child until it exits, or until OWNER_PID's thread dies or this process gets SIGTERM; then
    `stop_tree` it with the grace in GRACE_ENV. Its output is relayed (`Relay`, to LOG too). Returns its exit code
    (see module doc)."""
    import subprocess

    stopping = received(signal.SIGTERM)
    # a terminal's Ctrl-C reaches the owner too, which stops us; a handler, as SIG_IGN would pass on to COMMAND
    signal.signal(signal.SIGINT, lambda *_: None)
    die_with_parent(owner_pid, signal.SIGTERM)
    me = os.getpid()
    relay = Relay(log, command)
    child = subprocess.Popen(
        command,
        env={**os.environ, OWNER_ENV: Proc.of().token},
        preexec_fn=lambda: die_with_parent(me),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        encoding="utf-8",
        errors="replace",
    )
    copier = threading.Thread(target=relay.copy, args=(child.stdout,), daemon=True)
    copier.start()
    stopped = None
    while child.poll() is None:
        if stopping:
            stopped = stop_tree(child.pid, command, float(os.environ.get(GRACE_ENV, 0)), relay)
            break
        time.sleep(poll_s)
    code = child.wait() if stopped is None else stopped
    copier.join(timeout=REAP_GRACE_S)  # the last lines; a stray process still holding the pipe is not waited for
    relay.close(code)
    return code


def guarded(server: Proc, command: list[str]) -> list[str]:
    """COMMAND, stopped as soon as SERVER exits (`run_while`): for a client that sends SERVER's secret with every
    request (the Prefect worker, the auth string), which must not go on sending it to whoever binds the port next."""
    return [sys.executable, "-m", "infra.procs", "--while", server.token, "--", *command]


def run_while(watched: Proc, command: list[str], poll_s: float = 1.0) -> int:
    """Run COMMAND as a child until it exits, WATCHED exits (SIGTERM, SIGKILL after 15 s) or this process is signalled."""
    import subprocess

    child = subprocess.Popen(command)
    stop = received(signal.SIGTERM, signal.SIGINT)
    while child.poll() is None:
        gone = watched.process() is None
        if gone or stop:
            if gone:
                print(f"pid {watched.pid} is gone: stopping {os.path.basename(command[0])}", flush=True)
            child.terminate()
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                kill_tree(child.pid)
            break
        time.sleep(poll_s)
    return child.wait()


USAGE = """usage (smolflow starts these itself):
  python -m infra.procs OWNER_PID [--log FILE] -- COMMAND...   run COMMAND tethered to OWNER_PID (`tether`)
  python -m infra.procs --while PID:START -- COMMAND...        run COMMAND while that process lives (`run_while`)
  python -m infra.procs --reap PID:START                       once that process is gone, stop what carries its mark"""


def _named(token: str) -> Proc | None:
    """The process a PID:START token names, or None for anything else."""
    try:
        return Proc.parse(token)
    except ValueError:
        return None


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--reap"] and len(args) == 2 and _named(args[1]):
        reap(args[1])
        return
    if args[:1] == ["--while"] and len(args) > 3 and (watched := _named(args[1])) and args[2] == "--":
        sys.exit(run_while(watched, args[3:]))
    parent, log, rest = args[:1], None, args[1:]
    if rest[:1] == ["--log"] and len(rest) > 1:
        log, rest = Path(rest[1]), rest[2:]
    if not parent or not parent[0].isdigit() or rest[:1] != ["--"] or len(rest) < 2:
        sys.exit(USAGE)
    code = tether(int(parent[0]), rest[1:], log=log)
    if code < 0:  # killed by a signal: end the same way, so the owner reads what it would have read from COMMAND
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)  # our own handler, SIGTERM's, must not catch it
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
