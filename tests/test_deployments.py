"""The deployed pipeline, end to end: a real `prefect server start`, work pool, worker and automation
(flows/server.py), `prefect deploy --all` from prefect.yaml, and `prefect deployment run`."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from flows.server import Server
from infra.launch import free_port
from tasks.evaluation.results import run_results
from tests.helpers import REPO, logged_steps, losses, micro_recipe, write_recipe

pytestmark = pytest.mark.slow
PREFECT = str(Path(sys.executable).with_name("prefect"))
SMOLFLOW = str(Path(sys.executable).with_name("smolflow"))
SFT_QUICK = [
    "postrain.sft.max_steps=20",
    "postrain.sft.weak_checkpoint_step=5",
    "postrain.sft.logging_steps=5",
    "postrain.data.generated=300",
    "postrain.data.heldout=20",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, pool and worker as a user starts them (`smolflow server start`), on a free port and state dir."""
    server = Server(root=REPO, state=tmp_path_factory.mktemp("state"), port=free_port())
    env = {**os.environ, "SMOLFLOW_STATE": str(server.state)}
    start = subprocess.run([SMOLFLOW, "server", "start", "--port", str(server.port)], env=env, cwd=REPO, capture_output=True, text=True)
    assert start.returncode == 0, start.stdout + start.stderr + log_tails(server)
    deploy = prefect(server, "--no-prompt", "deploy", "--all")
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr + log_tails(server)
    yield server
    server.stop()
    assert server.pid("server") is None and server.pid("worker") is None


def log_tails(server: Server) -> str:
    """The server's and worker's logs, ends only: a failed start in CI is read from its output, its temp dir gone."""
    return "".join(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}" for log in sorted(server.state.glob("*.log")))


def server_stacks(server: Server) -> str:
    """Where the server's processes are (py-spy dump): what a server that stopped answering waits on."""
    pid = server.pid("server")
    if pid is None:
        return "(the server is gone)"
    family = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    spy = Path(sys.executable).with_name("py-spy")  # the `cluster` extra's (make setup)
    if not spy.exists():
        return f"(no {spy} to show the server's stacks)"
    return "".join(subprocess.run([str(spy), "dump", "--pid", str(p)], capture_output=True, text=True, timeout=60).stdout for p in family)


@dataclass(frozen=True)
class Launched:
    run_id: str
    recipe: Path
    run_dir: Path


@pytest.fixture(scope="module")
def pipeline(server, tmp_path_factory) -> Launched:
    """The micro pipeline until SFT through its deployment, its trainers logging to trackio, started once: the crash
    test kills its flow process and waits for the relaunch to finish; the browser test opens what it published."""
    tmp = tmp_path_factory.mktemp("pipeline")
    tracked = {"pretrain.checkpoint.every_steps": 10, "pretrain.tracking": "trackio", "postrain.tracking": "trackio"}
    recipe = write_recipe(tmp / "micro.yaml", micro_recipe(**tracked))
    params = {"recipe": str(recipe), "run_dir": str(tmp / "run"), "overrides": SFT_QUICK, "until": "sft"}
    return Launched(run_deployment(server, "full-pipeline/tiny", params), recipe, tmp / "run")


def prefect(server: Server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PREFECT, *args], env=server.env(), cwd=REPO, capture_output=True, text=True, timeout=300)


def api(server: Server, path: str, body: dict | None = None, auth: bool = True):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(server.auth().encode()).decode()
    request = urllib.request.Request(f"{server.api_url}{path}", data=data, headers=headers)
    for attempt in range(5):
        try:  # Prefect's SQLite waits up to 60 s on a lock (busy_timeout) before its 503: wait longer than that
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:  # 503: SQLite busy on a loaded 2-core machine; ask again
            if e.code != 503 or attempt == 4:
                raise
            time.sleep(2)


def run_deployment(server: Server, name: str, params: dict) -> str:
    out = prefect(server, "deployment", "run", name, "--params", json.dumps(params))
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)


SILENT_S = 300  # a server that answers nothing for this long has hung (a lock waits at most 60 s, then 503)


