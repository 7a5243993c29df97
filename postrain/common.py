"""What the TRL stages share: trainer arguments, resuming, saving, and held-out evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from infra.recipe import TrainerCfg
from postrain.data import extract_answer, is_correct
from postrain.generation import Backend, stop_token_ids


def trl_args(config_cls, cfg: TrainerCfg, out: Path, seed: int, **extra: Any):
    """TRL config for `cfg`; on CPU bf16 and activation checkpointing are switched off (TRL defaults them on)."""
    cuda = torch.cuda.is_available()
    return config_cls(
        output_dir=str(out / "checkpoints"),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size,
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
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=False,
        **extra,
    )


def last_complete_checkpoint(folder: Path) -> str | None:
    """Newest `checkpoint-N` whose trainer state was written (it is written last) and parses."""
    candidates = sorted(Path(folder).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]), reverse=True)
    for path in candidates:
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if any(path.glob("model*.safetensors")) and (path / "optimizer.pt").exists():
            return str(path)
    return None


def save_final(model, tokenizer, path: Path) -> None:
    """An HF checkpoint whose generation stops at the end of the assistant turn."""
    model.generation_config = GenerationConfig(eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.config.use_cache = True
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


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
    }


def loss_history(log_history: list[dict[str, Any]], key: str = "loss") -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in log_history if key in row and "step" in row]


def train_and_save(trainer, out: Path, curves: dict[str, str]) -> dict[str, Any]:
    """Train from the newest complete checkpoint in `out` (if any), save `out/final`, return the logged curves."""
    resume = last_complete_checkpoint(out / "checkpoints")
    state = json.loads((Path(resume) / "trainer_state.json").read_text()) if resume else {}
    if state.get("global_step", 0) >= trainer.args.max_steps:
        # killed after its last checkpoint: resuming would train one step past max_steps (at a zero learning
        # rate, but with its own rollouts and log line), so the checkpoint's weights are the final model
        model, history = type(trainer.model).from_pretrained(resume), state["log_history"]
    else:
        trainer.train(resume_from_checkpoint=resume)
        model, history = trainer.model, trainer.state.log_history
    save_final(model, trainer.processing_class, out / "final")
    return {"resumed_from": resume, **{name: loss_history(history, key) for name, key in curves.items()}}
