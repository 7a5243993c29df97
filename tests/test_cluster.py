"""Curation on a real single-node Slurm cluster and a real Ray head (flows/cluster.py): the same documents as local,
failed ranks and time-outs named, no job left behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flows.cluster import Ray, Slurm
from infra.launch import launch_env
from infra.recipe import LauncherCfg, parse_recipe
from tasks.curation import pipelines
from tasks.pretrain import run_slurm_job
from tests.conftest import free_port
from tests.helpers import REPO, micro_recipe
from tests.test_curation import planted, read_ids  # noqa: F401  (planted: the fixture, curated locally)
from tests.test_pretrain import data, losses, make_job, run_job  # noqa: F401  (data: the fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (its daemons run as root); CI runs as root")
    cluster = Slurm(state=tmp_path_factory.mktemp("slurm"), port=free_port())
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


def cluster_executor(kind: str, **changes):
    recipe = micro_recipe(executor={"kind": kind, "tasks": 2, "workers": 2, "slurm": {"mem_per_cpu_gb": 0.5}, **changes})
    return parse_recipe(recipe, f"{kind} recipe").executor


def slurm_executor(**changes):
    return cluster_executor("slurm", **changes)


def curate_and_compare(ex, local, tmp_path):
    recipe = local["recipe"]
    steps = {name: tmp_path / name for name in ("ingest", "filter", "dedup", "decont")}
    pipelines.ingest(recipe.sources, {"web": str(local["root"] / "raw")}, ex, recipe.storage.s3, False, steps["ingest"])
    pipelines.filter_docs({"web": {}}, ex, steps["ingest"], steps["filter"])
    dedup = pipelines.dedup(recipe.curate.dedup, ex, steps["filter"], steps["dedup"])
    decont = pipelines.decontaminate(recipe.curate.decontaminate, ex, steps["dedup"], steps["decont"])
    for name in steps:
        kept = sorted(read_ids(local["steps"][name] / "data"))
        assert kept and sorted(read_ids(steps[name] / "data")) == kept, f"{name}: {ex.kind} kept other documents than local"
    untimed = {k: v for k, v in local["dedup"].items() if k != "seconds"}  # stage wall times differ by engine
    assert ({k: v for k, v in dedup.items() if k != "seconds"}, decont) == (untimed, local["decont"])
    return steps


def test_curation_on_slurm_keeps_the_same_documents_as_local(slurm, planted, tmp_path):  # noqa: F811
    steps = curate_and_compare(slurm_executor(), planted, tmp_path)
    assert list((steps["dedup"] / "logs").rglob("slurm_logs/*.out")), "the jobs' Slurm logs are in the step folder"
    assert slurm.jobs() == []


def test_curation_on_ray_keeps_the_same_documents_as_local(ray_head, planted, tmp_path):  # noqa: F811
    curate_and_compare(cluster_executor("ray"), planted, tmp_path)


def fail_on_rank_1(docs, rank: int = 0, world_size: int = 1):
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    yield from docs or []


def sleep_long(docs, rank: int = 0, world_size: int = 1):
    time.sleep(120)
    yield from docs or []


def test_a_failed_rank_fails_the_task_with_its_log_and_leaves_no_job(slurm, tmp_path):
    with pytest.raises(pipelines.ClusterJobFailed, match=r"1 of 2 tasks incomplete(.|\n)*rank 1 broke on purpose"):
        pipelines.run_pipeline(slurm_executor(), [fail_on_rank_1], tmp_path / "logs", 2, "broken")
    assert slurm.jobs() == []


def pass_through(docs, rank: int = 0, world_size: int = 1):
    yield from docs or []


def test_a_relaunch_cancels_the_jobs_of_the_attempt_before_it_then_submits_its_own(slurm, tmp_path):
    """A SIGKILLed flow process leaves its array in the queue (no `except` runs): the relaunch, holding the step's lock,
    cancels it before it submits, so no rank runs in two jobs at once."""
    logs = tmp_path / "logs"
    name = pipelines.slurm_job_name("relaunched", logs)
    submit = ["sbatch", "--parsable", f"--job-name={name}", "--partition=cpu", "--mem-per-cpu=50", f"--output={tmp_path}/stale.out"]
    stale = subprocess.run([*submit, "--wrap", "sleep 300"], capture_output=True, text=True, check=True).stdout.strip()
    assert [j["id"] for j in slurm.jobs()] == [stale]
    pipelines.run_pipeline(slurm_executor(), [pass_through], logs, 2, "relaunched")
    state = subprocess.run(["scontrol", "show", "job", stale], capture_output=True, text=True).stdout
    assert "JobState=CANCELLED" in state, state
    assert slurm.jobs() == []


def test_a_pipeline_past_its_time_budget_fails_and_its_jobs_are_cancelled(slurm, tmp_path):
    started = time.time()
    with pytest.raises(pipelines.ClusterTimeout, match=r"2 of 2 tasks still incomplete after"):
        pipelines.run_pipeline(slurm_executor(timeout_hours=0.002), [sleep_long], tmp_path / "logs", 2, "slow")
    assert time.time() - started < 100  # it gave up before the jobs could finish
    assert slurm.jobs() == []


CANCELLED_FLOW = """
import sys
from pathlib import Path

