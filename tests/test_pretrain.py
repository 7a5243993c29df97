"""The trainer as its own process: exact resume after SIGKILL, stage chaining, torchrun, HF checkpoints."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from infra.launch import kill_tree, launch_command, launch_env, run_streaming
from infra.recipe import LauncherCfg, parse_recipe
from model.train import TrainJob
from tasks.curation import tokenizer as bpe
from tests.helpers import micro_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tokenizer and two token sources of synthetic documents."""
    root = tmp_path_factory.mktemp("pretrain-data")
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(300)]
    vocab = len(bpe.save_hf(bpe.train_bpe(iter(texts), vocab_size=320, min_frequency=1), root / "tok"))
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        # counting runs (next token = this one + 1): learnable, so a trained model is plain to tell apart
        docs = [(rng.integers(0, vocab) + np.arange(rng.integers(5, 60))) % vocab for _ in range(400)]
        folder = root / name
        folder.mkdir()
        np.concatenate(docs).astype(np.uint16).tofile(folder / f"{name}.ds")
        np.cumsum([len(d) for d in docs]).astype(np.uint64).tofile(folder / f"{name}.ds.index")
        (folder / f"{name}.ds.metadata").write_text("tokenizer.json|2\n0\n0")
    return root


def make_job(data: Path, out: Path, stage_index: int = 0, launcher: dict | None = None, **fields) -> Path:
    recipe = micro_recipe()
    recipe["model"] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    recipe["pretrain"].update(
        seq_len=32,
        micro_batch_size=4,
        log_every=1,
        tracking="none",
        checkpoint={"every_steps": 3, "every_minutes": 60, "keep_last": 2},
        optimizer={"lr": 1e-2, "warmup_steps": 3, "decay_fraction": 0.3, "z_loss": 1e-4},
        launcher=launcher or {"kind": "python", "nproc": 1, "threads_per_rank": 1},
        stages=[
            {"name": "s1", "tokens": 10_000, "mixture": {"a": 0.5, "b": 0.5}},
            {"name": "long", "tokens": 4_000, "seq_len": 64, "micro_batch_size": 2, "rope_theta": 1e5, "mixture": {"a": 0.5, "b": 0.5}},
        ],
        yarn_factor=2.0,
    )
    r = parse_recipe({**recipe, "sources": [{"name": n, "domain": "prose", "format": "embedded"} for n in ("a", "b")]}, "t")
    out.mkdir(parents=True, exist_ok=True)
    p = r.pretrain
    stage = p.stages[stage_index]
    windows = {n: stage.tokens // 2 // p.stage_seq_len(stage) for n in ("a", "b")}
    job = TrainJob(
        run_name="t",
        stage_index=stage_index,
        seed=5,
        model=r.model,
        pretrain=p,
        sources={n: str(data / n) for n in ("a", "b")},
        samples=windows,
        tokenizer_dir=str(data / "tok"),
        out_dir=str(out),
        checkpoint_dir=str(out / "checkpoints"),
        total_main_steps=78,
        last_stage=stage_index == 1,
        peak_flops=1e11,
        **fields,
    )
    path = out / "job.json"
    path.write_text(job.model_dump_json())
    return path


def run_job(job: Path, launcher: LauncherCfg | None = None) -> list[str]:
    launcher = launcher or LauncherCfg(kind="python", nproc=1, threads_per_rank=1)
    lines: list[str] = []
    code = run_streaming(
        launch_command(launcher, "model.train", [str(job)], port=29400 + random.randrange(500)), launch_env(launcher), lines.append
    )
    assert code == 0, "\n".join(lines[-30:])
    return lines


def losses(out: Path) -> dict[int, float]:
    """The loss logged at each step; after a resume a step may be logged twice, and the last one counts."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def start_killable(job: Path) -> subprocess.Popen:
    launcher = LauncherCfg(kind="python", nproc=1, threads_per_rank=1)
    return subprocess.Popen(
        launch_command(launcher, "model.train", [str(job)], port=29990),
        env=launch_env(launcher),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    run_job(make_job(data, out))
    return out


def test_sigkill_at_a_random_step_resumes_with_the_same_losses(data, reference, tmp_path):
    out = tmp_path / "killed"
    job = make_job(data, out)
    kill_at = random.Random().randint(4, 60)
    proc = start_killable(job)
    while proc.poll() is None and logged_steps(out) < kill_at:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "summary.json").exists(), "killed before the end"
    lines = run_job(job)
    assert any("resumed s1 from checkpoint" in line for line in lines)
    expected, got = losses(reference), losses(out)
    assert sorted(got) == sorted(expected) and len(expected) == 78
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(data, reference, tmp_path):
    out = tmp_path / "torn"
    job = make_job(data, out)
    proc = start_killable(job)
    staging = out / "checkpoints" / ".tmp"
    while proc.poll() is None and not any(staging.glob("step*/*")):
        time.sleep(0.002)
    kill_tree(proc.pid)
    latest = json.loads((out / "checkpoints" / "latest.json").read_text()) if (out / "checkpoints" / "latest.json").exists() else None
    lines = run_job(job)
    if latest is not None:
        assert any(f"from checkpoint {latest['tag']}" in line for line in lines)
    assert losses(out) == pytest.approx(losses(reference), rel=1e-6, abs=1e-7)


def test_long_context_stage_starts_from_previous_weights_and_exports_yarn(data, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.train import initial_model

    job_path = make_job(data, tmp_path / "long", stage_index=1, init_from=str(reference / "final"))
    job = TrainJob.model_validate_json(job_path.read_text())
    start = initial_model(job, 0, {}, None)  # the vocabulary comes from the previous stage's config
    previous = AutoModelForCausalLM.from_pretrained(reference / "final")
    assert start.config.max_position_embeddings == 64 and start.config.rope_parameters["rope_theta"] == 1e5
    for (name, a), (_, b) in zip(start.state_dict().items(), previous.state_dict().items()):
        assert torch.equal(a, b), name
    run_job(job_path)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "long" / "final")
    assert final.config.rope_parameters["rope_type"] == "yarn" and final.config.max_position_embeddings == 128
    tok = AutoTokenizer.from_pretrained(tmp_path / "long" / "final")
    out = final.generate(**tok("def f(x):", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 3
    ckpt = max((tmp_path / "long" / "checkpoints").glob("step*"))
    assert AutoModelForCausalLM.from_pretrained(ckpt / "hf").config.model_type == "smollm3"


def test_two_ranks_with_torchrun_then_a_main_stage_continues(data, tmp_path):
    launcher = {"kind": "torchrun", "nproc": 2, "threads_per_rank": 1}
    out = tmp_path / "ddp"
    run_job(make_job(data, out, launcher=launcher), LauncherCfg(**launcher))
    steps = losses(out)
    assert max(steps) == 39 and all(np.isfinite(list(steps.values())))  # 78 windows / (4 x 2 ranks)
    # a second main stage loads the first one's DeepSpeed checkpoint (weights and optimizer state)
    job = make_job(data, tmp_path / "s2", launcher=launcher, init_from=str(out / "checkpoints"))
    lines = run_job(job, LauncherCfg(**launcher))
    assert any("continuing from" in line for line in lines)
    first, trained = losses(tmp_path / "s2"), losses(out)
    assert first[1] < 0.5 * trained[1]  # it starts from trained weights, not from scratch


def test_cancelled_launch_leaves_no_rank_behind(data, tmp_path):
    """Killing the launcher's tree ends torchrun's workers, which run in sessions of their own."""
    import psutil

    launcher = LauncherCfg(kind="torchrun", nproc=2, threads_per_rank=1)
    job = make_job(data, tmp_path / "cancel", launcher=launcher.model_dump())
    proc = subprocess.Popen(
        launch_command(launcher, "model.train", [str(job)], port=29877),
        env=launch_env(launcher),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(psutil.Process(proc.pid).children(recursive=True)) < 2:
        time.sleep(0.2)
    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert len(ranks) >= 2
    kill_tree(proc.pid)
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive


def test_resume_on_fewer_ranks_goes_through_a_universal_checkpoint(data, tmp_path):
    """2 ranks of ZeRO-2 stop mid-stage; 1 rank (same global batch via grad_accum 2) finishes the stage."""
    out = tmp_path / "zero2"
    two = {"kind": "torchrun", "nproc": 2, "threads_per_rank": 1}
    job = make_job(data, out, launcher=two, stop_after_steps=7)
    text = json.loads(job.read_text())
    text["pretrain"]["zero_stage"] = 2
    job.write_text(json.dumps(text))
    run_job(job, LauncherCfg(**two))
    assert not (out / "summary.json").exists()

    text["pretrain"].update(grad_accum=2, launcher={"kind": "python", "nproc": 1, "threads_per_rank": 1})
    text["stop_after_steps"] = None
    job.write_text(json.dumps(text))
    lines = run_job(job)
    assert any("converting step00000006 to a universal checkpoint" in line for line in lines), "\n".join(lines[-20:])
    assert any("resumed s1 from checkpoint step00000006" in line for line in lines)
    assert json.loads((out / "summary.json").read_text())["steps"] == 39


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_loss_spike_policies(data, tmp_path, policy):
    """A hair-trigger spike factor makes ordinary noise count as spikes: each policy acts and the stage finishes."""
    job = make_job(data, tmp_path / policy)
    text = json.loads(job.read_text())
    text["pretrain"]["spike"] = {"policy": policy, "factor": 1.02, "warmup_steps": 6}
    text["pretrain"]["optimizer"]["lr"] = 5e-2  # a high learning rate makes the loss jumpy
    job.write_text(json.dumps(text))
    lines = run_job(job)
    assert any("loss spike at step" in line for line in lines)
    if policy == "rollback":
        assert any("rolled back to step" in line for line in lines)
    assert json.loads((tmp_path / policy / "summary.json").read_text())["steps"] == 78


def test_deepspeed_launcher_runs_two_ranks_on_cpu(data, tmp_path):
    launcher = {"kind": "deepspeed", "nproc": 2, "threads_per_rank": 1}
    job = make_job(data, tmp_path / "ds", launcher=launcher, stop_after_steps=4)
    lines = run_job(job, LauncherCfg(**launcher))
    assert any("2 rank(s)" in line for line in lines), "\n".join(lines[-20:])
    assert sorted(losses(tmp_path / "ds")) == [1, 2, 3, 4]
