"""APO (anchored preference optimisation) with TRL's DPOTrainer: `loss_type=["apo_zero"]`.

Reference log-probs are computed once before training (`precompute_ref_log_probs=True`), so no
second copy of the model sits in memory. On tiny data `["apo_zero", "sft"]` keeps the chosen
log-prob rising where plain `apo_zero` pushes both sides down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from infra.recipe import APOCfg
from postrain.common import train_and_save, trl_args


def run_apo(
    model_path: str, pairs: list[dict[str, Any]], cfg: APOCfg, out: Path, seed: int, tracking: dict[str, Any] | None = None
) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    args = trl_args(
        DPOConfig,
        cfg,
        out,
        seed,
        tracking,
        loss_type=list(cfg.loss_type),
        loss_weights=cfg.loss_weights,
        beta=cfg.beta,
        precompute_ref_log_probs=True,
        max_length=cfg.max_length,
    )
    dataset = Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs])
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    return train_and_save(trainer, out, {"loss": "loss", "chosen_logps": "logps/chosen", "rejected_logps": "logps/rejected"})