def wait_final(server: Server, run_id: str, timeout_s: float = 1500) -> dict:
    deadline, answered = time.time() + timeout_s, time.time()
    while time.time() < deadline:
        try:
            run = api(server, f"/flow_runs/{run_id}")
        except OSError as err:  # a busy 2-core machine: the server may answer late; ask again
            if time.time() - answered > SILENT_S:  # seen once (the flow run finished, then no answer for 17 min)
                pytest.fail(f"the server has answered nothing for {SILENT_S} s ({err}):\n{server_stacks(server)}{log_tails(server)}")
            time.sleep(3)
            continue
        answered = time.time()
        if run["state_type"] in ("COMPLETED", "FAILED", "CANCELLED"):
            return run
        time.sleep(3)
    pytest.fail(f"flow run {run_id} did not finish in {timeout_s:.0f} s")


def trainer_processes(run_dir: Path) -> list[psutil.Process]:
    """Trainers of this run only (their job file lies in it): other test files may train beside it (pytest-xdist).
    A trainer's own child between fork and exec still shows the trainer's command line: it is not a second trainer."""
    found, roots = [], (str(run_dir), str(run_dir.resolve()))
    for p in psutil.process_iter(["cmdline", "ppid"]):
        cmd = p.info["cmdline"] or []
        if "model.train" in cmd and "infra.procs" not in cmd and any(arg.startswith(roots) for arg in cmd):
            found.append(p)
    pids = {p.pid for p in found}
    return [p for p in found if p.info["ppid"] not in pids]


def run_states(server: Server, run_id: str) -> list[dict]:
    return sorted(api(server, f"/flow_run_states/?flow_run_id={run_id}"), key=lambda s: s["timestamp"])


def state_history(server: Server, run_id: str) -> list[str]:
    return [s["type"] for s in run_states(server, run_id)]


def flow_run_processes(server: Server) -> list[psutil.Process]:
    """Everything the worker runs: under its guard (flows/server.py), the worker, its flow run processes and theirs."""
    return psutil.Process(server.pid("worker")).children(recursive=True)


def command_of(process: psutil.Process) -> str:
    """Its command line, or "" once it has exited (checkpoint evaluations come and go while a test looks)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_the_server_refuses_requests_without_its_auth_string(server):
    with pytest.raises(urllib.error.HTTPError, match="401"):
        api(server, "/deployments/filter", {}, auth=False)
    assert api(server, "/deployments/filter", {})  # with it: the deployments
    state = [server.state, *server.state.rglob("*")]  # the database and its WAL, logs, PREFECT_HOME, auth, env
    assert {"auth", "env", "prefect.db", "server.log", "worker.log"} <= {p.name for p in state}
    readable = [
        f"{p.relative_to(server.state)} {p.stat().st_mode & 0o777:o}" for p in state if not p.is_symlink() and p.stat().st_mode & 0o077
    ]
    assert not readable, f"readable by other users: {readable}"


def test_a_secret_override_is_refused_before_the_server_stores_it(server):
    """The deployment's parameter schema refuses a credential among the overrides (infra/recipe.py `Override`): the
    server answers 409 and stores no flow run; the flow's own refusal would come after its parameters were stored."""
    leaked = f"leaked-{uuid.uuid4().hex}"
    params = {"recipe": "configs/micro.yaml", "overrides": ["curate.strict=true", f"storage.s3={{secret: {leaked}}}"]}
    out = prefect(server, "deployment", "run", "full-pipeline/tiny", "--params", json.dumps(params))
    assert out.returncode != 0 and "overrides" in out.stdout + out.stderr, out.stdout + out.stderr
    stored = [p.name for p in server.state.rglob("*") if p.is_file() and leaked.encode() in p.read_bytes()]
    assert not stored, f"the secret reached {stored}"


def set_state(server: Server, run_id: str, kind: str, name: str | None = None, at: str | None = None) -> None:
    state = {"type": kind, "name": name, "state_details": {"scheduled_time": at} if at else {}}
    assert api(server, f"/flow_runs/{run_id}/set_state", {"state": state, "force": True})["status"] == "ACCEPT"


