"""Per-phase data mixtures: a token budget and source weights resolved against what curation kept.

datatrove has no mixture class; pretraining samples each phase's sources by these exact token
counts. A small, high-quality source drawn many times over is the classic way to overfit it (the
playbook capped math at 3% in stage 1 for this reason), so repeats above one epoch are warned
about and repeats above the recipe's `max_epochs` fail.
"""

from __future__ import annotations

import math
from typing import Any

from infra.errors import SmolflowError
from infra.recipe import Strict


class MixtureError(SmolflowError):
    """A phase cannot be drawn from the curated data as the recipe asks."""


class MixturePhase(Strict):
    """What the mixtures step reads of a pretraining phase: its budget, weights and sequence length."""

    name: str
    tokens: int
    mixture: dict[str, float]
    seq_len: int


def split_budget(tokens: int, weights: dict[str, float]) -> dict[str, int]:
    """Integer token counts proportional to `weights` that sum exactly to `tokens` (largest remainder)."""
    exact = {name: tokens * w for name, w in weights.items()}
    counts = {name: math.floor(v) for name, v in exact.items()}
    by_remainder = sorted(exact, key=lambda n: (exact[n] - counts[n], n), reverse=True)
    for name in by_remainder[: tokens - sum(counts.values())]:
        counts[name] += 1
    return counts


def windows(phase: MixturePhase) -> dict[str, int]:
    """`seq_len` windows the phase draws from each source: a function of the recipe alone."""
    return {source: tokens // phase.seq_len for source, tokens in split_budget(phase.tokens, phase.mixture).items()}


def resolve_mixtures(phases: list[MixturePhase], max_epochs: float, available: dict[str, int]) -> dict[str, Any]:
    """The mixture manifest: per phase and source, tokens drawn, tokens available and epochs.

    Repetition counts across phases: a source seen twice in phase 1 and twice more in phase 2 has
    been repeated four times by the end of phase 2, and that is what `max_epochs` bounds.
    """
    resolved, warnings = [], []
    drawn_so_far: dict[str, int] = {}
    for i, phase in enumerate(phases):
        rows = {}
        for source, tokens in split_budget(phase.tokens, phase.mixture).items():
            have = available.get(source, 0)
            if have == 0:
                raise MixtureError(f"pretrain.phases[{i}] ({phase.name}): source {source!r} has no tokens left after curation")
            drawn_so_far[source] = drawn_so_far.get(source, 0) + tokens
            cumulative = drawn_so_far[source] / have
            if cumulative > max_epochs:
                raise MixtureError(
                    f"pretrain.phases[{i}] ({phase.name}): source {source!r} would be repeated {cumulative:.1f} times "
                    f"by the end of this phase ({drawn_so_far[source]:,} tokens drawn from {have:,}), over "
                    f"pretrain.max_epochs={max_epochs:g}: lower its weight or the phases' tokens"
                )
            if cumulative > 1:
                warnings.append(f"{phase.name}: {source} repeated {cumulative:.2f}x so far ({drawn_so_far[source]:,} of {have:,} tokens)")
            rows[source] = {
                "weight": phase.mixture[source],
                "tokens": tokens,
                "available": have,
                "epochs": round(tokens / have, 4),
                "cumulative_epochs": round(cumulative, 4),
            }
        resolved.append({"name": phase.name, "tokens": phase.tokens, "seq_len": phase.seq_len, "sources": rows})
    return {"phases": resolved, "warnings": warnings}
