"""Prefect tasks of evaluation: follow the trainer's checkpoints, score finished models, scan a run
dir or an s3:// prefix on a schedule, and build the report card (code in tasks/evaluation/)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.errors import SmolflowError
from infra.recipe import Recipe, load_recipe, parse_recipe
from infra.steps import RunContext, StepOutput
from infra.storage import Mirror, download_folder, filesystem
from tasks.common import run_logger, stage_task
from tasks.evaluation.harness import EvalFailed, prepare_tasks
from tasks.evaluation.report import build_report
from tasks.evaluation.results import ResultStore, models_in_prefix, models_in_run
from tasks.evaluation.runner import EvalSummary, Evaluator
from tasks.pretrain import following


def evaluator(
    recipe: Recipe, run_dir: Path, mirror: Mirror | None, store: ResultStore | None = None, heldout: Path | None = None
) -> Evaluator:
    cfg = recipe.evaluation
    include = prepare_tasks(cfg.task_dirs, heldout or run_dir / "tokenize" / "heldout", run_dir / "evals" / "tasks")
    store = store or ResultStore(str(run_dir / "evals" / "results"))
    return Evaluator(cfg, store, include, run_dir / "evals" / "work", run_logger(), mirror, recipe.storage.s3)


def _finish(summary: EvalSummary, what: str) -> dict:
    run_logger().info("%s: %s", what, summary.line())
    if summary.failed:
        details = "; ".join(f"{label}: {err.splitlines()[0]}" for label, err in summary.failed.items())
        raise EvalFailed(f"{what}: {len(summary.failed)} model(s) failed evaluation: {details}")
    return {"evaluated": summary.evaluated, "cached": summary.cached, "busy": summary.busy, "seconds": round(summary.seconds, 1)}


@stage_task("eval-follow", retries=1)
def follow_checkpoints(ctx: RunContext, stop: threading.Event) -> dict:
    """Evaluate each pretraining checkpoint as the trainer commits it, until `stop` and none is left."""
    if not following(ctx.recipe):
        stop.wait()
        return {}
    ev = evaluator(ctx.recipe, ctx.run_dir, ctx.mirror)
    summary = ev.follow(lambda: [m for m in models_in_run(ctx.run_dir, ctx.recipe) if m.kind == "checkpoint"], stop)
    if summary.failed:  # the evaluate stage retries them; training is not failed for an eval
        run_logger().warning(
            "eval follower: %d checkpoint(s) failed, left to the evaluate stage: %s", len(summary.failed), sorted(summary.failed)
        )
    run_logger().info("eval follower: %s", summary.line())
    return {"evaluated": summary.evaluated, "failed": sorted(summary.failed)}


@stage_task("eval-model")
def evaluate_model(ctx: RunContext, step: StepOutput) -> dict:
    """Score a finished model (a post-training step's `final/`) right after its step."""
    models = [m for m in models_in_run(ctx.run_dir, ctx.recipe) if m.kind == "model" and Path(m.path) == step.path / "final"]
    return _finish(evaluator(ctx.recipe, ctx.run_dir, ctx.mirror).run(models), f"eval {step.name}")


@stage_task("eval-run")
def evaluate_run(ctx: RunContext) -> dict:
    """Score every checkpoint and model of the run that has no results yet."""
    models = models_in_run(ctx.run_dir, ctx.recipe)
    return _finish(evaluator(ctx.recipe, ctx.run_dir, ctx.mirror).run(models), "eval run")


@stage_task("eval-scan")
def evaluate_source(source: str, recipe: Recipe, work_dir: Path) -> dict:
    """Scheduled evaluation of a run dir or an s3:// prefix: only models without results are scored."""
    if "://" not in source:
        run_dir = Path(source)
        return _finish(evaluator(recipe, run_dir, None).run(models_in_run(run_dir, recipe)), f"eval {source}")
    s3 = recipe.storage.s3
    store = ResultStore(f"{source.rstrip('/')}/evals/results", s3, lock_dir=work_dir / "evals" / "locks")
    heldout = _pull_heldout(source, s3, work_dir)
    models = models_in_prefix(source, s3)
    return _finish(evaluator(recipe, work_dir, None, store, heldout).run(models), f"eval {source}")


def _pull_heldout(prefix: str, s3, work_dir: Path) -> Path:
    """The mirrored tokenize step's held-out documents, for the perplexity tasks."""
    return download_folder(f"{prefix.rstrip('/')}/tokenize/heldout", work_dir / "tokenize" / "heldout", s3)


def source_recipe(source: str, recipe_path: str | None, s3=None) -> Recipe:
    """The recipe a run was made with (its recipe.json), unless one is given."""
    if recipe_path:
        return load_recipe(recipe_path)
    url = f"{source.rstrip('/')}/recipe.json"
    fs, path = filesystem(url, s3)
    try:
        with fs.open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise SmolflowError(f"{source} has no recipe.json: pass the recipe the run was made with") from None
    for secret in ("key", "secret"):  # masked in recipe.json: credentials come from the environment
        data.get("storage", {}).get("s3", {}).pop(secret, None)
    return parse_recipe(data, url)


@stage_task("report-card", retries=1)
def report_card(run_dir: Path, recipe: Recipe) -> Path:
    """Markdown + PNG report card of the run, also published as Prefect artifacts."""
    card = build_report(Path(run_dir), recipe)
    key = f"{recipe.name}-report-card".replace("_", "-")
    create_markdown_artifact(card.markdown, key=key, description=f"Report card of {run_dir}")
    if card.eval_rows:
        create_table_artifact(card.eval_rows, key=f"{key}-evals", description="Evaluation results per checkpoint")
    run_logger().info("report card: %s (plots: %s)", card.path.resolve(), ", ".join(p.name for p in card.plots))
    return card.path