def test_the_crash_check_relaunches_only_runs_that_crashed_while_running(server, tmp_path):
    """Each crash report Prefect makes (here: the states a worker, a zombie detector or a dying process would set,
    through the real server, automation and check flow) is checked; only the real crash is relaunched."""
    deployment = api(server, "/deployments/name/scheduled-eval/tiny")
    later = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 86400))  # out of the worker's sight
    cases = {  # case -> states after Pending, and what the check must leave
        "crashed while running": (["RUNNING", "CRASHED"], "relaunched"),
        "completed after a false crash report": (["RUNNING", "CRASHED", "COMPLETED"], "no longer Crashed"),
        "cron run that never started": (["CRASHED"], "never started"),
        "died while awaiting a retry": (["RUNNING", "AwaitingRetry", "CRASHED"], "never started (or was awaiting a retry)"),
        "alive, still beating": (["RUNNING", "CRASHED", "heartbeat"], "heartbeat"),
        "out of attempts": (["RUNNING", "PENDING", "RUNNING", "PENDING", "RUNNING", "CRASHED"], "attempt 3 of 3"),
    }
    runs = {}
    for case, (states, _) in cases.items():
        scheduled = {"type": "SCHEDULED", "state_details": {"scheduled_time": later}}
        body = {"state": scheduled, "parameters": {"source": str(tmp_path / "none")}}
        run_id = runs[case] = api(server, f"/deployments/{deployment['id']}/create_flow_run", body)["id"]
        set_state(server, run_id, "PENDING")
        for state in states:
            if state == "AwaitingRetry":
                set_state(server, run_id, "SCHEDULED", "AwaitingRetry", later)
            elif state == "heartbeat":
                event = {"event": "prefect.flow-run.heartbeat", "resource": {"prefect.resource.id": f"prefect.flow-run.{run_id}"}}
                api(server, "/events", [{**event, "occurred": datetime.now(UTC).isoformat(), "id": str(uuid.uuid4())}])
            else:
                set_state(server, run_id, state)

    verdicts, deadline = {}, time.time() + 600
    while len(verdicts) < len(runs) and time.time() < deadline:
        checks = api(server, "/flow_runs/filter", {"deployments": {"name": {"any_": ["check"]}}, "limit": 50})
        for check in checks:
            target = check["parameters"]["crashed"].removeprefix("prefect.flow-run.")
            if check["state_type"] == "COMPLETED" and target in runs.values():
                logs = api(server, "/logs/filter", {"logs": {"flow_run_id": {"any_": [check["id"]]}}})
                said = " ".join(log["message"] for log in logs)
                if "left flow run" in said or "relaunched flow run" in said:  # logs may land after the state
                    verdicts[target] = said
        time.sleep(3)
    for case, (_, said) in cases.items():
        assert said in verdicts.get(runs[case], "(no check ran)"), f"{case}: {verdicts.get(runs[case])}"
        history = state_history(server, runs[case])
        if case != "crashed while running":
            assert history[-1] == cases[case][0][-1].replace("heartbeat", "CRASHED"), f"{case}: touched: {history}"
    relaunched = wait_final(server, runs["crashed while running"], timeout_s=600)  # it runs again (nothing to score)
    names = [s["name"] for s in run_states(server, relaunched["id"])]
    assert names[names.index("Crashed") + 1] == "AwaitingRetry" and relaunched["state_type"] == "COMPLETED", names


