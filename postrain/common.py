"""What the TRL stages share: trainer arguments, resuming, saving, and held-out evaluation.

The trainers run on every rank that `accelerate launch` started (postrain/run.py), or in the calling
process when nothing launched them: a rank takes `batch_size / WORLD_SIZE` sequences per micro-step,
and only rank 0 writes what is not a collective save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from infra.errors import SmolflowError
from infra.recipe import TrainerCfg
from infra.steps import CHECKPOINTS, FINAL
from infra.summaries import item_id, outcomes
from postrain.data import extract_answer, is_correct
from postrain.generation import Backend, stop_token_ids


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def tracking_args(project: str | None, run: str) -> dict[str, Any]:
    """TrainingArguments that log the trainer's curves to trackio's PROJECT (its folder: TRACKIO_DIR, set by the
    launching task) as RUN, beside the pretraining phases; None: no dashboard. Local only: no Space is made."""
    if project is None:
        return {"report_to": []}
    return {"report_to": ["trackio"], "project": project, "run_name": run, "trackio_static_space_id": False}


def trl_args(config_cls, cfg: TrainerCfg, out: Path, seed: int, tracking: dict[str, Any] | None = None, **extra: Any):
    """TRL config for `cfg` on this launch's ranks; on CPU bf16 and activation checkpointing are off (TRL defaults them
    on). TRACKING: `tracking_args` (default: none)."""
    import torch

    cuda, ranks = torch.cuda.is_available(), world_size()
    if cfg.batch_size % ranks:
        raise ValueError(f"batch_size {cfg.batch_size} does not split over {ranks} ranks")
    return config_cls(
        output_dir=str(out / CHECKPOINTS),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size // ranks,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_ratio,  # a float below 1 is a ratio of the total steps
        logging_steps=cfg.logging_steps,
        save_steps=cfg.save_steps,
        save_total_limit=2,
        seed=seed,
        data_seed=seed,
        use_cpu=not cuda,
        bf16=cuda,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
        **(tracking or tracking_args(None, "")),
        **extra,
    )


def last_complete_checkpoint(folder: Path) -> str | None:
    """Newest `checkpoint-N` whose trainer state (written last) parses and whose optimizer state is there
    (`optimizer.pt`, or DeepSpeed's `global_stepN` under ZeRO)."""
    candidates = sorted(Path(folder).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]), reverse=True)
    for path in candidates:
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if any(path.glob("model*.safetensors")) and ((path / "optimizer.pt").exists() or (path / "latest").exists()):
            return str(path)
    return None


def check_resumable(checkpoint: str) -> None:
    """ZeRO shards the optimizer state by rank: such a checkpoint loads on the rank count that wrote it only."""
    shards = len(list(Path(checkpoint).glob("global_step*/*optim_states.pt")))
    if shards and shards != world_size():
        raise SmolflowError(
            f"{checkpoint} holds ZeRO optimizer shards of {shards} ranks; this launch has {world_size()}: "
            f"resume with postrain.launcher.nproc: {shards}"
        )


def save_final(trainer, path: Path, checkpoint: str | None = None) -> None:
    """An HF model at PATH whose generation stops at the end of the assistant turn, written whole and then renamed.

    Every rank calls it (under ZeRO-3 saving gathers the weights); CHECKPOINT: copy that checkpoint's model instead.
    """
    from transformers import GenerationConfig

    tmp, main = path.with_name(path.name + ".tmp"), trainer.is_world_process_zero()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    model, tokenizer = trainer.model, trainer.processing_class
    model.config.use_cache = True
    model.generation_config = GenerationConfig(eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    if checkpoint is None:
        trainer.save_model(str(tmp))
    elif main:
        tmp.mkdir(parents=True)
        for file in Path(checkpoint).glob("model*.safetensors*"):
            shutil.copy2(file, tmp / file.name)
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    if main:
        model.generation_config.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)


def heldout_accuracy(backend: Backend, tokenizer, items: list[dict[str, Any]], max_new_tokens: int) -> dict[str, Any]:
    """Greedy held-out accuracy (final answer exact match) and mean answer length in tokens."""
    completions = backend.chat([i["prompt"] for i in items], max_new_tokens, temperature=0.0)
    correct = [is_correct(c, i["answer"]) for c, i in zip(completions, items, strict=True)]
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]
    by_family: dict[str, list[bool]] = {}
    for item, ok in zip(items, correct, strict=True):
        by_family.setdefault(item["family"], []).append(ok)
    return {
        "items": len(items),
        "accuracy": sum(correct) / len(items),
        "mean_answer_tokens": sum(lengths) / len(items),
        "answered": sum(extract_answer(c) is not None for c in completions) / len(items),
        "by_family": {k: sum(v) / len(v) for k, v in sorted(by_family.items())},
        "examples": [{"prompt": i["prompt"][-1]["content"], "completion": c} for i, c in list(zip(items, completions))[:3]],
        "outcomes": outcomes([item_id(i["prompt"]) for i in items], correct),
    }


