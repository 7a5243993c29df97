"""The `smolflow` command line: validate a recipe, run the pipeline or one stage as Prefect flows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infra.env import apply_offline_defaults
from infra.errors import SmolflowError

apply_offline_defaults()

app = typer.Typer(
    help="smolflow: train a small language model end to end (SmolLM3 recipe), every stage a Prefect flow.\n\n"
    "A recipe (YAML) is the whole experiment; configs/tiny.yaml runs on a 2-core laptop.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML, e.g. configs/tiny.yaml.", show_default=False)]
RunDirOpt = Annotated[str | None, typer.Option("--run-dir", help="Folder for every step's outputs [default: runs/<recipe name>].")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe key, e.g. --set curate.strict=true (repeatable; value is YAML)."),
]


def _fail(err: SmolflowError) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Check a recipe without running anything: unknown keys, wrong types, impossible values."""
    from infra.recipe import load_recipe

    try:
        r = load_recipe(recipe, set_ or [])
    except SmolflowError as err:
        _fail(err)
    typer.echo(f"{recipe}: valid recipe {r.name!r}")
    typer.echo(f"  sources: {', '.join(f'{s.name} ({s.domain}, {s.format})' for s in r.sources)}")
    for stage in r.pretrain.stages:
        mix = ", ".join(f"{k} {v:.0%}" for k, v in stage.mixture.items())
        typer.echo(f"  stage {stage.name}: {stage.tokens:,} tokens, seq {stage.seq_len or r.pretrain.seq_len}: {mix}")


