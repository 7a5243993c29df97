"""Supervised fine-tuning with TRL's SFTTrainer, the loss on assistant tokens only.

The chat template marks assistant turns (and the newline after `<|im_end|>`) with `{% generation %}`,
so `assistant_only_loss=True` trains exactly the answers. An early copy of the model is kept as
the weak side of the preference pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

from infra.recipe import SFTCfg
from postrain.common import save_final, train_and_save, trl_args


class KeepEarlyCopy(TrainerCallback):
    """Saves the model once, at `step`, as a weak model for preference pairs (on every rank: a collective save)."""

    def __init__(self, step: int, path: Path, trainer: SFTTrainer):
        # decided once, before training, so that all ranks agree
        self.step, self.path, self.trainer, self.done = step, path, trainer, path.exists()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and not self.done:
            save_final(self.trainer, self.path)
            self.done = True


def build_trainer(
    model_path: str, train: list[dict[str, Any]], cfg: SFTCfg, out: Path, seed: int, tracking: dict[str, Any] | None = None
) -> SFTTrainer:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    args = trl_args(
        SFTConfig,
        cfg,
        out,
        seed,
        tracking,
        assistant_only_loss=True,
        packing=cfg.packing,
        padding_free=cfg.packing,
        max_length=cfg.max_length,
    )
    dataset = Dataset.from_list([{"messages": row["messages"]} for row in train])
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.add_callback(KeepEarlyCopy(cfg.weak_checkpoint_step, out / "weak", trainer))
    return trainer


def run_sft(
    model_path: str, train: list[dict[str, Any]], cfg: SFTCfg, out: Path, seed: int, tracking: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train (resuming from the newest complete checkpoint in `out`), save `out/final` and `out/weak`."""
    return train_and_save(build_trainer(model_path, train, cfg, out, seed, tracking), out, {"loss": "loss"})
