"""Prefect flows: one per pipeline stage and the full pipeline, each running its selection of the graph.

A run's recipe is resolved once, when the run is opened, and frozen in RUN/recipe.json. The full
pipeline opens it once and hands its stage flows the run dir alone, so a YAML edited mid-run
changes nothing of the running pipeline; a retry or a crash relaunch of the same flow run reads
the frozen recipe too. A stage flow given a recipe path (the CLI, a stage deployment) freezes that
recipe in its place, logging every changed key.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger

from flows.graph import STAGES, Graph, build_graph
from infra.errors import SmolflowError
from infra.recipe import Recipe, load_recipe
from infra.steps import RECIPE, Run, Step, StepOutput, finished, frozen_recipe, require, statuses
from infra.storage import filesystem
from tasks import curate, postrain, pretrain
from tasks import evaluate as ev
from tasks.common import build


def open_run(recipe: str | None, run_dir: str | None, overrides: list[str] | None) -> tuple[Run, Graph]:
    """The run and its graph; `owner` makes a relaunch of this flow run read the recipe it froze."""
    from prefect.runtime import flow_run

    run = Run.open(recipe, run_dir, overrides or [], owner=flow_run.root_flow_run_id)
    return run, build_graph(run.recipe)


def upstream_steps(graph: Graph, stages: list[str]) -> dict[str, Step]:
    """The steps of other stages that `stages` read, by name."""
    return {d.name: d for s in graph.steps if s.stage in stages for d in s.deps.values() if d.stage not in stages}


def upstream(run_dir: Path, graph: Graph, stages: list[str]) -> dict[str, StepOutput]:
    """The outputs that `stages` read from other stages, each finished and current with the recipe, or
    UpstreamMissing naming the stage to run first. Checked before a stage starts anything (the CLI checks it
    before a Prefect server starts), not when its first step needs it."""
    deps = upstream_steps(graph, stages)
    known = {s.step.name: s for s in statuses(run_dir, graph.steps)} if deps else {}
    return {name: require(run_dir, dep, known[name], needed_by=" and ".join(stages)) for name, dep in deps.items()}


def run_steps(run: Run, stage: str, graph: Graph, available: dict[str, StepOutput] | None = None) -> dict[str, StepOutput]:
    """Build the stage's steps in order on the outputs of earlier stages (`available`, else checked here)."""
    known = dict(upstream(run.run_dir, graph, [stage]) if available is None else available)
    for step in graph.stage(stage):
        known[step.name] = build(run, step, {role: known[d.name] for role, d in step.deps.items()})
    return {step.name: known[step.name] for step in graph.stage(stage)}


@flow(name="curate")
def curate_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Curate the sources into RUN_DIR; returns the path of the curation report."""
    run, graph = open_run(recipe, run_dir, overrides)
    out = run_steps(run, "curate", graph)
    roles = {role: out[step.name] for role, step in graph.curation.items()}
    return str(curate.report(run.run_dir, run.recipe.name, list(out.values()), run.recipe.curate.examples_per_filter, **roles))


@contextmanager
def eval_follower(run: Run, graph: Graph, kinds: tuple[str, ...]) -> Iterator[bool]:
    """Scores the run's KINDS of models ("checkpoint", "model") as they are committed, beside the body;
    no follower without KINDS or when the recipe turns following off. Yields whether one follows."""
    if not kinds or not ev.following(run.recipe):
        yield False
        return
    stop = threading.Event()
    follower = ev.follow.submit(run, graph.models, stop, kinds)
    try:
        yield True
    finally:
        stop.set()
        follower.wait()


@flow(name="pretrain")
def pretrain_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None, evals: bool = True) -> str:
    """Pretrain on the curated mixtures in RUN_DIR, every checkpoint evaluated while the trainer runs (`evals`
    False: the caller's follower scores them); returns the final model's folder."""
    run, graph = open_run(recipe, run_dir, overrides)
    available = upstream(run.run_dir, graph, ["pretrain"])  # before the follower starts
    with eval_follower(run, graph, ("checkpoint",) if evals else ()):
        out = run_steps(run, "pretrain", graph, available)
    phases = [out[s.name] for s in graph.phases]
    pretrain.report(run.run_dir, run.recipe.name, phases)
    return str(phases[-1].path / "final")


def _post(
    stage: str, recipe: str | None, run_dir: str | None, overrides: list[str] | None, evals: bool
) -> tuple[Run, Graph, dict[str, StepOutput]]:
    """A post-training stage's steps; with `evals` each model it leaves is scored right after its step."""
    run, graph = open_run(recipe, run_dir, overrides)
    out = run_steps(run, stage, graph)
    for step in graph.stage(stage):
        if step.model and evals:
            ev.evaluate_model(run, graph.models, step, out[step.name])
    return run, graph, out


@flow(name="sft")
def sft_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None, evals: bool = True) -> str:
    """Chat data and supervised fine-tuning of the pretrained model; returns the SFT model's folder."""
    _, graph, out = _post("sft", recipe, run_dir, overrides, evals)
    return str(out[graph.ladder[0].name].path / "final")


