"""Curation and training on a real Ray head, and the deployed pipeline on both engines (curation on Ray, pretraining as
Slurm jobs): the same documents as local, cancelled flows stop their tasks, a trainer dies with its launcher, a swarm's
proxies as Ray tasks at once. Slurm alone: tests/test_slurm.py (another worker: its own cluster, both run at once)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import pytest

from infra.launch import free_port
from tasks.curation import pipelines
from tests.clusters import (
    SEEDED,
    TRAINED,
    cluster_executor,
    curate_and_compare,
    fail_on_rank_1,
    micro_swarm,
    record_parent,
    run_watched,
    scores,
)
from tests.helpers import REPO, built, survivors
from tests.test_curation import planted  # noqa: F401  (planted: the fixture, curated locally)

pytestmark = pytest.mark.slow


def test_a_swarm_trains_its_proxies_as_ray_tasks_at_once(ray_head, local_swarm, tmp_path):
    """With `pretrain.launcher.kind: ray` each proxy's trainer is a Ray task reserving its cores: two run at once on the
    2-core head, none is left behind, and every proxy scores exactly what it scores locally (the two not trained here
    and the curation come from local_swarm's store)."""
    import psutil

    def ray_trainers() -> int:
        """Trainers whose ancestor is a Ray worker (Ray titles a worker's process `ray::...`)."""
        found = 0
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if "model.train" in (proc.info["cmdline"] or []):
                    found += any(p.cmdline()[:1] and p.cmdline()[0].startswith("ray::") for p in proc.parents())
            except psutil.Error:
                pass
        return found

    store = local_swarm.seed(tmp_path / "steps", SEEDED)
    most = run_watched(micro_swarm(tmp_path, {"pretrain.launcher.kind": "ray"}, store), tmp_path / "sw", ray_trainers)
    assert most >= 2, f"at most {most} proxy task(s) ran at once"
    assert sorted(built(store)) == ["mixtures"] * 2 + ["pretrain_phase1"] * 2, "the trained proxies' steps alone, no curation"
    for proxy in TRAINED:
        log = (tmp_path / "sw" / proxy / "pretrain_phase1" / "ray.log").read_text()
        assert log.startswith("ray: ") and "step" in log, "the trainer ran as a Ray task, its output in the step's ray.log"
    assert scores(tmp_path / "sw") == local_swarm.scores, "a proxy's scores do not depend on where it trained"
    time.sleep(2)  # trainers of other tests (other xdist workers) may run: only those under a Ray worker are this one's
    assert ray_trainers() == 0, "a trainer outlived its Ray task"


# --- the deployed pipeline on both engines --------------------------------------------------------


def test_the_pipeline_deployment_curates_on_ray_and_pretrains_as_slurm_jobs(slurm, ray_head, tmp_path):
    """`prefect deployment run 'full-pipeline/tiny'` with the shipped Ray overlay, on the process work pool:
    the worker (started after the clusters, as `make serve` after `smolflow cluster ... start`) reaches both."""
    import json

    from flows.server import Server
    from tests.test_deployments import prefect, run_deployment, state_history, wait_final

    server = Server(root=REPO, state=tmp_path / "state", port=free_port())
    server.start(timeout_s=240)
    try:
        deploy = prefect(server, "--no-prompt", "deploy", "--all")
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        recipe = tmp_path / "micro.yaml"
        recipe.write_text((REPO / "configs" / "micro.yaml").read_text())
        run_dir = tmp_path / "run"
        # phase 1 alone (the other phases are Slurm jobs of the same kind): its 64-token model has no room to generate
        overrides = ["@configs/overlays/ray.yaml", "pretrain.until_phase=phase1", "evaluation.model_tasks=[]"]
        params = {"recipe": str(recipe), "run_dir": str(run_dir), "overrides": overrides, "until": "pretrain"}
        run_id = run_deployment(server, "full-pipeline/tiny", params)
        run = wait_final(server, run_id, timeout_s=1500)
        assert run["state_type"] == "COMPLETED", state_history(server, run_id)
    finally:
        server.stop()
    executors = {"ray_remote_kwargs" in json.loads(p.read_text()) for p in run_dir.glob("*/logs/**/executor.json")}
    assert executors == {True}, "every curation pipeline ran on Ray"
    phases = sorted(p.parent.name for p in run_dir.glob("pretrain_*/manifest.json"))
    assert phases and all((run_dir / name / "job.sbatch").exists() and (run_dir / name / "slurm.log").exists() for name in phases)
    assert all("#SBATCH --requeue" in (run_dir / name / "job.sbatch").read_text() for name in phases)
    assert slurm.jobs() == []


def test_curation_on_ray_keeps_the_same_documents_as_local(ray_head, planted, tmp_path):  # noqa: F811
    curate_and_compare(cluster_executor("ray"), planted, tmp_path)


CANCELLED_RAY_FLOW = """
import os
import sys
import time
from pathlib import Path

from prefect import flow

from tasks.curation import pipelines
from tests.clusters import cluster_executor


PIDS = Path(sys.argv[1]).parent  # a global of __main__: pickled with the function, as Ray workers have their own argv


def record_pid_and_sleep(docs, rank: int = 0, world_size: int = 1):
    (PIDS / f"pid.{rank}").write_text(str(os.getpid()))
    time.sleep(120)
    yield from docs or []


@flow
def curate_on_ray():
    pipelines.run_pipeline(cluster_executor("ray"), [record_pid_and_sleep], Path(sys.argv[1]), 2, "cancelled")


curate_on_ray()
"""


def test_a_cancelled_flow_run_stops_its_ray_tasks(ray_head, prefect_server, tmp_path):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.Popen([sys.executable, "-c", CANCELLED_RAY_FLOW, str(tmp_path / "logs")], env=env, cwd=REPO)
    deadline = time.time() + 180
    while len(pids := [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text()]) < 2:
        assert time.time() < deadline and proc.poll() is None, "the flow never got its Ray tasks running"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=150)
    assert not survivors(pids, 60), "the cancelled flow run left its Ray tasks running"


