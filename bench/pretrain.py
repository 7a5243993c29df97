"""Benchmark: the trainer's tokens/s against a bare PyTorch loop on the same model and batches;
with --slurm, a 2-rank phase under torchrun against the same phase as a Slurm job (the local cluster).

Both train the tiny recipe's SmolLM3 (seq 256, micro-batch 16, fp32, 2 threads) on the same packed
batches; the bare loop runs before and after the trainer and the ratio uses their mean (these
machines are noisy: compare ratios from one run). The bare loop runs twice each time: with the
trainer's fused `lm_loss` and with the textbook F.cross_entropy + logsumexp, to price the fused loss.
MFU is against this machine's measured fp32 matmul peak. With --slurm (after `smolflow cluster slurm
start`, with SLURM_CONF exported) both sides run 2 ranks of 1 thread, back to back: per job, the wall
time from launch to exit; per step, tokens/s.
Usage:  .venv/bin/python bench/pretrain.py [--steps 60] [--slurm]
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from infra.launch import launch_command, launch_env, run_streaming  # noqa: E402
from infra.recipe import LauncherCfg, load_recipe  # noqa: E402
from model.config import Schedule, TrainJob  # noqa: E402
from model.data import IGNORE, MixtureBatches, TokenSource, sample_order  # noqa: E402
from model.network import build_model, model_config, param_groups  # noqa: E402
from model.plan import flops_per_token, measure_peak_flops  # noqa: E402
from model.train import lm_loss  # noqa: E402
from tasks.curation import tokenizer as bpe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def make_data(root: Path, vocab: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    for name in ("prose", "code", "math"):
        folder = root / name
        folder.mkdir(parents=True)
        lengths = rng.integers(50, 800, tokens // 400)
        np.concatenate([rng.integers(0, vocab, n) for n in lengths]).astype(np.uint16).tofile(folder / f"{name}.ds")
        np.cumsum(lengths).astype(np.uint64).tofile(folder / f"{name}.ds.index")
        (folder / f"{name}.ds.metadata").write_text("tokenizer.json|2\n0\n0")


def textbook_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss as lm_loss the usual way: shifted logits, F.cross_entropy, a second logsumexp for the z-loss."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)
    return ce + z_loss * (torch.logsumexp(logits, dim=-1)[targets != IGNORE] ** 2).mean(), ce


def sync(device: str) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it."""
    if device == "cuda":
        torch.cuda.synchronize()


def bare_loop(
    recipe,
    batches: MixtureBatches,
    vocab: int,
    steps: int,
    warmup: int,
    loss_fn=lm_loss,
    device: str = "cpu",
    bf16: bool = False,
    compiled: bool = False,
) -> float:
    """Tokens/s of a plain PyTorch loop: forward (bf16 autocast when asked; through torch.compile when
    asked, which fuses the model's small kernels), loss, backward, clip, AdamW step."""
    p = recipe.pretrain
    model = build_model(model_config(recipe.model, vocab, p.seq_len), seed=0).to(device)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(param_groups(model, p.optimizer.weight_decay), lr=p.optimizer.lr, betas=p.optimizer.betas)
    for step in range(warmup + steps):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        for mb in batches.micro_batches(step, 0, 1):
            mb = {key: value.to(device) for key, value in mb.items()}
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                logits = forward(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
            loss, _ = loss_fn(logits, mb["labels"], p.optimizer.z_loss)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), p.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    return steps * batches.batch_size * p.seq_len / (time.perf_counter() - start)


