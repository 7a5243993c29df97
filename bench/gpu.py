"""Benchmark on a GPU: the tiny recipe's phase 1, trained by the real trainer (model/train.py under
DeepSpeed) on CUDA in bf16 and in fp32, with MFU against the card's own measured matmul peak in that
precision, beside the same phase as this CPU trained it (the run the pack was taken from). A bare
PyTorch loop on the same batches prices the trainer's overhead, and a micro-batch sweep of the bare
loop shows how far a model this small is from filling the card.

Three steps (the GPU machine has torch and transformers; deepspeed and pydantic travel as wheels):
  here, after a run trained phase 1:   .venv/bin/python bench/gpu.py pack runs/tiny/pretrain_phase1 .gpu
  on the GPU machine:                  python3 bench/gpu.py run .gpu OUT; python3 bench/gpu.py scale .gpu OUT
  here, the figures into docs:         cp OUT/gpu*.json docs/ && .venv/bin/python bench/gpu.py doc docs/gpu.json > docs/gpu.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
SWEEP = (16, 64, 256)  # sequences per micro-batch: the recipe's, then 4x and 16x


def pack(link: Path, dest: Path) -> None:
    """Copy what a phase's job reads (its job, tokenizer, token sources) and the CPU run's record of it;
    `link` is the phase as its run names it (RUN/NAME); the MFU probe is in the store beside the step."""
    step = link.resolve()
    job = json.loads((step / "job.json").read_text())
    dest.mkdir(parents=True)
    shutil.copytree(job["tokenizer_dir"], dest / "tokenizer")
    for name, folder in job["sources"].items():
        shutil.copytree(folder, dest / "data" / name)
    for name in ("job.json", "metrics.jsonl", "summary.json"):
        shutil.copy(step / name, dest / f"cpu-{name}")
    probes = json.loads((step.parent / "peak_flops.json").read_text())  # the store's, per host: this one's
    (dest / "cpu-peak_flops.json").write_text(json.dumps(probes[socket.gethostname()], indent=2))
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"packed {step.name} into {dest}: {size / 2**20:.1f} MiB")


def tiny_job(pack_dir: Path, out: Path, precision: str, **update):
    """Phase 1 of the CPU run, from scratch on the packed tokens, in `precision` (and any other config change)."""
    from model.config import TrainJob

    cpu = TrainJob.model_validate_json((pack_dir / "cpu-job.json").read_text())
    config = cpu.config.model_copy(update={"precision": precision, "peak_flops": None, "tracking": "none", "hold_unevaluated": 0} | update)
    return cpu.model_copy(
        update={
            "config": config,
            "sources": {name: str(pack_dir / "data" / name) for name in cpu.sources},
            "tokenizer_dir": str(pack_dir / "tokenizer"),
            "out_dir": str(out),
            "checkpoint_dir": str(out / "checkpoints"),
            "mirror": None,
        }
    )


def launch(job, on_line=print) -> int:
    """The trainer on `job` through the pipeline's own launcher, one process; its exit code."""
    from infra.launch import launch_command, launch_env, run_streaming
    from infra.recipe import LauncherCfg

    out = Path(job.out_dir)
    out.mkdir(parents=True)
    (out / "job.json").write_text(job.model_dump_json())
    launcher = LauncherCfg(kind="python", nproc=1, threads_per_rank=job.config.threads)
    return run_streaming(launch_command(launcher, "model.train", [str(out / "job.json")], 29600), launch_env(launcher), on_line)


def trainer(pack_dir: Path, out: Path, precision: str) -> dict:
    """Phase 1 from scratch through the pipeline's own launcher; the trainer probes the card's peak itself."""
    start = time.perf_counter()
    if (code := launch(tiny_job(pack_dir, out, precision))) != 0:
        raise SystemExit(f"trainer ({precision}) exited with {code}")
    return record(out, time.perf_counter() - start)


