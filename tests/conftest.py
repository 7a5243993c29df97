"""Shared fixtures: a real Prefect test server, a real S3 server on 127.0.0.1, a fine-tuned model vLLM can serve."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from infra.env import apply_offline_defaults, cores
from infra.launch import free_port
from infra.recipe import Strict
from infra.steps import NoInputs
from infra.summaries import Summary
from tests.helpers import REPO

apply_offline_defaults()


def share_cores() -> None:
    """pytest-xdist workers run side by side unpinned: each takes its share of the cores for every thread it
    starts (infra.env.cores), so two workers' trainers never contend thread for thread."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("SMOLFLOW_CORES", str(max(1, cores() // workers)))
        os.environ.setdefault("OMP_NUM_THREADS", os.environ["SMOLFLOW_CORES"])
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


share_cores()

# Test files by their time in the suite, longest first (`--durations=0` of `make test` on 2 cores: 642 s,
# 430 s, 338 s, ...; the rest take under 65 s each). `make test` hands whole files to the xdist workers in
# collection order (`--dist loadfile --no-loadscope-reorder`), so the longest start first and the last to
# end is a short one; xdist's own order (most tests first) started test_cluster.py a third of the way in,
# and it ran alone for the last ~4 minutes (so did test_swarm.py's end-to-end test, ~300 CPU s, before it was
# listed). Within a file its slow tests come first: xdist gives a worker its next file once two of its tests are
# left, and that file waits behind them (test_swarm.py's end-to-end test, 9-12 min, was last in its file).
# test_cluster.py held every Slurm and Ray test and ran ~32 of the suite's 33 minutes on one worker: its Slurm tests
# are test_slurm.py now, on another worker with a cluster of its own. The order changes only the wall time, never a result.
LONGEST_FIRST = ["test_cluster.py", "test_slurm.py", "test_deployments.py", "test_pretrain.py", "test_swarm.py", "test_postrain.py",
                 "test_flow.py", "test_evaluation.py", "test_ablation.py", "test_crash_safety.py"]  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: otherwise each file keeps its own order
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), item.get_closest_marker("slow") is None))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, Prefect: ~550,000 objects) lives as long as the process: moved out
    of the collector's reach, a full collection no longer walks it (0.28 CPU s each; accelerate runs one per trainer
    built in this process, pytest several per test: ~20 CPU s a suite)."""
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gc.unfreeze()  # at exit, nanobind (triton's bindings) reports what was never collected as leaked


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N", help="list the N tests that used the most CPU")


def cpu_s() -> float:
    """CPU seconds of this process's tree so far: each live (or not yet reaped) process's own, and those of the
    processes it reaped. A test's difference then counts what a long-lived descendant (a fixture's server, the shared
    eval child) used during it. RUSAGE_CHILDREN alone counted a child when it was reaped: in a later test (a 0.1 s
    test was listed at 68 s), or never (a Popen no one waits for)."""
    me, total = psutil.Process(), 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            t = process.cpu_times()
        except psutil.Error:  # reaped since the listing: its CPU is in its parent's children_* from now on
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    item.stash[CPU_START] = cpu_s()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    if call.when == "teardown":  # setup, call and teardown together: a module fixture counts for its first test
        report.user_properties.append(("cpu_s", cpu_s() - item.stash[CPU_START]))
    return report


CPU_START = pytest.StashKey[float]()
CPU_USED: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "cpu_s":  # on the controller too: pytest-xdist sends each worker's reports with their properties
            CPU_USED[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    top = config.getoption("--cpu-durations")
    if top and CPU_USED:
        terminalreporter.write_sep("=", f"most CPU: {top} tests of {len(CPU_USED)}, {sum(CPU_USED.values()):.0f} CPU s in all")
        for nodeid, seconds in sorted(CPU_USED.items(), key=lambda kv: -kv[1])[:top]:
            terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Recipes name repo-relative paths (eval sets), as when run from the repo root."""
    monkeypatch.chdir(REPO)


class SharedServer:
    """One Prefect test server for every pytest-xdist worker, run by the controller: a server per worker cost each
    ~15 CPU s to start and ~1 CPU s a minute idle for the whole suite. It starts in a thread while the workers start
    (~20 s) and writes its API URL to `url` once it answers; it stops when the controller ends."""

    def __init__(self) -> None:
        import tempfile
        import threading

        self.dir = Path(tempfile.mkdtemp(prefix="prefect-shared-"))
        self.url, self.server = self.dir / "api_url", None
        self.thread = threading.Thread(target=self._start, daemon=True)
        self.thread.start()

    def _start(self) -> None:
        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

        with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{self.dir / 'prefect.db'}", **lean()}):
            self.server = SubprocessASGIServer(port=free_port())
            self.server.start(timeout=180)
        ready = self.dir / "api_url.tmp"
        ready.write_text(self.server.api_url)
        ready.rename(self.url)  # a worker that sees the file reads the whole URL

    def stop(self) -> None:
        import shutil

        self.thread.join(timeout=180)
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def lean() -> dict:
    """Settings of the test server: the services that record task runs and persist events are off. The tests' flows
    read neither back, and on 2 cores recording each task run's events cost the server most of its CPU (a flow of 150
    logging tasks, twice: 9 CPU s with them, 1 without). The deployment tests run `smolflow server`, every service on."""
    from prefect.settings import (
        PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED,
        PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED,
    )

    return {
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED: False,
        PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED: False,
        PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED: False,
    }


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):  # the xdist controller
        config.stash[SHARED] = SharedServer()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist: what the controller hands a worker it starts
    node.workerinput["prefect_api_url"] = str(node.config.stash[SHARED].url)