def test_pipeline_deployment_survives_a_crash_then_single_stages_and_scheduled_eval(server, pipeline, tmp_path):
    run_id, recipe, run_dir = pipeline.run_id, pipeline.recipe, pipeline.run_dir

    # SIGKILL only the flow run's own process (an OOM kill, a lost worker) once a pretraining checkpoint exists:
    # its trainer must die with it, and no two trainers may ever run at once
    deadline = time.time() + 900
    while not list((run_dir / ".partial" / "pretrain_phase1" / "checkpoints").glob("step*/checkpoint.json")):
        assert time.time() < deadline, "pretraining never wrote a checkpoint"
        time.sleep(0.5)
    flow_process = [p for p in flow_run_processes(server) if "prefect.engine" in command_of(p)]  # the worker's child
    trainers = [p for p in flow_run_processes(server) if "model.train" in command_of(p)]
    assert len(flow_process) == 1 and trainers, "a flow run process with its trainer under the worker"
    flow_process[0].kill()
    _, alive = psutil.wait_procs(trainers, timeout=20)
    assert not alive, "the trainer outlived the flow run process"

    most, seen, deadline = 0, [], time.time() + 1500
    while time.time() < deadline:
        if len(trainers := trainer_processes(run_dir)) > most:
            most, seen = len(trainers), [(p.pid, p.info["ppid"], p.info["cmdline"]) for p in trainers]
        try:
            if api(server, f"/flow_runs/{run_id}")["state_type"] in ("COMPLETED", "FAILED", "CANCELLED"):
                break
        except OSError:  # a busy 2-core machine: the server may answer late
            pass
        time.sleep(1)
    assert most <= 1, f"{most} trainers alive at once (pid, parent, command): {seen}"

    run = wait_final(server, run_id)
    history = state_history(server, run_id)
    assert run["state_type"] == "COMPLETED", history
    assert "CRASHED" in history and run["run_count"] >= 2  # the automation put the crashed run back in the queue

    # every stage ran, each model was evaluated, and the report card shows them
    manifests = {p.parent.name for p in run_dir.glob("*/manifest.json")}
    assert {"mixtures", "pretrain_phase1", "pretrain_long_context", "sft"} <= manifests
    records = run_results(run_dir).all()
    labels = {r["model"]["label"] for r in records}
    assert {"base", "sft"} <= labels and any(label.startswith("phase1/") for label in labels)
    checkpoint_tokens = sorted(r["model"]["tokens"] for r in records if r["model"]["kind"] == "checkpoint")
    assert checkpoint_tokens and checkpoint_tokens[0] > 0
    card = (run_dir / "reports" / "card.md").read_text()
    assert "## Pretraining" in card and "## Evaluations" in card and "## Post-training ladder" in card and "_not run yet_" not in card
    plots = {p.name for p in (run_dir / "reports" / "plots").glob("*.png")}
    assert plots == {"pretrain.png", "evals.png", "audit.png", "postrain.png", "wall_time.png"}
    assert "## Early-signal checks" in card and "| smol_arithmetic_cf | acc |" in card, "the audit over the run's checkpoints"

    # a single stage rerun through its own deployment: finished steps are skipped, its model is not re-evaluated
    sft_mtime = (run_dir / "sft" / "manifest.json").stat().st_mtime
    results_before = {p.name: p.stat().st_mtime for p in (run_dir / "evals" / "results").glob("*.json")}
    stage = wait_final(server, run_deployment(server, "sft/tiny", {"recipe": str(recipe), "run_dir": str(run_dir), "overrides": SFT_QUICK}))
    assert stage["state_type"] == "COMPLETED"
    assert (run_dir / "sft" / "manifest.json").stat().st_mtime == sft_mtime
    assert {p.name: p.stat().st_mtime for p in (run_dir / "evals" / "results").glob("*.json")} == results_before

    # the scheduled evaluation carries its cron schedule and scores only what has no results
    deployment = api(server, "/deployments/name/scheduled-eval/tiny")
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 * * * *"]
    assert deployment["work_queue_name"] == "eval"

    def kept_checkpoint(result: Path) -> bool:  # a checkpoint still on disk: pruning removed the early ones once scored
        model = json.loads(result.read_text())["model"]  # one result (task) of one model
        step = model["label"].rpartition("/")[2]
        return model["kind"] == "checkpoint" and (run_dir / f"pretrain_{model['stage']}" / "checkpoints" / step).is_dir()

    dropped = next(p for p in (run_dir / "evals" / "results").glob("*.json") if kept_checkpoint(p))
    dropped.unlink()
    scan = wait_final(server, run_deployment(server, "scheduled-eval/tiny", {"source": str(run_dir), "work_dir": str(tmp_path / "scan")}))
    assert scan["state_type"] == "COMPLETED"
    after = {p.name: p.stat().st_mtime for p in (run_dir / "evals" / "results").glob("*.json")}
    assert set(after) == set(results_before)
    assert [name for name in after if after[name] != results_before[name]] == [dropped.name]


PLOTS = {"loss and throughput", "evals vs tokens", "early-signal checks", "ladder", "wall time"}  # the report card's


