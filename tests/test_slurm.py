"""Curation and pretraining on a real single-node Slurm cluster: the same documents and losses as local, failed ranks,
time-outs, requeues and busy controllers named, no job left behind; a swarm's proxies as jobs at once."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from infra.launch import launch_env
from infra.recipe import LauncherCfg
from tasks.curation import pipelines
from tasks.pretrain import run_slurm_job
from tests.clusters import (
    PROXIES,
    SEEDED,
    TRAINED,
    curate_and_compare,
    fail_on_rank_1,
    micro_swarm,
    run_watched,
    scores,
    sleep_long,
    slurm_executor,
    slurm_launcher,
)
from tests.helpers import REPO, built, losses
from tests.test_curation import planted  # noqa: F401  (planted: the fixture, curated locally)
from tests.test_pretrain import data, make_job, run_job  # noqa: F401  (data: the fixture)

pytestmark = pytest.mark.slow

# Longest first (xdist gives a worker its next file once two of its tests are left): the swarm's test comes last, by
# when test_cluster.py's worker has likely built the local swarm it compares with.

# --- pretraining as a Slurm job ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_reference(data, tmp_path_factory):  # noqa: F811
    """The 2-rank phase under torchrun: what the same phase as a Slurm job must reproduce."""
    out = tmp_path_factory.mktemp("torchrun")
    run_job(make_job(data, out, world=2, batch_size=8), LauncherCfg(kind="torchrun", nproc=2, threads_per_rank=1))
    return losses(out)


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


def follow_and_interrupt(slurm, data, out, interrupt: list[str]) -> list[str]:  # noqa: F811
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


def test_curation_on_slurm_keeps_the_same_documents_as_local(slurm, planted, tmp_path):  # noqa: F811
    steps = curate_and_compare(slurm_executor(), planted, tmp_path)
    assert list((steps["dedup"] / "logs").rglob("slurm_logs/*.out")), "the jobs' Slurm logs are in the step folder"
    buckets = steps["dedup"] / "logs" / "minhash-buckets"  # 14 shards (one a bucket), 2 workers, tasks_per_job 'even'
    assert len(list((buckets / "completions").iterdir())) == 14 and len(list(buckets.glob("slurm_logs/*.out"))) == 2
    assert slurm.jobs() == []


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
from tests.clusters import cluster_executor, sleep_long


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


def test_a_swarm_trains_its_proxies_as_slurm_jobs_at_once(slurm, local_swarm, tmp_path):
    """`smolflow swarm FILE --set OVERLAY` with the pretraining launcher on Slurm: `concurrency: 2` puts two
    proxies in the queue at once, no job is left behind, and every proxy scores exactly what it scores locally (the two
    not trained here and the curation come from local_swarm's store)."""
    engine = {"pretrain.launcher.kind": "slurm", "pretrain.launcher.slurm.time": "10"}
    store = local_swarm.seed(tmp_path / "steps", SEEDED)
    most = run_watched(
        micro_swarm(tmp_path, engine, store),
        tmp_path / "sw",
        lambda: sum(1 for j in slurm.jobs() if j["state"] == "RUNNING" and "pretrain_" in j["name"]),
    )
    assert most >= 2, f"at most {most} proxy job(s) ran at once"
    assert sorted(built(store)) == ["mixtures"] * 2 + ["pretrain_phase1"] * 2, "the trained proxies' steps alone, no curation"
    assert all((tmp_path / "sw" / p / "pretrain_phase1" / "slurm.log").is_file() for p in TRAINED), "each proxy was a batch job"
    assert slurm.jobs() == []
    assert [r["run_id"] for r in local_swarm.scores] == PROXIES
    assert scores(tmp_path / "sw") == local_swarm.scores, "a proxy's scores do not depend on where it trained"


def test_a_taken_daemon_port_is_named_before_any_daemon_starts_and_a_daemon_that_exits_is_named_at_once(tmp_path, monkeypatch):
    """slurmd, its port taken (here by this process; once by a connection's own port), only logs that it cannot bind,
    and the node then stayed 'unknown' until the start timed out: now the start refuses at once, naming the holder;
    and a port taken between that check and the bind fails the start as soon as slurmd is seen gone, quoting its log."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root")
    from flows import cluster as clusters
    from infra.errors import SmolflowError

    port = clusters.free_port_pair()
    cluster = clusters.Slurm(state=tmp_path, port=port)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + 1))
        held.listen()
        with pytest.raises(SmolflowError, match=rf"slurmd cannot listen on port {port + 1}: pid {os.getpid()} \("):
            cluster.start(timeout_s=120)
        assert cluster.pid("slurmctld") is None and not cluster.conf.exists(), "nothing started, no configuration written"

        monkeypatch.setattr(clusters, "port_taken", lambda port: None)  # as if taken after the check
        began = time.time()
        try:
            with pytest.raises(SmolflowError, match=r"(?s)slurmd exited while the Slurm node was .*Unable to bind listen port"):
                cluster.start(timeout_s=120)
            assert time.time() - began < 60, "named once slurmd was seen gone, not at the timeout"
        finally:
            cluster.stop()
