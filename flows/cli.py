"""The `smolflow` command line: validate a recipe, run the pipeline or one stage as Prefect flows, say
what a run would do (`--dry-run`), score models, rebuild the report card, manage the local server."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from infra.env import apply_offline_defaults
from infra.errors import SmolflowError

if TYPE_CHECKING:  # the CLI imports the step machinery only in the commands that use it
    from flows.graph import Graph
    from infra.steps import Run, Status

apply_offline_defaults()

app = typer.Typer(
    help="smolflow: train a small language model end to end (SmolLM3 recipe), every stage a Prefect flow.\n\n"
    "A recipe (YAML) is the whole experiment; configs/tiny.yaml runs on a 2-core laptop.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML, e.g. configs/tiny.yaml.", show_default=False)]
RunDirOpt = Annotated[str | None, typer.Option("--run-dir", help="Folder for every step's outputs (default: `runs/<recipe name>`).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a recipe key, e.g. --set curate.strict=true (repeatable; value is YAML), "
        "or apply an overlay file of such keys: --set @configs/overlays/slurm.yaml.",
    ),
]


def runs_flows(command):
    """For a command that runs flows in this process: what it starts from here on, Prefect's temporary API
    server included, is killed once the process is gone, however it ends (infra/procs.py `reap_when_gone`)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from infra.procs import reap_when_gone

        reap_when_gone()
        return command(*args, **kwargs)

    return wrapper


def _start(flow, *args, **kwargs):
    """Call FLOW here, Prefect's temporary API server (where no PREFECT_API_URL is set) in a session of its own, so a
    Ctrl-C reaches the flow and not the server it reports to. Set up here, once the command's checks passed: Prefect's
    server module costs 4 CPU s to import, and a refused command (a bad recipe, a missing upstream) does not need it."""
    from flows.server import temporary_server_of_its_own

    temporary_server_of_its_own()
    return flow(*args, **kwargs)


def _fail(err: SmolflowError) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Say what would run and why (cached / run / rerun + changed keys); run nothing.")
]


def _resolve(recipe: Path, overrides: list[str]):
    """The recipe and its step graph; every check a run would do before starting anything."""
    from flows.graph import build_graph
    from infra.recipe import load_recipe

    r = load_recipe(recipe, overrides)
    return r, build_graph(r)


