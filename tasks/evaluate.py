"""Prefect tasks of evaluation: follow the trainer's checkpoints, score finished models, scan a run
dir or an s3:// prefix on a schedule, and build the report card (code in tasks/evaluation/).

Which steps hold checkpoints and finished models comes from the step graph (`Step.checkpoints`,
`Step.model`), handed in by the flows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from infra.recipe import Recipe
from infra.steps import Run, Step, StepOutput
from infra.storage import Mirror, download_folder
from tasks.common import run_logger, stage_task
from tasks.curation.pipelines import HELDOUT
from tasks.evaluation.harness import EvalFailed, prepare_tasks
from tasks.evaluation.plots import artifact, table_artifact
from tasks.evaluation.report import build_report
from tasks.evaluation.results import RESULTS, ResultStore, keep_keys, models_in_prefix, models_in_run, run_results
from tasks.evaluation.runner import EvalSummary, Evaluator


@dataclass(frozen=True)
class Models:
    """Where a run's evaluable models are: the graph's steps, and the step whose held-out documents
    the perplexity tasks read."""

    steps: list[Step]
    heldout: Step

    def heldout_dir(self, root: str | Path) -> str:
        return f"{str(root).rstrip('/')}/{self.heldout.name}/{HELDOUT}"


def evaluator(
    recipe: Recipe, run_dir: Path, heldout: Path, mirror: Mirror | None, store: ResultStore | None = None, alone: bool = False
) -> Evaluator:
    """`alone`: nothing else of the run is running (a stage's own evals; `Evaluator`). Without STORE it scores into
    the run's own, and records the keys it scores under there, which the run's reports then read."""
    cfg = recipe.evaluation
    include = prepare_tasks(cfg.task_dirs, heldout, run_dir / "evals" / "tasks")
    ev = Evaluator(cfg, store or run_results(run_dir), include, run_dir / "evals" / "work", run_logger(), mirror, recipe.storage.s3, alone)
    if store is None:
        keep_keys(run_dir, ev.keys)
    return ev


def following(recipe: Recipe) -> bool:
    return recipe.evaluation.follow and bool(recipe.evaluation.checkpoint_tasks)


def _finish(summary: EvalSummary, what: str) -> dict:
    run_logger().info("%s: %s", what, summary.line())
    if summary.failed:
        details = "; ".join(f"{label}: {err.splitlines()[0]}" for label, err in summary.failed.items())
        raise EvalFailed(f"{what}: {len(summary.failed)} model(s) failed evaluation: {details}")
    return {"evaluated": summary.evaluated, "cached": summary.cached, "busy": summary.busy, "seconds": round(summary.seconds, 1)}


@stage_task("eval-follow", retries=1)
def follow(run: Run, models: Models, stop: threading.Event, kinds: tuple[str, ...], abandon: threading.Event) -> dict:
    """Evaluate each checkpoint (and with "model" in KINDS each finished model) as it is committed, until
    `stop` and none is left: beside a trainer it takes the cores the trainer leaves idle. `abandon`: at once."""
    ev = evaluator(run.recipe, run.run_dir, Path(models.heldout_dir(run.run_dir)), run.mirror)
    summary = ev.follow(lambda: [m for m in models_in_run(run.run_dir, models.steps) if m.kind in kinds], stop, abandon)
    if summary.failed:  # the evaluate stage retries them; training is not failed for an eval
        run_logger().warning(
            "eval follower: %d model(s) failed, left to the evaluate stage: %s", len(summary.failed), sorted(summary.failed)
        )
    run_logger().info("eval follower: %s", summary.line())
    return {"evaluated": summary.evaluated, "failed": sorted(summary.failed)}


@stage_task("eval-model")
def evaluate_model(run: Run, models: Models, step: Step, output: StepOutput) -> dict:
    """Score a finished model (a post-training step's `final/`) right after its step."""
    found = [m for m in models_in_run(run.run_dir, [step]) if m.kind == "model"]
    ev = evaluator(run.recipe, run.run_dir, Path(models.heldout_dir(run.run_dir)), run.mirror, alone=True)
    return _finish(ev.run(found), f"eval {output.name}")


@stage_task("eval-run")
def evaluate_run(run: Run, models: Models) -> dict:
    """Score every checkpoint and model of the run that has no results yet."""
    found = models_in_run(run.run_dir, models.steps)
    ev = evaluator(run.recipe, run.run_dir, Path(models.heldout_dir(run.run_dir)), run.mirror, alone=True)
    return _finish(ev.run(found), "eval run")


@stage_task("eval-scan")
def evaluate_source(source: str, recipe: Recipe, models: Models, work_dir: Path) -> dict:
    """Scheduled evaluation of a run dir or an s3:// prefix: only models without results are scored."""
    if "://" not in source:
        run_dir = Path(source)
        ev = evaluator(recipe, run_dir, Path(models.heldout_dir(run_dir)), None)
        return _finish(ev.run(models_in_run(run_dir, models.steps)), f"eval {source}")
    s3 = recipe.storage.s3
    store = ResultStore(f"{source.rstrip('/')}/{RESULTS.as_posix()}", s3, lock_dir=work_dir / "evals" / "locks")
    heldout = download_folder(models.heldout_dir(source), Path(models.heldout_dir(work_dir)), s3)
    found, skipped = models_in_prefix(source, s3, models.steps)
    if skipped:
        run_logger().warning("eval %s: %d model folder(s) not evaluated: %s", source, len(skipped), skipped)
    return _finish(evaluator(recipe, work_dir, heldout, None, store).run(found), f"eval {source}") | {"skipped": skipped}


@stage_task("report-card", retries=1)
def report_card(run_dir: Path, name: str, steps: list[Step]) -> Path:
    """Markdown + PNG report card of the run, also published as Prefect artifacts."""
    card = build_report(Path(run_dir), name, steps)
    key = f"{name}-report-card".replace("_", "-")
    artifact(card.markdown, card.path.parent, key, f"Report card of {run_dir}")
    if card.eval_rows:
        table_artifact(card.eval_rows, key=f"{key}-evals", description="Evaluation results per checkpoint")
    run_logger().info("report card: %s (plots: %s)", card.path.resolve(), ", ".join(p.name for p in card.plots))
    return card.path
