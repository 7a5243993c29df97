"""Crash safety at scale: racing relaunches, leftover trainers, records that uploads and downloads are checked
against, continuous upload retries, secrets kept out of parameters (issue 10). Every process here is real."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from infra.errors import DataError, StepLocked
from infra.launch import free_port, run_streaming
from infra.locks import acquire
from infra.procs import HOST, Proc, kill_tree
from infra.recipe import S3Cfg
from infra.steps import JOB, LAUNCH_LOG, MANIFEST, Step, fingerprint_tree, run_step
from infra.storage import CorruptFile, Mirror, StorageError, download_folder, inside, temporaries
from model.checkpoint import MARKER, CheckpointStore, MirrorBehind
from tests.helpers import REPO, survivors
from tests.test_steps import Cfg

RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from infra.errors import StepLocked
    from infra.steps import Step, run_step
    from tests.test_steps import Cfg

    run_dir, log, go, sleep = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])

    def build(cfg, inputs, out):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(sleep)
        (out / "data.txt").write_text("built")
        return {}

    while not go.exists():
        time.sleep(0.01)
    try:
        run_step(run_dir, Step("train", "test", build, Cfg()), {})
    except StepLocked:
        sys.exit(3)
    """
)


def racers(tmp_path: Path, n: int, sleep: float = 1.0) -> list[subprocess.Popen]:
    go = tmp_path / f"go-{time.time()}"
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / "run"), str(tmp_path / "builds.log"), str(go), str(sleep)], cwd=REPO)
        for _ in range(n)
    ]
    time.sleep(3)  # all imported and polling
    go.touch()
    for p in procs:
        p.wait(timeout=120)
    return procs


def builds(tmp_path: Path) -> list[str]:
    log = tmp_path / "builds.log"
    return log.read_text().split() if log.exists() else []


def lease_file(tmp_path: Path) -> Path:
    sid = Step("train", "test", None, Cfg()).step_id({})
    return tmp_path / "run" / "steps" / ".partial" / f"train-{sid}.lock"


@pytest.mark.parametrize("case", ["all alive", "holder SIGKILLed", "stale lease from another host"])
def test_racing_relaunches_build_a_step_exactly_once(tmp_path, case):
    if case == "holder SIGKILLed":
        holder = subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path / "run"), str(tmp_path / "builds.log"), str(tmp_path), "600"], cwd=REPO
        )
        deadline = time.time() + 60
        while not builds(tmp_path) and time.time() < deadline:
            time.sleep(0.05)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert builds(tmp_path) == [str(holder.pid)]
        assert json.loads(lease_file(tmp_path).read_text())["pid"] == holder.pid  # its lease is left behind
    if case == "stale lease from another host":
        lease_file(tmp_path).parent.mkdir(parents=True)
        lease_file(tmp_path).write_text(json.dumps({"host": "node-7", "pid": 4242, "started": 1.0, "heartbeat": time.time() - 600}))
    before = len(builds(tmp_path))
    procs = racers(tmp_path, 4)
    assert len(builds(tmp_path)) - before == 1, "exactly one racer builds"
    assert sorted(p.returncode for p in procs).count(0) >= 1 and all(p.returncode in (0, 3) for p in procs)
    assert json.loads((tmp_path / "run" / "train" / MANIFEST).read_text())["name"] == "train"
    assert not lease_file(tmp_path).exists()


def test_a_live_lease_from_another_host_is_respected(tmp_path, caplog, monkeypatch):
    import infra.steps

    monkeypatch.setattr(infra.steps, "WAIT_LOG_S", 0.4)  # a minute in production
    caplog.set_level("INFO", logger="infra.steps")
    lease_file(tmp_path).parent.mkdir(parents=True)
    lease_file(tmp_path).write_text(json.dumps({"host": "node-7", "pid": 4242, "started": 1.0, "heartbeat": time.time(), "lease_s": 120}))
    with pytest.raises(StepLocked, match=r"pid 4242 on node-7.*gave up waiting after \d+ s \(storage.wait_for_builder_s"):
        run_step(tmp_path / "run", Step("train", "test", lambda c, i, o: {}, Cfg()), {}, wait_s=1.0)
    said = [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]
    assert len(said) >= 2 and all("pid 4242 on node-7" in line for line in said), "the wait says who holds the step, again and again"
    assert builds(tmp_path) == []


def test_a_leftover_trainer_is_stopped_by_the_next_holder_but_a_reused_or_foreign_pid_is_not(tmp_path):
    from infra.locks import LEASE_ENV
    from infra.procs import GRACE_ENV

    token = "a1" * 16
    leftover = subprocess.Popen(["sleep", "120"], env={**os.environ, LEASE_ENV: token})  # launched under the lease
    bystander = subprocess.Popen(["sleep", "120"], env={**os.environ, LEASE_ENV: token})
    foreign = subprocess.Popen(["sleep", "120"])  # ours, alive, named in the lease, but never launched under it
    saved = tmp_path / "saved"
    save = f"import time; time.sleep(3); open({str(saved)!r}, 'w').close()"  # a launched tree finishing its checkpoint
    stopping = subprocess.Popen([sys.executable, "-c", save], env={**os.environ, LEASE_ENV: token, GRACE_ENV: "60"})
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    lock = tmp_path / "step.lock"
    children = [Proc.of(leftover.pid).dump(), {**Proc.of(bystander.pid).dump(), "started": 12.0}, Proc.of(foreign.pid).dump()]
    children.append(Proc.of(stopping.pid).dump())
    lease = {"host": HOST, "pid": dead_owner.pid, "started": 1.0, "heartbeat": time.time(), "token": token, "children": children}
    lock.write_text(json.dumps(lease))
    try:
        held = acquire(lock)
        assert held is not None and held.record["epoch"] == 1 and held.token != token
        leftover.wait(timeout=10)  # killed (psutil reaped it, so its exit status reads 0), not the 120 s sleep
        assert bystander.poll() is None, "a reused pid (another start time) is left alone"
        assert foreign.poll() is None, "a pid planted in a lease, without the lease's token, is left alone"
        assert saved.exists(), "a launched tree is given its grace (its checkpoint) before it is killed"
        held.release()
    finally:
        for p in (leftover, bystander, foreign, stopping):
            p.kill()
            p.wait()