def loss_history(log_history: list[dict[str, Any]], key: str = "loss") -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in log_history if key in row and "step" in row]


# the most logits one plain LM head builds at once (128 MiB of fp32); larger batches keep TRL's tiles
PLAIN_HEAD_MAX_LOGITS = 2**25


def plain_log_probs(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
    """TRL's `ChunkedLogProbFunction` contract (log-probs of `targets` and the asked-for per-token extras)
    in plain autograd ops: one projection and one log-softmax over all the rows' logits at once."""
    import torch
    import torch.nn.functional as F

    z = F.linear(hidden, weight, bias).float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = z.log_softmax(-1)
    log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    with torch.no_grad():  # TRL marks these three non-differentiable
        sq = (2 * log_p).logsumexp(-1) if "log_sum_sq_probs" in outputs else None
        mean = z.mean(-1) if "mean_logits" in outputs else None
        top1 = log_p.argmax(-1) == targets if "is_top1" in outputs else None  # the first maximum, as TRL counts it
    return log_probs, entropy, sq, mean, top1


def cpu_lm_head() -> None:
    """On CPU, TRL's fused LM head (the SFT, APO and GRPO losses) scores only the labelled positions,
    through one plain projection while their logits are small.

    Off Triton devices TRL projects every position, so that tile shapes stay fixed for graph compilers
    (Neuron), and folds each tile in a dozen torch ops. Eager CPU needs no fixed shapes; prompts and
    padding are most of a chat batch, and a 4k-vocabulary head's logits fit in memory: the same loss
    and gradients make a tiny-recipe SFT step 1.6x faster (bench/postrain.py)."""
    import trl.trainer.utils as trl_utils

    original, tiled = getattr(trl_utils, "_use_triton", None), getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if original is None or tiled is None:
        print("note: this TRL's fused LM head is not the one cpu_lm_head knows; it scores prompts and padding too", flush=True)
        return
    if hasattr(tiled, "original"):  # patched already
        return
    compact = lambda device: device.type == "cpu" or original(device)  # noqa: E731
    compact.original = original
    trl_utils._use_triton = compact

    class Head:
        """Plain while small, else TRL's tiles."""

        original = tiled

        @staticmethod
        def apply(hidden, weight, *args):
            small = hidden.device.type == "cpu" and hidden.shape[0] * weight.shape[0] <= PLAIN_HEAD_MAX_LOGITS
            return plain_log_probs(hidden, weight, *args) if small else Head.original.apply(hidden, weight, *args)

    trl_utils._ChunkedLogProbFunction = Head


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint (postrain/run.py exits with PREEMPTED)."""


def stop_on_signal():
    """A trainer callback: after SIGTERM (a cancel, a preemption) or SIGUSR1 (Slurm's warning before the time limit)
    the step in progress finishes, a checkpoint is saved and training stops, as pretraining does. The ranks agree on
    the stop each step (a rank signalled a step later would otherwise wait in a collective the others left)."""
    import signal

    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        def __init__(self) -> None:
            self.why: str | None = None
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._set)

        def _set(self, signum, frame) -> None:
            self.why = f"received {signal.Signals(signum).name}"

        def on_step_end(self, args, state, control, **kwargs):
            flag = torch.tensor([1.0 if self.why else 0.0])
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                self.why = self.why or "another rank was signalled"
                control.should_save = control.should_training_stop = True
            return control

    return StopOnSignal()


def train_and_save(trainer, out: Path, curves: dict[str, str]) -> dict[str, Any]:
    """Train from the newest complete checkpoint in `out` (if any), save `out/final`, return the logged curves.
    Signalled (stop_on_signal), it saves a checkpoint and raises Stopped: a retry resumes there."""
    cpu_lm_head()
    resume = last_complete_checkpoint(out / CHECKPOINTS)
    state = json.loads((Path(resume) / "trainer_state.json").read_text()) if resume else {}
    if resume:
        check_resumable(resume)
    if state.get("global_step", 0) >= trainer.args.max_steps:
        # killed after its last checkpoint: resuming would train one step past max_steps (at a zero learning
        # rate, but with its own rollouts and log line), so the checkpoint's weights are the final model
        save_final(trainer, out / FINAL, checkpoint=resume)
        history = state["log_history"]
    else:
        stop = stop_on_signal()
        trainer.add_callback(stop)
        trainer.train(resume_from_checkpoint=resume)
        if stop.why:
            raise Stopped(f"{stop.why}: checkpoint-{trainer.state.global_step} saved; exiting for a retry to resume")
        save_final(trainer, out / FINAL)
        history = trainer.state.log_history
    return {"resumed_from": resume, **{name: loss_history(history, key) for name, key in curves.items()}}