from prefect import flow

from tasks.curation import pipelines
from tests.test_cluster import cluster_executor, sleep_long


@flow
def curate_on_slurm():
    pipelines.run_pipeline(cluster_executor("slurm"), [sleep_long], Path(sys.argv[1]), 2, "cancelled")


curate_on_slurm()
"""


def test_a_cancelled_flow_run_cancels_its_slurm_jobs(slurm, prefect_server, tmp_path):
    """A worker cancels a flow run with SIGTERM, which Prefect turns into an exception in the flow: its jobs go too."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.Popen([sys.executable, "-c", CANCELLED_FLOW, str(tmp_path / "logs")], env=env, cwd=REPO)
    deadline = time.time() + 180
    while not any(job["state"] == "RUNNING" for job in slurm.jobs()):
        assert time.time() < deadline and proc.poll() is None, "the flow never got its jobs running"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=150)
    assert slurm.jobs() == [], "the cancelled flow run left its Slurm jobs running"


CANCELLED_RAY_FLOW = """
import os
import sys
import time
from pathlib import Path

from prefect import flow

from tasks.curation import pipelines
from tests.test_cluster import cluster_executor


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
    import psutil
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.Popen([sys.executable, "-c", CANCELLED_RAY_FLOW, str(tmp_path / "logs")], env=env, cwd=REPO)
    deadline = time.time() + 180
    while len(pids := [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text()]) < 2:
        assert time.time() < deadline and proc.poll() is None, "the flow never got its Ray tasks running"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=150)
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=60)
    assert not alive, "the cancelled flow run left its Ray tasks running"


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


# --- pretraining as a Slurm job ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_reference(data, tmp_path_factory):  # noqa: F811
    """The 2-rank phase under torchrun: what the same phase as a Slurm job must reproduce."""
    out = tmp_path_factory.mktemp("torchrun")
    run_job(make_job(data, out, world=2, batch_size=8), LauncherCfg(kind="torchrun", nproc=2, threads_per_rank=1))
    return losses(out)


def slurm_launcher(**slurm) -> LauncherCfg:
    return LauncherCfg(kind="slurm", nproc=2, threads_per_rank=1, slurm={"time": "10", **slurm})


def same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want), "the job logged other steps"
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst < 1e-6, f"losses differ by up to {worst:.2e} (relative)"


def test_a_pretraining_phase_as_a_slurm_job_equals_torchrun(slurm, data, torchrun_reference, tmp_path):  # noqa: F811
    out = tmp_path / "phase"
    job = make_job(data, out, world=2, batch_size=8)
    lines: list[str] = []
    code = run_slurm_job(slurm_launcher(), out, job, launch_env(slurm_launcher()), "s1", on_line=lines.append)
    assert code == 0, "\n".join(lines[-30:])
    assert any(line.startswith("[rank0]") or "step" in line for line in lines), "the job's log reached the task log"
    same_losses(losses(out), torchrun_reference)
    assert slurm.jobs() == []


def follow_and_interrupt(slurm: Slurm, data, out, interrupt: list[str]) -> list[str]:  # noqa: F811
    """Run the phase as a job; once a checkpoint is down, run `interrupt` + the job id; returns the task's log lines."""
    job = make_job(data, out, world=2, batch_size=8)
    lines: list[str] = []
    result: dict[str, int | None] = {}
    launcher = slurm_launcher()
    env = launch_env(launcher)
    follower = threading.Thread(target=lambda: result.update(code=run_slurm_job(launcher, out, job, env, "s1", lines.append)))
    follower.start()
    deadline = time.time() + 300
    while not list((out / "checkpoints").glob("*/checkpoint.json")):  # mid-phase: a checkpoint is down
        assert time.time() < deadline and follower.is_alive(), "\n".join(lines[-30:])
        time.sleep(0.2)
    slurm.run(*interrupt, slurm.jobs()[0]["id"])
    follower.join(timeout=600)
    assert result.get("code") == 0, "\n".join(lines[-40:])
    assert any("requeued (restart 1)" in line for line in lines), "\n".join(lines[-40:])
    assert any("resumed s1 from checkpoint" in line for line in lines), "the restarted job began again instead of resuming"
    return lines