def pytest_unconfigure(config: pytest.Config) -> None:
    if SHARED in config.stash:
        config.stash[SHARED].stop()


SHARED = pytest.StashKey[SharedServer]()


@pytest.fixture(scope="session")
def prefect_server(request, tmp_path_factory):
    """A real (test-harness) Prefect API server; results go to a temp dir, not the user's home. Under pytest-xdist,
    the controller's one server (SharedServer), else a server of this process."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("prefect-results"))
    shared = getattr(request.config, "workerinput", {}).get("prefect_api_url")
    if shared is None:
        with temporary_settings(lean()), prefect_test_harness(server_startup_timeout=180):
            yield
        return
    url, deadline = Path(shared), time.time() + 240
    while not url.exists():
        assert time.time() < deadline, "the controller's Prefect server did not start in 240 s"
        time.sleep(0.2)
    with temporary_settings({PREFECT_API_URL: url.read_text()}):
        yield


@pytest.fixture(scope="session")
def s3_server():
    """A real moto S3 server on 127.0.0.1 with dummy credentials in the environment."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "S3_UPLOAD_PART_MIN_SIZE": "1024"},  # lets tests force multipart uploads with small files
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("moto_server did not start")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield {"endpoint": endpoint, "port": port, "proc": proc}
    proc.kill()
    proc.wait()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def shared_root(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session sees (their base temps are its children)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_vllm_sft(cfg: Strict, inputs: NoInputs, out: Path) -> Summary:
    """A tiny model that vLLM can serve, briefly fine-tuned (answers that are not empty), with its early copy as the weak model."""
    from infra.recipe import ModelCfg, SFTCfg
    from model.network import build_model, model_config, save_pretrained
    from postrain import data as chat
    from postrain.sft import run_sft
    from tasks.curation import tokenizer as bpe

    # vLLM's CPU attention kernels take head sizes of 32 and up: a tiny SmolLM3 with 2 heads of 32
    arch = ModelCfg(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    texts = [m["content"] for item in chat.generate(2000, {"arithmetic": 0.5, "word_problem": 0.5}, 49, 0) for m in item["messages"]]
    tok = bpe.save_hf(bpe.train_bpe(iter(texts * 3), vocab_size=400, min_frequency=2), out / "base")
    special = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    save_pretrained(build_model(model_config(arch, len(tok), 256, special_ids=special), seed=0), out / "base")
    sft = SFTCfg(learning_rate=3e-3, max_steps=240, batch_size=16, save_steps=240, logging_steps=40, weak_checkpoint_step=20, max_length=96)
    # sums of numbers up to 9: learnt well enough in 240 steps that some answers are right
    run_sft(str(out / "base"), chat.generate(2000, {"arithmetic": 1.0}, 9, 3), sft, out / "sft", seed=0)
    return Summary()


@pytest.fixture(scope="session")
def vllm_sft(tmp_path_factory) -> Path:
    """build_vllm_sft's model, built once per `make test` through a store every worker shares: the first worker to
    need it builds it, the others wait for its lock and link it (read it only)."""
    pytest.importorskip("vllm")
    from infra.steps import Step, run_step

    built = run_step(shared_root(tmp_path_factory) / "shared", Step("vllm_sft", "test", build_vllm_sft, Strict()), {})
    return built.path / "sft"


@pytest.fixture
def small_disk(tmp_path):
    """Mounts size-limited filesystems (tmpfs) for the test, `small_disk(bytes) -> folder`: needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
        mounts.append(folder)
        return folder

    yield mount
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real single-node Slurm cluster of the test file's own (test_slurm.py and test_cluster.py run one each at once)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (its daemons run as root); CI runs as root")
    from flows.cluster import Slurm, free_port_pair

    cluster = Slurm(state=tmp_path_factory.mktemp("slurm"), port=free_port_pair())
    cluster.start(timeout_s=180)
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    cluster.stop()
    if before is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = before
    assert cluster.pid("slurmctld") is None and cluster.pid("slurmd") is None


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real Ray head with token auth (one file only, test_cluster.py: `ray stop` ends every head of this user)."""
    from flows.cluster import Ray

    head = Ray(state=tmp_path_factory.mktemp("ray"), port=free_port())
    head.start()
    before = {key: os.environ.get(key) for key in head.env()}
    os.environ.update(head.env())  # its address and token, as `source .smolflow/env` gives them
    yield head
    import ray

    ray.shutdown()
    head.stop()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key)
        else:
            os.environ[key] = value
    assert not head.up()


@pytest.fixture(scope="session")
def swarm_store(tmp_path_factory) -> Path:
    """The step store of local_swarm's proxies, which test_swarm.py's swarm shares (`storage.store`)."""
    return shared_root(tmp_path_factory) / "swarm-steps"


@pytest.fixture(scope="session")
def local_swarm(prefect_server, swarm_store, tmp_path_factory):
    """The micro swarm's proxies trained by this process's children: what they score, what every engine must reproduce,
    and their steps: built once per `make test` (test_slurm.py, test_cluster.py and test_swarm.py run on three workers)
    through a shared store."""
    import csv
    import json

    from infra.steps import Step, run_step
    from tests.clusters import LocalSwarm, SwarmStore, train_local_swarm

    step = Step("local_swarm", "test", train_local_swarm, SwarmStore(store=str(swarm_store)))
    built = run_step(shared_root(tmp_path_factory) / "shared", step, {})
    with open(built.path / "metrics.csv") as f:
        return LocalSwarm(list(csv.DictReader(f)), swarm_store, json.loads((built.path / "folders.json").read_text()))