def test_the_report_card_subflows_and_training_curves_show_in_a_browser(server, pipeline, tmp_path):
    """What a user opens in Chromium: the report card artifact with every plot loaded (relative links are broken images
    in the Prefect UI), the pipeline run's subflows, and the run's curves in `smolflow dashboard`, on loopback only."""
    from playwright.sync_api import sync_playwright

    assert shutil.which("chromium"), "Debian's chromium is missing: `make setup` installs it as root (apt-get install chromium)"
    run = wait_final(server, pipeline.run_id)
    assert run["state_type"] == "COMPLETED", state_history(server, pipeline.run_id)
    card = api(server, "/artifacts/filter", {"artifacts": {"key": {"any_": ["micro-report-card"]}}, "sort": "CREATED_DESC", "limit": 1})
    subflows = api(server, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [pipeline.run_id]}}})
    stages = {api(server, f"/flows/{f['flow_id']}")["name"] for f in subflows}
    assert {"curate", "pretrain", "sft", "evaluate"} <= stages
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 4800})  # the UI scrolls inside: a tall page shows it all
        page.goto(server.ui_url, wait_until="load")  # the UI asks for the auth string first
        page.locator("input[type=password]").fill(server.auth())
        page.keyboard.press("Enter")
        page.wait_for_url(lambda url: "login" not in url)

        page.goto(f"{server.ui_url}artifacts/artifact/{card[0]['id']}", wait_until="load")  # live updates: never network-idle
        page.wait_for_selector('img[alt="wall time"]')
        page.wait_for_function("Array.from(document.images).every(i => i.complete)")
        images = page.evaluate("Array.from(document.images).map(i => [i.alt, i.naturalWidth])")
        page.screenshot(path=tmp_path / "report-card.png")
        assert {alt for alt, _ in images} >= PLOTS and all(width > 0 for _, width in images), images

        page.goto(f"{server.ui_url}runs/flow-run/{pipeline.run_id}", wait_until="load")
        page.get_by_text("Subflow Runs", exact=True).click()
        page.get_by_text(f"{len(subflows)} Flow runs", exact=True).wait_for()
        for stage in stages:  # the list fills in after its count
            page.get_by_text(stage, exact=True).first.wait_for()

        port = free_port()
        dashboard = subprocess.Popen([SMOLFLOW, "dashboard", str(pipeline.run_dir), "--port", str(port)], cwd=REPO)
        try:
            deadline = time.time() + 120
            while not (listening := [c.laddr for c in psutil.Process(dashboard.pid).net_connections("inet") if c.status == "LISTEN"]):
                assert dashboard.poll() is None and time.time() < deadline, "the dashboard never listened"
                time.sleep(0.5)
            assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
            page.goto(f"http://127.0.0.1:{port}/?project=smolflow-micro", wait_until="load")
            page.get_by_text(re.compile(r"^train \(\d+\)$")).wait_for()  # TRL's curves (train/...), after pretraining's
            shown = page.inner_text("body").splitlines()
            page.screenshot(path=tmp_path / "dashboard.png")
        finally:
            dashboard.terminate()
            dashboard.wait(30)
        browser.close()
    assert {"phase1", "long_context", "sft"} <= set(shown), "the runs: each pretraining phase and the post-training trainer"
    # each chart's title, then the runs it draws: pretraining's loss over its phases, then SFT's in the train section
    trl = next(i for i, line in enumerate(shown) if line.startswith("train ("))
    assert shown[shown.index("loss") + 1 : shown.index("loss") + 3] == ["long_context", "phase3"] and shown.index("loss") < trl
    assert shown[shown.index("loss", trl) + 1] == "sft"


def logged(server: Server, run_id: str, text: str) -> int:
    """How many of the flow run's log lines (its tasks' included) contain TEXT; 0 while the server is busy."""
    try:
        return sum(text in log["message"] for log in api(server, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}}))
    except OSError:
        return 0


def said(server: Server, run_id: str, text: str, timeout_s: float = 60) -> bool:
    """Whether a line of the ended flow run contains TEXT, asked until it does: the server may be busy, and the lines
    a process sent last are written after its run's final state."""
    deadline = time.time() + timeout_s
    while not logged(server, run_id, text):
        if time.time() > deadline:
            return False
        time.sleep(1)
    return True


