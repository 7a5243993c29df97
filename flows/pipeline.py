"""The full pipeline: every stage's flow as a subflow, in DAG order. Finished steps are skipped."""

from __future__ import annotations

from prefect import flow

from flows.curate import curate_flow
from flows.postrain import apo_flow, grpo_flow, preference_flow, sft_flow
from flows.pretrain import pretrain_flow

# Stage name -> its flow; `smolflow stage NAME` runs one of them on its own.
STAGES = {
    "curate": curate_flow,
    "pretrain": pretrain_flow,
    "sft": sft_flow,
    "preference": preference_flow,
    "apo": apo_flow,
    "grpo": grpo_flow,
}


@flow(name="full-pipeline")
def full_pipeline(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> dict[str, str]:
    """Run every stage of RECIPE in order; returns each stage's result (e.g. its report path)."""
    return {name: stage(recipe, run_dir, overrides) for name, stage in STAGES.items()}
