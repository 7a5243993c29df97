"""The pretraining loop: one phase of SmolLM3 pretraining under `deepspeed.initialize`.

Run as its own process(es) by a launcher (`python -m model.train JOB.json`, torchrun or the
deepspeed launcher); the Prefect task that starts it streams its output. A phase resumes from its
newest complete checkpoint; its batches are a pure function of the step (model/data.py), and the
RNG state and step travel in the checkpoint, so a killed and resumed run logs the same losses as
one that was never interrupted, on any number of ranks (the global batch is fixed by the config).

The job carries resolved values (the learning-rate schedule, sample counts, paths), not the
recipe: `TrainConfig` is exactly what the pipeline's step for this phase hashes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from infra.env import skip_deepspeed_shm_build, thread_count
from infra.errors import DiskFull, SmolflowError
from infra.launch import mark_disk_full
from infra.procs import PREEMPTED, PREEMPTED_MARK, die_with_parent, exit_without_teardown, watch_owner
from infra.recipe import S3Cfg, SpikeCfg
from infra.steps import FINAL, METRICS, PHASE_SUMMARY
from infra.storage import Mirror
from infra.summaries import PhaseSummary
from model.checkpoint import MARKER, CheckpointStore, MirrorBehind, tag_for, verify, weights_only_engine
from model.config import TrainConfig, TrainJob
from model.data import IGNORE, MixtureBatches, TokenSource, sample_order
from model.network import (
    build_model,
    load_config,
    load_model,
    long_context_config,
    model_config,
    param_groups,
    read_tokenizer,
    save_pretrained,
    with_yarn,
)
from model.plan import flops_per_token, measure_peak_flops

# --- process and engine -------------------------------------------------------------------------


UPLOAD_WAIT_S = 300  # at a phase's end, how long checkpoint uploads failing in an outage are retried before it ends without them


class Preemption:
    """Set by SIGTERM (a cancel, Slurm's preemption) or SIGUSR1 (Slurm's warning before the time limit):
    the loop finishes its step, every rank agrees, saves a checkpoint and exits with PREEMPTED."""

    def __init__(self):
        self.why = ""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._set)

    def _set(self, signum, frame) -> None:
        self.why = f"received {signal.Signals(signum).name}"

    def is_set(self) -> bool:
        return bool(self.why)


def setup_distributed() -> tuple[int, int]:
    """Start the process group; a lone rank uses an in-memory store, so nothing listens beyond loopback
    (and DeepSpeed, finding the group started, skips its MPI discovery)."""
    import deepspeed

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    skip_deepspeed_shm_build()
    if not torch.distributed.is_initialized() and os.environ["WORLD_SIZE"] == "1":
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def grad_accum(cfg: TrainConfig, world: int) -> int:
    """Micro-batches per rank and step: the global batch is fixed, the rank count is not."""
    per_pass = cfg.micro_batch_size * world
    if cfg.batch_size % per_pass:
        raise ValueError(
            f"{cfg.phase}: batch_size {cfg.batch_size} is not a multiple of micro_batch_size {cfg.micro_batch_size} x {world} rank(s)"
        )
    return cfg.batch_size // per_pass


def ds_config(cfg: TrainConfig, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": grad_accum(cfg, world),
        # the loop owns the optimizer step: a skipped batch then never reaches the optimizer
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.precision == "bf16"},
        # a torch AdamW instead of DeepSpeed's (whose CPU build compiles FusedAdam for a minute)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def initial_model(job: TrainJob, vocab_size: int, special_ids: dict[str, int], init_tag: str | None):
    """Fresh weights for phase 1; the previous phase's config for later main phases (its DeepSpeed
    checkpoint is loaded after initialize); the previous weights with raised RoPE theta for long context."""
    cfg = job.config
    if job.init_from is None:
        return build_model(model_config(cfg.model, vocab_size, cfg.seq_len, special_ids=special_ids), cfg.seed)
    if cfg.long_context:
        return load_model(job.init_from, long_context_config(load_config(job.init_from), cfg.seq_len, cfg.rope_theta))
    return build_model(load_config(Path(job.init_from) / init_tag / "hf"), cfg.seed)


def build_engine(job: TrainJob, world: int, vocab_size: int, special_ids: dict[str, int], init_tag: str | None, universal: bool):
    import deepspeed

    cfg = job.config
    model = initial_model(job, vocab_size, special_ids, init_tag)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.schedule.peak, betas=cfg.betas, eps=cfg.eps)
    config = ds_config(cfg, world) | ({"checkpoint": {"load_universal": True}} if universal else {})
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    weights_only_engine(engine)
    if world == 1 and cfg.zero_stage == 0:
        # one rank: the gradient all-reduce is a copy for nothing (ZeRO still needs it: it partitions there)
        engine.enable_backward_allreduce = False
    return engine, optimizer


# --- one step ---------------------------------------------------------------------------------


class _LMLoss(torch.autograd.Function):
    """Cross-entropy and z-loss from one log-sum-exp per position, and a backward that writes the
    gradient once: softmax x d(loss)/d(lse), minus the target's share. F.cross_entropy plus a separate
    logsumexp made ~8 passes over the logits (16 x 256 x 4,096 floats in the tiny recipe), a third of a
    CPU step's time; this makes ~3 (bench/pretrain.py measures the trainer against the same loss)."""

    @staticmethod
    def forward(ctx, logits, targets, z_loss):
        mask = targets != IGNORE
        n = mask.sum().clamp(min=1)
        lse = torch.logsumexp(logits, dim=-1)
        index = targets.clamp(min=0).unsqueeze(-1)
        ce = ((lse - logits.gather(-1, index).squeeze(-1)) * mask).sum() / n
        total = ce + z_loss * (lse.square() * mask).sum() / n
        ctx.save_for_backward(logits, lse, index, mask.to(logits.dtype) / n)
        ctx.z_loss = z_loss
        return total, ce.detach()

    @staticmethod
    def backward(ctx, grad, _):
        logits, lse, index, weight = ctx.saved_tensors
        weight = weight * grad  # d(total)/d(ce term) per position
        out = (logits - lse.unsqueeze(-1)).exp_().mul_((weight * (1 + 2 * ctx.z_loss * lse)).unsqueeze(-1))
        return out.scatter_add_(-1, index, -weight.unsqueeze(-1)), None, None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy (labels -100 ignored) plus the optional z-loss; returns (total, ce).
    The labels shift, not the logits: slicing the logits would copy them, and their gradient, once more."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return _LMLoss.apply(logits.float(), targets, z_loss)