def test_a_process_is_named_by_its_start_since_boot_which_a_wall_clock_step_does_not_move(monkeypatch):
    """psutil's create_time adds the boot time /proc/stat gives at each call, whole seconds that step when the
    wall clock is adjusted: a live lock holder, rank owner or flow process must still be found after such a step,
    or its lock is taken over and its tree reaped under it."""
    import psutil._pslinux as pslinux

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        me, other = Proc.of(), Proc.of(sleeper.pid)
        booted = pslinux.boot_time()
        monkeypatch.setattr(pslinux, "boot_time", lambda: booted + 1.0)  # the step, as psutil would read it
        assert Proc.parse(me.token).process() is not None
        assert Proc.load(other.dump()).process().pid == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
    assert Proc.load(other.dump()).process() is None, "gone is still gone"


def test_the_processes_a_step_launches_carry_its_lease_token(tmp_path):
    """What lets the next holder tell a leftover trainer from any process that happens to have its pid."""
    from infra.launch import launch_env
    from infra.locks import LEASE_ENV, holder
    from infra.recipe import AccelerateCfg

    seen = {}

    def build(cfg, inputs, out):
        seen["env"], seen["lease"] = launch_env(AccelerateCfg()).get(LEASE_ENV), holder(lease_file(tmp_path))["token"]
        return {}

    run_step(tmp_path / "run", Step("train", "test", build, Cfg()), {})
    assert seen["env"] and seen["env"] == seen["lease"]
    assert LEASE_ENV not in launch_env(AccelerateCfg()), "outside a build nothing claims a lease"


def test_a_lock_file_planted_as_a_link_or_owned_by_another_user_is_refused(tmp_path):
    from infra.errors import SmolflowError

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run" / "steps" / ".partial").mkdir(parents=True)
    lease_file(tmp_path).symlink_to(victim)
    with pytest.raises(SmolflowError, match="is a symbolic link: refusing"):
        run_step(tmp_path / "run", Step("train", "test", lambda c, i, o: {}, Cfg()), {})
    assert victim.read_text() == "precious", "the link's target is neither truncated nor written"
    foreign = tmp_path / "foreign.lock"
    foreign.write_text("")
    os.chown(foreign, 4242, 4242)
    with pytest.raises(SmolflowError, match="owned by uid 4242"):
        acquire(foreign)


def test_an_empty_lock_file_is_a_holder_between_create_and_first_write_until_it_ages(tmp_path):
    lock = tmp_path / "step.lock"
    lock.write_text("")  # another host created it and has not written its lease yet
    assert acquire(lock, lease_s=60) is None
    old = time.time() - 120
    os.utime(lock, (old, old))  # nobody wrote a lease in two minutes: a dead holder
    held = acquire(lock, lease_s=60)
    assert held is not None
    held.release()


FORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from infra.locks import acquire

    lock = acquire(Path(sys.argv[1]))
    if os.fork() == 0:  # a forked child (a pool worker, a fork of the CLI) that outlives its parent
        os.write(1, b"forked\\n")  # past the fork hooks; one write each, or an unbuffered print interleaves the two
        time.sleep(120)
        os._exit(0)
    os.write(1, b"held\\n")
    time.sleep(120)
    """
)
HANDER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from infra.locks import acquire

    lock = acquire(Path(sys.argv[1]))  # hands its descriptor on explicitly: a child that really holds the lock
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=[lock.fd])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def test_a_fork_of_a_killed_holder_does_not_keep_its_lock_and_a_stuck_lock_names_the_process_that_holds_it(tmp_path):
    """A fork of a SIGKILLed `smolflow stage curate` slept on, sharing the step's lock, and every relaunch for 20
    minutes failed naming the dead process."""
    lock = tmp_path / "step.lock"
    parent = subprocess.Popen([sys.executable, "-c", FORKER, str(lock)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert {parent.stdout.readline().strip(), parent.stdout.readline().strip()} == {"held", "forked"}
    fork = [p for p in psutil.Process(parent.pid).children() if p.pid != parent.pid]
    assert fork, "the fork is alive"
    parent.kill()
    parent.wait()
    taken = acquire(lock)
    try:
        assert taken is not None, "the fork left the lock of its dead parent"
    finally:
        for p in fork:
            p.kill()
        if taken:
            taken.release()

    hander = subprocess.Popen([sys.executable, "-c", HANDER, str(lease_file(tmp_path))], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(hander.stdout.readline())
    hander.kill()
    hander.wait()
    try:
        with pytest.raises(StepLocked, match=rf"held open by pid {child} \(.*time.sleep"):
            run_step(tmp_path / "run", Step("train", "test", lambda c, i, o: {}, Cfg()), {}, wait_s=0)
    finally:
        psutil.Process(child).kill()


FLOW_FORKS = textwrap.dedent(
    """
    import os, threading, time
    import multiprocess
    from infra.procs import reap_when_gone

    reap_when_gone()  # as a flow process does
    forks = []
    def task():  # a task's thread forks, as datatrove's LocalPipelineExecutor starts its rank queue's server
        manager = multiprocess.Manager()
        forks.append(manager._process.pid)
        if (pid := os.fork()) == 0:
            time.sleep(120)
            os._exit(0)
        forks.append(pid)
        time.sleep(120)
    threading.Thread(target=task, daemon=True).start()
    while len(forks) < 2:
        time.sleep(0.05)
    print(*forks, flush=True)
    time.sleep(120)
    """
)


def test_forks_of_a_sigkilled_flow_process_die_with_it_though_they_carry_no_mark(tmp_path):
    """Found by the kill drill: a flow process SIGKILLed while curation ran left datatrove's `multiprocess.Manager`
    server (a fork, no exec) running for good. A fork's /proc/PID/environ is its parent's at exec, without the tree
    mark the flow process set later, so the reaper's census never saw it (nor did the drill's)."""
    from infra.procs import census

    flow = subprocess.Popen([sys.executable, "-c", FLOW_FORKS], cwd=REPO, stdout=subprocess.PIPE, text=True)
    forks = [psutil.Process(int(pid)) for pid in flow.stdout.readline().split()]
    token = Proc.of(flow.pid).token
    assert len(forks) == 2 and not {p.pid for p in census(token)} & {p.pid for p in forks}, "invisible to the census"
    flow.kill()
    flow.wait()
    alive = survivors([p.pid for p in forks], timeout_s=10)
    for p in forks:
        if p.pid in alive:
            p.kill()
    assert not alive, f"forks outlived their flow process: {alive}"


STALLER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import infra.locks as locks
    import infra.steps as steps
    from tests.test_steps import Cfg

    locks.LEASE_S = 1.0
    run_dir, log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

    def build(cfg, inputs, out):
        with open(log, "a") as f:
            f.write("building\\n")
        while not go.exists():  # the test stops this process here, past its lease, then lets it go on
            time.sleep(0.05)
        (out / "data.txt").write_text("stalled holder")
        return {}

    try:
        steps.run_step(run_dir, steps.Step("train", "test", build, Cfg()), {})
    except locks.LockLost as err:
        print("LOST:", err, flush=True)
        sys.exit(4)
    """
)