def test_a_requeued_job_checkpoints_and_resumes_with_the_same_losses(slurm, data, torchrun_reference, tmp_path):  # noqa: F811
    """`scontrol requeue` (an operator, a preemption): Slurm sends SIGTERM, the ranks checkpoint, the job runs again."""
    lines = follow_and_interrupt(slurm, data, tmp_path / "phase", ["scontrol", "requeue"])
    assert any("received SIGTERM" in line for line in lines)
    same_losses(losses(tmp_path / "phase"), torchrun_reference)


def test_a_job_warned_of_its_time_limit_checkpoints_requeues_itself_and_resumes(slurm, data, torchrun_reference, tmp_path):  # noqa: F811
    """USR1 to the job's steps, as Slurm sends it `signal_s` before the time limit (`--signal=USR1@N`): the ranks
    checkpoint and exit PREEMPTED, the batch script requeues the job, the restart resumes."""
    lines = follow_and_interrupt(slurm, data, tmp_path / "phase", ["scancel", "--signal=USR1"])
    assert any("received SIGUSR1" in line for line in lines) and any("requeueing job" in line for line in lines)
    same_losses(losses(tmp_path / "phase"), torchrun_reference)


def test_a_job_requeues_when_srun_reports_the_kill_of_a_slower_rank_not_preempted(slurm, tmp_path):
    """The first rank to exit PREEMPTED makes srun kill the others (`--kill-on-bad-exit`), and srun then exits with
    their signal (143), not PREEMPTED: the rank-0 mark left beside the checkpoint still requeues the job. A stand-in
    for the trainer (the race made certain: rank 1 is still busy when rank 0 exits), on the real cluster."""
    from infra import slurm as jobs
    from infra.procs import PREEMPTED, PREEMPTED_MARK

    out = tmp_path / "phase"
    out.mkdir()
    (tmp_path / "stand_in.py").write_text(
        "import os, sys, time\n"
        "if os.environ.get('SLURM_RESTART_COUNT', '0') != '0':\n"
        "    print(f'rank {os.environ[\"RANK\"]}: resumed', flush=True); sys.exit(0)\n"
        "if os.environ['RANK'] == '0':\n"
        f"    open({str(out / PREEMPTED_MARK)!r}, 'w').write('step00000001: test'); sys.exit({PREEMPTED})\n"
        "time.sleep(120)\n"
    )
    script = out / "job.sbatch"
    script.write_text(jobs.batch_script(slurm_launcher(), jobs.job_name(out), out / "slurm.log", "stand_in", [], out))
    job = jobs.submit(script, {**launch_env(slurm_launcher()), "PYTHONPATH": str(tmp_path)})
    lines: list[str] = []
    end = jobs.follow(job, out / "slurm.log", lines.append, pending_s=600)
    assert end.name == "COMPLETED", "\n".join(lines)
    assert any("requeueing job" in line and f"({PREEMPTED})" not in line for line in lines), "\n".join(lines)  # srun said otherwise
    assert sum("resumed" in line for line in lines) == 2 and not (out / PREEMPTED_MARK).exists()


