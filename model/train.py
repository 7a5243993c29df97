"""The pretraining loop: one stage of SmolLM3 pretraining under `deepspeed.initialize`.

Run as its own process(es) by a launcher (`python -m model.train JOB.json`, torchrun or the
deepspeed launcher); the Prefect task that starts it streams its output. A stage resumes from its
newest complete checkpoint; its batches are a pure function of the step (model/data.py), and the
RNG state and step travel in the checkpoint, so a killed and resumed run logs the same losses as
one that was never interrupted.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from infra.recipe import ModelCfg, PretrainCfg, S3Cfg
from infra.storage import Mirror
from model.checkpoint import MARKER, CheckpointStore, tag_for, weights_only_engine
from model.data import IGNORE, MixtureBatches, TokenSource, flatten, plan_stage
from model.network import build_model, flops_per_token, long_context_config, model_config, param_groups, with_yarn


class TrainJob(BaseModel):
    """Everything one stage's trainer needs; written by the Prefect task as JSON (no secrets in it)."""

    model_config = ConfigDict(extra="forbid")

    run_name: str  # the recipe's name: the tracking project
    stage_index: int
    seed: int
    model: ModelCfg
    pretrain: PretrainCfg
    sources: dict[str, str]  # source name -> folder of .ds files
    samples: dict[str, int]  # source name -> seq_len windows this stage draws from it
    tokenizer_dir: str
    out_dir: str  # the stage's step folder: final HF model, metrics, summary
    checkpoint_dir: str
    init_from: str | None = None  # previous stage's checkpoint root (main stage) or final model (long context)
    init_remote: str | None = None  # the previous stage's checkpoints on the mirror
    remote_name: str = ""  # this stage's checkpoints on the mirror
    step_offset: int = 0  # optimizer steps of the main stages before this one (the schedule is global)
    total_main_steps: int = 1
    last_stage: bool = False
    mirror: str | None = None  # s3:// prefix for checkpoints; credentials come from the environment
    s3_endpoint: str | None = None
    s3_region: str | None = None
    peak_flops: float | None = None  # per rank; measured with a matmul probe when None
    stop_after_steps: int | None = None  # testing and drills: exit after this many steps of this run
    hold_unevaluated: int = 0  # checkpoints kept past keep_last until the evaluator has scored them

    @property
    def stage(self):
        return self.pretrain.stages[self.stage_index]


def wsd_lr(step: int, total: int, opt) -> float:
    """Warmup-stable-decay: linear warmup, constant, then linear decay over the last `decay_fraction`."""
    peak, floor = opt.lr, opt.lr * opt.min_lr_ratio
    if step < opt.warmup_steps:
        return peak * (step + 1) / opt.warmup_steps
    decay_start = total - int(total * opt.decay_fraction)
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
    return peak + (floor - peak) * progress


def stage_lr(job: TrainJob, global_step: int) -> float:
    opt = job.pretrain.optimizer
    if job.stage.long_context:
        return job.stage.lr or opt.lr * max(opt.min_lr_ratio, 0.1)
    return wsd_lr(global_step, job.total_main_steps, opt)


def die_with_parent() -> None:
    """Exit when the launcher dies, so no rank outlives a cancelled or killed task (Linux prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent is already gone
        sys.exit(1)


def setup_distributed() -> tuple[int, int]:
    """Default to a one-rank group (DeepSpeed would otherwise try MPI discovery) and start it."""
    import deepspeed

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29511")
    if not torch.cuda.is_available():
        # the shared-memory allreduce op is compiled with g++ on first use (minutes); gloo needs none of it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def measure_peak_flops(seconds: float = 1.5, n: int = 1024) -> float:
    """Achieved fp32 matmul FLOP/s of this process (the MFU denominator on a CPU): the best of several
    short probes, so that a moment of contention from other processes does not lower it."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(5):
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            a @ b
            done += 1
        best = max(best, 2 * n**3 * done / (time.perf_counter() - start))
    return best