@flow(name="preference")
def preference_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None, evals: bool = True) -> str:
    """Strong vs weak answers to the training prompts; returns the pairs file."""
    _, graph, out = _post("preference", recipe, run_dir, overrides, evals)
    return str(out[graph.pairs.name].path / "pairs.jsonl")


@flow(name="apo")
def apo_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None, evals: bool = True) -> str:
    """APO on the preference pairs, from the SFT model; returns the APO model's folder."""
    _, graph, out = _post("apo", recipe, run_dir, overrides, evals)
    return str(out[graph.ladder[1].name].path / "final")


@flow(name="grpo")
def grpo_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None, evals: bool = True) -> str:
    """GRPO from the APO model, then the post-training report; returns the report's path."""
    run, graph, out = _post("grpo", recipe, run_dir, overrides, evals)
    # the earlier steps are upstream of GRPO, so current: the report reads them as they are
    done = {s.name: out.get(s.name) or finished(run.run_dir, s.name) for s in graph.ladder + [graph.pairs]}
    models = [(s.model, done[s.name]) for s in graph.ladder]
    return str(postrain.report(run.run_dir, run.recipe.name, models, done[graph.pairs.name], list(done.values())))


@flow(name="evaluate")
def evaluate_flow(recipe: str | None = None, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Evaluate every checkpoint and model in RUN_DIR that has no results yet, then rebuild the report card."""
    run, graph = open_run(recipe, run_dir, overrides)
    ev.evaluate_run(run, graph.models)
    return str(ev.report_card(run.run_dir, run.recipe.name, graph.steps))


# Stage name -> its flow; `smolflow stage NAME` runs one of them on its own.
STAGE_FLOWS = dict(zip(STAGES, (curate_flow, pretrain_flow, sft_flow, preference_flow, apo_flow, grpo_flow, evaluate_flow), strict=True))


@flow(name="full-pipeline")
def full_pipeline(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None, until: str | None = None) -> dict[str, str]:
    """Run the stages of RECIPE in order, up to and including `until` (default: all), then evaluate what
    the run holds and rebuild its report card; returns each stage's result. The recipe is frozen in the
    run dir once, here: the stage flows read it from there."""
    if until is not None and until not in STAGES:
        raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
    run, graph = open_run(recipe, run_dir, overrides)
    chosen = list(STAGES[: STAGES.index(until) + 1] if until else STAGES)
    if "evaluate" not in chosen:
        chosen.append("evaluate")
    *stages, last = chosen  # the evaluate stage, once the follower is done
    # one eval follower beside the training stages: checkpoints and models are scored on the cores the
    # trainers leave idle, not between stages; it starts once the held-out documents its tasks read exist
    ready = STAGES.index(graph.models.heldout.stage) + 1
    results = {name: STAGE_FLOWS[name](None, str(run.run_dir)) for name in stages[:ready]}
    with eval_follower(run, graph, ("checkpoint", "model") if stages[ready:] else ()) as following:
        for name in stages[ready:]:
            results[name] = STAGE_FLOWS[name](None, str(run.run_dir), evals=not following)
    results[last] = STAGE_FLOWS[last](None, str(run.run_dir))
    return results


@flow(name="scheduled-eval")
def scheduled_eval_flow(source: str = "runs/tiny", recipe: str | None = None, work_dir: str = ".smolflow/scheduled-eval") -> dict:
    """Scan SOURCE (a run dir or an s3:// prefix of mirrored checkpoints) and evaluate only what has no results.

    Safe to overlap with itself or a training run: results are keyed by content and claimed with a lock.
    """
    if "://" not in source and not (Path(source) / "recipe.json").is_file():
        get_run_logger().warning("scheduled eval: %s holds no run yet; nothing to evaluate", source)
        return {}
    resolved = source_recipe(source, recipe)
    graph = build_graph(resolved)
    summary = ev.evaluate_source(source, resolved, graph.models, Path(work_dir))
    if "://" not in source:
        ev.report_card(Path(source), resolved.name, graph.steps)
    return summary


def source_recipe(source: str, recipe_path: str | None) -> Recipe:
    """The recipe a run was made with (its frozen recipe.json, locally or on S3), unless one is given."""
    if recipe_path:
        return load_recipe(recipe_path)
    url = f"{source.rstrip('/')}/{RECIPE}"
    fs, path = filesystem(url)
    try:
        with fs.open(path, "rb") as f:
            return frozen_recipe(json.loads(f.read()), url)
    except FileNotFoundError:
        raise SmolflowError(f"{source} has no {RECIPE}: pass the recipe the run was made with") from None