def test_a_busy_controller_never_cancels_a_job_and_a_job_that_cannot_start_fails_with_slurms_reason(slurm, tmp_path, monkeypatch):
    """`scontrol show job` that fails as a busy controller does ("Socket timed out on send/recv operation") once
    made the task cancel a healthy job; a job PENDING forever hung its task."""
    from infra import slurm as jobs

    out = tmp_path / "phase"
    out.mkdir()
    (tmp_path / "stand_in.py").write_text("import time; time.sleep(4); print('done', flush=True)\n")
    real = shutil.which("scontrol")
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "scontrol"  # the first three lookups time out, as on a busy controller
    calls = tmp_path / "calls"
    wrapper.write_text(
        f'#!/bin/bash\nif [ "$1 $2" = "show job" ]; then\n  n=$(cat {calls} 2>/dev/null || echo 0)\n  echo $((n + 1)) > {calls}\n'
        '  if [ "$n" -lt 3 ]; then echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1; fi\nfi\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    script = out / "job.sbatch"
    launcher = slurm_launcher()
    script.write_text(jobs.batch_script(launcher, jobs.job_name(out), out / "slurm.log", "stand_in", [], out))
    job = jobs.submit(script, {**launch_env(launcher), "PYTHONPATH": str(tmp_path)})
    lines: list[str] = []
    end = jobs.follow(job, out / "slurm.log", lines.append, pending_s=600, poll_s=0.5)
    assert end.name == "COMPLETED" and sum("done" in line for line in lines) == 2, "\n".join(lines)  # 2 ranks
    assert sum("Socket timed out" in line and "left alone" in line for line in lines) == 3

    later = subprocess.run(["sbatch", "--parsable", "--begin=now+1hour", str(script)], capture_output=True, text=True, check=True)
    job = later.stdout.strip().split(";")[0]  # waits for its start time: PENDING (BeginTime)
    with pytest.raises(jobs.SlurmPending, match=r"waited 0\.00 h to start \(reason: BeginTime\); cancelled"):
        jobs.follow(job, out / "slurm.log", lines.append, pending_s=3, poll_s=0.5)
    assert jobs.find(jobs.job_name(out)) is None and slurm.jobs() == [], "the job that could not start is cancelled"


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
        params = {"recipe": str(recipe), "run_dir": str(run_dir), "overrides": ["@configs/overlays/ray.yaml"], "until": "pretrain"}
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


# --- a swarm's proxies on Slurm and Ray: at once, and scoring what they score locally --------------------------

PROXIES = ["p000", "p001", "p002", "p003"]


def micro_swarm(tmp_path: Path, engine: dict[str, str] | None = None) -> tuple[Path, list[str]]:
    """The micro swarm file (4 proxies, no validation) and the overrides that send its proxies to ENGINE."""
    import yaml

    from tests.test_swarm import swarm_file

    targets = {"smol_ppl_code": 1.0, "smol_ppl_prose": 2.0}  # the micro recipe holds out no math documents
    path = swarm_file(tmp_path, concurrency=2, bounds={"math": [0.05, 0.5]}, targets=targets, validation=None)
    if engine is None:
        return path, []
    overlay = tmp_path / "engine.yaml"
    overlay.write_text(yaml.safe_dump(engine))
    return path, [f"@{overlay}"]


def scores(root: Path) -> list[dict[str, str]]:
    """The swarm's metrics.csv: each proxy's target and per-task scores, as written."""
    import csv

    with open(root / "report" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def local_swarm(prefect_server, tmp_path_factory) -> list[dict[str, str]]:
    """What the micro swarm's proxies score trained by this process's children: what every engine must reproduce."""
    from flows.swarm import swarm_flow

    tmp = tmp_path_factory.mktemp("local-swarm")
    swarm_flow(str(micro_swarm(tmp)[0]), str(tmp / "sw"))
    return scores(tmp / "sw")


def run_watched(swarm: tuple[Path, list[str]], root: Path, count: Callable[[], int]) -> int:
    """Run the swarm, sampling COUNT (trainers running on the engine) every half second; the most seen at once."""
    from flows.swarm import swarm_flow

    running: list[int] = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            running.append(count())
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        swarm_flow(str(swarm[0]), str(root), swarm[1])
    finally:
        stop.set()
        watcher.join()
    return max(running)


def test_a_swarm_trains_its_proxies_as_slurm_jobs_at_once(slurm, local_swarm, tmp_path):
    """`smolflow swarm FILE --set OVERLAY` with the pretraining launcher on Slurm: `concurrency: 2` puts two
    proxies in the queue at once, no job is left behind, and every proxy scores exactly what it scores locally."""
    engine = {"pretrain.launcher.kind": "slurm", "pretrain.launcher.slurm.time": "10"}
    most = run_watched(
        micro_swarm(tmp_path, engine),
        tmp_path / "sw",
        lambda: sum(1 for j in slurm.jobs() if j["state"] == "RUNNING" and "pretrain_" in j["name"]),
    )
    assert most >= 2, f"at most {most} proxy job(s) ran at once"
    assert all((tmp_path / "sw" / p / "pretrain_phase1" / "slurm.log").is_file() for p in PROXIES), "each proxy was a batch job"
    assert slurm.jobs() == []
    assert [r["run_id"] for r in local_swarm] == PROXIES
    assert scores(tmp_path / "sw") == local_swarm, "a proxy's scores do not depend on where it trained"


def test_a_swarm_trains_its_proxies_as_ray_tasks_at_once(ray_head, local_swarm, tmp_path):
    """With `pretrain.launcher.kind: ray` each proxy's trainer is a Ray task reserving its cores: two run at once on the
    2-core head, none is left behind, and every proxy scores exactly what it scores locally."""
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

    most = run_watched(micro_swarm(tmp_path, {"pretrain.launcher.kind": "ray"}), tmp_path / "sw", ray_trainers)
    assert most >= 2, f"at most {most} proxy task(s) ran at once"
    for proxy in PROXIES:
        log = (tmp_path / "sw" / proxy / "pretrain_phase1" / "ray.log").read_text()
        assert log.startswith("ray: ") and "step" in log, "the trainer ran as a Ray task, its output in the step's ray.log"
    assert scores(tmp_path / "sw") == local_swarm, "a proxy's scores do not depend on where it trained"
    time.sleep(2)  # trainers of other tests (other xdist workers) may run: only those under a Ray worker are this one's
    assert ray_trainers() == 0, "a trainer outlived its Ray task"


# Two quick tests last: xdist gives a worker its next file once two of its tests are left, and that file waits
# behind them (behind the swarm tests above, it waited ~15 min and ran alone at the end of `make test`).


def test_the_ray_head_refuses_a_process_without_its_token(ray_head):
    """Any local user could `ray.init` the head and run tasks as its owner."""
    join = f"import ray; ray.init(address={ray_head.address!r}, log_to_driver=False)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "InvalidAuthToken" in out.stderr, out.stderr[-2000:]
    assert ray_head.token.stat().st_mode & 0o077 == 0 and ray_head.state.stat().st_mode & 0o077 == 0


def test_a_failed_ray_task_fails_the_task_with_its_log(ray_head, tmp_path):
    with pytest.raises(pipelines.ClusterJobFailed, match=r"1 of 2 tasks incomplete(.|\n)*rank 1 broke on purpose"):
        pipelines.run_pipeline(cluster_executor("ray"), [fail_on_rank_1], tmp_path / "logs", 2, "broken")