def ds_config(job: TrainJob, micro_batch: int) -> dict[str, Any]:
    p = job.pretrain
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "gradient_clipping": p.optimizer.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": p.precision == "bf16"},
        # a torch AdamW instead of DeepSpeed's (whose CPU build compiles FusedAdam for a minute)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy (labels -100 ignored) plus the optional z-loss; returns (total, ce)."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    mask = targets != IGNORE
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)
    if z_loss == 0:
        return ce, ce
    lse = torch.logsumexp(logits, dim=-1)[mask]
    return ce + z_loss * (lse**2).mean(), ce


class Tracker:
    """metrics.jsonl in the stage folder (the record) and trackio (the dashboard) on rank 0."""

    def __init__(self, job: TrainJob, rank: int, config: dict):
        self.enabled = rank == 0
        self.path = Path(job.out_dir) / "metrics.jsonl"
        self.run = None
        if self.enabled and job.pretrain.tracking == "trackio":
            try:
                import trackio  # its folder comes from TRACKIO_DIR, set by the launching task

                self.run = trackio.init(
                    project=f"smolflow-{job.run_name}",
                    name=job.stage.name,
                    config=config,
                    resume="allow",
                    auto_log_cpu=False,
                    auto_log_gpu=False,
                )
            except Exception as err:  # the dashboard is optional; metrics.jsonl is not
                print(f"warning: trackio unavailable ({err}); metrics go to {self.path} only", flush=True)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.run is not None:
            import trackio

            trackio.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=metrics["step"])

    def finish(self) -> None:
        if self.run is not None:
            import trackio

            trackio.finish()


def load_sources(job: TrainJob) -> tuple[list[TokenSource], list[int]]:
    names = list(job.stage.mixture)
    return [TokenSource(Path(job.sources[n])) for n in names], [job.samples[n] for n in names]