@dataclass
class SpikeGuard:
    """Decides, batch by batch and before its backward, whether a step's update must be dropped.

    A non-finite loss always is (its gradients would poison the weights); a spike (loss above
    `factor` x its running mean) is for the `skip` and `rollback` policies; `warn` only logs it.
    """

    cfg: SpikeCfg
    ema: float | None = None
    skip_steps: set[int] = field(default_factory=set)  # steps a rollback decided never to train on

    def spiked(self, step: int, loss: float) -> bool:
        return self.ema is not None and step >= self.cfg.warmup_steps and loss > self.cfg.factor * self.ema

    def drop(self, step: int, loss: float) -> bool:
        return not math.isfinite(loss) or step in self.skip_steps or (self.cfg.policy != "warn" and self.spiked(step, loss))

    def update(self, loss: float) -> None:
        self.ema = loss if self.ema is None else 0.95 * self.ema + 0.05 * loss


def agree(value: float, op) -> float:
    """The same number on every rank (a sum or max over ranks), so every rank takes the same decision."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")  # NCCL reduces GPU tensors only
    dist.all_reduce(t, op=op)
    return float(t.item())


def train_step(engine, batches: list[dict[str, torch.Tensor]], cfg: TrainConfig, drop) -> tuple[float, bool, float]:
    """Forward and backward this rank's micro-batches, then one optimizer update unless `drop(loss)` says
    a batch must not be trained on (on any rank): then no backward of it, gradients discarded, and the
    optimizer not called at all (no moment, weight-decay or step-count change).
    Returns (mean loss, dropped, gradient norm before clipping; NaN when dropped)."""
    import torch.distributed as dist

    bf16 = cfg.precision == "bf16" and not torch.cuda.is_available()
    losses, dropped = [], False
    for batch in batches:
        batch = {key: value.to(engine.device) for key, value in batch.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss, ce = lm_loss(logits, batch["labels"], cfg.z_loss)
        losses.append(ce.item())
        if drop(losses[-1]) or not math.isfinite(loss.item()):
            dropped = True
            break
        engine.backward(loss)
    dropped = agree(float(dropped), dist.ReduceOp.MAX) > 0
    mean = agree(sum(losses) / len(losses), dist.ReduceOp.SUM) / dist.get_world_size()
    if dropped:
        engine.optimizer.zero_grad() if engine.zero_optimization() or cfg.precision == "bf16" else engine.zero_grad()
        return mean, dropped, math.nan
    # DeepSpeed's ZeRO and bf16 optimizers record the norm they clip by; its plain fp32 path clips without
    # keeping it, so there it is taken here, from the gradients already averaged across ranks
    recorded = engine.zero_optimization() or cfg.precision == "bf16"
    own = None if recorded else torch.nn.utils.get_total_norm([q.grad for q in engine.module.parameters() if q.grad is not None])
    engine.step()
    norm = engine.get_global_grad_norm() if recorded else own
    return mean, dropped, math.nan if norm is None else float(norm)


# --- the phase ----------------------------------------------------------------------------------


class Tracker:
    """metrics.jsonl in the phase folder (the record) and trackio (the dashboard) on rank 0."""

    def __init__(self, job: TrainJob, rank: int):
        cfg = job.config
        self.enabled = rank == 0
        self.path = Path(job.out_dir) / METRICS
        self.run = None
        if self.enabled and cfg.tracking == "trackio":
            try:
                import trackio  # its folder comes from TRACKIO_DIR, set by the launching task

                config = cfg.model_dump(mode="json", exclude={"samples"})
                self.run = trackio.init(
                    project=cfg.project, name=cfg.phase, config=config, resume="allow", auto_log_cpu=False, auto_log_gpu=False
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


@dataclass
class Window:
    """Loss, throughput and the gradient norm since the last log line."""

    started: float = field(default_factory=time.time)
    loss: float = 0.0
    steps: int = 0
    grad_norm: float = math.nan  # of the window's last update (NaN if every batch was dropped)

    def metrics(self, cfg: TrainConfig, step: int, lr: float, tokens_per_step: int, fpt: float, peak: float, world: int) -> dict:
        elapsed = max(time.time() - self.started, 1e-9)
        tok_s = self.steps * tokens_per_step / elapsed
        return {
            "phase": cfg.phase,
            "step": step,
            "global_step": cfg.schedule.offset + step,
            "tokens": (cfg.schedule.offset + step) * tokens_per_step,
            "loss": self.loss / max(self.steps, 1),
            "lr": lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": tok_s,
            "step_s": elapsed / max(self.steps, 1),
            "mfu": tok_s / world * fpt / peak,
            "peak_flops_per_rank": peak,  # the MFU denominator, so a figure can always be checked
            "eta_s": (cfg.schedule.steps - step) * elapsed / max(self.steps, 1),
        } | ({"gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_available() else {})  # the peak so far


def train(job: TrainJob) -> PhaseSummary:
    die_with_parent()
    watch_owner()
    cfg = job.config
    torch.set_num_threads(thread_count(cfg.threads))  # this node's cores: a Slurm job's cpuset, not the submitting host's
    rank, world = setup_distributed()
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    store, init_tag, latest, load_from, universal = restore_point(job, rank, world)
    vocab_size, special = read_tokenizer(Path(job.tokenizer_dir))
    engine, optimizer = build_engine(job, world, vocab_size, special, init_tag, universal)
    sources = [TokenSource(Path(job.sources[n])) for n in cfg.samples]
    order = sample_order(list(cfg.samples.values()), cfg.seed, cfg.index)
    data = MixtureBatches(sources, order, cfg.seq_len, cfg.micro_batch_size, cfg.batch_size)
    guard = SpikeGuard(cfg.spike)
    step = load(engine, load_from, guard, optimizer_only=latest is None) if load_from else 0
    say(
        f"resumed {cfg.phase} from checkpoint {latest} (step {step}/{cfg.schedule.steps})"
        if latest
        else f"{cfg.phase}: continuing from {job.init_from}/{init_tag} (weights and optimizer state)"
        if init_tag
        else f"{cfg.phase}: from {job.init_from} (weights only: a fresh optimizer for RoPE theta {cfg.rope_theta:g})"
        if cfg.long_context
        else f"{cfg.phase}: from scratch"
    )
    fpt, peak = flops_per_token(engine.module.config, cfg.seq_len), cfg.peak_flops or measure_peak_flops(cfg.precision)
    tracker, tokens_per_step = Tracker(job, rank), cfg.batch_size * cfg.seq_len
    say(
        f"{cfg.phase}: {cfg.schedule.steps} steps x {tokens_per_step:,} tokens, seq {cfg.seq_len}, {world} rank(s) of "
        f"{torch.get_num_threads()} thread(s) x "
        f"{grad_accum(cfg, world)} micro-batch(es) of {cfg.micro_batch_size}, {sum(q.numel() for q in engine.module.parameters()):,} params"
    )
    window, last_save, saves, first, dropped_steps = Window(), time.time(), [], step, []
    preempted = Preemption()
    while step < cfg.schedule.steps:
        if job.stop_after_steps is not None and step - first >= job.stop_after_steps:
            break
        lr = cfg.schedule.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, dropped, norm = train_step(engine, data.micro_batches(step, rank, world), cfg, lambda value, s=step: guard.drop(s, value))
        if guard.spiked(step, loss) or not math.isfinite(loss):
            say(
                f"loss spike at step {step}: {loss:.3f} vs running mean {guard.ema:.3f} (policy: {cfg.spike.policy}"
                f"{', update dropped' if dropped else ''})"
            )
            if cfg.spike.policy == "rollback" and step not in guard.skip_steps and store.local_tags():
                spiked = step
                step = load(engine, (store.root, broadcast(store.latest() if rank == 0 else None)), guard)
                guard.skip_steps.add(spiked)
                say(f"rolled back to step {step}; the batch of step {spiked} will be skipped")
                continue
        if dropped:
            dropped_steps.append(step)
        else:
            guard.update(loss)
            window.grad_norm = norm
        step += 1
        window.loss, window.steps = window.loss + loss, window.steps + 1
        if step % cfg.log_every == 0 or step == cfg.schedule.steps:
            metrics = window.metrics(cfg, step, lr, tokens_per_step, fpt, peak, world)
            tracker.log(metrics)
            say(
                f"[{cfg.phase}] step {step}/{cfg.schedule.steps} | loss {metrics['loss']:.4f} | lr {lr:.2e} | "
                f"{metrics['tokens_per_s']:,.0f} tok/s | {metrics['step_s']:.2f} s/step | MFU {metrics['mfu']:.1%} | "
                f"eta {metrics['eta_s']:.0f}s"
                + (f" | GPU memory {metrics['gpu_memory_gib']:.1f} GiB" if "gpu_memory_gib" in metrics else "")
            )
            window = Window()
        stopping = agree(float(preempted.is_set()), torch.distributed.ReduceOp.MAX) > 0
        if (
            stopping
            or step % cfg.checkpoint.every_steps == 0
            or time.time() - last_save > cfg.checkpoint.every_minutes * 60
            or step == cfg.schedule.steps
        ):
            begun = time.time()
            position = {"phase": cfg.phase, "tokens": (cfg.schedule.offset + step) * tokens_per_step}
            save(engine, store, step, guard, position, rank, Path(job.tokenizer_dir))
            last_save = time.time()
            saves.append(last_save - begun)
        if stopping and step < cfg.schedule.steps:
            say(f"{cfg.phase}: {preempted.why}: checkpoint {tag_for(step)} saved; exiting for a retry to resume from it")
            if rank == 0:
                store.close()
                (Path(job.out_dir) / PREEMPTED_MARK).write_text(f"{tag_for(step)}: {preempted.why}\n")
            sys.exit(PREEMPTED)
    return finish(job, engine, store, tracker, rank, step, guard, saves, dropped_steps)


def restore_point(job: TrainJob, rank: int, world: int):
    """This phase's checkpoint store, the previous phase's checkpoint to start from, this phase's newest
    checkpoint, and what to load (in DeepSpeed's universal format when saved by another rank count)."""
    cfg = job.config
    mirror = Mirror(job.mirror, S3Cfg(endpoint_url=job.s3_endpoint, region=job.s3_region)) if job.mirror else None
    store = CheckpointStore(Path(job.checkpoint_dir), cfg.checkpoint.keep_last, mirror, job.remote_name, cfg.hold_unevaluated)
    if rank == 0:
        store.clear_staging()
        (Path(job.out_dir) / PREEMPTED_MARK).unlink(missing_ok=True)  # an earlier run's: this one has not been signalled
    init_tag = None
    if job.init_from is not None and not cfg.long_context:  # the previous main phase's newest checkpoint
        previous = CheckpointStore(Path(job.init_from), cfg.checkpoint.keep_last, mirror, remote_name=job.init_remote or "")
        init_tag = broadcast(previous.latest() if rank == 0 else None)
        previous.close()
        if init_tag is None:
            raise FileNotFoundError(f"{cfg.phase}: no complete checkpoint of the previous phase in {job.init_from}")
    latest = broadcast(store.latest() if rank == 0 else None)
    load_from = (store.root, latest) if latest else (Path(job.init_from), init_tag) if init_tag else None
    universal = load_from is not None and needs_universal(*load_from, world, cfg.zero_stage)
    if universal:
        load_from = to_universal(*load_from, rank)
    return store, init_tag, latest, load_from, universal


def load(engine, where: tuple[Path, str], guard: SpikeGuard, optimizer_only: bool = False) -> int:
    """Load weights and optimizer state; unless it is the previous phase's checkpoint (`optimizer_only`),
    also the step, RNG and spike state, returning the step to continue from."""
    _, client = engine.load_checkpoint(str(where[0]), tag=where[1], load_optimizer_states=True)
    if optimizer_only:
        return 0
    guard.skip_steps |= set(client["skip_steps"])
    guard.ema = client["loss_ema"]
    set_rng_state(client["rng"])
    return client["step"]


def finish(job: TrainJob, engine, store, tracker, rank, step, guard, saves, dropped_steps) -> PhaseSummary:
    import torch.distributed as dist

    cfg = job.config
    done = step >= cfg.schedule.steps
    summary = PhaseSummary(
        phase=cfg.phase,
        steps=cfg.schedule.steps,
        tokens=cfg.schedule.steps * cfg.batch_size * cfg.seq_len,
        final_loss=guard.ema,
        seq_len=cfg.seq_len,
        stopped_early=not done,
        dropped_steps=dropped_steps,
        failed_uploads=store.close(wait_s=UPLOAD_WAIT_S) if rank == 0 else [],
        checkpoint_seconds=round(sum(saves) / len(saves), 3) if saves else None,
    )
    if rank == 0 and done:
        export_final(engine, Path(job.tokenizer_dir), Path(job.out_dir) / FINAL, cfg.yarn_factor)
        (Path(job.out_dir) / PHASE_SUMMARY).write_text(summary.model_dump_json(indent=2))
    tracker.finish()
    dist.barrier()
    return summary


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def needs_universal(root: Path, tag: str, world: int, zero_stage: int) -> bool:
    """ZeRO shards saved by a different number of ranks cannot be loaded as they are."""
    saved = json.loads((Path(root) / tag / MARKER).read_text()).get("world_size", world)
    return zero_stage > 0 and saved != world


def to_universal(root: Path, tag: str, rank: int) -> tuple[Path, str]:
    """Convert ROOT/TAG with DeepSpeed's ds_to_universal (once, on rank 0) into ROOT/.universal/TAG."""
    import torch.distributed as dist

    target = Path(root) / ".universal"
    if rank == 0 and not (target / tag / "zero").exists():
        verify(Path(root) / tag)  # the conversion unpickles with weights_only=False: only files this project wrote
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


def save(engine, store: CheckpointStore, step: int, guard: SpikeGuard, position: dict[str, Any], rank: int, tokenizer_dir: Path) -> None:
    """Save every rank's shards plus an HF export; `position` (phase, tokens seen) goes into the marker for eval plots."""
    import torch.distributed as dist

    tag = tag_for(step)
    problem = None
    if rank == 0:
        try:  # about 16 bytes a parameter: fp32 weights, two Adam moments and the HF export
            store.make_room(16 * sum(q.numel() for q in engine.module.parameters()))
        except (DiskFull, MirrorBehind) as err:
            problem = err
    if broadcast(problem is not None):  # every rank stops, or the others would wait in the save
        if problem is not None:
            raise problem  # main says why (rank 0)
        sys.exit(1)
    client = {"step": step, "rng": rng_state(), "skip_steps": sorted(guard.skip_steps), "loss_ema": guard.ema}
    engine.save_checkpoint(str(store.tmp_dir()), tag=tag, client_state=client, save_latest=False)
    dist.barrier()
    if rank == 0:
        hf = store.tmp_dir() / tag / "hf"
        save_pretrained(engine.module, hf, tokenizer_dir)
        store.commit(tag, step, {"world_size": dist.get_world_size(), **position})
    dist.barrier()


def export_final(engine, tokenizer_dir: Path, out: Path, yarn_factor: float | None) -> None:
    """The phase's output: a plain HF checkpoint (safetensors + config + tokenizer)."""
    model = engine.module
    save_pretrained(model, out, tokenizer_dir, with_yarn(model.config, yarn_factor) if yarn_factor else None)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train one pretraining phase (a job file written by smolflow).")
    parser.add_argument("job", type=Path, help="the phase's job.json")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher (LOCAL_RANK is used)")
    args = parser.parse_args()
    job = TrainJob.model_validate_json(args.job.read_text())
    try:
        train(job)
    except Exception as err:  # a full disk is said beside the exit, for the task to end without a retry
        mark_disk_full(err, Path(job.out_dir), [Path(job.checkpoint_dir), Path(job.out_dir)])
        if not isinstance(err, SmolflowError):
            raise
        print(f"error: {type(err).__name__}: {err}", flush=True)  # a message for the user: no traceback
        sys.exit(1)
    finally:
        # an exit with the group still up can abort a rank (SIGABRT) while gloo's peers hang up
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    exit_without_teardown(main)
