"""Evaluation flows: the run's evaluate stage, and the scheduled scan of a run dir or s3:// prefix."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from infra.steps import RunContext
from tasks import evaluate as t


@flow(name="evaluate")
def evaluate_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Evaluate every checkpoint and model in RUN_DIR that has no results yet, then rebuild the report card."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    t.evaluate_run(ctx)
    return str(t.report_card(ctx.run_dir, ctx.recipe))


@flow(name="scheduled-eval")
def scheduled_eval_flow(source: str = "runs/tiny", recipe: str | None = None, work_dir: str = ".smolflow/scheduled-eval") -> dict:
    """Scan SOURCE (a run dir or an s3:// prefix of mirrored checkpoints) and evaluate only what has no results.

    Safe to overlap with itself or a training run: results are keyed by content and claimed with a lock.
    """
    if "://" not in source and not (Path(source) / "recipe.json").is_file():
        get_run_logger().warning("scheduled eval: %s holds no run yet; nothing to evaluate", source)
        return {}
    resolved = t.source_recipe(source, recipe)
    summary = t.evaluate_source(source, resolved, Path(work_dir))
    if "://" not in source:
        t.report_card(Path(source), resolved)
    return summary