def trainer(recipe, root: Path, samples: dict[str, int], steps: int, log_every: int, peak: float, launcher: LauncherCfg, run: int = 0):
    """Tokens/s the real trainer logs (its first window, with start-up, left out), its summary, and the job's wall time."""
    from tasks.pretrain import run_slurm_job, train_configs

    phase1 = train_configs(recipe)[0]
    opt = recipe.pretrain.optimizer
    config = phase1.model_copy(
        update={
            "samples": samples,
            "schedule": Schedule(steps=steps, total=steps, warmup=opt.warmup_steps, decay_start=steps, peak=opt.lr, floor=opt.lr),
            "log_every": log_every,
            "tracking": "none",
            "threads": launcher.threads_per_rank,
            "micro_batch_size": phase1.micro_batch_size // launcher.nproc,  # the same global batch on every rank count
            "checkpoint": recipe.pretrain.checkpoint.model_copy(update={"every_steps": steps}),
            "peak_flops": peak,
        }
    )
    out = root / f"out-{launcher.kind}-{run}"
    job = TrainJob(
        config=config,
        sources={n: str(root / n) for n in samples},
        tokenizer_dir=str(root / "tok"),
        out_dir=str(out),
        checkpoint_dir=str(out / "checkpoints"),
    )
    out.mkdir()
    (out / "job.json").write_text(job.model_dump_json())
    lines: list[str] = []
    start = time.perf_counter()
    if launcher.kind == "slurm":
        code = run_slurm_job(launcher, out, out / "job.json", launch_env(launcher), "s1", lines.append)
    else:
        code = run_streaming(launch_command(launcher, "model.train", [str(out / "job.json")], 29600), launch_env(launcher), lines.append)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"trainer ({launcher.kind}) failed:\n" + "\n".join(lines[-20:]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return float(np.mean([r["tokens_per_s"] for r in rows[1:]])), summary, wall


def compare_slurm(recipe, root: Path, samples: dict[str, int], steps: int, log_every: int, peak: float, rounds: int = 2) -> None:
    """torchrun and Slurm alternately, `rounds` times each (the first run of a process pays for cold caches)."""
    sides = {
        "torchrun": LauncherCfg(kind="torchrun", nproc=2, threads_per_rank=1),
        "Slurm job": LauncherCfg(kind="slurm", nproc=2, threads_per_rank=1, slurm={"time": "30"}),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for i in range(rounds):
        for name, launcher in sides.items():
            tps, _, wall = trainer(recipe, root, samples, steps, log_every, peak, launcher, run=i)
            runs[name].append((wall, tps))
    print(f"2 ranks x 1 thread, {steps} steps of the tiny recipe's phase 1; {rounds} runs each, alternating")
    print(f"{'':12}{'job wall s (each run)':>28}{'tokens/s (each run)':>26}")
    for name, rows in runs.items():
        print(f"{name:12}{' '.join(f'{w:8.1f}' for w, _ in rows):>28}{' '.join(f'{t:9,.0f}' for _, t in rows):>26}")
    wall = {name: float(np.mean([w for w, _ in rows])) for name, rows in runs.items()}
    tps = {name: float(np.mean([t for _, t in rows])) for name, rows in runs.items()}
    print(
        f"per job: a Slurm job takes {wall['Slurm job'] - wall['torchrun']:+.1f} s against torchrun (mean); "
        f"per step: tokens/s ratio Slurm / torchrun {tps['Slurm job'] / tps['torchrun']:.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slurm", action="store_true", help="compare torchrun with a Slurm job (2 ranks each) instead")
    args = parser.parse_args()
    torch.set_num_threads(2)
    recipe = load_recipe(REPO / "configs" / "tiny.yaml")
    p = recipe.pretrain
    per_step = p.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # random words reach the recipe's vocabulary (digits are split one by one: "token123" words gave 265),
        # and the vocabulary sets the LM head's and the loss's share of a step
        rng = random.Random(0)
        texts = (" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(20)) for _ in range(5000))
        size = recipe.curate.tokenizer.train.vocab_size
        vocab = len(bpe.save_hf(bpe.train_bpe(texts, vocab_size=size, min_frequency=1), root / "tok"))
        assert vocab == size, f"bench tokenizer has {vocab} tokens, the recipe {size}"
        make_data(root, vocab, tokens=per_step * p.seq_len * (args.steps + 10))
        samples = {
            "prose": per_step * (args.steps + 10) // 3,
            "code": per_step * (args.steps + 10) // 3,
            "math": per_step * (args.steps + 10) // 3,
        }
        sources = [TokenSource(root / n) for n in samples]
        batches = MixtureBatches(sources, sample_order(list(samples.values()), 0, 0), p.seq_len, p.micro_batch_size, p.batch_size)
        steps = batches.steps - 5
        peak = measure_peak_flops(seconds=2.0)
        if args.slurm:
            return compare_slurm(recipe, root, samples, batches.steps, max(1, steps // 6), peak)
        textbook_before = bare_loop(recipe, batches, vocab, steps // 2, warmup=3, loss_fn=textbook_loss)
        bare_before = bare_loop(recipe, batches, vocab, steps // 2, warmup=3)
        launcher = LauncherCfg(kind="python", nproc=1, threads_per_rank=2)
        ours, summary, _ = trainer(recipe, root, samples, batches.steps, max(1, steps // 6), peak, launcher)
        bare_after = bare_loop(recipe, batches, vocab, steps // 2, warmup=3)
        textbook_after = bare_loop(recipe, batches, vocab, steps // 2, warmup=3, loss_fn=textbook_loss)
        bare, textbook = (bare_before + bare_after) / 2, (textbook_before + textbook_after) / 2
        fpt = flops_per_token(model_config(recipe.model, vocab, p.seq_len), p.seq_len)
    print(f"model: tiny recipe SmolLM3, seq {p.seq_len}, micro-batch {p.micro_batch_size}, fp32, 2 threads")
    print(f"measured fp32 matmul peak: {peak / 1e9:.0f} GFLOP/s")
    print(f"{'':28}{'tokens/s':>10}{'MFU':>8}")
    for name, mean, before, after in (
        ("bare loop, F.cross_entropy", textbook, textbook_before, textbook_after),
        ("bare loop, lm_loss", bare, bare_before, bare_after),
    ):
        print(f"{name:28}{mean:10,.0f}{mean * fpt / peak:8.1%}   (before {before:,.0f}, after {after:,.0f})")
    print(f"{'smolflow trainer':28}{ours:10,.0f}{ours * fpt / peak:8.1%}")
    print(f"ratio lm_loss / F.cross_entropy (bare loops): {bare / textbook:.3f}x; trainer / bare loop with lm_loss: {ours / bare:.3f}x")
    print(
        f"checkpoint save (DeepSpeed shards + HF export, fsync, rename): {summary['checkpoint_seconds']:.2f} s "
        f"= {summary['checkpoint_seconds'] * ours / (per_step * p.seq_len):.1f} training steps"
    )


if __name__ == "__main__":
    main()
