"""The trainer as its own process: exact resume after SIGKILL, phase chaining, torchrun, HF checkpoints."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from infra.errors import DiskFull, SmolflowError
from infra.launch import check_disk, launch_command, launch_env, run_streaming
from infra.procs import PREEMPTED, STOPPING, kill_tree
from infra.recipe import CheckpointCfg, LauncherCfg, ModelCfg
from model.checkpoint import checkpoint_bytes, step_of
from model.config import Schedule, TrainConfig, TrainJob
from tasks.curation import tokenizer as bpe
from tests.helpers import REPO, logged_steps, losses

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


MODEL = ModelCfg(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def make_job(data: Path, out: Path, phase: int = 0, world: int = 1, batch_size: int = 4, **fields) -> Path:
    """Phase 0: 10k tokens of seq 32 (78 steps of 4); phase 1: long context, 4k tokens of seq 64."""
    long = phase == 1
    seq, tokens, batch = (64, 4000, 2) if long else (32, 10_000, batch_size)
    samples = {n: tokens // 2 // seq for n in ("a", "b")}
    steps = sum(samples.values()) // batch
    schedule = Schedule(
        steps=steps, total=78, warmup=3, decay_start=78 - int(78 * 0.3), peak=1e-2, floor=1e-3, constant=1e-3 if long else None
    )
    config = TrainConfig(
        phase="long" if long else "s1",
        index=phase,
        seed=5,
        model=MODEL,
        samples=samples,
        seq_len=seq,
        batch_size=batch,
        schedule=schedule,
        z_loss=1e-4,
        rope_theta=1e5 if long else None,
        yarn_factor=2.0 if long else None,
        micro_batch_size=batch // world,
        checkpoint=CheckpointCfg(every_steps=3, every_minutes=60, keep_last=2),
        threads=1,
        log_every=1,
        tracking="none",
        peak_flops=1e11,
    )
    out.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        config=config,
        sources={n: str(data / n) for n in ("a", "b")},
        tokenizer_dir=str(data / "tok"),
        out_dir=str(out),
        **{"checkpoint_dir": str(out / "checkpoints"), **fields},
    )
    path = out / "job.json"
    path.write_text(job.model_dump_json())
    return path


def edit(job: Path, **config) -> None:
    """Change fields of the job's TrainConfig in place."""
    text = json.loads(job.read_text())
    text["config"].update(config)
    job.write_text(json.dumps(text))


def run_job(job: Path, launcher: LauncherCfg | None = None) -> list[str]:
    launcher = launcher or LauncherCfg(kind="python", nproc=1, threads_per_rank=1)
    lines: list[str] = []
    code = run_streaming(
        launch_command(launcher, "model.train", [str(job)], port=29400 + random.randrange(500)), launch_env(launcher), lines.append
    )
    errors = [line for line in lines if re.search(r"error|terminate|abort|exception", line, re.I)]
    assert code == 0, "\n".join(errors[:20] + ["..."] + lines[-30:])
    return lines


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


def test_a_launch_never_starts_more_threads_than_the_cores_it_may_use(data, tmp_path, monkeypatch):
    """More OpenMP threads than cores spin against each other (bench/threads.py): SMOLFLOW_CORES or the
    affinity mask (a Slurm cpuset, taskset) caps what the recipe asks for, in the launch and in the trainer."""
    ask = LauncherCfg(kind="python", nproc=1, threads_per_rank=8)
    monkeypatch.setenv("SMOLFLOW_CORES", "1")
    job = make_job(data, tmp_path / "out")
    edit(job, threads=8)
    assert any("1 rank(s) of 1 thread(s)" in line for line in run_job(job, ask))
    probe = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    assert subprocess.run(probe, env=launch_env(ask), capture_output=True, text=True).stdout.split() == ["1"]
    monkeypatch.delenv("SMOLFLOW_CORES")
    code = "from infra.launch import launch_env; from infra.recipe import LauncherCfg as L; print(launch_env(L(threads_per_rank=8)))"
    shown = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert "'OMP_NUM_THREADS': '1'" in shown.stdout, shown.stderr
    monkeypatch.setenv("SMOLFLOW_CORES", "two")
    with pytest.raises(SmolflowError, match="SMOLFLOW_CORES='two'"):
        launch_env(ask)


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
    """Killed while writing a later checkpoint (not the first): the torn save is never loaded, the one before is."""
    out = tmp_path / "torn"
    job = make_job(data, out)
    proc = start_killable(job)
    root, torn = out / "checkpoints", None
    while proc.poll() is None and torn is None:
        latest = json.loads((root / "latest.json").read_text())["tag"] if (root / "latest.json").exists() else None
        if latest and step_of(latest) >= 6:
            torn = next((p.parent.name for p in (root / ".tmp").glob("step*/*") if p.parent.name > latest), None)
    kill_tree(proc.pid)
    previous = json.loads((root / "latest.json").read_text())["tag"]
    assert torn is not None and (root / ".tmp" / torn).exists() and step_of(previous) < step_of(torn) and step_of(previous) >= 6
    lines = run_job(job)
    assert any(f"resumed s1 from checkpoint {previous}" in line for line in lines), lines[:5]
    assert losses(out) == pytest.approx(losses(reference), rel=1e-6, abs=1e-7)


