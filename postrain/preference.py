"""Preference pairs: for each prompt the strong model's answer is chosen and the weak model's rejected.

SmolLM3 paired Qwen3-32B (strong) with Qwen3-0.6B (weak); the tiny recipe pairs its SFT model with an
early SFT checkpoint. Models are loaded one at a time. Pairs with equal answers carry no preference
and are dropped; so are pairs whose chosen answer fails the task's verifier (it must not be taught).
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable
from typing import Any

from postrain.data import dedup_and_decontaminate, is_correct
from postrain.generation import Backend


def answers(
    make_backend: Callable[[str], Backend], model: str, prompts: list[list[dict]], max_new_tokens: int, temperature: float
) -> list[str]:
    backend = make_backend(model)
    try:
        return backend.chat(prompts, max_new_tokens, temperature)
    finally:
        del backend
        gc.collect()


def build_pairs(
    items: list[dict[str, Any]], strong: list[str], weak: list[str], dedup_threshold: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    drops: Counter[str] = Counter()
    pairs = []
    for item, chosen, rejected in zip(items, strong, weak, strict=True):
        if chosen.strip() == rejected.strip():
            drops["equal answers"] += 1
        elif item["answer"] and not is_correct(chosen, item["answer"]):
            drops["chosen answer wrong"] += 1
        else:
            pairs.append(
                {
                    "prompt": item["prompt"],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                    "answer": item["answer"],
                    "family": item["family"],
                }
            )
    # identical pairs teach the same thing twice; compare them on prompt + both answers
    keyed = [{**p, "prompt": [{"role": "user", "content": _key(p)}]} for p in pairs]
    kept_keyed, dedup = dedup_and_decontaminate(keyed, [], dedup_threshold)
    kept_ids = {id(k) for k in kept_keyed}
    kept = [p for p, k in zip(pairs, keyed, strict=True) if id(k) in kept_ids]
    drops["duplicate pairs"] += dedup["duplicates"]
    verifiable = [(i, s, w) for i, s, w in zip(items, strong, weak, strict=True) if i["answer"]]
    stats = {
        "prompts": len(items),
        "pairs": len(kept),
        "dropped": dict(drops),
        "strong_accuracy": sum(is_correct(s, i["answer"]) for i, s, _ in verifiable) / max(1, len(verifiable)),
        "weak_accuracy": sum(is_correct(w, i["answer"]) for i, _, w in verifiable) / max(1, len(verifiable)),
    }
    return kept, stats


def _key(pair: dict[str, Any]) -> str:
    return " || ".join([pair["prompt"][-1]["content"], pair["chosen"][0]["content"], pair["rejected"][0]["content"]])
