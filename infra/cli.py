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
def run(recipe: RecipeArg, run_dir: RunDirOpt = None, set_: SetOpt = None) -> None:
    """Run the full pipeline as one Prefect flow run; finished steps of the run dir are skipped."""
    from flows.pipeline import full_pipeline

    _run_flow(full_pipeline, recipe, run_dir, set_ or [])


@app.command()
def stage(
    name: Annotated[str, typer.Argument(help="Stage to run: curate.", show_default=False)],
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