def test_sigterm_saves_a_checkpoint_and_exits_for_a_retry_to_resume(data, reference, tmp_path):
    """A Slurm preemption or a cancel (SIGTERM) between checkpoints loses no step: checkpoint, exit 75, resume."""
    out = tmp_path / "preempted"
    job = make_job(data, out)
    edit(job, checkpoint=CheckpointCfg(every_steps=50, every_minutes=60, keep_last=2).model_dump())
    proc = start_killable(job)
    while proc.poll() is None and logged_steps(out) < 20:
        time.sleep(0.01)
    listening = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) == {"127.0.0.1"}, f"a lone rank listens beyond loopback: {listening}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == PREEMPTED
    tag = json.loads((out / "checkpoints" / "latest.json").read_text())["tag"]
    assert 20 <= step_of(tag) < 50, "saved where it stopped, not at a scheduled checkpoint"
    lines = run_job(job)
    assert any(f"resumed s1 from checkpoint {tag}" in line for line in lines)
    assert losses(out) == pytest.approx(losses(reference), rel=1e-6, abs=1e-7)


def test_a_small_disk_is_pruned_before_a_save_and_a_full_one_named(data, reference, tmp_path, small_disk):
    size = checkpoint_bytes(max((reference / "checkpoints").glob("step*")))
    disk = small_disk(int(2.6 * size))  # two checkpoints fit (keep_last), a third only once the oldest is pruned
    job = make_job(data, tmp_path / "small", checkpoint_dir=str(disk / "ckpt"))
    run_job(job)
    assert losses(tmp_path / "small") == pytest.approx(losses(reference), rel=1e-6, abs=1e-7)

    full = small_disk(int(0.5 * size))
    job = make_job(data, tmp_path / "full", checkpoint_dir=str(full / "ckpt"))
    launcher = LauncherCfg(kind="python", nproc=1, threads_per_rank=1)
    lines: list[str] = []
    code = run_streaming(launch_command(launcher, "model.train", [str(job)], port=0), launch_env(launcher), lines.append)
    message = next((line for line in lines if "DiskFull" in line), "\n".join(lines[-10:]))
    assert code != 0 and str(full / "ckpt") in message and "MiB free, the next checkpoint needs about" in message
    with pytest.raises(DiskFull, match=rf"pretrain s1: the trainer ran out of disk: {full / 'ckpt'}: \d+\.\d MiB free, the next"):
        check_disk("pretrain s1", tmp_path / "full", [tmp_path / "full"])  # the disk that stopped it is named in the mark


def test_a_launch_that_ends_while_stopping_sends_the_ranks_last_lines_at_once():
    """A cancelled flow process may end (the worker's SIGTERM) right after its trainer did, before Prefect's log handler
    sends its next batch; the trainer's last line, where it checkpointed, was lost so. A launch that ends while the
    process is STOPPING flushes every log handler once the ranks' lines are in."""

    class Batched(logging.Handler):  # as Prefect's API handler: lines are queued, and sent on flush
        def __init__(self):
            super().__init__()
            self.queued, self.sent = [], []

        def emit(self, record):
            self.queued.append(record.getMessage())

        def flush(self):
            self.sent, self.queued = self.sent + self.queued, []

    handler, logger = Batched(), logging.getLogger("smolflow.tests.batched")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    STOPPING.set()
    try:
        code = run_streaming([sys.executable, "-c", "print('phase1: received SIGTERM: checkpoint step00000105 saved')"], {}, logger.info)
    finally:
        STOPPING.clear()
        logger.removeHandler(handler)
    assert code == 0 and handler.sent == ["phase1: received SIGTERM: checkpoint step00000105 saved"] and not handler.queued


