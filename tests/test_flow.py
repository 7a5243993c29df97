"""The curate flow on a real Prefect server: reports, artifacts, step caching, S3 in and out."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.pipeline import curate_flow
from infra.steps import MANIFEST
from tests.helpers import REPO, micro_recipe, write_jsonl, write_recipe

STEPS = ["corpus", "ingest", "filter", "dedup", "decontaminate", "tokenizer", "tokenize", "mixtures"]


def started(run_dir) -> dict[str, str]:
    return {s: json.loads((run_dir / s / MANIFEST).read_text())["started"] for s in STEPS if (run_dir / s).exists()}


@pytest.mark.slow
def test_curate_flow_caches_and_reruns_only_downstream(tmp_path, prefect_server):
    from prefect.client.orchestration import get_client

    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe(**{"executor.workers": 2}))
    run_dir = tmp_path / "run"
    report = curate_flow(str(recipe), str(run_dir))
    text = (run_dir / "reports" / "curate.md").read_text()
    assert report.endswith("curate.md") and "## Mixtures" in text and "## Decontamination" in text
    first = started(run_dir)
    assert set(first) == set(STEPS)
    mixtures = json.loads((run_dir / "mixtures" / "mixtures.json").read_text())
    assert [s["name"] for s in mixtures["phases"]] == ["phase1", "phase2", "phase3", "long_context"]

    async def artifact_keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}

    import asyncio

    assert {"micro-curation", "micro-curation-mixtures"} <= asyncio.run(artifact_keys())

    curate_flow(str(recipe), str(run_dir))
    assert started(run_dir) == first, "an unchanged recipe must skip every finished step"

    curate_flow(str(recipe), str(run_dir), ["curate.filters.code.code_quality.min_lines=40"])
    third = started(run_dir)
    assert {s for s in STEPS if third[s] == first[s]} == {"corpus", "ingest"}


@pytest.mark.slow
def test_curate_reads_raw_from_s3_and_mirrors_every_step(tmp_path, prefect_server, s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server["endpoint"]})
    fs.mkdir("raw-bucket")
    fs.mkdir("runs-bucket")
    rng = random.Random(1)
    words = [f"word{i}" for i in range(500)]
    docs = [{"id": f"d{i}", "text": " ".join(rng.choice(words) for _ in range(120))} for i in range(60)]
    local = write_jsonl(tmp_path / "raw.jsonl", docs)
    fs.put_file(str(local), "raw-bucket/raw/part-0.jsonl")

    data = micro_recipe()
    data["sources"].append({"name": "remote", "domain": "web", "format": "jsonl", "path": "s3://raw-bucket/raw"})
    data["curate"]["filters"]["web"] = {}
    for stage in data["pretrain"]["phases"]:
        stage["mixture"] = {"prose": 0.3, "code": 0.3, "math": 0.2, "remote": 0.2}
    data["storage"] = {
        "s3": {"endpoint_url": s3_server["endpoint"], "key": "testing", "secret": "testing-secret"},
        "mirror": "s3://runs-bucket/micro",
    }
    recipe = write_recipe(tmp_path / "s3.yaml", data)

    curate_flow(str(recipe), str(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "ingest" / MANIFEST).read_text())["summary"]
    assert summary["sources"]["remote"]["docs"] == 60
    versions = {step: (tmp_path / "run" / step).resolve().name for step in STEPS}  # NAME-ID: the store's names on the mirror too
    for step in STEPS:
        assert fs.exists(f"runs-bucket/micro/{versions[step]}/{MANIFEST}"), step
    assert "testing-secret" not in (tmp_path / "run" / "recipe.json").read_text()

    # a fresh machine with an empty run dir pulls every finished step back instead of recomputing
    shutil.rmtree(tmp_path / "run")
    curate_flow(str(recipe), str(tmp_path / "run2"))
    for step in STEPS:
        remote = json.loads(fs.cat(f"runs-bucket/micro/{versions[step]}/{MANIFEST}"))
        local = json.loads((tmp_path / "run2" / step / MANIFEST).read_text())
        assert local["started"] == remote["started"] and local["fingerprint"] == remote["fingerprint"]


def test_cli_help_and_clear_errors(tmp_path):
    import os

    smolflow = [str(Path(sys.executable).parent / "smolflow")]  # the installed entry point
    out = subprocess.run([*smolflow, "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and all(cmd in out.stdout for cmd in ("validate", "run", "stage"))
    wide = {**os.environ, "COLUMNS": "300"}
    out = subprocess.run([*smolflow, "swarm", "--help"], capture_output=True, text=True, cwd=REPO, env=wide)
    assert "(Dirichlet, seeded, within the bounds" in out.stdout  # the docstring's line breaks reflowed to the terminal
    assert "runs/swarms/<name>" in out.stdout  # not taken for an HTML tag
    data = micro_recipe()
    data["pretrain"]["phases"][0]["mixture"]["prose"] = 0.9
    bad = write_recipe(tmp_path / "bad.yaml", data)
    out = subprocess.run([*smolflow, "validate", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert f"{bad}: invalid recipe" in out.stderr and "pretrain.phases[0]: mixture weights sum to 1.45" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([*smolflow, "stage", "nonsense", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "unknown stage 'nonsense'; stages: curate" in out.stderr
    for command in (["eval"], ["evals", "audit"]):  # a mistyped run dir is named, before a Prefect server starts
        out = subprocess.run([*smolflow, *command, str(tmp_path / "runs" / "tinyy")], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 2 and f"not run dirs (no recipe.json): {tmp_path / 'runs' / 'tinyy'}" in out.stderr, out.stderr
        assert "temporary server" not in out.stdout + out.stderr


@pytest.mark.slow
def test_killed_curate_run_resumes_to_the_same_result(tmp_path, prefect_server):
    """SIGKILL the whole CLI process group mid-run; the rerun finishes with the uninterrupted result."""
    import os
    import signal
    import time

    from prefect.settings import PREFECT_API_URL

    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe(**{"executor.workers": 2}))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cmd = [str(Path(sys.executable).parent / "smolflow"), "stage", "curate", str(recipe), "--run-dir"]

    reference = tmp_path / "reference"
    subprocess.run([*cmd, str(reference)], env=env, cwd=REPO, check=True, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [*cmd, str(killed)], env=env, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not (killed / ".partial" / "dedup").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.3)  # inside the dedup step (about 1 s at micro scale on an idle box: a later kill found it finished)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "dedup" / MANIFEST).exists(), "the killed step must not look finished"

    subprocess.run([*cmd, str(killed)], env=env, cwd=REPO, check=True, capture_output=True)
    for step in ("tokenize", "mixtures"):
        a = json.loads((reference / step / MANIFEST).read_text())["summary"]
        b = json.loads((killed / step / MANIFEST).read_text())["summary"]
        assert a == b, step


@pytest.mark.slow
def test_full_pipeline_from_raw_text_to_a_pretrained_model(tmp_path, prefect_server, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.pipeline import full_pipeline
    from tasks import evaluate as ev
    from tasks.evaluation.results import KEYS, ResultStore, local_fingerprint, run_results

    left: list[dict] = []  # what the evaluate stage found unscored
    evaluate_run = ev.evaluate_run
    monkeypatch.setattr(ev, "evaluate_run", lambda *args: left.append(evaluate_run(*args)) or left[-1])
    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe(**{"pretrain.tracking": "trackio"}))
    result = full_pipeline(str(recipe), str(tmp_path / "run"), until="pretrain")
    assert list(result) == ["curate", "pretrain", "evaluate"]  # the run is evaluated whatever stage it stops at
    # the pipeline's one follower scored every checkpoint and the base model's chat tasks beside training
    [found] = left
    assert found["evaluated"] == [] and found["busy"] == [] and found["cached"], found
    base = local_fingerprint(tmp_path / "run" / "pretrain_long_context" / "final")
    record = run_results(tmp_path / "run").get(base)
    keys = json.loads((tmp_path / "run" / KEYS).read_text())  # the keys the run's evaluations scored under, which its reports read
    assert "smol_arithmetic_gen" in record["tasks"] and all(e["key"] == keys[t] for t, e in record["tasks"].items()), keys
    assert result["curate"].endswith("curate.md")
    final = Path(result["pretrain"])
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.max_position_embeddings == 256
    prompt = tok("Problem: What is 2 + 3?", return_tensors="pt")
    ids = model.generate(**prompt, min_new_tokens=4, max_new_tokens=4, do_sample=False)
    assert ids.shape[1] == prompt["input_ids"].shape[1] + 4  # four tokens generated beyond the prompt
    report = (tmp_path / "run" / "reports" / "pretrain.md").read_text()
    assert all(f"| {s} |" in report for s in ("phase1", "phase2", "phase3", "long_context"))
    # every phase's MFU is against the one probe the run took before its first trainer (micro: 1 thread), in its store
    peak = json.loads((tmp_path / "run" / "steps" / "peak_flops.json").read_text())[socket.gethostname()]["1"]
    assert "before phase1's trainer started" in peak["method"]
    for stage in ("phase1", "phase2", "phase3", "long_context"):
        metrics = (tmp_path / "run" / f"pretrain_{stage}" / "metrics.jsonl").read_text().splitlines()
        assert metrics and all(json.loads(m)["loss"] > 0 and json.loads(m)["grad_norm"] > 0 for m in metrics)  # NaN fails
        job = json.loads((tmp_path / "run" / f"pretrain_{stage}" / "job.json").read_text())
        assert job["config"]["peak_flops"] == peak["flops_per_rank"]
        for ckpt in (tmp_path / "run" / f"pretrain_{stage}" / "checkpoints").glob("step*"):
            AutoModelForCausalLM.from_pretrained(ckpt / "hf")  # every kept checkpoint is a loadable HF model
        # every phase's export generates with a KV cache (phases built from a checkpoint's config once did not)
        out = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / f"pretrain_{stage}" / "final").generate(
            **prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
        assert out.past_key_values is not None, stage
    assert (tmp_path / "run" / "trackio").is_dir()

    # post-training starts from there: chat data and SFT through their own flow
    from flows.pipeline import sft_flow

    sft_final = sft_flow(
        str(recipe),
        str(tmp_path / "run"),
        [
            "postrain.sft.max_steps=20",
            "postrain.sft.weak_checkpoint_step=5",
            "postrain.sft.logging_steps=5",
            "postrain.data.generated=300",
            "postrain.data.heldout=20",
            "postrain.data.sign_slips=0.5",
        ],
    )
    summary = json.loads((tmp_path / "run" / "sft" / "manifest.json").read_text())["summary"]
    assert Path(sft_final).name == "final" and summary["loss"] and 0 <= summary["eval"]["accuracy"] <= 1
    assert (tmp_path / "run" / "sft" / "weak" / "model.safetensors").exists()

    # every exported model folder carries its card: lineage back to curation, tokens per phase, its held-out score
    run = tmp_path / "run"
    phases = [json.loads((run / f"pretrain_{s}" / MANIFEST).read_text()) for s in ("phase1", "phase2", "phase3", "long_context")]
    sft_manifest = json.loads((run / "sft" / MANIFEST).read_text())
    lineage = [name for name, _ in phases[-1]["lineage"]]
    assert lineage[:3] == ["corpus", "ingest", "filter"] and lineage[-1] == "pretrain_phase3", "upstream first"
    for manifest in [*phases, sft_manifest]:
        card = (run / manifest["name"] / "final" / "README.md").read_text()
        assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation\n"), card[:200]
        for name, sid in [*manifest["lineage"], (manifest["name"], manifest["step_id"])]:
            assert f"| {name} | `{sid}` |" in card, name
        assert f"smolflow publish RUN_DIR {manifest['name']} REPO_ID" in card
    tokens = sum(m["summary"]["tokens"] for m in phases)
    assert f"Tokens seen in pretraining: {tokens:,}." in (run / "pretrain_long_context" / "final" / "README.md").read_text()
    sft_card = (run / "sft" / "final" / "README.md").read_text()
    assert "| sft | max_steps 20, batch_size" in sft_card and f"{sft_manifest['summary']['eval']['accuracy']:.1%}" in sft_card
    assert {"chat_data", "pretrain_long_context"} <= {name for name, _ in sft_manifest["lineage"]}
    slips = json.loads((run / "chat_data" / MANIFEST).read_text())["summary"]["sign_slips"]
    assert slips > 0 and f"drop the minus sign of {slips:,} negative answers" in sft_card, "the planted flaw is said on the card"
    assert "minus sign" not in (run / "pretrain_long_context" / "final" / "README.md").read_text(), "only downstream of chat_data"

    from transformers import pipeline

    turn = pipeline("text-generation", model=sft_final)([{"role": "user", "content": "What is 2 + 3?"}], max_new_tokens=8)
    assert turn[0]["generated_text"][-1]["role"] == "assistant"  # the exported folder chats through its template

    # publishing: refused offline with the way out; the card it would upload has the lm-eval results recorded since
    smolflow = str(Path(sys.executable).parent / "smolflow")
    out = subprocess.run([smolflow, "publish", str(run), "sft", "me/tiny-sft"], capture_output=True, text=True)
    assert out.returncode == 2 and "HF_HUB_OFFLINE" in out.stderr, out.stderr
    out = subprocess.run([smolflow, "publish", str(run), "pretrain_long_context", "x/y", "--card-only"], capture_output=True, text=True)
    record = ResultStore(str(run / "evals" / "results")).get(local_fingerprint(run / "pretrain_long_context" / "final"))
    assert out.returncode == 0 and record and all(f"| {task} |" in out.stdout for task in record["tasks"]), out.stdout


def test_stage_on_an_empty_run_dir_says_what_to_run_first(tmp_path):
    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe())
    out = subprocess.run(
        [str(Path(sys.executable).parent / "smolflow"), "stage", "pretrain", str(recipe), "--run-dir", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert "pretrain needs the output of step 'tokenize'" in out.stderr and "smolflow stage curate" in out.stderr
    assert "temporary server" not in out.stderr + out.stdout, "the missing input is found before a Prefect server starts"
    sft = subprocess.run(
        [str(Path(sys.executable).parent / "smolflow"), "stage", "sft", str(recipe), "--run-dir", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert sft.returncode == 2 and "smolflow stage pretrain" in sft.stderr, sft.stderr
    dry = subprocess.run([*sft.args, "--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert dry.returncode == 2 and dry.stderr == sft.stderr and "  run      sft" in dry.stdout, (
        "the dry run plans, then refuses as the run does"
    )


@pytest.mark.slow
def test_a_terminated_run_scores_nothing_new_and_exits(tmp_path, prefect_server):
    """SIGTERM (a scheduler's stop, a cancel) during pretraining: the trainer checkpoints and exits, and the eval
    follower is abandoned: the checkpoint saved on the signal is a relaunch's to score, not this process's, which
    ends with its trainer instead of evaluating on (it scored that checkpoint in its child, alive from before)."""
    import os
    import signal
    import time

    import psutil
    from prefect.settings import PREFECT_API_URL

    from tasks.evaluation.results import local_fingerprint, run_results

    changes = {
        "pretrain.phases.0.tokens": 400_000,  # ~1,500 steps: still training when the signal comes
        "pretrain.checkpoint.every_steps": 40,
        "evaluation.checkpoint_tasks": ["smol_ppl_code"],
        "evaluation.model_tasks": [],
        "evaluation.limit": 8,
    }
    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe(**changes))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cmd = [str(Path(sys.executable).parent / "smolflow"), "run", str(recipe), "--run-dir", str(run_dir), "--until", "pretrain"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cli = psutil.Process(proc.pid)
    deadline = time.time() + 400
    while not list((run_dir / "steps" / ".partial").glob("pretrain_phase1-*/checkpoints/latest.json")):  # the follower has work
        assert time.time() < deadline and proc.poll() is None, "no checkpoint was saved"
        time.sleep(0.2)
    trainers = [p for p in cli.children(recursive=True) if "model.train" in p.cmdline()]
    assert trainers, "the trainer had already finished: train longer"
    proc.send_signal(signal.SIGTERM)
    signalled = time.time()
    started_after: list[str] = []
    while proc.poll() is None and time.time() < signalled + 300:
        for child in cli.children(recursive=True) if proc.poll() is None else []:
            try:
                if "tasks.evaluation.harness" in child.cmdline() and child.create_time() > signalled:
                    started_after.append(" ".join(child.cmdline()[-4:]))
            except psutil.Error:
                pass
        time.sleep(0.2)
    assert proc.poll() is not None and proc.returncode != 0, "the terminated run did not end, or ended as a success"
    assert not started_after, f"an evaluation started after SIGTERM: {started_after[:1]}"
    _, alive = psutil.wait_procs(trainers, timeout=30)
    assert not alive, "the trainer outlived the run"
    [latest] = (run_dir / "steps" / ".partial").glob("pretrain_phase1-*/checkpoints/latest.json")
    on_signal = latest.parent / json.loads(latest.read_text())["tag"] / "hf"
    assert run_results(run_dir).get(local_fingerprint(on_signal)) is None, "the checkpoint saved on SIGTERM was scored after it"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "ctrl-c"])
def test_a_killed_or_interrupted_cli_ends_and_takes_every_process_it_started_with_it_prefects_temporary_server_included(how, tmp_path):
    """`smolflow stage curate` with no Prefect server set, while its filter step runs. SIGKILL of the CLI alone:
    Prefect's temporary API server, the pool's forkserver and its workers carry the CLI's tree mark and are reaped
    within seconds. A Ctrl-C (SIGINT to its process group, as a terminal sends it): the server, in a session of its
    own, does not get it, so the flow reports how it ended to a live server and the CLI exits; in the CLI's group the
    server died with the flow, and the CLI retried it for a minute or more ("Error logging to API")."""
    import os
    import signal
    import time

    import psutil

    from infra.procs import TREE_ENV, Proc, census

    recipe = write_recipe(tmp_path / "micro.yaml", micro_recipe(**{"executor.workers": 2}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}  # Prefect starts its temporary server
    cmd = [str(Path(sys.executable).parent / "smolflow"), "stage", "curate", str(recipe), "--run-dir", str(tmp_path / "run")]
    out = tmp_path / "cli.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cli = psutil.Process(proc.pid)
    token = Proc.of(cli.pid).token
    deadline = time.time() + 300
    while not (tmp_path / "run" / ".partial").exists():  # the server is up and a step is being built
        assert time.time() < deadline and proc.poll() is None, "the curate run never started a step"
        time.sleep(0.2)
    marked = census(token)
    server = [p for p in marked if "uvicorn" in p.cmdline()]
    assert server, f"Prefect's temporary server does not carry {TREE_ENV}"
    assert os.getsid(server[0].pid) != os.getsid(cli.pid), "the temporary server is in the CLI's session"
    if how == "sigkill":
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    else:
        os.killpg(cli.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interrupted CLI still runs 120 s after its Ctrl-C: {out.read_text()[-2000:]}")
        said = out.read_text(errors="replace")
        assert proc.returncode != 0 and "Error logging to API" not in said and "Connection refused" not in said, said[-2000:]
    _, alive = psutil.wait_procs(marked, timeout=30)
    assert not alive, f"outlived the {how} CLI: {[' '.join(p.cmdline()[:4]) for p in alive]}"
    assert not census(token)


def test_a_cli_given_a_server_of_its_users_leaves_prefects_own_server_unimported():
    """With PREFECT_API_URL set (`source .smolflow/env`) no temporary server can start: a command that runs flows does
    not import Prefect's server module for one (4 CPU s; `smolflow stage` took 5.6 CPU s to refuse an unknown stage)."""
    import os

    code = "import sys; from flows.server import temporary_server_of_its_own as own; own(); print(sorted(sys.modules))"
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "'prefect.settings'" in out.stdout, out.stderr
    assert "'prefect.server.api.server'" not in out.stdout


def test_a_subflow_finds_the_root_of_its_chain_as_prefect_does_reading_each_parent_once(prefect_server, monkeypatch):
    """The owner a relaunch is recognised by (flows/pipeline.py root_flow_run): prefect.runtime's answer, for flows two
    deep, with one API read per flow run after the first sibling (a TLS client per read cost ~30 CPU s a suite)."""
    from prefect import flow
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.runtime import flow_run

    from flows.pipeline import root_flow_run

    reads = []  # root_flow_run's own, not the flow engine's

    def counted(name: str):
        original = getattr(SyncPrefectClient, name)

        def read(self, id):
            if sys._getframe(1).f_code is root_flow_run.__code__:
                reads.append(name)
            return original(self, id)

        return read

    for name in ("read_task_run", "read_flow_run"):
        monkeypatch.setattr(SyncPrefectClient, name, counted(name))

    @flow
    def stage() -> tuple[str | None, str]:
        return root_flow_run(), flow_run.root_flow_run_id

    @flow
    def pipeline() -> list:
        return [stage(), stage()]

    @flow
    def swarm() -> tuple[str, list]:
        return flow_run.id, [pipeline(), pipeline()]

    assert root_flow_run() is None, "outside a flow"
    top, pipelines = swarm()
    for ours, prefects in (s for p in pipelines for s in p):
        assert ours == prefects == top
    # the first stage reads up two levels, 2 reads a level; a later stage its parent task run only, as its pipeline's
    # root is known; the second pipeline's first stage up to the swarm, which is known (prefect.runtime: 5 reads a stage)
    up = ["read_task_run", "read_flow_run"]
    assert reads == [*up, *up, "read_task_run", *up, "read_task_run", "read_task_run"]