TAKER = textwrap.dedent(
    """
    import fcntl, sys, time
    from pathlib import Path
    import infra.locks as locks
    import infra.procs as procs

    # another host: its kernel locks do not see ours (as on a filesystem whose locks are local to each host)
    locks.HOST = procs.HOST = "node-7"
    fcntl.flock = lambda fd, op: None
    lock = locks.acquire(Path(sys.argv[1]), lease_s=1.0)
    print("epoch", lock.record["epoch"], flush=True)
    time.sleep(float(sys.argv[2]))
    lock.release()
    """
)


def test_a_holder_whose_heartbeat_stalled_past_its_lease_is_fenced_off(tmp_path):
    """Real processes: the holder is stopped past its lease, another host takes the lock over (epoch 2); the holder,
    let go on, must not commit its build nor remove the new holder's lock file."""
    run_dir, log, go = tmp_path / "run", tmp_path / "builds.log", tmp_path / "go"
    holder = subprocess.Popen([sys.executable, "-c", STALLER, str(run_dir), str(log), str(go)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not log.exists() and time.time() < deadline:
        time.sleep(0.05)
    holder.send_signal(signal.SIGSTOP)  # a stalled heartbeat: the lease (1 s) runs out
    try:
        time.sleep(2.5)
        taker = subprocess.Popen([sys.executable, "-c", TAKER, str(lease_file(tmp_path)), "6"], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert taker.stdout.readline().split() == ["epoch", "2"]
    finally:
        holder.send_signal(signal.SIGCONT)
    go.touch()
    out, _ = holder.communicate(timeout=60)
    assert holder.returncode == 4 and "taken over" in out, out
    assert not (run_dir / "train").exists() and not any((run_dir / "steps").glob("train-*")), "the fenced holder committed nothing"
    assert lease_file(tmp_path).exists() and json.loads(lease_file(tmp_path).read_text())["host"] == "node-7", "its lock file is left alone"
    taker.wait(timeout=30)


OWNER = textwrap.dedent(
    """
    import sys
    from infra.launch import run_streaming
    import os
    # a launcher that starts its rank in a session of its own, as torchrun does, then waits
    rank = "import time; from infra.procs import watch_owner; watch_owner(0.2); time.sleep(120)"
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(120)"
    run_streaming([sys.executable, "-c", launcher], dict(os.environ), print)
    """
)


def test_a_sigkilled_task_process_takes_its_launcher_and_ranks_with_it(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=REPO)
    deadline, tree = time.time() + 60, []
    while time.time() < deadline and len(tree) < 3:  # the tether, the launcher and its rank
        time.sleep(0.2)
        tree = psutil.Process(owner.pid).children(recursive=True)
    rank = [p for p in tree if "watch_owner(0.2)" in " ".join(p.cmdline())]
    assert rank and len(tree) == 3, "the launcher and its rank started"
    owner.send_signal(signal.SIGKILL)  # no finally runs in the task process
    owner.wait()
    _, alive = psutil.wait_procs(tree + rank, timeout=15)
    assert not alive, f"left running: {alive}"


# A rank that takes SAVE_S to checkpoint after SIGTERM, longer than the reaper gives a process outside a launched tree.
SAVE_S = 8
TOY_RANK = textwrap.dedent(
    f"""
    import os, signal, sys, time
    from pathlib import Path
    from infra.procs import watch_owner

    watch_owner(0.2)
    out, rank, term = Path(sys.argv[1]), os.environ["RANK"], []
    signal.signal(signal.SIGTERM, lambda *_: term.append(1))
    (out / f"started.{{rank}}").touch()
    while not term:
        time.sleep(0.05)
    (out / f"stopping.{{rank}}").touch()
    time.sleep({SAVE_S})  # the checkpoint
    (out / f"saved.{{rank}}").touch()
    print(f"rank {{rank}}: checkpoint saved", flush=True)  # the task that launched it is gone by now
    (out / f"said.{{rank}}").touch()
    sys.exit(75)
    """
)
CANCELLED_TASK = textwrap.dedent(
    """
    import signal, sys
    from pathlib import Path
    from infra.launch import launch_command, launch_env, run_streaming
    from infra.steps import LAUNCH_LOG
    from infra.procs import reap_when_gone
    from infra.recipe import LauncherCfg

    reap_when_gone()  # as a flow process does
    def cancelled(*_):  # as Prefect's handler does: an exception in the main thread
        raise SystemExit("cancelled")
    signal.signal(signal.SIGTERM, cancelled)
    launcher = LauncherCfg(kind="torchrun", nproc=2)
    command = launch_command(launcher, "toy_rank", [sys.argv[1]], int(sys.argv[2]))
    run_streaming(command, launch_env(launcher), print, grace_s=60, log=Path(sys.argv[1]) / LAUNCH_LOG)
    """
)


def test_a_cancelled_task_sigkilled_mid_grace_still_gives_its_ranks_the_grace_to_checkpoint(tmp_path):
    """Prefect's runner SIGKILLs a cancelled flow's process 30 s after its SIGTERM, whatever the grace: the tether
    holds the grace after its owner died, the ranks wait for it, and the reaper spares the launched tree meanwhile;
    once the ranks have saved, nothing is left."""
    (tmp_path / "toy_rank.py").write_text(TOY_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    task = subprocess.Popen([sys.executable, "-c", CANCELLED_TASK, str(tmp_path), str(free_port())], cwd=REPO, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(tmp_path.glob("started.*"))) < 2:
        time.sleep(0.2)
    assert len(list(tmp_path.glob("started.*"))) == 2, "torchrun started both ranks"
    tree = psutil.Process(task.pid).children(recursive=True)
    task.send_signal(signal.SIGTERM)  # the cancel
    while time.time() < deadline and len(list(tmp_path.glob("stopping.*"))) < 2:
        time.sleep(0.05)
    assert len(list(tmp_path.glob("stopping.*"))) == 2, "both ranks were told to checkpoint"
    task.send_signal(signal.SIGKILL)  # mid-checkpoint, as Prefect's runner does once its 30 s are up
    task.wait()
    _, alive = psutil.wait_procs(tree, timeout=SAVE_S + 30)
    assert sorted(p.name for p in tmp_path.glob("saved.*")) == ["saved.0", "saved.1"], "both ranks finished their checkpoint"
    assert not alive, f"left running: {alive}"
    # what the ranks said after the task was gone: written without error (no broken pipe), kept in the launch log,
    # and passed on by the next launch in that folder, which the relaunch's log then shows
    assert sorted(p.name for p in tmp_path.glob("said.*")) == ["said.0", "said.1"], "a rank's output failed once the task was gone"
    lines: list[str] = []
    run_streaming([sys.executable, "-c", "print('relaunched')"], dict(os.environ), lines.append, log=tmp_path / LAUNCH_LOG)
    unseen = lines[: lines.index("relaunched")]
    assert "never reached its task" in unseen[0] and {"rank 0: checkpoint saved", "rank 1: checkpoint saved"} <= set(unseen), lines
    assert lines[-1] == "relaunched"
    lines.clear()
    run_streaming([sys.executable, "-c", "print('again')"], dict(os.environ), lines.append, log=tmp_path / LAUNCH_LOG)
    assert lines == ["again"], "lines a task received are not passed on again"


STOPPED_RANK = textwrap.dedent(
    """
    import signal, sys, time
    if sys.argv[1] == "checkpoints":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # as a trainer does once its checkpoint is saved
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # still saving when the grace ends
    print("training", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("rank", ["checkpoints", "overruns"])
def test_a_launch_stopped_from_a_thread_returns_its_ranks_own_exit(tmp_path, rank):
    """A thread's launch (an ablation's run, a swarm's proxy) stopped through STOPPING returns what its rank did: the
    checkpoint's PREEMPTED or SIGKILL once the grace ran out, and its task ends as Stopped instead of retrying.
    (The tether's wait for the rank reaped it, after which it reported every stopped launch as exit 0.)"""
    import threading

    from infra.errors import Stopped
    from infra.launch import raise_if_stopped
    from infra.procs import PREEMPTED, STOPPING

    (tmp_path / "stopped_rank.py").write_text(STOPPED_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    codes: list[int] = []

    def on_line(line: str) -> None:
        if line == "training":
            STOPPING.set()

    launch = threading.Thread(
        target=lambda: codes.append(run_streaming([sys.executable, "-m", "stopped_rank", rank], env, on_line, grace_s=2))
    )
    try:
        launch.start()
        launch.join(timeout=60)
        assert codes == ([PREEMPTED] if rank == "checkpoints" else [-signal.SIGKILL])
        with pytest.raises(Stopped, match="apo: this process is stopping; the trainer (checkpointed|was stopped)"):
            raise_if_stopped("apo", codes[0])  # which the task raises: no retry while its process stops
    finally:
        STOPPING.clear()


LEAVER = textwrap.dedent("""
    import atexit, sys
    from pathlib import Path
    from infra.procs import exit_without_teardown

    out, how = Path(sys.argv[1]), sys.argv[2]

    class Global:  # freed only by the interpreter's teardown, where a rank's gloo threads once aborted it
        def __del__(self, write=(out / "teardown").write_text):
            write("ran")

    kept = Global()
    atexit.register((out / "atexit").write_text, "ran")

    def main():
        print("said", end="")  # not flushed yet
        if how != "return":
            sys.exit(int(how) if how.isdigit() else how)

    exit_without_teardown(main)
""")


@pytest.mark.parametrize("how, code", [("return", 0), ("75", 75), ("a message", 1)])
def test_a_rank_exits_with_its_code_and_its_atexit_handlers_run_but_skips_the_interpreters_teardown(tmp_path, how, code):
    """A trainer rank's exit (`exit_without_teardown`): a clean return, PREEMPTED after a forced checkpoint, and
    sys.exit(message) keep their exit codes and output, atexit handlers run, and nothing is left to tear down in."""
    out = subprocess.run([sys.executable, "-c", LEAVER, str(tmp_path), how], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == code and out.stdout == "said", out.stderr
    assert (how == "a message") == ("a message" in out.stderr), out.stderr
    assert (tmp_path / "atexit").exists() and not (tmp_path / "teardown").exists()


# A tether (or `--while` guard) around `sleep` whose main thread, once ARMED exists, sends itself SIGTERM as soon as
# threading's own code entered a lock (`with` on an Event's or a Condition's): the handler runs there, the lock held.
SIGNALLED_INSIDE_A_LOCK = textwrap.dedent("""
    import os, signal, sys, threading
    from infra.procs import Proc, run_while, tether

    armed, guard = sys.argv[1], sys.argv[2] == "while"

    def hook(frame, event, arg):
        inside = frame.f_code.co_filename == threading.__file__
        if event == "c_return" and inside and getattr(arg, "__name__", "") == "__enter__" and os.path.exists(armed):
            os.unlink(armed)
            os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(hook)  # the main thread only
    command = ["sleep", "120"]
    sys.exit(run_while(Proc.of(os.getppid()), command, 0.05) if guard else tether(os.getppid(), command, 0.05))
""")


@pytest.mark.parametrize("runner", ["tether", "while"])
def test_a_sigterm_that_lands_while_the_main_thread_holds_a_lock_still_stops_the_tree(tmp_path, runner):
    """A tether's SIGTERM handler once set a threading.Event the main loop waited on; landing inside that wait (which
    holds the Event's lock) the handler never returned, and a trainer outlived its SIGKILLed flow process."""
    armed = tmp_path / "armed"
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED_INSIDE_A_LOCK, str(armed), runner], cwd=REPO)
    deadline, sleeper = time.time() + 30, []
    while not sleeper and time.time() < deadline:
        time.sleep(0.1)
        sleeper = [p for p in psutil.Process(proc.pid).children() if p.name() == "sleep"]
    assert sleeper, "the command started"
    armed.touch()
    time.sleep(1)
    try:
        armed.unlink()  # still there: its loop took no such lock, so the signal comes from here
    except FileNotFoundError:
        pass
    else:
        proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"{runner}: SIGTERM'd inside a lock, it never stopped its command")
    assert not psutil.pid_exists(sleeper[0].pid), "the command stopped"


def test_daemons_and_jobs_meant_to_outlive_a_flow_are_started_without_its_tree_mark(tmp_path, monkeypatch):
    """The reaper kills what carries a dead flow process's mark: the local server and worker, Slurm's and Ray's
    daemons and Slurm jobs (which a relaunch follows by name) must not carry it."""
    from flows.cluster import Ray, Slurm
    from flows.server import Server
    from infra import slurm
    from infra.procs import TREE_ENV

    monkeypatch.setenv(TREE_ENV, "1:2.0")
    assert TREE_ENV not in Server(root=REPO, state=tmp_path).env()
    assert TREE_ENV not in Slurm(state=tmp_path, port=6817).env()
    seen: list[dict] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env=None, **kw: seen.append(env) or subprocess.CompletedProcess(cmd, 0, "7", ""))
    slurm.submit(tmp_path / "job.sh", dict(os.environ))
    Ray.here()._ray("status")
    assert len(seen) == 2 and all(TREE_ENV not in env for env in seen)


def test_secrets_are_refused_as_overrides_and_never_written(tmp_path):
    from infra.recipe import RecipeError, load_recipe

    secret = "AKIA-very-secret-value"
    for override in ("storage.s3.key=" + secret, "storage.s3={endpoint_url: http://x, secret: " + secret + "}"):
        with pytest.raises(RecipeError, match="AWS_ACCESS_KEY_ID") as err:
            load_recipe(REPO / "configs" / "micro.yaml", [override])
        assert secret not in str(err.value)
    assert load_recipe(REPO / "configs" / "micro.yaml", ["storage.s3.endpoint_url=http://x"]).storage.s3.endpoint_url == "http://x"
    command = [sys.executable, "-m", "flows.cli", "run", "configs/micro.yaml", "--run-dir", str(tmp_path / "r")]
    proc = subprocess.run(  # the CLI refuses it before a Prefect server (and its parameter store) is started
        [*command, "--set", "storage.s3.secret=" + secret],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "AWS_ACCESS_KEY_ID" in proc.stdout + proc.stderr and secret not in proc.stdout + proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_data_error_is_not_retried_and_a_transient_one_is(prefect_server):
    from prefect import flow

    from tasks.common import stage_task

    calls = {"data": 0, "storage": 0}

    @stage_task("flaky", retries=2)
    def flaky(kind: str) -> None:
        calls[kind] += 1
        raise (DataError("bad.jsonl line 3: not JSON") if kind == "data" else StorageError("s3 unreachable"))

    @flow
    def both() -> None:
        for kind in calls:
            try:
                flaky.with_options(retry_delay_seconds=0)(kind)
            except Exception:
                pass

    both()
    assert calls == {"data": 1, "storage": 3}


def test_step_data_is_on_disk_before_its_manifest(tmp_path, monkeypatch):
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    def build(cfg, inputs, out):
        (out / "sub").mkdir()
        (out / "sub" / "part-0.bin").write_bytes(b"data" * 1000)
        (out / "part-1.bin").write_bytes(b"more")
        return {}

    run_step(tmp_path, Step("tok", "test", build, Cfg()), {})
    first_manifest = next(i for i, p in enumerate(synced) if MANIFEST in p)
    before = synced[:first_manifest]
    assert any(p.endswith("sub/part-0.bin") for p in before) and any(p.endswith("part-1.bin") for p in before)
    record = json.loads((tmp_path / "tok" / MANIFEST).read_text())["files"]
    assert record["part-1.bin"] == {"size": 4, "md5": hashlib.md5(b"more").hexdigest()}


@pytest.fixture
def bucket(s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server["endpoint"]})
    name = f"b{time.time_ns()}"
    fs.mkdir(name)
    return fs, name, S3Cfg(endpoint_url=s3_server["endpoint"])


def small_parts(mirror: Mirror) -> Mirror:
    mirror.part_size = 16 * 1024  # moto accepts parts this small (S3_UPLOAD_PART_MIN_SIZE in conftest)
    return mirror


SID = "ab" * 10  # a step id: the mirror holds the store's names, NAME-ID/checkpoints/stepN


def test_multipart_uploads_are_verified_and_mirrored_models_fingerprinted_from_records(tmp_path, bucket):
    from flows.graph import build_graph
    from infra.recipe import parse_recipe
    from tasks.evaluation.results import local_fingerprint, models_in_prefix
    from tests.helpers import micro_recipe

    fs, name, s3 = bucket
    mirror = small_parts(Mirror(f"s3://{name}/run", s3, attempts=1))
    steps = build_graph(parse_recipe(micro_recipe(), "micro")).steps
    phase = next(s for s in steps if s.checkpoints)
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2, mirror=mirror, remote_name=f"{phase.name}-{SID}/checkpoints")
    staged = store.tmp_dir() / "step00000010"
    (staged / "hf").mkdir(parents=True)
    (staged / "hf" / "model.safetensors").write_bytes(os.urandom(100 * 1024))  # 7 parts of 16 KiB
    (staged / "hf" / "config.json").write_text('{"a": 1}')
    store.commit("step00000010", 10, {"tokens": 2560})
    assert store.close() == []
    remote = f"{name}/run/{phase.name}-{SID}/checkpoints/step00000010"
    assert "-" in fs.info(f"{remote}/hf/model.safetensors")["ETag"], "uploaded in parts"

    # an older marker (sizes only) beside it: reported as skipped, with the reason
    fs.pipe(f"{name}/run/{phase.name}-{SID}/checkpoints/step00000005/hf/config.json", b"{}")
    fs.pipe(
        f"{name}/run/{phase.name}-{SID}/checkpoints/step00000005/{MARKER}", json.dumps({"step": 5, "files": {"hf/config.json": 2}}).encode()
    )
    found, skipped = models_in_prefix(f"s3://{name}/run", s3, steps)
    assert [m.label for m in found] == [f"{phase.checkpoints}/step00000010"]
    assert found[0].fingerprint == local_fingerprint(tmp_path / "ckpt" / "step00000010" / "hf")
    assert list(skipped) == [f"{name}/run/{phase.name}-{SID}/checkpoints/step00000005/hf"] and "no MD5" in next(iter(skipped.values()))
    copy = download_folder(found[0].path, tmp_path / "copy", s3)
    assert local_fingerprint(copy) == found[0].fingerprint

    # a file changed after it was recorded is never uploaded as if it were the checkpoint
    (tmp_path / "ckpt" / "step00000010" / "hf" / "config.json").write_text('{"a": 2}')
    with pytest.raises(CorruptFile, match="config.json"):
        mirror.push(tmp_path / "ckpt" / "step00000010", "elsewhere", MARKER)


def test_pulls_check_every_file_against_its_record(tmp_path, bucket):
    fs, name, s3 = bucket
    mirror = small_parts(Mirror(f"s3://{name}/run", s3, attempts=1))
    step = Step("tok", "test", lambda c, i, out: (out / "data.bin").write_bytes(b"x" * 50_000) and {}, Cfg())
    out = run_step(tmp_path / "a", step, {}, mirror)
    fs.pipe(f"{name}/run/{out.folder}/data.bin", b"y" * 50_000)  # same size, other bytes
    with pytest.raises(StorageError, match="does not match its record"):
        mirror.pull(out.folder, tmp_path / "b", MANIFEST)
    assert not (tmp_path / "b" / "data.bin").exists()
    assert [p.name for p in (tmp_path / "b").iterdir()] == []  # nothing half-downloaded kept under a real name
    with pytest.raises(StorageError, match="outside"):
        inside(tmp_path / "b", "../../etc/cron.d/x")


def test_a_step_whose_push_failed_is_pushed_when_found_finished(tmp_path, bucket):
    fs, name, s3 = bucket
    down = Mirror(f"s3://{name}/run", S3Cfg(endpoint_url="http://127.0.0.1:9"), attempts=1)
    step = Step("tok", "test", lambda c, i, out: (out / "data.txt").write_text("tokens") and {}, Cfg())
    remote = f"{name}/run/tok-{step.step_id({})}"  # the store's own name
    with pytest.raises(StorageError):
        run_step(tmp_path, step, {}, down)
    assert (tmp_path / "steps" / f"tok-{step.step_id({})}" / MANIFEST).exists() and not fs.exists(f"{remote}/{MANIFEST}")
    out = run_step(tmp_path, step, {}, Mirror(f"s3://{name}/run", s3))
    assert out.cached and fs.cat_file(f"{remote}/data.txt") == b"tokens" and fs.exists(f"{remote}/{MANIFEST}")


def copy_on_mirror(fs, src: str, dst: str, keep: bool = True) -> None:
    """Every object under SRC to the same name under DST, SRC kept or not (a layout made by hand)."""
    fs.invalidate_cache()  # the mirror wrote through another client
    for key in fs.find(src):
        fs.copy(key, f"{dst}/{key[len(src) + 1 :]}")
    if not keep:
        fs.rm(src, recursive=True)
    fs.invalidate_cache()


def test_a_step_finished_on_a_mirror_of_the_old_layout_is_pulled_not_rebuilt_and_copied_to_its_name_there(tmp_path, bucket):
    """Before STORE/NAME-ID, a run mirrored its steps as MIRROR/NAME (the manifest naming the version): a fresh machine
    with today's code pulls such a step of the same id instead of building it again, and leaves the copy under NAME-ID;
    another version under NAME is not taken for it."""
    from infra.steps import decide

    fs, name, s3 = bucket
    calls: list[int] = []

    def make(cfg, inputs, out):
        calls.append(cfg.v)
        (out / "data.txt").write_text(f"tokens {cfg.v}")
        (out / JOB).write_text(str(out))  # a trace: its manifest of those days fingerprinted it too
        return {}

    step = Step("tok", "test", make, Cfg())
    sid = step.step_id({})
    first = run_step(tmp_path / "machine1", step, {}, Mirror(f"s3://{name}/m", s3))
    copy_on_mirror(fs, f"{name}/m/tok-{sid}", f"{name}/m/tok", keep=False)  # the old layout
    manifest = json.loads(fs.cat_file(f"{name}/m/tok/{MANIFEST}"))
    manifest["fingerprint"] = fingerprint_tree(first.path, frozenset({MANIFEST}))
    fs.pipe_file(f"{name}/m/tok/{MANIFEST}", json.dumps(manifest).encode())
    assert not fs.exists(f"{name}/m/tok-{sid}/{MANIFEST}") and fs.exists(f"{name}/m/tok/{MANIFEST}")

    mirror = Mirror(f"s3://{name}/m", s3)
    status = decide(tmp_path / "machine2", step, {}, mirror)
    said = f"finished on s3://{name}/m as tok (the layout before tok-{sid}: copied there once pulled)"
    assert (status.state, status.reason) == ("pull", said)
    out = run_step(tmp_path / "machine2", step, {}, mirror)
    assert calls == [0] and out.cached and (out.path / "data.txt").read_text() == "tokens 0"
    assert json.loads(fs.cat_file(f"{name}/m/tok-{sid}/{MANIFEST}"))["step_id"] == sid, "the mirror holds it under NAME-ID now"
    assert decide(tmp_path / "machine3", step, {}, mirror).reason == f"finished on s3://{name}/m"

    other = Step("tok", "test", make, Cfg(v=2))  # another version: MIRROR/tok holds the first one's
    assert decide(tmp_path / "machine2", other, {}, mirror).state == "rerun"
    run_step(tmp_path / "machine2", other, {}, mirror)
    assert calls == [0, 2]


def test_the_dry_run_the_upstream_check_and_the_build_make_one_decision_mirror_included(tmp_path, bucket):
    """A fresh machine whose mirror holds the upstream: the dry run says `pull`, a stage's upstream check passes
    and the stage pulls it; nothing is built again."""
    from flows.graph import upstream
    from infra.steps import Run
    from tests.helpers import micro_recipe, write_recipe

    fs, name, s3 = bucket
    calls: list = []

    def make(cfg, inputs, out):
        calls.append(1)
        (out / "data.txt").write_text("tokens")
        return {"docs": 3}

    up = Step("tok", "curate", make, Cfg())
    down = Step("train", "pretrain", lambda c, i, out: calls.append(2) or {}, Cfg(), {"tokens": up})
    graph = type("G", (), {"steps": [up, down]})()
    storage = {"storage.mirror": f"s3://{name}/m", "storage.s3.endpoint_url": s3.endpoint_url}
    path = write_recipe(tmp_path / "r.yaml", micro_recipe(**storage))
    first = Run.open(str(path), str(tmp_path / "machine1"))
    first.build(up, {})
    second = Run.open(str(path), str(tmp_path / "machine2"), freeze=False)
    assert [(s.state, s.reason) for s in second.statuses(graph.steps)] == [("pull", f"finished on s3://{name}/m"), ("run", "")]
    second = Run.open(str(path), str(tmp_path / "machine2"))
    pulled = upstream(second, graph, ["pretrain"])["tok"]
    assert calls == [1] and (tmp_path / "machine2" / "tok" / "data.txt").read_text() == "tokens"
    assert pulled.summary.model_dump() == {"docs": 3}
    assert [s.state for s in second.statuses(graph.steps)] == ["cached", "run"]
    assert fs.exists(f"{name}/m/runs/machine1/recipe.json"), "each run's recipe beside the store it mirrors"


def fake_checkpoint(store: CheckpointStore, step: int) -> None:
    staged = store.tmp_dir() / f"step{step:08d}"
    staged.mkdir(parents=True)
    (staged / "optim.pt").write_bytes(os.urandom(1000))
    store.commit(f"step{step:08d}", step, {})


BLACKHOLE = "import socket, sys, time; s = socket.create_server(('127.0.0.1', int(sys.argv[1]))); c = [s.accept() for _ in range(99)]"


@contextmanager
def blackhole(monkeypatch) -> Iterator[str]:
    """An S3 endpoint that accepts connections and never answers; credentials, so that requests are sent."""
    port = free_port()
    hole = subprocess.Popen([sys.executable, "-c", BLACKHOLE, str(port)])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "the blackhole did not listen"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        hole.kill()


def test_closing_a_checkpoint_store_is_bounded_when_the_mirror_hangs(tmp_path, monkeypatch):
    """An S3 endpoint that never answers once kept rank 0 in `close()` (the queue joined before any deadline)
    while the other ranks waited in a barrier."""
    with blackhole(monkeypatch) as endpoint:
        mirror = Mirror("s3://bucket/run", S3Cfg(endpoint_url=endpoint))
        store = CheckpointStore(tmp_path / "ckpt", keep_last=1, mirror=mirror, remote_name="phase/checkpoints")
        fake_checkpoint(store, 10)
        started = time.time()
        assert store.close(wait_s=2, drain_s=2) == ["step00000010"], "the checkpoint the mirror lacks is named"
        assert time.time() - started < 10 and (tmp_path / "ckpt" / "step00000010").is_dir(), "its only copy is kept"


def test_opening_a_run_never_waits_on_its_mirror(tmp_path, monkeypatch):
    """`Run.open` uploaded recipe.json before anything ran: an S3 outage held runs whose steps are all local."""
    from infra.steps import RECIPE, Run
    from tests.helpers import micro_recipe, write_recipe

    with blackhole(monkeypatch) as endpoint:
        path = write_recipe(tmp_path / "r.yaml", micro_recipe(**{"storage.mirror": "s3://b/m", "storage.s3.endpoint_url": endpoint}))
        started = time.time()
        run = Run.open(str(path), str(tmp_path / "run"))
        assert time.time() - started < 10 and (run.run_dir / RECIPE).is_file()


def test_failed_uploads_retry_on_their_own_and_an_outage_is_capped(tmp_path):
    """A private S3 server goes down: uploads fail, the store refuses a checkpoint past the cap naming the
    mirror; the server comes back and the waiting checkpoints go up with no further save."""
    import s3fs

    port = free_port()
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "1024"}

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"}, skip_instance_cache=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                fs.mkdir("ckpt")
                return proc
            except Exception:
                time.sleep(0.3)
        raise AssertionError("moto did not start")

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret")
    mirror = Mirror("s3://ckpt/run", S3Cfg(endpoint_url=f"http://127.0.0.1:{port}"), attempts=1)
    store = CheckpointStore(tmp_path, keep_last=1, mirror=mirror, remote_name="c", max_unmirrored=2, retry_s=(0.2, 1.0))
    fake_checkpoint(store, 1)
    fake_checkpoint(store, 2)
    deadline = time.time() + 90
    while len(store.unmirrored()) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert store.unmirrored() == ["step00000001", "step00000002"]
    with pytest.raises(MirrorBehind, match="s3://ckpt/run"):
        store.make_room(1000)
    assert store.local_tags() == ["step00000001", "step00000002"]  # never pruned before uploaded
    server = start()
    try:
        deadline = time.time() + 60
        while store.unmirrored() and time.time() < deadline:
            time.sleep(0.2)
        assert store.unmirrored() == []
        store.make_room(1000)
        assert store.close() == []
        assert store.local_tags() == ["step00000002"]  # pruned once uploaded
    finally:
        server.kill()
        server.wait()


def test_a_checkpoint_whose_files_changed_is_refused_before_anything_unpickles_it(tmp_path):
    from model.checkpoint import verify

    store = CheckpointStore(tmp_path, keep_last=2)
    fake_checkpoint(store, 3)
    verify(tmp_path / "step00000003")  # as written: accepted
    data = bytearray((tmp_path / "step00000003" / "optim.pt").read_bytes())
    data[10] ^= 0xFF  # same size, other bytes: the size check alone would pass it
    (tmp_path / "step00000003" / "optim.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="optim.pt"):
        verify(tmp_path / "step00000003")


COMMITTER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import infra.steps as steps
    from tests.test_steps import Cfg

    run_dir, count, case = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def build(cfg, inputs, out):
        with open(count, "a") as f:
            f.write("build\\n")
        for i in range(3):
            (out / f"shard{i}.bin").write_bytes(bytes([i]) * 10_000)
        return {"shards": 3}

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if case == "md5":  # half-way through the MD5 pass over the outputs
        real = steps.fsync_tree
        def fsync_tree(root, skip_dirs=()):
            for path in sorted(Path(root).glob("shard1.bin")):
                with open(path, "rb") as f:
                    f.read(100)
                die()
            return real(root, skip_dirs)
        steps.fsync_tree = fsync_tree
    if case == "manifest":  # the manifest's temporary written, not yet renamed into place
        real_replace = os.replace
        def replace(src, dst):
            if Path(dst).name == steps.MANIFEST:
                die()
            real_replace(src, dst)
        os.replace = replace
    if case in ("before rename", "after rename"):
        def commit(ready, final):
            if case == "after rename":
                os.replace(ready, final)
            die()
        steps._commit = commit
    steps.run_step(run_dir, steps.Step("tok", "test", build, Cfg()), {})
    """
)


@pytest.mark.parametrize("case", ["md5", "manifest", "before rename", "after rename"])
def test_a_step_killed_anywhere_in_its_commit_is_committed_by_the_relaunch_never_built_again(tmp_path, case):
    count, run_dir = tmp_path / "builds.txt", tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", COMMITTER, str(run_dir), str(count), case], cwd=REPO)
    assert killed.returncode == -signal.SIGKILL and count.read_text().split() == ["build"]
    assert not (run_dir / "tok").exists(), "the kill left the step uncommitted in the run"
    if case == "manifest":
        [cut] = temporaries(run_dir / "steps" / ".partial")  # the kill left the manifest's temporary
        cut.with_name(".manifest.json.tmp").write_text('{"half": ')  # and one an earlier version's kill left
    relaunch = subprocess.run([sys.executable, "-c", COMMITTER, str(run_dir), str(count), "none"], cwd=REPO)
    assert relaunch.returncode == 0
    assert count.read_text().split() == ["build"], "exactly one build: the relaunch commits what the first one built"
    manifest = json.loads((run_dir / "tok" / MANIFEST).read_text())
    assert manifest["summary"] == {"shards": 3} and sorted(manifest["files"]) == ["shard0.bin", "shard1.bin", "shard2.bin"]
    assert fingerprint_tree(run_dir / "tok") == manifest["fingerprint"]
    left = [p.name for p in (run_dir / "steps" / ".partial").glob("tok-*") if p.suffix != ".lock"]  # a dead holder's lease may stay
    assert not left, f"nothing of the build is left behind: {left}"


def test_eval_of_a_mirror_finds_every_version_an_ablation_left_there(tmp_path, bucket, monkeypatch):
    """`smolflow eval s3://...`: the mirror holds the store's names (NAME-ID), so the models of every run that shares
    it are found, and the recipe comes from the runs' records beside them."""
    from flows.pipeline import source_recipe
    from infra.steps import Run
    from tasks.evaluation.results import models_in_prefix
    from tests.helpers import micro_recipe, write_recipe

    fs, name, s3 = bucket

    def model(cfg, inputs, out):
        (out / "final").mkdir()
        (out / "final" / "config.json").write_text(json.dumps({"v": cfg.v}))
        return {}

    storage = {"storage.mirror": f"s3://{name}/abl", "storage.s3.endpoint_url": s3.endpoint_url}
    path = write_recipe(tmp_path / "r.yaml", micro_recipe(**storage))
    for variant in (1, 2):
        run = Run.open(str(path), str(tmp_path / f"variant{variant}"))
        run.build(Step("sft", "sft", model, Cfg(v=variant), model="sft"), {})
    found, skipped = models_in_prefix(f"s3://{name}/abl", s3, [Step("sft", "sft", model, Cfg(), model="sft")])
    assert len(found) == 2 and not skipped and all(m.label == "sft" for m in found)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)  # `smolflow eval s3://...` reads the endpoint as any AWS client does
    assert source_recipe(f"s3://{name}/abl", None).name == "micro"


def test_eval_of_a_mirror_of_the_old_layout_finds_its_models_and_its_recipe(tmp_path, bucket, monkeypatch):
    """A mirror written before STORE/NAME-ID holds a run's steps as NAME and its recipe as recipe.json beside them:
    `smolflow eval s3://...` still finds both."""
    from flows.pipeline import source_recipe
    from infra.steps import RECIPE, RUNS, Run
    from tasks.evaluation.results import models_in_prefix
    from tests.helpers import micro_recipe, write_recipe

    fs, name, s3 = bucket

    def model(cfg, inputs, out):
        (out / "final").mkdir()
        (out / "final" / "config.json").write_text("{}")
        return {}

    storage = {"storage.mirror": f"s3://{name}/old", "storage.s3.endpoint_url": s3.endpoint_url}
    run = Run.open(str(write_recipe(tmp_path / "r.yaml", micro_recipe(**storage))), str(tmp_path / "run"))
    step = Step("sft", "sft", model, Cfg(), model="sft")
    run.build(step, {})
    deadline = time.time() + 60  # the run's recipe is mirrored in the background
    while not fs.exists(f"{name}/old/{RUNS}/run/{RECIPE}"):
        assert time.time() < deadline, "the run's recipe never reached its mirror"
        time.sleep(0.5)
        fs.invalidate_cache()
    copy_on_mirror(fs, f"{name}/old/sft-{step.step_id({})}", f"{name}/old/sft", keep=False)  # the layout before NAME-ID
    fs.copy(f"{name}/old/{RUNS}/run/{RECIPE}", f"{name}/old/{RECIPE}")
    fs.rm(f"{name}/old/{RUNS}", recursive=True)
    found, skipped = models_in_prefix(f"s3://{name}/old", s3, [step])
    assert [m.path for m in found] == [f"s3://{name}/old/sft/final"] and not skipped
    copy_on_mirror(fs, f"{name}/old/sft", f"{name}/old/sft-{step.step_id({})}")  # a pull's copy beside it: one model, scored once
    assert [m.path for m in models_in_prefix(f"s3://{name}/old", s3, [step])[0]] == [f"s3://{name}/old/sft-{step.step_id({})}/final"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    assert source_recipe(f"s3://{name}/old", None).name == "micro"


def test_two_hosts_scoring_one_model_in_one_bucket_keep_each_others_results(bucket, monkeypatch):
    """Each host has its own claim lock, so both may score a model at once: host B commits its task while host A
    writes its own; A's commit must not drop B's (a record read, changed and written back would)."""
    import s3fs

    from tasks.evaluation.results import ModelRef, ResultStore

    fs, name, s3 = bucket
    host_a, host_b = (ResultStore(f"s3://{name}/evals/results", s3) for _ in range(2))
    host_b.fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3.endpoint_url}, skip_instance_cache=True)  # its own cache
    model = ModelRef(f"s3://{name}/m", "f" * 24, "base", "model", "base")
    first = type(host_a.fs).mv
    interleaved = []

    def mv(self, *args, **kwargs):  # host A's commit: host B commits its own result first
        if not interleaved:
            interleaved.append(True)
            host_b.put(model, {"smol_ppl_code": {"bits_per_byte": 1.5}}, {"smol_ppl_code": "k"}, None, 2.0)
        return first(self, *args, **kwargs)

    monkeypatch.setattr(type(host_a.fs), "mv", mv)
    record = host_a.put(model, {"smol_arithmetic_cf": {"acc": 0.5}}, {"smol_arithmetic_cf": "k"}, None, 3.0)
    assert interleaved and set(record["tasks"]) == {"smol_arithmetic_cf", "smol_ppl_code"}
    both = ["smol_arithmetic_cf", "smol_ppl_code"]
    assert record["seconds"] == 5.0 and host_b.pending(model, both, dict.fromkeys(both, "k")) == []
    host_a.all()  # host A has listed the store; host B adds a result: A's next read lists afresh, not from its cache
    host_b.put(model, {"smol_ppl_prose": {"bits_per_byte": 2.5}}, {"smol_ppl_prose": "k"}, None, 1.0)
    assert "smol_ppl_prose" in host_a.get(model.fingerprint)["tasks"]
    # a record of the earlier layout (one object per model) still reads, merged with the objects written since
    fs.pipe(
        f"{name}/evals/results/{'e' * 24}.json",
        json.dumps({"fingerprint": "e" * 24, "model": model.info(), "tasks": {"old": {"key": "k"}}}).encode(),
    )
    assert {r["fingerprint"]: sorted(r["tasks"]) for r in host_a.all()} == {
        "e" * 24: ["old"],
        "f" * 24: ["smol_arithmetic_cf", "smol_ppl_code", "smol_ppl_prose"],
    }
