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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from flows.graph import EVALUATE, STAGES, Graph, build_graph, upstream
from infra.errors import SmolflowError
from infra.procs import stop_on_signals
from infra.recipe import Override, Recipe, load_recipe
from infra.steps import RECIPE, RUNS, Run, Step, StepOutput, finished, frozen_recipe, out_of_date, rebuild_command
from infra.storage import filesystem
from tasks import curate, postrain, pretrain
from tasks import evaluate as ev
from tasks.common import build, run_logger

Overrides = list[Override] | None  # a deployment refuses a secret among them before Prefect stores it


@contextmanager
def opened(recipe: str | None, run_dir: str | None, overrides: list[str] | None) -> Iterator[tuple[Run, Graph]]:
    """The run and its graph for a flow's body; `owner` makes a relaunch of this flow run read the recipe it froze.
    Given a recipe, the run holds its run dir's recipe lock till the body ends: a stage started meanwhile with a
    recipe of its own is refused instead of re-freezing the recipe this flow's later stages read."""
    stop_on_signals()  # the threads beside this one learn of a SIGTERM too (infra/procs.py STOPPING)
    run = Run.open(recipe, run_dir, overrides or [], owner=root_flow_run())
    try:
        yield run, build_graph(run.recipe)
    finally:
        run.close()


_ROOTS: dict[str, str] = {}  # flow run id -> the id at the top of its chain of parents, which never changes


def root_flow_run() -> str | None:
    """The id of the flow run at the top of this one's chain of parent flows (a stage's pipeline's, a proxy's swarm's),
    None outside a flow. Each parent is read from the API once a process, with one client: `prefect.runtime`'s
    `root_flow_run_id` read the whole chain for every stage flow, two reads a level, each with a client of its own
    (a TLS context each, 21 ms), ~30 CPU s over the test suite."""
    from prefect.client.orchestration import get_client

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    run_id, parent_task, chain = str(ctx.flow_run.id), ctx.flow_run.parent_task_run_id, []
    if run_id not in _ROOTS and parent_task is not None:
        with get_client(sync_client=True) as client:
            while run_id not in _ROOTS and parent_task is not None:
                chain.append(run_id)
                run_id = str(client.read_task_run(parent_task).flow_run_id)
                parent_task = None if run_id in _ROOTS else client.read_flow_run(run_id).parent_task_run_id
    root = _ROOTS.get(run_id, run_id)
    _ROOTS.update(dict.fromkeys([*chain, root], root))
    return root


def run_steps(run: Run, stage: str, graph: Graph, available: dict[str, StepOutput] | None = None) -> dict[str, StepOutput]:
    """Build the stage's steps in order on the outputs of earlier stages (`available`, else checked here)."""
    known = dict(upstream(run, graph, [stage]) if available is None else available)
    for step in graph.stage(stage):
        known[step.name] = build(run, step, {role: known[d.name] for role, d in step.deps.items()})
    return {step.name: known[step.name] for step in graph.stage(stage)}


@contextmanager
def eval_follower(run: Run, graph: Graph, kinds: tuple[str, ...]) -> Iterator[bool]:
    """Scores the run's KINDS of models ("checkpoint", "model") as they are committed, beside the body;
    no follower without KINDS or when the recipe turns following off. Yields whether one follows.
    A body that fails or is stopped (SIGTERM, a cancel) abandons the follower: it scores nothing new and
    its running evaluation is killed, so the process ends with its trainers (a relaunch scores the rest)."""
    if not kinds or not ev.following(run.recipe):
        yield False
        return
    stop, abandon = threading.Event(), threading.Event()
    follower = ev.follow.submit(run, graph.models, stop, kinds, abandon)
    try:
        yield True
    except BaseException:
        abandon.set()
        raise
    finally:
        stop.set()
        try:
            follower.wait()
        except BaseException:  # stopped while the follower finished its last round
            abandon.set()
            raise


Report = Callable[[Run, Graph, dict[str, StepOutput]], Path]
STAGE_REPORTS: list[tuple[Callable[[Graph], list[Step]], Report]] = []  # (the steps it reads, the report)


def stage_report(reads: Callable[[Graph], list[Step]]) -> Callable[[Report], Report]:
    """A report the stage flow that builds the last of the steps it READS writes after its steps."""

    def register(fn: Report) -> Report:
        STAGE_REPORTS.append((reads, fn))
        return fn

    return register


@stage_report(lambda graph: list(graph.curation.values()))
def _curation_report(run: Run, graph: Graph, out: dict[str, StepOutput]) -> Path:
    roles = {role: out[step.name] for role, step in graph.curation.items()}
    return curate.report(run.run_dir, run.recipe.name, list(out.values()), run.recipe.curate.examples_per_filter, **roles)


@stage_report(lambda graph: graph.phases)
def _pretraining_report(run: Run, graph: Graph, out: dict[str, StepOutput]) -> Path:
    return pretrain.report(run.run_dir, run.recipe.name, [out[s.name] for s in graph.phases])


@stage_report(lambda graph: [*graph.ladder, graph.pairs])
def _post_training_report(run: Run, graph: Graph, out: dict[str, StepOutput]) -> Path:
    # the earlier rungs and the pairs are upstream of the last rung, so current: the report reads them as they are
    done = {s.name: out.get(s.name) or finished(run.run_dir, s) for s in [*graph.ladder, graph.pairs]}
    models = [(s.model, done[s.name]) for s in graph.ladder]
    return postrain.report(run.run_dir, run.recipe.name, models, done[graph.pairs.name], list(done.values()))