RAY_DRIVER = """
import os
import sys
from pathlib import Path

from infra import rayjobs

rayjobs.connect(None)
sleeper = "import os, time; print('sleeper', os.getpid(), flush=True); time.sleep(600)"
rayjobs.run_task([sys.executable, "-c", sleeper], dict(os.environ), Path(sys.argv[1]), 1, "sleeper", print, 5)
"""


def test_a_trainer_on_ray_dies_with_the_process_that_started_it(ray_head, tmp_path):
    """`launcher.kind: ray`: a flow process SIGKILLed (no `finally` runs) leaves no trainer on the Ray worker."""
    import psutil

    log = tmp_path / "ray.log"
    driver = subprocess.Popen([sys.executable, "-c", RAY_DRIVER, str(log)], cwd=REPO)
    deadline = time.time() + 180
    while not (log.is_file() and "sleeper " in log.read_text()):
        assert time.time() < deadline and driver.poll() is None, "the Ray task never started its command"
        time.sleep(0.5)
    sleeper = psutil.Process(int(log.read_text().split("sleeper ")[1].split()[0]))
    assert any(p.cmdline()[:1] and p.cmdline()[0].startswith("ray::") for p in sleeper.parents()), "it runs under a Ray worker"
    driver.kill()
    driver.wait(timeout=30)
    _, alive = psutil.wait_procs([sleeper], timeout=60)
    assert not alive, "the trainer outlived the process that launched it"


# Two quick tests last: xdist gives a worker its next file once two of its tests are left, and that file waits
# behind them (behind the swarm tests above, it waited ~15 min and ran alone at the end of `make test`).


def test_the_ray_head_refuses_a_process_without_its_token(ray_head):
    """Any local user could `ray.init` the head and run tasks as its owner."""
    join = f"import ray; ray.init(address={ray_head.address!r}, log_to_driver=False)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "InvalidAuthToken" in out.stderr, out.stderr[-2000:]
    assert ray_head.token.stat().st_mode & 0o077 == 0 and ray_head.state.stat().st_mode & 0o077 == 0


def test_a_ray_actors_shards_run_in_processes_forked_by_a_forkserver_not_by_the_actor(ray_head, tmp_path):
    """datatrove's Ray actor runs its job's shards in a process pool. Forked from the actor, which runs threads from its
    start, 6 of a pool's 14 processes once hung before they ran, and the actor waited on them with every shard complete
    (infra.rayjobs.pools_fork_from_a_server)."""
    step = functools.partial(record_parent, folder=str(tmp_path))
    pipelines.run_pipeline(cluster_executor("ray"), [step], tmp_path / "logs", 4, "forks")  # 2 actors, 2 shards each
    parents = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name.isdigit()}
    assert sorted(parents) == ["0", "1", "2", "3"] and all("forkserver" in cmd for cmd in parents.values()), parents


def test_a_failed_ray_task_fails_the_task_with_its_log(ray_head, tmp_path):
    with pytest.raises(pipelines.ClusterJobFailed, match=r"1 of 2 tasks incomplete(.|\n)*rank 1 broke on purpose"):
        pipelines.run_pipeline(cluster_executor("ray"), [fail_on_rank_1], tmp_path / "logs", 2, "broken")
