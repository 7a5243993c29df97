"""The full pipeline: every stage's flow as a subflow, in DAG order. Finished steps are skipped."""

from __future__ import annotations

from prefect import flow

from flows.curate import curate_flow
from flows.evaluate import evaluate_flow
from flows.post_training import apo_flow, grpo_flow, preference_flow, sft_flow
from flows.pretrain import pretrain_flow

# Stage name -> its flow; `smolflow stage NAME` runs one of them on its own.
STAGES = {
    "curate": curate_flow,
    "pretrain": pretrain_flow,
    "sft": sft_flow,
    "preference": preference_flow,
    "apo": apo_flow,
    "grpo": grpo_flow,
    "evaluate": evaluate_flow,
}


@flow(name="full-pipeline")
def full_pipeline(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None, until: str | None = None) -> dict[str, str]:
    """Run the stages of RECIPE in order, up to and including `until` (default: all), then evaluate what
    the run holds and rebuild its report card; returns each stage's result."""
    names = list(STAGES)
    if until is not None and until not in STAGES:
        raise ValueError(f"unknown stage {until!r}; stages: {', '.join(names)}")
    chosen = names[: names.index(until) + 1] if until else names
    if "evaluate" not in chosen:
        chosen.append("evaluate")
    return {name: STAGES[name](recipe, run_dir, overrides) for name in chosen}
