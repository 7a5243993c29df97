"""Per-stage data mixtures: a token budget and source weights resolved against what curation kept.

datatrove has no mixture class; pretraining samples each stage's sources by these exact token
counts. A small, high-quality source drawn many times over is the classic way to overfit it (the
playbook capped math at 3% in stage 1 for this reason), so repeats above one epoch are warned
about and repeats above the recipe's `max_epochs` fail.
"""

from __future__ import annotations

import math
from typing import Any

from infra.errors import SmolflowError
from infra.recipe import PretrainCfg


class MixtureError(SmolflowError):
    """A stage cannot be drawn from the curated data as the recipe asks."""


def split_budget(tokens: int, weights: dict[str, float]) -> dict[str, int]:
    """Integer token counts proportional to `weights` that sum exactly to `tokens` (largest remainder)."""
    exact = {name: tokens * w for name, w in weights.items()}
    counts = {name: math.floor(v) for name, v in exact.items()}
    by_remainder = sorted(exact, key=lambda n: (exact[n] - counts[n], n), reverse=True)
    for name in by_remainder[: tokens - sum(counts.values())]:
        counts[name] += 1
    return counts


def resolve_mixtures(pretrain: PretrainCfg, available: dict[str, int]) -> dict[str, Any]:
    """The mixture manifest: per stage and source, tokens drawn, tokens available and epochs.

    Repetition counts across stages: a source seen twice in stage 1 and twice more in stage 2 has
    been repeated four times by the end of stage 2, and that is what `max_epochs` bounds.
    """
    stages, warnings = [], []
    drawn_so_far: dict[str, int] = {}
    for i, stage in enumerate(pretrain.stages):
        rows = {}
        for source, tokens in split_budget(stage.tokens, stage.mixture).items():
            have = available.get(source, 0)
            if have == 0:
                raise MixtureError(f"pretrain.stages[{i}] ({stage.name}): source {source!r} has no tokens left after curation")
            drawn_so_far[source] = drawn_so_far.get(source, 0) + tokens
            cumulative = drawn_so_far[source] / have
            if cumulative > pretrain.max_epochs:
                raise MixtureError(
                    f"pretrain.stages[{i}] ({stage.name}): source {source!r} would be repeated {cumulative:.1f} times "
                    f"by the end of this stage ({drawn_so_far[source]:,} tokens drawn from {have:,}), over "
                    f"pretrain.max_epochs={pretrain.max_epochs:g}: lower its weight or the stages' tokens"
                )
            if cumulative > 1:
                warnings.append(f"{stage.name}: {source} repeated {cumulative:.2f}x so far ({drawn_so_far[source]:,} of {have:,} tokens)")
            rows[source] = {
                "weight": stage.mixture[source],
                "tokens": tokens,
                "available": have,
                "epochs": round(tokens / have, 4),
                "cumulative_epochs": round(cumulative, 4),
            }
        stages.append({"name": stage.name, "tokens": stage.tokens, "seq_len": stage.seq_len or pretrain.seq_len, "sources": rows})
    return {"stages": stages, "warnings": warnings}