def test_long_context_phase_starts_from_previous_weights_and_exports_yarn(data, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.train import initial_model

    job_path = make_job(data, tmp_path / "long", phase=1, init_from=str(reference / "final"))
    job = TrainJob.model_validate_json(job_path.read_text())
    start = initial_model(job, 0, {}, None)  # the vocabulary comes from the previous phase's config
    previous = AutoModelForCausalLM.from_pretrained(reference / "final")
    assert start.config.max_position_embeddings == 64 and start.config.rope_parameters["rope_theta"] == 1e5
    for (name, a), (_, b) in zip(start.state_dict().items(), previous.state_dict().items()):
        assert torch.equal(a, b), name
    run_job(job_path)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "long" / "final")
    assert final.config.rope_parameters["rope_type"] == "yarn" and final.config.max_position_embeddings == 128
    tok = AutoTokenizer.from_pretrained(tmp_path / "long" / "final")
    prompt = tok("def f(x):", return_tensors="pt")
    out = final.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5  # five tokens generated beyond the prompt
    ckpt = max((tmp_path / "long" / "checkpoints").glob("step*"))
    assert AutoModelForCausalLM.from_pretrained(ckpt / "hf").config.model_type == "smollm3"


def test_two_ranks_with_torchrun_then_a_main_phase_continues(data, tmp_path):
    launcher = LauncherCfg(kind="torchrun", nproc=2, threads_per_rank=1)
    out = tmp_path / "ddp"
    run_job(make_job(data, out, world=2, batch_size=8), launcher)
    steps = losses(out)
    assert max(steps) == 39 and all(np.isfinite(list(steps.values())))  # 312 windows / batches of 8 (4 x 2 ranks)
    # a second main phase loads the first one's DeepSpeed checkpoint (weights and optimizer state)
    job = make_job(data, tmp_path / "s2", world=2, batch_size=8, init_from=str(out / "checkpoints"))
    lines = run_job(job, launcher)
    assert any("continuing from" in line for line in lines)
    first, trained = losses(tmp_path / "s2"), losses(out)
    assert first[1] < 0.5 * trained[1]  # it starts from trained weights, not from scratch


def test_cancelled_launch_leaves_no_rank_behind(data, tmp_path):
    """Killing the launcher's tree ends torchrun's workers, which run in sessions of their own."""
    import psutil

    launcher = LauncherCfg(kind="torchrun", nproc=2, threads_per_rank=1)
    job = make_job(data, tmp_path / "cancel", world=2, batch_size=8)
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


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_loss_spike_policies(data, tmp_path, policy):
    """A hair-trigger spike factor makes ordinary noise count as spikes: each policy acts and the phase finishes."""
    job = make_job(data, tmp_path / policy)
    schedule = json.loads(job.read_text())["config"]["schedule"] | {"peak": 5e-2}  # a high learning rate makes the loss jumpy
    edit(job, spike={"policy": policy, "factor": 1.02, "warmup_steps": 6}, schedule=schedule)
    lines = run_job(job)
    assert any("loss spike at step" in line for line in lines)
    if policy == "rollback":
        assert any("rolled back to step" in line for line in lines)
    assert json.loads((tmp_path / policy / "summary.json").read_text())["steps"] == 78


def test_deepspeed_launcher_runs_two_ranks_on_cpu(data, tmp_path):
    job = make_job(data, tmp_path / "ds", world=2, batch_size=8, stop_after_steps=4)
    lines = run_job(job, LauncherCfg(kind="deepspeed", nproc=2, threads_per_rank=1))
    assert any("2 rank(s)" in line for line in lines), "\n".join(lines[-20:])
    assert sorted(losses(tmp_path / "ds")) == [1, 2, 3, 4]