@app.command()
def validate(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Check a recipe without running anything: unknown keys, wrong types, impossible values, filter parameters."""
    try:
        r, graph = _resolve(recipe, set_ or [])
    except SmolflowError as err:
        _fail(err)
    typer.echo(f"{recipe}: valid recipe {r.name!r}, {len(graph.steps)} steps")
    typer.echo(f"  sources: {', '.join(f'{s.name} ({s.domain}, {s.format})' for s in r.sources)}")
    for phase in r.pretrain.phases:
        mix = ", ".join(f"{k} {v:.0%}" for k, v in phase.mixture.items())
        typer.echo(f"  phase {phase.name}: {phase.tokens:,} tokens, seq {r.pretrain.phase_seq_len(phase)}: {mix}")
    typer.echo(f"  generation: {_generation(r)}")


def _generation(r) -> str:
    """Which engine each generating step uses on this machine, and the vLLM build found."""
    from infra.env import vllm_build
    from postrain.generation import resolve_backend

    def pick(kind: str) -> str:
        try:
            return resolve_backend(kind)
        except SmolflowError:
            return "vllm (not installed: the step will fail)"

    p = r.postrain
    uses = {"preference pairs": p.preference.backend, "GRPO rollouts": p.grpo.backend, "held-out scoring": p.heldout_eval.backend}
    used = ", ".join(f"{name} {pick(kind)}" for name, kind in uses.items())
    return f"{vllm_build() or 'no vLLM installed'}; {used}; lm-eval {r.evaluation.backend}"


@app.command("plan")
def plan_cmd(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Per pretraining phase: tokens, steps, global batch, FLOPs, memory per GPU (ZeRO 0-3), GPUs needed;
    per post-training trainer: ranks, ZeRO stage, batch, memory per GPU."""
    from infra.recipe import load_recipe
    from model.plan import plan, trainer_plans

    try:
        r = load_recipe(recipe, set_ or [])
        vocab = r.model.vocab_size or (r.curate.tokenizer.train.vocab_size if r.curate.tokenizer.train else None)
        if vocab is None:
            raise SmolflowError("model.vocab_size is needed to plan a recipe whose tokenizer is given by path")
        result = plan(r.model, r.pretrain, vocab)
    except (SmolflowError, ValueError) as err:
        _fail(SmolflowError(str(err)))
    p = r.pretrain
    typer.echo(
        f"{r.name}: {result.params / 1e9:.3f}B parameters, {result.total_tokens:,} tokens, layout "
        f"DP {p.parallel.dp} x TP {p.parallel.tp} x PP {p.parallel.pp} = {result.gpus} {p.hardware.name}"
    )
    for s in result.phases:
        typer.echo(
            f"\n{s.name}: {s.tokens:,} tokens, seq {s.seq_len}, micro-batch {s.micro_batch} per GPU, global batch "
            f"{s.global_batch_tokens // s.seq_len} x {s.seq_len} = {s.global_batch_tokens:,} tokens, {s.steps:,} steps"
        )
        typer.echo(f"  compute: 6ND = {s.flops_6nd:.3e} FLOPs ({s.flops:.3e} with attention)")
        for z, mem in s.memory.items():
            typer.echo(f"  memory/GPU ZeRO-{z}: {_memory(mem)}" + (" <- recipe" if z == p.zero_stage else ""))
        for problem in s.problems:
            typer.secho(f"  ! {problem}", fg=typer.colors.YELLOW)
    if result.gpus_needed is not None:
        hw = p.hardware
        typer.echo(
            f"\nGPUs needed for {hw.target_days:g} days at {hw.assumed_mfu:.0%} MFU of {hw.peak_tflops:g} TFLOP/s: "
            f"{result.gpus_needed:.0f} (recipe layout: {result.gpus})"
        )
    typer.echo(f"\npost-training (postrain.launcher), memory per {p.hardware.name}:")
    for t in trainer_plans(r.model, r.postrain, vocab, p.hardware.memory_gb):
        typer.echo(
            f"  {t.name}: {t.ranks} rank(s), ZeRO-{t.zero_stage}, {t.per_rank} x {t.seq_len} tokens per rank per micro-step, "
            f"{t.global_batch} sequences per update; memory/GPU {_memory(t.memory)}"
        )
        for problem in t.problems:
            typer.secho(f"    ! {problem}", fg=typer.colors.YELLOW)


def _memory(mem: dict[str, float]) -> str:
    from model.plan import GiB

    parts = ", ".join(f"{k} {mem[k] / GiB:.1f}" for k in ("weights", "grads", "optimizer", "activations"))
    return f"{mem['total'] / GiB:7.1f} GiB ({parts})"


def _explain(run: Run, graph: Graph, recipe: Path, overrides: list[str], stages: list[str], always: bool) -> list[Status] | None:
    """Print what running `stages` would do in the run dir: recipe changes against the frozen recipe, then
    each step as cached / pull / resume / run / rerun with the config keys that changed (the build's own
    decision, mirror included); only when the recipe changed, unless `always`. Returns every step's decision."""
    from infra.recipe import operational_key

    if not always and not run.changes:
        return None
    decided = run.statuses(graph.steps)
    typer.echo(f"{run.run_dir}: {recipe}" + (f" with {' '.join(overrides)}" if overrides else ""))
    if run.changes:
        typer.echo(f"recipe changes against the frozen {run.run_dir / 'recipe.json'}:")
        for key, old, new in run.changes:
            note = "   (operational: reruns nothing)" if operational_key(key) else ""
            typer.echo(f"  {key}: {old!r} -> {new!r}{note}")
    chosen = [s for s in decided if s.step.stage in stages]
    typer.echo(f"steps (store {run.store}):")
    for status in chosen:
        why = f"  ({status.reason})" if status.reason else ""
        typer.echo(f"  {status.state:8} {status.step.name}{why}")
        for key, old, new in status.changes:
            typer.echo(f"             {key}: {old!r} -> {new!r}")
    runs = sum(s.state != "cached" for s in chosen)
    typer.echo(f"{runs} of {len(chosen)} steps would run; {len(chosen) - runs} cached.")
    return decided


def _run_flow(recipe: Path, run_dir: str | None, overrides: list[str], dry_run: bool, stage: str | None, until: str | None = None) -> None:
    """Run one STAGE's flow, else the pipeline's up to UNTIL, after the checks a dry run also makes."""
    from flows.graph import STAGES, build_graph, upstream
    from infra.steps import Run

    stages = [stage] if stage else list(STAGES[: STAGES.index(until) + 1] if until else STAGES)
    try:
        _resolve(recipe, overrides)  # fail fast, before a Prefect server is started
        run = Run.open(str(recipe), run_dir, overrides, freeze=False)  # opened once: its recipe changes are logged once
        graph = build_graph(run.recipe)
        decided = _explain(run, graph, recipe, overrides, stages, always=dry_run)
        # inputs from earlier stages missing: refused here, in seconds, not in a flow run after a Prefect server start;
        # the stage flow's own decision (cached, or pulled from the mirror), without pulling; a dry run ends with it
        upstream(run, graph, stages, obtain=False, decided=decided)
        if dry_run:
            return
        from flows.pipeline import STAGE_FLOWS, full_pipeline  # Prefect, imported once a flow runs (~2 CPU s)

        args = (str(recipe), run_dir, overrides)
        result = _start(STAGE_FLOWS[stage], *args) if stage else _start(full_pipeline, *args, until=until)
    except SmolflowError as err:
        _fail(err)
    if isinstance(result, dict):
        for name, value in result.items():
            typer.echo(f"{name}: {value}")
    else:
        typer.echo(str(result))


@app.command()
@runs_flows
def run(
    recipe: RecipeArg,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    until: Annotated[str | None, typer.Option(help="Stop after this stage, e.g. pretrain (the run is still evaluated).")] = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Run the full pipeline as one Prefect flow run; finished steps of the run dir are skipped.

    On an existing run dir whose frozen recipe differs, the changes and what they rerun are printed first."""
    from flows.graph import STAGES

    if until is not None and until not in STAGES:
        typer.secho(f"error: unknown stage {until!r}; stages: {', '.join(STAGES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    _run_flow(recipe, run_dir, set_ or [], dry_run, None, until)


@app.command()
@runs_flows
def stage(
    name: Annotated[str, typer.Argument(help="Stage to run: curate, pretrain, sft, preference, apo, grpo, evaluate.", show_default=False)],
    recipe: RecipeArg,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Run one stage's flow, reading its inputs from the run dir of earlier stages (which must be current)."""
    from flows.graph import STAGES

    if name not in STAGES:
        typer.secho(f"error: unknown stage {name!r}; stages: {', '.join(STAGES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    _run_flow(recipe, run_dir, set_ or [], dry_run, name)


@app.command()
@runs_flows
def ablate(
    ablation: Annotated[Path, typer.Argument(help="Ablation file, e.g. configs/ablations/apo_vs_dpo.yaml.", show_default=False)],
    run_dir: Annotated[str | None, typer.Option("--run-dir", help="Folder of the ablation (default: `runs/ablations/<name>`).")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Per run, which steps are cached, built, or shared with other runs; run nothing.")
    ] = False,
    report_only: Annotated[bool, typer.Option("--report", help="Only rebuild the comparison report from what the runs hold.")] = False,
) -> None:
    """Run the variants of an ablation side by side, each step they share built once, and compare them.

    An ablation file names a base recipe and variants (a name + `--set` overrides each), and seeds per variant.
    Each variant x seed is a run dir under the ablation's folder; steps with the same identity are built once.
    report/ablation.md compares each variant with the baseline over the items both answered (a paired interval,
    McNemar for right/wrong items) and calls it better or worse only beyond the noise floor the baseline's seeds
    measure; it says which eval tasks carry signal (`smolflow evals audit`)."""
    from flows.ablation import ablation_flow, explain, open_ablation
    from flows.ablation import report as ablation_report

    try:
        abl = open_ablation(str(ablation), run_dir)  # every variant validated before a Prefect server starts
        if dry_run:
            typer.echo("\n".join(explain(abl)))
            return
        path = ablation_report(abl) if report_only else _start(ablation_flow, str(ablation), run_dir)
    except SmolflowError as err:
        _fail(err)
    typer.echo(str(path))


@app.command()
@runs_flows
def swarm(
    swarm_file: Annotated[Path, typer.Argument(help="Swarm file, e.g. configs/swarms/mix_phase1.yaml.", show_default=False)],
    run_dir: Annotated[str | None, typer.Option("--run-dir", help="Folder of the swarm (default: `runs/swarms/<name>`).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="The proxies' mixtures and what each would build; run nothing.")] = False,
    report_only: Annotated[bool, typer.Option("--report", help="Only refit and rewrite the report from what the proxies hold.")] = False,
    set_: SetOpt = None,
) -> None:
    """Search one pretraining phase's mixture with a swarm of small proxy runs, then fit and propose.

    The base recipe is curated once; N mixtures are drawn around the phase's prior (Dirichlet, seeded, within
    the bounds and pretrain.max_epochs: refused draws are redrawn and counted); each proxy is a run of an ablation
    (shared steps built once, `concurrency` at a time) that trains the phases up to the searched one (a failed
    proxy is reported, and retried by a rerun). A log-linear and a lightgbm fit of mixture -> target
    (the target tasks' weighted main metric) are compared out of fold; the better one proposes a mixture, which
    is then trained beside the prior and the natural mixture at a larger scale over seeds (`validation`).
    Sources listed as `frozen` keep the prior's proportions and move as one weight (Olmix's mixture reuse), and the
    `prior` may be another swarm's `report/swarm.json` (its proposal): after one source's data changed, search it
    alone against the rest as proposed, with fewer proxies (configs/swarms/mix_phase1_math.yaml).
    report/swarm.md, ratios.csv and metrics.csv (Olmix's format) land in the swarm's folder. `--set` applies to
    every run, e.g. `--set @configs/overlays/slurm.yaml` trains each proxy's phases as Slurm jobs,
    `--set pretrain.launcher.kind=ray` as Ray tasks."""
    from flows.ablation import plan_table
    from flows.swarm import explain, known_tokens, open_swarm, swarm_flow
    from flows.swarm import report as swarm_report
    from infra.swarm import load_swarm

    try:
        available = known_tokens(load_swarm(swarm_file, run_dir, set_))
        sw, draws, abl = open_swarm(str(swarm_file), run_dir, available, set_)  # every proxy validated before a server starts
        if dry_run:
            typer.echo("\n".join(explain(sw, draws, known_tokens=available is not None) + [""] + plan_table(abl)[0]))
            return
        if report_only and available is None:
            raise SmolflowError(f"{sw.root}: no finished curation run yet: run the swarm first")
        path = swarm_report(sw, draws, abl, available) if report_only else _start(swarm_flow, str(swarm_file), run_dir, set_)
    except SmolflowError as err:
        _fail(err)
    typer.echo(str(path))


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run dir, e.g. runs/tiny.", show_default=False)],
    recipe: Annotated[Path | None, typer.Option(help="Recipe of the run (default: the run dir's recipe.json).")] = None,
) -> None:
    """Rebuild the run's report card (RUN_DIR/reports/card.md and its PNG plots) from what the run dir holds."""
    from flows.graph import build_graph
    from flows.pipeline import source_recipe
    from tasks.evaluation.report import build_report

    if not run_dir.is_dir():
        _fail(SmolflowError(f"{run_dir} is not a run dir"))
    try:
        r = source_recipe(str(run_dir), str(recipe) if recipe else None)
        card = build_report(run_dir, r.name, build_graph(r).steps)
    except SmolflowError as err:
        _fail(err)
    typer.echo(f"{card.path} ({len(card.plots)} plots, {len(card.eval_rows)} eval results)")


@app.command()
def publish(
    run_dir: Annotated[Path, typer.Argument(help="A run dir, e.g. runs/tiny.", show_default=False)],
    step: Annotated[str, typer.Argument(help="The step whose final/ model to publish, e.g. grpo or pretrain_phase3.", show_default=False)],
    repo_id: Annotated[str, typer.Argument(help="Hub repository, e.g. my-org/smol-tiny-grpo (created if missing).", show_default=False)],
    private: Annotated[bool, typer.Option(help="Create the repository private.")] = False,
    card_only: Annotated[bool, typer.Option("--card-only", help="Print the card that would be uploaded; upload nothing.")] = False,
) -> None:
    """Upload a finished model folder to the Hugging Face hub, with its model card and the eval results recorded
    since the step finished. Needs the network and a token (HF_TOKEN or `hf auth login`); smolflow runs offline
    by default, so run it as `HF_HUB_OFFLINE=0 smolflow publish ...`."""
    from flows.graph import build_graph
    from flows.pipeline import source_recipe
    from tasks.card import publish as upload
    from tasks.card import publish_card

    try:
        steps = [s.name for s in build_graph(source_recipe(str(run_dir), None)).steps]
        folder, files, card = publish_card(run_dir, step, steps)
        if card_only:
            typer.echo(card)
            return
        typer.echo(f"{folder}: uploading {len(files)} files (checked against the step's manifest) to {repo_id}")
        typer.echo(upload(folder, files, card, repo_id, private))
    except SmolflowError as err:
        _fail(err)


@app.command()
def dashboard(
    run_dir: Annotated[Path, typer.Argument(help="A run dir, e.g. runs/tiny.", show_default=False)],
    port: Annotated[int, typer.Option(help="Port to listen on, on 127.0.0.1 only.")] = 7860,
) -> None:
    """Show the run's training curves (each pretraining phase, SFT, APO, GRPO) in trackio's dashboard, served on
    127.0.0.1 only: open the printed address here, or from another machine through `ssh -L PORT:127.0.0.1:PORT`.
    Ctrl-C stops it. The trainers log there with pretrain.tracking / postrain.tracking: trackio (the default)."""
    import os

    from tasks.common import TRACKIO, tracking_env

    projects = sorted(p.stem for p in (run_dir / TRACKIO).glob("*.db"))
    if not projects:
        _fail(SmolflowError(f"{run_dir / TRACKIO} holds no trackio metrics: not a run dir, or its trainers ran with tracking: none"))
    os.environ.update(tracking_env(run_dir))  # before trackio is imported: it reads its folder then
    import trackio

    project = projects[0] if len(projects) == 1 else None  # several: the dashboard lets the user pick
    # host and share given: trackio's defaults follow $SYSTEM (a Space: every interface) and $GRADIO_SHARE (a public tunnel)
    trackio.show(project, host="127.0.0.1", share=False, server_port=port, open_browser=False, block_thread=True)


@app.command("eval")
@runs_flows
def eval_cmd(
    source: Annotated[str, typer.Argument(help="A run dir or an s3:// prefix of mirrored checkpoints.", show_default=False)],
    recipe: Annotated[Path | None, typer.Option(help="Recipe of the run (default: the source's recipe.json).")] = None,
) -> None:
    """Evaluate every checkpoint and model under SOURCE that has no results yet (what the scheduled-eval flow runs)."""
    if "://" not in source:  # a typo is named here, before a Prefect server starts (a schedule's flow just waits for its run)
        _require_run_dirs([Path(source)])
    from flows.pipeline import scheduled_eval_flow

    try:
        result = _start(scheduled_eval_flow, source, str(recipe) if recipe else None)
    except SmolflowError as err:
        _fail(err)
    typer.echo(result)


def _require_run_dirs(paths: list[Path]) -> None:
    missing = [str(p) for p in paths if not (p / "recipe.json").is_file()]
    if missing:
        _fail(SmolflowError(f"not run dirs (no recipe.json): {', '.join(missing)}"))


evals_app = typer.Typer(help="Checks of the evaluation results that runs hold.")
app.add_typer(evals_app, name="evals")


@evals_app.command("audit")
def evals_audit(
    run_dirs: Annotated[list[Path], typer.Argument(help="One run dir, or seeds of one recipe.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON instead of a table.")] = False,
) -> None:
    """Which eval tasks carry signal at this scale, over the pretraining checkpoints of RUN_DIRS: monotonicity
    (Spearman vs tokens), noise (across the runs, taken as seeds; one run: its last checkpoints' jitter about their
    trend), signal-to-noise, distance from chance,
    and with several runs ranking consistency (Kendall) between successive checkpoints. Each task gets a verdict:
    usable early, usable late, or no signal at this scale (the report card shows the same table)."""
    _require_run_dirs(run_dirs)  # a typo named in a second, before the imports below
    import json

    from flows.graph import build_graph
    from flows.pipeline import source_recipe
    from tasks.evaluation.audit import audit, audit_table
    from tasks.evaluation.report import eval_records

    try:
        audits = audit([eval_records(d, build_graph(source_recipe(str(d), None)).steps) for d in run_dirs])
    except SmolflowError as err:
        _fail(err)
    typer.echo(json.dumps([a.row() for a in audits], indent=2) if as_json else "\n".join(audit_table(audits)))


@app.command()
def deployments(
    write: Annotated[bool, typer.Option("--write", help="Rewrite prefect.yaml's stage deployments (else print the file).")] = False,
) -> None:
    """prefect.yaml with one deployment per stage of the graph (flows/graph.py STAGES): a new stage gets its
    deployment here, not by hand. `make deploy` writes them before `prefect deploy --all`."""
    from flows.pipeline import stage_deployments

    path = Path("prefect.yaml")
    try:
        text = stage_deployments(path.read_text())
    except (OSError, SmolflowError) as err:
        _fail(err if isinstance(err, SmolflowError) else SmolflowError(f"{path}: {err}"))
    if write:
        path.write_text(text)
        typer.echo(f"{path}: stage deployments written")
    else:
        typer.echo(text, nl=False)


server_app = typer.Typer(help="A local Prefect server (127.0.0.1, SQLite under .smolflow/), work pool, worker and crash relaunch check.")
app.add_typer(server_app, name="server")


@server_app.command("start")
def server_start(
    port: Annotated[int | None, typer.Option(help="Port (default: $SMOLFLOW_PORT or 4200).")] = None,
    worker: Annotated[bool, typer.Option(help="Also start a worker on the smolflow pool.")] = True,
) -> None:
    """Start the server (if not running), create the work pool, queues, crash check and automation, start a worker."""
    from flows.server import Server

    server = Server.here(port)
    try:
        server.start(worker=worker, say=typer.echo)
    except SmolflowError as err:
        _fail(err)
    typer.echo(f"Next: source {server.state / 'env'} && prefect --no-prompt deploy --all && prefect deployment run 'full-pipeline/tiny'")


@server_app.command("stop")
def server_stop(port: Annotated[int | None, typer.Option(help="Port (default: $SMOLFLOW_PORT or 4200).")] = None) -> None:
    """Stop the worker, then the server (by the PIDs recorded at start)."""
    from flows.server import Server

    Server.here(port).stop(say=typer.echo)


@server_app.command("status")
def server_status(port: Annotated[int | None, typer.Option(help="Port (default: $SMOLFLOW_PORT or 4200).")] = None) -> None:
    """Whether the server and worker run, and where the UI is."""
    from flows.server import Server

    for key, value in Server.here(port).status().items():
        typer.echo(f"{key}: {value}")


cluster_app = typer.Typer(help="Local clusters (state under .smolflow/) to try the scale-out paths on this machine.")
slurm_app = typer.Typer(help="A single-node Slurm cluster: slurmctld + slurmd, partition `cpu`, config in .smolflow/slurm/.")
ray_app = typer.Typer(help="A Ray head on 127.0.0.1, which recipes with executor.kind=ray join.")
app.add_typer(cluster_app, name="cluster")
cluster_app.add_typer(slurm_app, name="slurm")
cluster_app.add_typer(ray_app, name="ray")


@slurm_app.command("start")
def slurm_start() -> None:
    """Install slurm-wlm and munge if missing (as root, apt-get), start munged, slurmctld and slurmd; wait for the node.
    The daemons listen on ports P and P+1 ($SMOLFLOW_SLURM_PORT, default 6817): a port taken is named before either starts."""
    from flows.cluster import Slurm

    try:
        Slurm.here().start(say=typer.echo)
    except SmolflowError as err:
        _fail(err)


@slurm_app.command("stop")
def slurm_stop() -> None:
    """Cancel the cluster's jobs, stop slurmd and slurmctld."""
    from flows.cluster import Slurm

    Slurm.here().stop(say=typer.echo)


@slurm_app.command("status")
def slurm_status() -> None:
    """Daemons, the node's state, the configuration file, missing commands and queued jobs."""
    from flows.cluster import Slurm

    slurm = Slurm.here()
    for key, value in slurm.status().items():
        typer.echo(f"{key}: {value}")
    for job in slurm.jobs() if slurm.pid("slurmctld") else []:
        typer.echo(f"job {job['id']} {job['name']} {job['state']}")


@ray_app.command("start")
def ray_start() -> None:
    """Start a Ray head on 127.0.0.1 ($SMOLFLOW_RAY_PORT, default 6379) with this machine's CPUs."""
    from flows.cluster import Ray

    try:
        Ray.here().start(say=typer.echo)
    except SmolflowError as err:
        _fail(err)


@ray_app.command("stop")
def ray_stop() -> None:
    """`ray stop`: end this user's Ray processes on this machine."""
    from flows.cluster import Ray

    try:
        Ray.here().stop(say=typer.echo)
    except SmolflowError as err:
        _fail(err)


@ray_app.command("status")
def ray_status() -> None:
    """The head's address and whether it answers."""
    from flows.cluster import Ray

    for key, value in Ray.here().status().items():
        typer.echo(f"{key}: {value}")


if __name__ == "__main__":
    app()
