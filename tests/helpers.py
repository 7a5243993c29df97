"""Helpers for tests: a micro recipe and small files."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def micro_recipe(**changes) -> dict:
    """configs/tiny.yaml shrunk to run in seconds; `changes` maps dotted keys to values."""
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["name"] = "micro"
    data["executor"] = {"kind": "local", "tasks": 2, "workers": 1}
    data["embedded"].update(stdlib_max_mb=0.6, math_problems=600)
    data["curate"]["tokenizer"]["train"] = {"vocab_size": 512, "min_frequency": 2, "sample_mb": 1}
    data["model"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    data["pretrain"].update(
        seq_len=64, micro_batch_size=4, log_every=5, tracking="none", checkpoint={"every_steps": 5, "every_minutes": 60, "keep_last": 2}
    )
    data["pretrain"]["optimizer"].update(warmup_steps=5)
    data["pretrain"]["launcher"]["threads_per_rank"] = 1
    for stage in data["pretrain"]["stages"]:
        stage["tokens"] = 2000
    data["pretrain"]["stages"][0]["tokens"] = 8000
    data["pretrain"]["stages"][-1].update(seq_len=128, micro_batch_size=2)
    data["curate"]["heldout_fraction"] = 0.05  # a few held-out documents per source even in a micro corpus
    data["evaluation"].update(
        checkpoint_tasks=["smol_arithmetic_cf", "smol_arithmetic_mcf", "smol_ppl_code"], model_tasks=["smol_arithmetic_gen"], limit=8
    )
    for key, value in changes.items():
        node = data
        *path, last = key.split(".")
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return data


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path