def initial_model(job: TrainJob, vocab_size: int, special_ids: dict[str, int], init_tag: str | None):
    """Fresh weights for stage 1; the previous stage's config for later main stages (its DeepSpeed
    checkpoint is loaded after initialize); the previous weights with raised RoPE theta for long context."""
    from transformers import AutoConfig, AutoModelForCausalLM

    seq_len = job.pretrain.stage_seq_len(job.stage)
    if job.init_from is None:
        config = model_config(job.model, vocab_size, seq_len, special_ids=special_ids)
        return build_model(config, job.seed)
    if job.stage.long_context:
        previous = AutoConfig.from_pretrained(job.init_from)
        config = long_context_config(previous, seq_len, job.stage.rope_theta)
        model = AutoModelForCausalLM.from_pretrained(job.init_from, config=config, dtype=torch.float32)
        model.config.use_cache = False
        return model
    config = AutoConfig.from_pretrained(Path(job.init_from) / init_tag / "hf")
    return build_model(config, job.seed)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def train(job: TrainJob) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoTokenizer

    die_with_parent()
    torch.set_num_threads(job.pretrain.launcher.threads_per_rank)
    rank, world = setup_distributed()
    p, stage = job.pretrain, job.stage
    seq_len, micro_batch = p.stage_seq_len(stage), p.stage_micro_batch(stage)
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)

    mirror = None
    if job.mirror:
        mirror = Mirror(job.mirror, S3Cfg(endpoint_url=job.s3_endpoint, region=job.s3_region))
    store = CheckpointStore(Path(job.checkpoint_dir), p.checkpoint.keep_last, mirror, job.remote_name, job.hold_unevaluated)
    init_tag = None
    if job.init_from is not None and not stage.long_context:  # the previous main stage's newest checkpoint
        previous = CheckpointStore(Path(job.init_from), p.checkpoint.keep_last, mirror, remote_name=job.init_remote or "")
        init_tag = broadcast(previous.latest() if rank == 0 else None)
        previous.close()
        if init_tag is None:
            raise FileNotFoundError(f"{stage.name}: no complete checkpoint of the previous stage in {job.init_from}")

    latest = broadcast(store.latest() if rank == 0 else None)
    # the checkpoint this run starts from, in DeepSpeed's universal format if it was saved by another rank count
    load_from = (store.root, latest) if latest else (Path(job.init_from), init_tag) if init_tag else None
    universal = load_from is not None and needs_universal(*load_from, world, p.zero_stage)
    if universal:
        load_from = to_universal(*load_from, rank)

    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer_dir)
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    model = initial_model(job, len(tokenizer), special, init_tag)
    optimizer = torch.optim.AdamW(
        param_groups(model, p.optimizer.weight_decay), lr=p.optimizer.lr, betas=p.optimizer.betas, eps=p.optimizer.eps
    )
    config = ds_config(job, micro_batch) | ({"checkpoint": {"load_universal": True}} if universal else {})
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    weights_only_engine(engine)
    if world == 1 and p.zero_stage == 0:
        # one rank: the gradient all-reduce is a copy for nothing (ZeRO still needs it: it partitions there)
        engine.enable_backward_allreduce = False

    sources, samples = load_sources(job)
    data = MixtureBatches(sources, plan_stage(samples, job.seed, job.stage_index), seq_len, micro_batch, p.grad_accum, world)
    step, skip_steps, ema = 0, set(), None
    if latest is not None:
        _, client = engine.load_checkpoint(str(load_from[0]), tag=load_from[1])
        step, skip_steps, ema = client["step"], set(client["skip_steps"]), client["loss_ema"]
        set_rng_state(client["rng"])
        say(f"resumed {stage.name} from checkpoint {latest} (step {step}/{data.steps})")
    elif init_tag is not None:
        engine.load_checkpoint(str(load_from[0]), tag=load_from[1], load_optimizer_states=True)
        say(f"{stage.name}: continuing from {job.init_from}/{init_tag} (weights and optimizer state)")

    flash_attention = engine.module.config._attn_implementation == "flash_attention_2"
    fpt = flops_per_token(engine.module.config, seq_len)
    peak = job.peak_flops or measure_peak_flops()
    tracker = Tracker(job, rank, {"stage": stage.name, **job.pretrain.model_dump(exclude={"stages"})})
    tokens_per_step = data.samples_per_step * seq_len
    say(
        f"{stage.name}: {data.steps} steps x {tokens_per_step:,} tokens, seq {seq_len}, {world} rank(s), "
        f"{sum(q.numel() for q in engine.module.parameters()):,} parameters"
    )

    last_save, window_loss, window_start, window_steps = time.time(), 0.0, time.time(), 0
    stopped_early, save_seconds = False, []
    started_at = step
    while step < data.steps:
        if job.stop_after_steps is not None and step - started_at >= job.stop_after_steps:
            stopped_early = True
            break
        global_step = job.step_offset + step
        lr = stage_lr(job, global_step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss, spiked = 0.0, False
        for batch in data.micro_batches(step, rank):
            if flash_attention:
                batch = flatten(batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p.precision == "bf16" and not torch.cuda.is_available()):
                logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss, ce = lm_loss(logits, batch["labels"], p.optimizer.z_loss)
            value = ce.item()
            step_loss += value / p.grad_accum
            spiked |= ema is not None and step >= p.spike.warmup_steps and value > p.spike.factor * ema
            skip = step in skip_steps or (spiked and p.spike.policy == "skip")
            engine.backward(loss * 0.0 if skip else loss)
            engine.step()
        if spiked:
            say(f"loss spike at step {step}: {step_loss:.3f} vs running mean {ema:.3f} (policy: {p.spike.policy})")
            if p.spike.policy == "rollback" and step not in skip_steps and store.local_tags():
                skip_steps.add(step)
                tag = broadcast(store.latest() if rank == 0 else None)
                _, client = engine.load_checkpoint(str(store.root), tag=tag)
                step, ema = client["step"], client["loss_ema"]
                set_rng_state(client["rng"])
                say(f"rolled back to {tag}; the batch of step {max(skip_steps)} will be skipped")
                continue
        if not (spiked and p.spike.policy != "warn"):
            ema = step_loss if ema is None else 0.95 * ema + 0.05 * step_loss
        step += 1
        window_loss += step_loss
        window_steps += 1
        if step % p.log_every == 0 or step == data.steps:
            elapsed = time.time() - window_start
            tok_s = window_steps * tokens_per_step / max(elapsed, 1e-9)
            grad_norm = engine.get_global_grad_norm()
            metrics = {
                "stage": stage.name,
                "step": step,
                "global_step": job.step_offset + step,
                "tokens": (job.step_offset + step) * tokens_per_step,
                "loss": window_loss / window_steps,
                "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "tokens_per_s": tok_s,
                "mfu": tok_s / world * fpt / peak,
            }
            tracker.log(metrics)
            eta = (data.steps - step) * elapsed / window_steps
            say(
                f"[{stage.name}] step {step}/{data.steps} | loss {metrics['loss']:.4f} | lr {lr:.2e} | "
                f"{tok_s:,.0f} tok/s | MFU {metrics['mfu']:.1%} | eta {eta:.0f}s"
            )
            window_loss, window_steps, window_start = 0.0, 0, time.time()
        due = step % p.checkpoint.every_steps == 0 or time.time() - last_save > p.checkpoint.every_minutes * 60
        if due or step == data.steps:
            begun = time.time()
            position = {"stage": stage.name, "tokens": (job.step_offset + step) * tokens_per_step}
            save(engine, store, step, {"skip_steps": sorted(skip_steps), "loss_ema": ema}, position, rank, tokenizer)
            last_save = time.time()
            save_seconds.append(last_save - begun)

    failed_uploads = store.close() if rank == 0 else []
    summary = {
        "stage": stage.name,
        "steps": data.steps,
        "tokens": data.steps * tokens_per_step,
        "final_loss": ema,
        "seq_len": seq_len,
        "stopped_early": stopped_early,
        "failed_uploads": failed_uploads,
        "checkpoint_seconds": round(sum(save_seconds) / len(save_seconds), 3) if save_seconds else None,
    }
    if rank == 0 and not stopped_early:
        export_final(engine, tokenizer, Path(job.out_dir) / "final", job)
        (Path(job.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    tracker.finish()
    dist.barrier()
    return summary


def needs_universal(root: Path, tag: str, world: int, zero_stage: int) -> bool:
    """ZeRO shards saved by a different number of ranks cannot be loaded as they are."""
    saved = json.loads((Path(root) / tag / MARKER).read_text()).get("world_size", world)
    return zero_stage > 0 and saved != world


def to_universal(root: Path, tag: str, rank: int) -> tuple[Path, str]:
    """Convert ROOT/TAG with DeepSpeed's ds_to_universal (once, on rank 0) into ROOT/.universal/TAG."""
    import torch.distributed as dist

    target = Path(root) / ".universal"
    if rank == 0 and not (target / tag / "zero").exists():
        staging = target / f".{tag}"
        shutil.rmtree(staging, ignore_errors=True)
        print(f"converting {tag} to a universal checkpoint (saved by another number of ranks)", flush=True)
        command = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(Path(root) / tag),
            "--output_folder",
            str(staging),
            "--inject_missing_state",
        ]
        subprocess.run(command, check=True)
        shutil.rmtree(target / tag, ignore_errors=True)
        os.replace(staging, target / tag)
    dist.barrier()
    return target, tag


def broadcast(value):
    """Rank 0's value on every rank (file-system decisions are made once, on rank 0)."""
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save(engine, store: CheckpointStore, step: int, extra: dict[str, Any], position: dict[str, Any], rank: int, tokenizer) -> None:
    """Save every rank's shards plus an HF export; `position` (stage, tokens seen) goes into the marker for eval plots."""
    import torch.distributed as dist

    tag = tag_for(step)
    client = {"step": step, "rng": rng_state(), **extra}
    engine.save_checkpoint(str(store.tmp_dir()), tag=tag, client_state=client, save_latest=False)
    dist.barrier()
    if rank == 0:
        hf = store.tmp_dir() / tag / "hf"
        engine.module.save_pretrained(hf, safe_serialization=True)
        tokenizer.save_pretrained(hf)
        store.commit(tag, step, {"world_size": dist.get_world_size(), **position})
    dist.barrier()


def export_final(engine, tokenizer, out: Path, job: TrainJob) -> None:
    """The stage's output: a plain HF checkpoint (safetensors + config + tokenizer)."""
    model = engine.module
    model.config.use_cache = True
    if job.last_stage and job.pretrain.yarn_factor:
        model.config = with_yarn(model.config, job.pretrain.yarn_factor)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train one pretraining stage (a job file written by smolflow).")
    parser.add_argument("job", type=Path, help="the stage's job.json")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (LOCAL_RANK is used)")
    args = parser.parse_args()
    train(TrainJob.model_validate_json(args.job.read_text()))


if __name__ == "__main__":
    main()