def cancelled_then_rerun(
    server: Server, pipeline: Launched, stage: str, overrides: list[str], curve: str, steps: int, tmp_path: Path, evals: bool = True
) -> int:
    """A user's cancel of the deployed post-training STAGE (`prefect flow-run cancel`: the run goes Cancelling) once its
    trainer has logged 3 points of CURVE: the worker SIGTERMs the flow run's process and kills it 30 s later; in that
    time the trainer must finish its step and save a checkpoint. The run ends Cancelled with no trainer left, and the
    stage's rerun resumes from that checkpoint to the CURVE of the same trainer run without a cancel (STEPS steps, a
    point logged every 2, no periodic checkpoint). EVALS: the stage scores its model (the follower its checkpoints).
    Returns how many resumed points were compared."""
    from infra.recipe import load_recipe
    from infra.steps import LAUNCH_LOG
    from postrain.run import PostJob
    from tasks.postrain import TrainedStepCfg, train

    run_dir = pipeline.run_dir
    params = {"recipe": str(pipeline.recipe), "run_dir": str(run_dir), "overrides": overrides, "evals": evals}
    run_id = run_deployment(server, f"{stage}/tiny", params)
    deadline = time.time() + 900
    while logged(server, run_id, f"'{curve}'") < 3:  # training, past its first steps
        assert time.time() < deadline, f"the {stage} stage never logged its {curve}: {state_history(server, run_id)}"
        time.sleep(1)
    set_state(server, run_id, "CANCELLING")
    cancelled = wait_final(server, run_id, timeout_s=300)
    assert cancelled["state_type"] == "CANCELLED", state_history(server, run_id)
    left = [command_of(p) for p in psutil.process_iter() if "postrain.run" in command_of(p) and str(run_dir) in command_of(p)]
    assert not left, f"trainers outlived the cancelled run: {left}"
    saved = sorted(int(p.name.split("-")[1]) for p in run_dir.glob(f"steps/.partial/{stage}-*/checkpoints/checkpoint-*"))
    assert len(saved) == 1 and 0 < saved[0] < steps, f"one checkpoint, the cancel's, before the last step: {saved}"
    # the trainer says why it stopped: in the run's log, or, said after the flow's process had ended, in the step's
    # launch log (which the rerun passes into its own log first)
    [partial] = [j.parent for j in run_dir.glob(f"steps/.partial/{stage}-*/job.json")]  # not the lock files beside it
    deadline = time.time() + 60
    while not ("received SIGTERM: checkpoint-" in (partial / LAUNCH_LOG).read_text() or logged(server, run_id, "received SIGTERM")):
        assert time.time() < deadline, "the trainer never said why it stopped"
        time.sleep(1)
    states = {s["type"]: s["timestamp"] for s in run_states(server, run_id)}
    print(f"{stage} cancel: {states['CANCELLING']} -> {states['CANCELLED']}, checkpoint-{saved[0]} of {steps}")

    rerun = wait_final(server, run_deployment(server, f"{stage}/tiny", params))
    assert rerun["state_type"] == "COMPLETED", state_history(server, rerun["id"])
    summary = json.loads((run_dir / stage / "manifest.json").read_text())["summary"]
    assert summary["resumed_from"].endswith(f"checkpoint-{saved[0]}")

    job = PostJob.model_validate_json((run_dir / stage / "job.json").read_text())
    postrain = load_recipe(pipeline.recipe, overrides).postrain
    cfg = TrainedStepCfg(launcher=postrain.launcher, heldout_eval=postrain.heldout_eval, seed=job.seed)
    (reference := tmp_path / f"uninterrupted-{stage}").mkdir()
    expected = dict(map(tuple, train(cfg, stage, job.trainer_cfg(), Path(job.model), Path(job.data), reference)[curve]))
    resumed = {s: v for s, v in map(tuple, summary[curve]) if s >= saved[0] + 2}  # logged over 2 steps, both resumed
    assert max(resumed) == steps
    assert all(resumed[s] == pytest.approx(expected[s], rel=1e-4) for s in resumed), {s: (resumed[s], expected[s]) for s in resumed}
    return len(resumed)


def test_a_stage_cancelled_through_the_api_checkpoints_and_its_rerun_resumes_with_the_losses_of_an_uninterrupted_run(
    server, pipeline, tmp_path
):
    """SFT (a new step: another config), cancelled through the API while it trains: see `cancelled_then_rerun`."""
    assert wait_final(server, pipeline.run_id)["state_type"] == "COMPLETED"
    longer = [o for o in SFT_QUICK if "max_steps" not in o and "logging_steps" not in o]
    longer += ["postrain.sft.max_steps=100", "postrain.sft.logging_steps=2", "postrain.sft.save_steps=1000"]
    assert cancelled_then_rerun(server, pipeline, "sft", longer, "loss", 100, tmp_path) >= 10