def test_a_skipped_batch_leaves_weights_and_optimizer_state_bit_identical(data, tmp_path, monkeypatch):
    """`skip` and a non-finite loss drop the update: no optimizer call, so no moment, weight-decay or step-count change."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from infra.launch import free_port
    from model.data import MixtureBatches, TokenSource, sample_order
    from model.train import build_engine, setup_distributed, train_step

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    job = TrainJob.model_validate_json(make_job(data, tmp_path).read_text())
    cfg = job.config
    setup_distributed()
    try:
        tok = AutoTokenizer.from_pretrained(data / "tok")
        engine, optimizer = build_engine(job, 1, len(tok), {"eos_token_id": tok.eos_token_id}, None, universal=False)
        batches = MixtureBatches([TokenSource(data / n) for n in cfg.samples], sample_order(list(cfg.samples.values()), 5, 0), 32, 4, 4)

        def state() -> dict:
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            moments = {(i, k): v.clone() for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
            return {"weights": weights, "moments": moments, "steps": engine.global_steps}

        def same(a: dict, b: dict) -> bool:
            return a["steps"] == b["steps"] and all(torch.equal(a[part][k], b[part][k]) for part in ("weights", "moments") for k in a[part])

        initial = state()
        _, dropped, norm = train_step(engine, batches.micro_batches(0, 0, 1), cfg, lambda loss: False)
        trained = state()
        assert not dropped and not same(initial, trained) and trained["moments"], "a normal step updates weights and moments"
        assert np.isfinite(norm) and norm > 0, "the fp32 ZeRO-0 path reports the norm DeepSpeed clipped by"

        loss, dropped, norm = train_step(engine, batches.micro_batches(1, 0, 1), cfg, lambda loss: True)  # the guard says: spike
        assert dropped and same(trained, state()) and np.isnan(norm)

        def overflow(module, args, out):  # logits that overflowed: the loss is no longer finite
            return type(out)(logits=out.logits * float("inf"))

        hook = engine.module.register_forward_hook(overflow)
        loss, dropped, _ = train_step(engine, batches.micro_batches(2, 0, 1), cfg, lambda loss: False)
        hook.remove()
        assert dropped and not np.isfinite(loss) and same(trained, state())
    finally:
        dist.destroy_process_group()


def test_a_phase_killed_on_two_ranks_resumes_on_one(tmp_path):
    """The rank count is operational: a 2-rank ZeRO-1 phase killed mid-way, rerun with `pretrain.launcher.nproc=1`,
    has the same step id and resumes from its newest checkpoint (re-split through DeepSpeed's universal format)."""
    import threading

    import psutil

    from flows.graph import build_graph
    from infra.errors import TrainerFailed
    from infra.recipe import parse_recipe
    from infra.steps import run_step, statuses
    from tests.helpers import micro_recipe

    common = {"evaluation.follow": False, "pretrain.zero_stage": 1}
    two = micro_recipe(
        **common, **{"pretrain.launcher": {"kind": "torchrun", "nproc": 2, "threads_per_rank": 1}, "pretrain.micro_batch_size": 2}
    )
    graph = build_graph(parse_recipe(two, "two ranks"))
    run_dir, outputs = tmp_path / "run", {}

    def build(step):
        outputs[step.name] = run_step(run_dir, step, {role: outputs[d.name] for role, d in step.deps.items()})

    for step in graph.stage("curate"):
        build(step)
    phase1 = graph.phases[0]
    checkpoints = run_dir / ".partial" / phase1.name / "checkpoints"  # a link to the build in the store, kept until it commits

    def kill_after_step_ten() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            latest = checkpoints / "latest.json"
            if latest.exists() and json.loads(latest.read_text())["step"] >= 10:
                # SIGKILL without waiting: reaping the launcher here would leave its Popen an exit code of 0
                for proc in psutil.Process().children(recursive=True):
                    try:
                        if "torch.distributed.run" in " ".join(proc.cmdline()):
                            for p in proc.children(recursive=True) + [proc]:
                                p.kill()
                    except psutil.Error:
                        pass  # a process that ended while we looked
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_step_ten)
    killer.start()
    with pytest.raises(TrainerFailed):
        build(phase1)
    killer.join()
    saved = json.loads((checkpoints / "latest.json").read_text())
    assert 10 <= saved["step"] < 31 and json.loads((checkpoints / saved["tag"] / "checkpoint.json").read_text())["world_size"] == 2

    one = build_graph(parse_recipe(micro_recipe(**common, **{"pretrain.launcher.nproc": 1}), "one rank"))
    status = next(s for s in statuses(run_dir, one.steps) if s.step.name == phase1.name)
    assert status.state == "resume", "only an operational value changed: same identity, the partial build resumes"
    build(one.phases[0])
    done = run_dir / phase1.name
    assert outputs[phase1.name].summary.steps == 31 and not (run_dir / ".partial" / phase1.name).exists()
    assert [p.name for p in (run_dir / "steps").glob(f"{phase1.name}-*")] == [done.resolve().name], "one version, resumed"
    assert (done / "checkpoints" / ".universal" / saved["tag"]).is_dir(), "the 2-rank ZeRO shards were re-split for 1 rank"
    lines = [json.loads(line) for line in (done / "metrics.jsonl").read_text().splitlines()]
    assert all(line["grad_norm"] > 0 for line in lines), "ZeRO-1's optimizer records the norm (NaN fails)"
    logged = [line["step"] for line in lines]
    # steps up to the saved checkpoint were trained once: the rerun started from there, not from step 0
    assert sorted(set(logged)) == list(range(5, 31, 5)) + [31] and all(logged.count(s) == 1 for s in logged if s <= saved["step"])