def record(folder: Path, wall: float | None = None, prefix: str = "") -> dict:
    """A phase's figures from its metrics.jsonl and summary.json: steady tokens/s and MFU leave out the
    first log window (start-up and first kernel launches)."""
    rows = [json.loads(line) for line in (folder / f"{prefix}metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    summary = json.loads((folder / f"{prefix}summary.json").read_text())
    return {
        "steps": rows[-1]["step"],
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "mfu": sum(r["mfu"] for r in steady) / len(steady),
        "peak_flops": rows[-1]["peak_flops_per_rank"],
        "final_loss": rows[-1]["loss"],
        "checkpoint_seconds": summary.get("checkpoint_seconds"),
        "wall_s": wall,
    }


def tiny_vocab(pack_dir: Path) -> int:
    """The packed tokenizer's vocabulary: the tiny model's embedding rows."""
    return len(json.loads((pack_dir / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"])


def tiny_params(pack_dir: Path) -> int:
    """Parameters of the packed phase's model (the tiny recipe's architecture on its own tokenizer)."""
    from model.config import TrainJob
    from model.network import model_config
    from model.plan import count_params

    cfg = TrainJob.model_validate_json((pack_dir / "cpu-job.json").read_text()).config
    return count_params(model_config(cfg.model, tiny_vocab(pack_dir), cfg.seq_len))


def sweep(pack_dir: Path, peak: float, compiled: bool = False) -> list[dict]:
    """The bare loop (bf16 autocast; its model through torch.compile when `compiled`) on phase 1's real
    batches at growing micro-batches, one per step."""
    import torch
    from pretrain import bare_loop

    from infra.recipe import load_recipe
    from model.config import TrainJob
    from model.data import MixtureBatches, TokenSource, sample_order
    from model.network import model_config
    from model.plan import flops_per_token

    recipe = load_recipe(REPO / "configs" / "tiny.yaml")
    cfg = TrainJob.model_validate_json((pack_dir / "cpu-job.json").read_text()).config
    sources = [TokenSource(pack_dir / "data" / name) for name in cfg.samples]
    vocab = tiny_vocab(pack_dir)
    fpt = flops_per_token(model_config(recipe.model, vocab, cfg.seq_len), cfg.seq_len)
    rows = []
    for micro in SWEEP:
        batches = MixtureBatches(sources, sample_order(list(cfg.samples.values()), cfg.seed, cfg.index), cfg.seq_len, micro, micro)
        steps = min(100, batches.steps - 5)
        tok_s = bare_loop(recipe, batches, vocab, steps, warmup=5, device="cuda", bf16=True, compiled=compiled)
        rows.append(
            {"micro_batch": micro, "tokens_per_step": micro * cfg.seq_len, "steps": steps, "tokens_per_s": tok_s, "mfu": tok_s * fpt / peak}
        )
        print(f"bare loop{' (compiled)' * compiled}, micro-batch {micro}: {tok_s:,.0f} tok/s, MFU {tok_s * fpt / peak:.2%}", flush=True)
    torch.cuda.empty_cache()
    return rows


def split(pack_dir: Path, precision: str, result: Path, steps: int = 40, profiled: int = 5) -> None:
    """Where a tiny bf16 or fp32 step goes, in this process through the trainer's own engine and step: the
    optimizer update's share of the wall time (timed between synchronizations), the kernels a step
    launches, and the GPU's busy share (kernel time per step, from torch's profiler, over the step)."""
    import tempfile

    import torch
    from pretrain import sync
    from torch.profiler import ProfilerActivity, profile

    from model.data import MixtureBatches, TokenSource, sample_order
    from model.network import read_tokenizer
    from model.train import build_engine, setup_distributed, train_step

    device = "cuda" if torch.cuda.is_available() else "cpu"
    job = tiny_job(pack_dir, Path(tempfile.mkdtemp()), precision)
    cfg = job.config
    setup_distributed()
    vocab_size, special = read_tokenizer(Path(job.tokenizer_dir))
    engine, _ = build_engine(job, 1, vocab_size, special, None, False)
    order = sample_order(list(cfg.samples.values()), cfg.seed, cfg.index)
    sources = [TokenSource(Path(job.sources[n])) for n in cfg.samples]
    data = MixtureBatches(sources, order, cfg.seq_len, cfg.micro_batch_size, cfg.batch_size)
    in_update, update = [0.0], engine.step

    def timed_update():
        sync(device)
        begun = time.perf_counter()
        update()
        sync(device)
        in_update[0] += time.perf_counter() - begun

    engine.step = timed_update
    steps_run = iter(range(data.steps))

    def train(n: int) -> None:
        for _ in range(n):
            train_step(engine, data.micro_batches(next(steps_run), 0, 1), cfg, lambda loss: False)
        sync(device)

    train(5)  # warm-up: first kernel launches and allocations
    in_update[0], begun = 0.0, time.perf_counter()
    train(steps)
    step_s = (time.perf_counter() - begun) / steps
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
        train(profiled)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / profiled
    figures = {
        "precision": precision,
        "step_s": step_s,
        "update_share": in_update[0] / steps / step_s,
        "kernels_per_step": len(kernels) / profiled,
        "kernel_s_per_step": kernel_s,
        "gpu_busy": kernel_s / step_s,
    }
    print(f"split {precision}: {json.dumps(figures)}", flush=True)
    result.write_text(json.dumps(figures))


def scale_job(pack_dir: Path, out: Path, recipe, layers: int, seq_len: int, batch: int, steps: int, peak: float):
    """The real recipe's architecture cut to `layers` layers, trained from scratch in bf16 on the packed tokens
    (the real vocabulary's embedding size; the tokens come from the tiny tokenizer), `steps` steps and no
    checkpoint: a throughput probe at sizes where matmuls dominate. Every update is applied (spike policy warn)."""
    from infra.recipe import CheckpointCfg, SpikeCfg
    from model.config import Schedule, TrainJob

    shares = TrainJob.model_validate_json((pack_dir / "cpu-job.json").read_text()).config.samples
    windows = batch * (steps + 1)
    samples = {name: max(1, -(-windows * n // sum(shares.values()))) for name, n in shares.items()}
    lr = recipe.pretrain.optimizer.lr
    job = tiny_job(
        pack_dir,
        out,
        "bf16",
        model=recipe.model.model_copy(update={"num_hidden_layers": layers}),
        samples=samples,
        seq_len=seq_len,
        batch_size=batch,
        micro_batch_size=1,
        schedule=Schedule(steps=10 * steps, total=10 * steps, warmup=steps, decay_start=10 * steps, peak=lr, floor=lr),
        checkpoint=CheckpointCfg(every_steps=10**6, every_minutes=10**6),
        spike=SpikeCfg(policy="warn"),
        log_every=2,
        threads=os.cpu_count(),
        peak_flops=peak,
    )
    return job.model_copy(update={"stop_after_steps": steps})


def scale(pack_dir: Path, out: Path, recipe_path: Path, depths: list[int], seq_len: int | None, batch: int, steps: int) -> None:
    """On the GPU machine: the tiny step's time split in bf16 and fp32, then the trainer at the real recipe's
    width and growing depth. gpu-scale.json is rewritten after each run, so a run cut short keeps what it had."""
    import subprocess

    from infra.recipe import load_recipe
    from model.network import model_config
    from model.plan import count_params, flops_per_token, measure_peak_flops

    pack_dir, out = pack_dir.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device_name(), "peak_bf16": measure_peak_flops("bf16"), "split": {}, "scale": []}
    save = lambda: (out / "gpu-scale.json").write_text(json.dumps(result, indent=1))  # noqa: E731
    for precision in ("bf16", "fp32"):
        figures = out / f"split-{precision}.json"
        code = subprocess.run([sys.executable, __file__, "split", str(pack_dir), precision, str(figures)]).returncode
        result["split"][precision] = json.loads(figures.read_text()) if code == 0 else {"exit": code}
        figures.unlink(missing_ok=True)
        save()
    recipe = load_recipe(recipe_path)
    seq_len = seq_len or recipe.pretrain.seq_len
    vocab = tiny_vocab(pack_dir)  # unless the recipe sets one
    result |= {"recipe": str(recipe_path.relative_to(REPO)), "seq_len": seq_len, "batch": batch, "micro_batch": 1, "steps": steps}
    for layers in depths:
        job = scale_job(pack_dir, out / f"scale-{layers}", recipe, layers, seq_len, batch, steps, result["peak_bf16"])
        shape = model_config(job.config.model, vocab, seq_len)
        lines: list[str] = []
        code = launch(job, lambda line, lines=lines: (lines.append(line), print(line, flush=True)))
        rows = [json.loads(line) for line in (out / f"scale-{layers}" / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
        steady = rows[1:] or rows
        entry = {"layers": layers, "params": count_params(shape), "flops_per_token": flops_per_token(shape, seq_len), "exit": code}
        if steady:
            entry |= {
                "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
                "mfu": sum(r["mfu"] for r in steady) / len(steady),
                "step_s": sum(r["step_s"] for r in steady) / len(steady),
                "gpu_memory_gib": max(r.get("gpu_memory_gib", 0.0) for r in rows),
                "losses": [r["loss"] for r in rows],
            }
        else:
            entry["error"] = next((line for line in reversed(lines) if "OutOfMemoryError" in line or "out of memory" in line), lines[-1:])
        shutil.rmtree(out / f"scale-{layers}")
        result["scale"].append(entry)
        save()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def run(pack_dir: Path, out: Path) -> None:
    import torch

    from model.plan import measure_peak_flops

    pack_dir, out = pack_dir.resolve(), out.resolve()
    device = torch.cuda.get_device_name()
    peaks = {p: measure_peak_flops(p) for p in ("bf16", "fp32")}
    print(f"{device}: measured matmul peak bf16 {peaks['bf16'] / 1e12:.0f} TFLOP/s, fp32 {peaks['fp32'] / 1e12:.0f} TFLOP/s", flush=True)
    result = {
        "device": device,
        "torch": torch.__version__,
        "params": tiny_params(pack_dir),
        "peaks": peaks,
        "cpu": record(pack_dir, prefix="cpu-")
        | {"peak_method": json.loads((pack_dir / "cpu-peak_flops.json").read_text())},  # per thread count
        "cpu_config": json.loads((pack_dir / "cpu-job.json").read_text())["config"],
        "trainer": {p: trainer(pack_dir, out / f"trainer-{p}", p) for p in ("bf16", "fp32")},
        "bare_bf16": sweep(pack_dir, peaks["bf16"]),
    }
    for p in ("bf16", "fp32"):
        shutil.rmtree(out / f"trainer-{p}")  # checkpoints: nothing to bring back
    (out / "gpu.json").write_text(json.dumps(result, indent=1))  # kept if the compiled sweep fails or runs out of time
    try:
        result["bare_bf16_compiled"] = sweep(pack_dir, peaks["bf16"], compiled=True)
    except Exception as error:  # noqa: BLE001 - a failed compile is a finding, not a lost run
        result["bare_bf16_compiled"] = {"error": f"{type(error).__name__}: {error}"[:500]}
    (out / "gpu.json").write_text(json.dumps(result, indent=1))
    print(doc(result))


def doc(r: dict, scale: dict | None = None) -> str:
    cfg, cpu, t = r["cpu_config"], r["cpu"], r["trainer"]
    bare16 = next(row for row in r["bare_bf16"] if row["micro_batch"] == cfg["micro_batch_size"])
    compiled = r.get("bare_bf16_compiled")
    lines = [
        "# The tiny recipe's phase 1 on a GPU",
        "",
        "Generated by `bench/gpu.py` (its docstring says how to rerun it): the real trainer (`model/train.py` under",
        f"DeepSpeed, ZeRO {cfg['zero_stage']}) trains phase 1 of `configs/tiny.yaml` from scratch on the curated tokens of a",
        f"demo run: {cfg['schedule']['steps']} steps of {cfg['batch_size']} x {cfg['seq_len']} tokens, micro-batch "
        f"{cfg['micro_batch_size']}, on one {r['device']} (torch {r['torch']}).",
        "MFU is against the card's own measured dense matmul peak in the run's precision (8192^3 products on",
        f"random data, median of 10): bf16 {r['peaks']['bf16'] / 1e12:.0f} TFLOP/s, fp32 {r['peaks']['fp32'] / 1e12:.0f} TFLOP/s.",
        "Steady figures leave out the first log window (start-up).",
        "",
        "| run | tokens/s | MFU | final loss | checkpoint saves (s) |",
        "|---|---:|---:|---:|---:|",
        f"| CPU, fp32, {cfg['threads']} threads (the demo run) | {cpu['tokens_per_s']:,.0f} | {cpu['mfu']:.1%} | "
        f"{cpu['final_loss']:.3f} | {cpu['checkpoint_seconds']:.1f} |",
    ]
    for p, row in t.items():
        figures = f"{row['tokens_per_s']:,.0f} | {row['mfu']:.2%} | {row['final_loss']:.3f} | {row['checkpoint_seconds']:.1f}"
        lines.append(f"| GPU, {p}, trainer | {figures} |")
    lines += [
        "",
        f"CPU MFU is against that machine's fp32 probe ({cpu['peak_method'][str(cfg['threads'])]['method']}).",
        f"GPU bf16 / CPU tokens/s: {t['bf16']['tokens_per_s'] / cpu['tokens_per_s']:.1f}x; bf16 / fp32 on the GPU: "
        f"{t['bf16']['tokens_per_s'] / t['fp32']['tokens_per_s']:.2f}x; the bf16 trainer / a bare PyTorch loop (bf16 autocast) on the "
        f"same micro-batch: {t['bf16']['tokens_per_s'] / bare16['tokens_per_s']:.2f}x. Final losses (the last log window) agree with the "
        f"CPU run's within {max(abs(t[p]['final_loss'] - cpu['final_loss']) for p in t):.2f}: the same batches, the same schedule.",
        "",
        f"A {r['params'] / 1e6:.1f}M-parameter model cannot fill the card: a step is a thousand kernels or more of a few microseconds each",
        "(counted below), so the GPU waits on Python and kernel launches. The bare loop at growing micro-batches (bf16 autocast, one",
        "micro-batch per step) shows MFU growing with the work per launch:",
        "",
        "| micro-batch | tokens/step | tokens/s | MFU | compiled: tokens/s | compiled: MFU |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {row['micro_batch']} | {row['tokens_per_step']:,} | {row['tokens_per_s']:,.0f} | {row['mfu']:.2%} | "
            + (f"{fast['tokens_per_s']:,.0f} | {fast['mfu']:.2%} |" if fast else "| |")
            for row, fast in zip(r["bare_bf16"], compiled if isinstance(compiled, list) else [None] * len(r["bare_bf16"]))
        ),
        "",
    ]
    if isinstance(compiled, list):
        gain = next(row for row in compiled if row["micro_batch"] == bare16["micro_batch"])["tokens_per_s"] / bare16["tokens_per_s"]
        lines += [
            "Compiled: the same loop with its model through `torch.compile` (default mode), its first steps (the compile)",
            f"left out: {gain:.1f}x the eager loop at the recipe's micro-batch. The trainer does not compile its model.",
            "",
        ]
    elif compiled:
        lines += [f"`torch.compile` of the loop failed on this machine: {compiled['error']}", ""]
    return "\n".join(lines + (scale_doc(scale) if scale else []))


DATASHEET_BF16 = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12}  # dense bf16 tensor-core FLOP/s, SXM


def scale_doc(c: dict) -> list[str]:
    """The sections from gpu-scale.json: where a tiny step's time goes, and the trainer at the real sizes."""
    split, biggest = c["split"], c["scale"][-1]
    mfus = [e["mfu"] for e in c["scale"] if "mfu" in e] or [math.nan]
    kernels = split["bf16"].get("kernels_per_step", math.nan) / split["fp32"].get("kernels_per_step", math.nan)
    sheet = DATASHEET_BF16.get(c["device"])
    lines = [
        "",
        f"## Where a tiny step goes ({c['device']}, the same trainer's engine and step, in-process)",
        "",
        "| precision | step (ms) | optimizer update | kernels per step | GPU busy |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {p} | {f['step_s'] * 1e3:.1f} | {f['update_share']:.0%} | {f['kernels_per_step']:,.0f} | {f['gpu_busy']:.0%} |"
            for p, f in split.items()
        ),
        "",
        "The update's share is timed between synchronizations; kernels and their time come from torch's profiler;",
        f"GPU busy is kernel time over the step's wall time. bf16 launches {kernels:.1f}x the kernels of fp32 for the same",
        "few milliseconds of GPU work (DeepSpeed's bf16 path: casts, and the fp32 master weights it updates and copies",
        "back; not broken down further), so on a model this small bf16 is slower: the card is idle most of each step.",
        "",
        f"## The trainer at the real recipe's sizes ({c['device']}, bf16)",
        "",
        f"`bench/gpu.py scale`: `{c['recipe']}`'s architecture (width, heads, NoPE layers, vocabulary size) cut to",
        f"fewer layers, trained from scratch by the same trainer and launcher: {c['steps']} steps of {c['batch']} x "
        f"{c['seq_len']} tokens in micro-batches of {c['micro_batch']}, ZeRO 0, no checkpoint. MFU is against this card's measured",
        f"bf16 matmul peak ({c['peak_bf16'] / 1e12:.0f} TFLOP/s), with FLOPs per token = 6 x parameters + 6 x layers x seq x width",
        "(the attention scores counted in full, causal masking ignored); steady windows leave out the first.",
        "",
        "| layers | parameters | tokens/s | step (s) | MFU | GPU memory (GiB) |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {e['layers']} | {e['params'] / 1e9:.2f}B | {e['tokens_per_s']:,.0f} | {e['step_s']:.2f} | {e['mfu']:.1%} | "
            f"{e['gpu_memory_gib']:.1f} |"
            if "mfu" in e
            else f"| {e['layers']} | {e['params'] / 1e9:.2f}B | failed: {e.get('error')} | | | |"
            for e in c["scale"]
        ),
        "",
    ]
    if "mfu" in biggest and sheet:
        lines += [
            f"Against the datasheet's dense bf16 peak ({sheet / 1e12:.0f} TFLOP/s) the {biggest['params'] / 1e9:.1f}B run's MFU is "
            f"{biggest['tokens_per_s'] * biggest['flops_per_token'] / sheet:.1%}; the trainer prints the measured one, which a",
            "user can check on their own card.",
            "",
        ]
    lines += [
        "What to take from it: the tiny recipe is sized for a 2-core CPU, where it runs at a large share of the",
        "machine's peak; on a GPU it is launch-bound and its MFU says nothing about the trainer. At the real",
        f"recipe's sizes matmuls dominate and the same trainer holds {min(mfus):.0%} to {max(mfus):.0%} of the card's measured bf16 peak.",
        f"The full {biggest['params'] / 1e9:.1f}B at ZeRO 0 needs {biggest.get('gpu_memory_gib', float('nan')):.0f} GiB on one card "
        "(bf16 weights and",
        "gradients, fp32 master weights and Adam moments, activations without recomputation): more ranks with ZeRO,",
        "as `smolflow plan` sizes them, leave room for longer micro-batches.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="copy a trained phase's job, tokenizer, tokens and CPU figures out of its run")
    p.add_argument("step", type=Path, help="the phase as its run links it, e.g. runs/tiny/pretrain_phase1")
    p.add_argument("dest", type=Path)
    r = sub.add_parser("run", help="on the GPU machine: peaks, the trainer in bf16 and fp32, the bare-loop sweep")
    r.add_argument("pack_dir", type=Path)
    r.add_argument("out", type=Path)
    c = sub.add_parser("scale", help="on the GPU machine: the tiny step's time split, then the trainer at the real recipe's sizes")
    c.add_argument("pack_dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--recipe", type=Path, default=REPO / "configs" / "smollm3-3b.yaml", help="whose architecture and sequence length")
    c.add_argument("--depths", type=int, nargs="+", default=[9, 18, 36], help="layer counts to train (the 3B has 36)")
    c.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the recipe's)")
    c.add_argument("--batch", type=int, default=8, help="sequences per step (micro-batches of one)")
    c.add_argument("--steps", type=int, default=8)
    t = sub.add_parser("split", help="(called by scale) one precision's step split, written to RESULT")
    t.add_argument("pack_dir", type=Path)
    t.add_argument("precision", choices=["bf16", "fp32"])
    t.add_argument("result", type=Path)
    d = sub.add_parser("doc", help="the markdown page for docs/ from a run's gpu.json (and gpu-scale.json beside it)")
    d.add_argument("result", type=Path)
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.step, args.dest)
    elif args.command == "run":
        run(args.pack_dir, args.out)
    elif args.command == "scale":
        scale(args.pack_dir, args.out, args.recipe.resolve(), args.depths, args.seq_len, args.batch, args.steps)
    elif args.command == "split":
        split(args.pack_dir.resolve(), args.precision, args.result)
    else:
        beside = args.result.with_name("gpu-scale.json")
        print(doc(json.loads(args.result.read_text()), json.loads(beside.read_text()) if beside.exists() else None))


if __name__ == "__main__":
    main()