def right_over_wrong(cfg, inputs, out: Path):
    """A stand-in for the preference step's function, named so: the strong model's answers are each chat's own, the
    weak one's "The answer is 0.", paired by the step's own `build_pairs`. The micro SFT model answers every prompt
    wrong, so no real pair would survive. Built under the real step's identity, so the APO stage finds its pairs built."""
    from infra.summaries import PreferenceSummary
    from postrain import data as chat
    from postrain.preference import build_pairs
    from tasks.postrain import PAIRS, TRAIN

    items = chat.read_jsonl(inputs["chats"].path / TRAIN)[: cfg.preference.prompts]
    right = [i["messages"][-1]["content"] for i in items]
    pairs, stats = build_pairs(items, right, ["The answer is 0."] * len(items), cfg.preference.dedup_threshold)
    chat.write_jsonl(out / PAIRS, pairs)
    return PreferenceSummary.model_validate({**stats, "backend": "stand-in"})


def test_apo_and_grpo_cancelled_through_the_api_checkpoint_and_their_reruns_resume_with_the_curves_of_uninterrupted_runs(
    server, pipeline, tmp_path
):
    """The cancel above, of APO (its loss) and then of GRPO (its reward: the rollouts' RNG resumes too), each a new step
    on the pipeline's SFT model; APO's pairs from `right_over_wrong`."""
    import dataclasses

    from flows.graph import build_graph, upstream
    from infra.steps import Run

    assert wait_final(server, pipeline.run_id)["state_type"] == "COMPLETED"
    run = Run.open(str(pipeline.recipe), str(pipeline.run_dir), SFT_QUICK)
    try:  # the run holds the run dir until closed: a stage given the recipe meanwhile refuses to start
        graph = build_graph(run.recipe)
        [step] = graph.stage("preference")
        known = upstream(run, graph, ["preference"])
        run.build(dataclasses.replace(step, fn=right_over_wrong), {role: known[d.name] for role, d in step.deps.items()})
    finally:
        run.close()

    apo = [*SFT_QUICK, "postrain.apo.max_steps=100", "postrain.apo.logging_steps=2", "postrain.apo.save_steps=1000"]
    assert cancelled_then_rerun(server, pipeline, "apo", apo, "loss", 100, tmp_path, evals=False) >= 5
    grpo = [f"postrain.grpo.{key}" for key in ("max_steps=60", "logging_steps=2", "save_steps=1000", "max_completion_length=16")]
    grpo += ["postrain.grpo.target_length=8"]
    assert cancelled_then_rerun(server, pipeline, "grpo", apo + grpo, "reward", 60, tmp_path, evals=False) >= 3


