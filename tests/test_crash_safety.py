"""Crash safety at scale: racing relaunches, leftover trainers, records that uploads and downloads are checked
against, continuous upload retries, secrets kept out of parameters (issue 10). Every process here is real."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from infra.errors import DataError, StepLocked
from infra.locks import acquire
from infra.procs import HOST, Proc
from infra.recipe import S3Cfg
from infra.steps import MANIFEST, Step, run_step
from infra.storage import CorruptFile, Mirror, StorageError, download_folder, inside
from model.checkpoint import MARKER, CheckpointStore, MirrorBehind
from tests.conftest import free_port
from tests.helpers import REPO
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
    return tmp_path / "run" / ".partial" / "train.lock"


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


def test_a_live_lease_from_another_host_is_respected(tmp_path):
    lease_file(tmp_path).parent.mkdir(parents=True)
    lease_file(tmp_path).write_text(json.dumps({"host": "node-7", "pid": 4242, "started": 1.0, "heartbeat": time.time(), "lease_s": 120}))
    with pytest.raises(StepLocked, match="pid 4242 on node-7"):
        run_step(tmp_path / "run", Step("train", "test", lambda c, i, o: {}, Cfg()), {})
    assert builds(tmp_path) == []


def test_a_leftover_trainer_is_killed_by_the_next_holder_but_a_reused_pid_is_not(tmp_path):
    leftover = subprocess.Popen(["sleep", "120"])
    bystander = subprocess.Popen(["sleep", "120"])
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    lock = tmp_path / "step.lock"
    children = [Proc.of(leftover.pid).dump(), {**Proc.of(bystander.pid).dump(), "started": 12.0}]  # the second: a reused pid
    lock.write_text(json.dumps({"host": HOST, "pid": dead_owner.pid, "started": 1.0, "heartbeat": time.time(), "children": children}))
    try:
        held = acquire(lock)
        assert held is not None
        leftover.wait(timeout=10)  # killed (psutil reaped it, so its exit status reads 0), not the 120 s sleep
        assert bystander.poll() is None
        held.release()
    finally:
        for p in (leftover, bystander):
            p.kill()
            p.wait()


OWNER = textwrap.dedent(
    """
    import sys
    from infra.launch import run_streaming
    from infra.procs import owner_env
    import os
    # a launcher that starts its rank in a session of its own, as torchrun does, then waits
    rank = "import time; from infra.procs import watch_owner; watch_owner(0.2); time.sleep(120)"
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(120)"
    run_streaming([sys.executable, "-c", launcher], {**os.environ, **owner_env()}, print)
    """
)


def test_a_sigkilled_task_process_takes_its_launcher_and_ranks_with_it(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], cwd=REPO)
    deadline, tree = time.time() + 60, []
    while time.time() < deadline and len(tree) < 2:  # the launcher (the tether shim exec'd into it) and its rank
        time.sleep(0.2)
        tree = psutil.Process(owner.pid).children(recursive=True)
    rank = [p for p in tree if "watch_owner(0.2)" in " ".join(p.cmdline())]
    assert rank and len(tree) == 2, "the launcher and its rank started"
    owner.send_signal(signal.SIGKILL)  # no finally runs in the task process
    owner.wait()
    _, alive = psutil.wait_procs(tree + rank, timeout=15)
    assert not alive, f"left running: {alive}"


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


def test_multipart_uploads_are_verified_and_mirrored_models_fingerprinted_from_records(tmp_path, bucket):
    from flows.graph import build_graph
    from infra.recipe import parse_recipe
    from tasks.evaluation.results import local_fingerprint, models_in_prefix
    from tests.helpers import micro_recipe

    fs, name, s3 = bucket
    mirror = small_parts(Mirror(f"s3://{name}/run", s3, attempts=1))
    steps = build_graph(parse_recipe(micro_recipe(), "micro")).steps
    phase = next(s for s in steps if s.checkpoints)
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2, mirror=mirror, remote_name=f"checkpoints/{phase.name}-abc")
    staged = store.tmp_dir() / "step00000010"
    (staged / "hf").mkdir(parents=True)
    (staged / "hf" / "model.safetensors").write_bytes(os.urandom(100 * 1024))  # 7 parts of 16 KiB
    (staged / "hf" / "config.json").write_text('{"a": 1}')
    store.commit("step00000010", 10, {"tokens": 2560})
    assert store.close() == []
    remote = f"{name}/run/checkpoints/{phase.name}-abc/step00000010"
    assert "-" in fs.info(f"{remote}/hf/model.safetensors")["ETag"], "uploaded in parts"

    # an older marker (sizes only) beside it: reported as skipped, with the reason
    fs.pipe(f"{name}/run/checkpoints/{phase.name}-abc/step00000005/hf/config.json", b"{}")
    fs.pipe(
        f"{name}/run/checkpoints/{phase.name}-abc/step00000005/{MARKER}", json.dumps({"step": 5, "files": {"hf/config.json": 2}}).encode()
    )
    found, skipped = models_in_prefix(f"s3://{name}/run", s3, steps)
    assert [m.label for m in found] == [f"{phase.checkpoints}/step00000010"]
    assert found[0].fingerprint == local_fingerprint(tmp_path / "ckpt" / "step00000010" / "hf")
    assert list(skipped) == [f"{name}/run/checkpoints/{phase.name}-abc/step00000005/hf"] and "no MD5" in next(iter(skipped.values()))
    copy = download_folder(found[0].path, tmp_path / "copy", s3)
    assert local_fingerprint(copy) == found[0].fingerprint

    # a file changed after it was recorded is never uploaded as if it were the checkpoint
    (tmp_path / "ckpt" / "step00000010" / "hf" / "config.json").write_text('{"a": 2}')
    with pytest.raises(CorruptFile, match="config.json"):
        mirror.push(tmp_path / "ckpt" / "step00000010", "elsewhere", MARKER)


def test_pulls_check_every_file_against_its_record(tmp_path, bucket):
    fs, name, s3 = bucket
    mirror = small_parts(Mirror(f"s3://{name}/run", s3, attempts=1))
    run_step(tmp_path / "a", Step("tok", "test", lambda c, i, out: (out / "data.bin").write_bytes(b"x" * 50_000) and {}, Cfg()), {}, mirror)
    fs.pipe(f"{name}/run/tok/data.bin", b"y" * 50_000)  # same size, other bytes
    with pytest.raises(StorageError, match="does not match its record"):
        mirror.pull("tok", tmp_path / "b", MANIFEST)
    assert not (tmp_path / "b" / "data.bin").exists()
    assert [p.name for p in (tmp_path / "b").iterdir()] == []  # nothing half-downloaded kept under a real name
    with pytest.raises(StorageError, match="outside"):
        inside(tmp_path / "b", "../../etc/cron.d/x")


def test_a_step_whose_push_failed_is_pushed_when_found_finished(tmp_path, bucket):
    fs, name, s3 = bucket
    down = Mirror(f"s3://{name}/run", S3Cfg(endpoint_url="http://127.0.0.1:9"), attempts=1)
    step = Step("tok", "test", lambda c, i, out: (out / "data.txt").write_text("tokens") and {}, Cfg())
    with pytest.raises(StorageError):
        run_step(tmp_path, step, {}, down)
    assert (tmp_path / "tok" / MANIFEST).exists() and not fs.exists(f"{name}/run/tok/{MANIFEST}")
    out = run_step(tmp_path, step, {}, Mirror(f"s3://{name}/run", s3))
    assert out.cached and fs.cat_file(f"{name}/run/tok/data.txt") == b"tokens" and fs.exists(f"{name}/run/tok/{MANIFEST}")


def fake_checkpoint(store: CheckpointStore, step: int) -> None:
    staged = store.tmp_dir() / f"step{step:08d}"
    staged.mkdir(parents=True)
    (staged / "optim.pt").write_bytes(os.urandom(1000))
    store.commit(f"step{step:08d}", step, {})


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