@app.command("plan")
def plan_cmd(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Per pretraining stage: tokens, steps, global batch, FLOPs, memory per GPU (ZeRO 0-3), GPUs needed."""
    from infra.plan import GiB, plan
    from infra.recipe import load_recipe

    try:
        r = load_recipe(recipe, set_ or [])
        result = plan(r)
    except (SmolflowError, ValueError) as err:
        _fail(SmolflowError(str(err)))
    p = r.pretrain
    typer.echo(
        f"{r.name}: {result.params / 1e9:.3f}B parameters, {result.total_tokens:,} tokens, layout "
        f"DP {p.parallel.dp} x TP {p.parallel.tp} x PP {p.parallel.pp} = {result.gpus} {p.hardware.name}"
    )
    for s in result.stages:
        typer.echo(
            f"\n{s.name}: {s.tokens:,} tokens, seq {s.seq_len}, micro-batch {s.micro_batch}, global batch "
            f"DP {p.parallel.dp} x {s.micro_batch} x {p.grad_accum} x {s.seq_len} = {s.global_batch_tokens:,} tokens, "
            f"{s.steps:,} steps"
        )
        typer.echo(f"  compute: 6ND = {s.flops_6nd:.3e} FLOPs ({s.flops:.3e} with attention)")
        for z, mem in s.memory.items():
            mark = " <- recipe" if z == p.zero_stage else ""
            typer.echo(
                f"  memory/GPU ZeRO-{z}: {mem['total'] / GiB:7.1f} GiB (weights {mem['weights'] / GiB:.1f}, "
                f"grads {mem['grads'] / GiB:.1f}, optimizer {mem['optimizer'] / GiB:.1f}, "
                f"activations {mem['activations'] / GiB:.1f}){mark}"
            )
        for problem in s.problems:
            typer.secho(f"  ! {problem}", fg=typer.colors.YELLOW)
    if result.gpus_needed is not None:
        hw = p.hardware
        typer.echo(
            f"\nGPUs needed for {hw.target_days:g} days at {hw.assumed_mfu:.0%} MFU of {hw.peak_tflops:g} TFLOP/s: "
            f"{result.gpus_needed:.0f} (recipe layout: {result.gpus})"
        )


def _run_flow(flow_fn, recipe: Path, run_dir: str | None, overrides: list[str]) -> None:
    from infra.recipe import load_recipe

    try:
        load_recipe(recipe, overrides)  # fail fast, before a Prefect server is started
        result = flow_fn(str(recipe), run_dir, overrides)
    except SmolflowError as err:
        _fail(err)
    if isinstance(result, dict):
        for name, value in result.items():
            typer.echo(f"{name}: {value}")
    else:
        typer.echo(str(result))


@app.command()
def run(
    recipe: RecipeArg,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    until: Annotated[str | None, typer.Option(help="Stop after this stage, e.g. pretrain.")] = None,
) -> None:
    """Run the full pipeline as one Prefect flow run; finished steps of the run dir are skipped."""
    from functools import partial

    from flows.pipeline import STAGES, full_pipeline

    if until is not None and until not in STAGES:
        typer.secho(f"error: unknown stage {until!r}; stages: {', '.join(STAGES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    _run_flow(partial(full_pipeline, until=until), recipe, run_dir, set_ or [])


@app.command()
def stage(
    name: Annotated[str, typer.Argument(help="Stage to run: curate, pretrain, sft, preference, apo, grpo, evaluate.", show_default=False)],
    recipe: RecipeArg,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
) -> None:
    """Run one stage's flow, reading its inputs from the run dir of earlier stages."""
    from flows.pipeline import STAGES

    if name not in STAGES:
        typer.secho(f"error: unknown stage {name!r}; stages: {', '.join(STAGES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    _run_flow(STAGES[name], recipe, run_dir, set_ or [])


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run dir, e.g. runs/tiny.", show_default=False)],
    recipe: Annotated[Path | None, typer.Option(help="Recipe of the run [default: the run dir's recipe.json].")] = None,
) -> None:
    """Rebuild the run's report card (RUN_DIR/reports/card.md and its PNG plots) from what the run dir holds."""
    from tasks.evaluate import source_recipe
    from tasks.evaluation.report import build_report

    if not run_dir.is_dir():
        _fail(SmolflowError(f"{run_dir} is not a run dir"))
    try:
        card = build_report(run_dir, source_recipe(str(run_dir), str(recipe) if recipe else None))
    except SmolflowError as err:
        _fail(err)
    typer.echo(f"{card.path} ({len(card.plots)} plots, {len(card.eval_rows)} eval results)")


@app.command("eval")
def eval_cmd(
    source: Annotated[str, typer.Argument(help="A run dir or an s3:// prefix of mirrored checkpoints.", show_default=False)],
    recipe: Annotated[Path | None, typer.Option(help="Recipe of the run [default: the source's recipe.json].")] = None,
) -> None:
    """Evaluate every checkpoint and model under SOURCE that has no results yet (what the scheduled-eval flow runs)."""
    from flows.evaluate import scheduled_eval_flow

    try:
        result = scheduled_eval_flow(source, str(recipe) if recipe else None)
    except SmolflowError as err:
        _fail(err)
    typer.echo(result)


server_app = typer.Typer(help="A local Prefect server (127.0.0.1, SQLite under .smolflow/), work pool, worker and crash automation.")
app.add_typer(server_app, name="server")


@server_app.command("start")
def server_start(
    port: Annotated[int | None, typer.Option(help="Port [default: $SMOLFLOW_PORT or 4200].")] = None,
    worker: Annotated[bool, typer.Option(help="Also start a worker on the smolflow pool.")] = True,
) -> None:
    """Start the server (if not running), create the work pool, queues and automation, start a worker."""
    from infra.server import Server

    server = Server.here(port)
    try:
        server.start(worker=worker, say=typer.echo)
    except SmolflowError as err:
        _fail(err)
    typer.echo(f"Next: source {server.state / 'env'} && prefect --no-prompt deploy --all && prefect deployment run 'full-pipeline/tiny'")


@server_app.command("stop")
def server_stop(port: Annotated[int | None, typer.Option(help="Port [default: $SMOLFLOW_PORT or 4200].")] = None) -> None:
    """Stop the worker, then the server (by the PIDs recorded at start)."""
    from infra.server import Server

    Server.here(port).stop(say=typer.echo)


@server_app.command("status")
def server_status(port: Annotated[int | None, typer.Option(help="Port [default: $SMOLFLOW_PORT or 4200].")] = None) -> None:
    """Whether the server and worker run, and where the UI is."""
    from infra.server import Server

    for key, value in Server.here(port).status().items():
        typer.echo(f"{key}: {value}")