def run_stage(stage: str, recipe: str | None, run_dir: str | None, overrides: list[str] | None, evals: bool = True) -> str:
    """Build STAGE's steps on what earlier stages left in the run dir, then the reports whose last step it built.
    With `evals`, checkpoints are scored while their trainer runs and each model right after its step (False:
    the caller's follower scores them). Returns what the stage made: its last step's model folder, else the
    stage's report, else its last step's folder."""
    with opened(recipe, run_dir, overrides) as (run, graph):
        steps = graph.stage(stage)
        available = upstream(run, graph, [stage])  # before the follower starts
        with eval_follower(run, graph, ("checkpoint",) if evals and any(s.checkpoints for s in steps) else ()):
            out = run_steps(run, stage, graph, available)
        for step in steps:
            if step.model and not step.checkpoints and evals:
                ev.evaluate_model(run, graph.models, step, out[step.name])
        order = [s.name for s in graph.steps]
        ours = [fn for reads, fn in STAGE_REPORTS if max(reads(graph), key=lambda s: order.index(s.name)).stage == stage]
        reports = [fn(run, graph, {**available, **out}) for fn in ours]
        for status in [] if _subflow() else out_of_date(run.run_dir, graph.steps):  # built on what this stage replaced
            run_logger().warning(
                "%s is out of date now (%s): `%s` rebuilds it on the run's recipe (`smolflow report` marks it on the card)",
                status.step.name, status.why(), rebuild_command(run.run_dir),
            )  # fmt: skip
        last = out[steps[-1].name]
        return str(last.final if steps[-1].model else reports[-1] if reports else last.path)


def _subflow() -> bool:
    """Whether this flow run is a stage of another (the full pipeline's), which builds the later stages itself."""
    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run is not None and ctx.flow_run.parent_task_run_id is not None


def _stage_flow(stage: str):
    """The Prefect flow of a stage of steps (`smolflow stage NAME`, the NAME/RECIPE deployments)."""

    def stage_flow(recipe: str | None = None, run_dir: str | None = None, overrides: Overrides = None, evals: bool = True) -> str:
        return run_stage(stage, recipe, run_dir, overrides, evals)

    stage_flow.__name__ = stage_flow.__qualname__ = f"{stage}_flow"
    return flow(name=stage, description=f"Build the {stage} stage's steps on what earlier stages left in RUN_DIR.")(stage_flow)


@flow(name=EVALUATE)
def evaluate_flow(recipe: str | None = None, run_dir: str | None = None, overrides: Overrides = None) -> str:
    """Evaluate every checkpoint and model in RUN_DIR that has no results yet, then rebuild the report card."""
    with opened(recipe, run_dir, overrides) as (run, graph):
        ev.evaluate_run(run, graph.models)
        return str(ev.report_card(run.run_dir, run.recipe.name, graph.steps))


# Stage name -> its flow, in DAG order: `smolflow stage NAME` runs one on its own, and prefect.yaml deploys each as
# flows/pipeline.py:NAME_flow (checked against STAGES by tests/test_graph.py).
STAGE_FLOWS = {name: evaluate_flow if name == EVALUATE else _stage_flow(name) for name in STAGES}
globals().update({f"{name}_flow": fn for name, fn in STAGE_FLOWS.items()})
BEGIN, END = "  # BEGIN stage deployments", "  # END stage deployments"


def stage_deployments(prefect_yaml: str) -> str:
    """PREFECT_YAML with its stage deployments (between the BEGIN and END lines) written from STAGES."""
    head, begin, rest = prefect_yaml.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SmolflowError(f"prefect.yaml has no lines starting {BEGIN!r} and {END!r} to put the stage deployments between")
    first = rest.split("\n", 1)[0]  # the rest of the BEGIN line
    lines = [
        f"  - {{name: tiny, entrypoint: flows/pipeline.py:{fn.fn.__name__}, parameters: *tiny, work_pool: *training, tags: *tags}}"
        for fn in STAGE_FLOWS.values()
    ]
    return "\n".join([head + begin + first, *lines, end + tail])


@flow(name="full-pipeline")
def full_pipeline(recipe: str, run_dir: str | None = None, overrides: Overrides = None, until: str | None = None) -> dict[str, str]:
    """Run the stages of RECIPE in order, up to and including `until` (default: all), then evaluate what
    the run holds and rebuild its report card; returns each stage's result. The recipe is frozen in the
    run dir once, here: the stage flows read it from there."""
    if until is not None and until not in STAGES:
        raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
    with opened(recipe, run_dir, overrides) as (run, graph):
        chosen = list(STAGES[: STAGES.index(until) + 1] if until else STAGES)
        if EVALUATE not in chosen:
            chosen.append(EVALUATE)
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
    """The recipe a run was made with (its frozen recipe.json; on a mirror, `runs/RUN/recipe.json`, or where a mirror
    written before that layout kept it: `recipe.json`, `RUN/recipe.json`), unless one is given."""
    if recipe_path:
        return load_recipe(recipe_path)
    fs, root = filesystem(source)
    local = "://" not in source
    if local:
        found = [f"{root}/{RECIPE}"]
    else:
        found = sorted(fs.glob(f"{root}/{RUNS}/*/{RECIPE}")) or sorted(fs.glob(f"{root}/{RECIPE}") + fs.glob(f"{root}/*/{RECIPE}"))
    if len(found) > 1:
        run_logger().warning("%s mirrors %d runs: evaluating with the recipe of %s (pass --recipe to choose)", source, len(found), found[0])
    try:
        with fs.open(found[0], "rb") as f:
            return frozen_recipe(json.loads(f.read()), found[0])
    except (FileNotFoundError, IndexError):
        where = RECIPE if local else f"{RUNS}/RUN/{RECIPE}"
        raise SmolflowError(f"{source} has no {where}: pass the recipe the run was made with") from None