def test_a_pretraining_stage_cancelled_through_the_api_checkpoints_where_it_stopped_and_its_rerun_ends_as_if_uncancelled(
    server, pipeline, tmp_path
):
    """The cancel above, of the pretrain stage: its trainer saves a checkpoint at the step it reached (none is due: the
    periodic ones are off) and exits, the run ends Cancelled with no rank left, and the rerun resumes from that checkpoint
    to the losses of the same job run without a cancel."""
    from infra.launch import launch_command, launch_env, run_streaming
    from infra.recipe import load_recipe
    from model.config import TrainJob

    assert wait_final(server, pipeline.run_id)["state_type"] == "COMPLETED"
    run_dir = pipeline.run_dir
    # phase 1 alone, STEPS steps of 256 tokens (a new step: another budget), no periodic checkpoint; the cancel lands
    # within a few steps of step 100 (the worker hears of it at once), far from the end even on a loaded machine
    steps = 800
    longer = [*SFT_QUICK, "pretrain.until_phase=phase1", f"pretrain.phases.0.tokens={steps * 256}", "pretrain.max_epochs=100"]
    longer += ["pretrain.checkpoint.every_steps=100000", "evaluation.model_tasks=[]"]  # a 64-token model generates nothing
    params = {"recipe": str(pipeline.recipe), "run_dir": str(run_dir), "overrides": longer}
    curated = wait_final(server, run_deployment(server, "curate/tiny", params))  # the mixtures step: the new budget
    assert curated["state_type"] == "COMPLETED", state_history(server, curated["id"])
    with ThreadPoolExecutor(1) as pool:  # the CLI may return only once the trainer is well under way: the files say how far
        started = pool.submit(run_deployment, server, "pretrain/tiny", params)
        deadline = time.time() + 600
        # the phase's partial folder (its job file tells it from the lock files beside it), past step 100
        partial = lambda: next((j.parent for j in run_dir.glob("steps/.partial/pretrain_phase1-*/job.json")), None)  # noqa: E731
        while (out := partial()) is None or logged_steps(out) < 20:
            assert time.time() < deadline and not (started.done() and started.exception()), "the phase never trained 100 steps"
            time.sleep(0.2)
        run_id = started.result()
    set_state(server, run_id, "CANCELLING")
    cancelled = wait_final(server, run_id, timeout_s=300)
    assert cancelled["state_type"] == "CANCELLED", state_history(server, run_id)
    assert not trainer_processes(run_dir), "a rank outlived the cancelled run"
    tag = json.loads((out / "checkpoints" / "latest.json").read_text())["tag"]
    assert 100 <= int(tag.removeprefix("step")) < steps, f"saved where it stopped: {tag}"
    print(f"cancel: checkpoint {tag} of {steps} steps")
    assert said(server, run_id, "received SIGTERM: checkpoint"), "the trainer said why it stopped"

    rerun = run_deployment(server, "pretrain/tiny", params)
    assert wait_final(server, rerun)["state_type"] == "COMPLETED", state_history(server, rerun)
    assert said(server, rerun, f"resumed phase1 from checkpoint {tag}")
    step = run_dir / "pretrain_phase1"
    job = TrainJob.model_validate_json((step / "job.json").read_text())
    reference = tmp_path / "uninterrupted"
    uncancelled = job.model_copy(update={"out_dir": str(reference), "checkpoint_dir": str(reference / "checkpoints"), "mirror": None})
    reference.mkdir()
    (reference / "job.json").write_text(uncancelled.model_dump_json())
    pretrain = load_recipe(pipeline.recipe, longer).pretrain
    launcher = pretrain.launcher  # the same ranks and threads: the same sums
    lines: list[str] = []
    command = launch_command(launcher, "model.train", [str(reference / "job.json")], port=free_port())
    code = run_streaming(command, launch_env(launcher), lines.append)
    assert code == 0, lines[-20:]
    resumed, expected = losses(step), losses(reference)
    assert sorted(resumed) == sorted(expected) and max(expected) == steps
    # each logged loss is the mean over its window of log_every steps; the window the cancel cut is not the reference's
    cut = int(tag.removeprefix("step"))
    kept = [s for s in expected if not cut < s < cut + pretrain.log_every]
    assert len(kept) >= len(expected) - 1 and max(kept) == steps
    assert {s: resumed[s] for s in kept} == pytest.approx({s: expected[s] for s in kept}, rel=1e-5), "as if never cancelled"


def sourced(server: Server) -> subprocess.CompletedProcess:
    """A shell that sources the state dir's env file, as a user does: the auth string it has then."""
    script = f". {server.state / 'env'} && echo ${{PREFECT_API_AUTH_STRING:-unset}}"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_the_worker_stops_with_its_server_and_then_sends_nothing_to_a_stranger_on_the_port(server):
    """Last in this file: it kills the module's server. A shell sourcing `.smolflow/env` gets the auth string only
    while the port is our server's. The worker, whose polls carry the auth string, is stopped with
    it (flows/server.py), so a local user who binds the freed port afterwards receives nothing. (Unguarded, the worker
    went on polling and such a listener got its requests with the auth string. The guard polls once a second: a
    listener bound within that second can still get the worker's first reconnect; see the module doc.)"""
    assert sourced(server).stdout.strip() == server.auth(), "`source .smolflow/env` gives a shell the auth string"
    worker = psutil.Process(server.pid("worker"))
    workers = [worker, *worker.children(recursive=True)]
    server_tree = psutil.Process(server.pid("server"))
    for p in [*server_tree.children(recursive=True), server_tree]:
        p.kill()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"worker processes outlived their server: {[command_of(p) for p in alive]}"
    received: list[bytes] = []
    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stranger.bind(("127.0.0.1", server.port))
    stranger.listen()
    stranger.settimeout(0.5)
    shell = sourced(server)  # ... but not while a stranger holds the port
    assert shell.stdout.strip() == "unset" and f"port {server.port} is not our Prefect server's" in shell.stderr
    end = time.time() + 15  # a leftover poller would poll within 10 s (PREFECT_WORKER_QUERY_SECONDS)
    while time.time() < end:
        try:
            conn, _ = stranger.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(2)
            received.append(conn.recv(65536))
    stranger.close()
    assert not received, f"requests reached a stranger on the port: {received}"
