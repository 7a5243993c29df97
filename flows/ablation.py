"""Ablations: run recipe variants side by side, build every step they share once, compare them.

Each run of an ablation (a variant with one seed) is an ordinary run dir, `ABLATION/RUN`, run by
the full pipeline, so its report card, `smolflow stage ... --run-dir` and `smolflow eval` work
as for any run. What makes the runs share work is one step store, `ABLATION/steps` or the
recipe's project-wide `storage.store`: every run's `RUN/steps` links to it, a step is built into
`steps/NAME-ID` and linked from the run dirs whose step has that identity (infra/steps.py), and a
run that finds a shared step being built by another waits for it. Evaluation results are shared the same way (`RUN/evals/results` links to
`ABLATION/evals/results`, keyed by model content), so a shared checkpoint is scored once.
"""

from __future__ import annotations

import contextvars
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow, get_run_logger

from flows.graph import STAGES, build_graph
from flows.pipeline import full_pipeline
from infra.ablation import AUTO, Ablation, AblationCfg, AblationRun, read_spec, resolve_ablation
from infra.errors import SmolflowError
from infra.procs import STOPPING, stop_on_signals
from infra.recipe import Recipe
from infra.steps import STEPS, Step, plan_ids, statuses
from infra.storage import Mirror, write_json_atomic
from tasks.evaluation.audit import NOISE_WINDOW
from tasks.evaluation.compare import AblationRunDir, publish_comparison
from tasks.evaluation.results import RESULTS


def open_ablation(path: str, run_dir: str | None = None) -> Ablation:
    """Load and validate the ablation file, every run's recipe and graph, before anything runs."""
    cfg = read_spec(Path(path), AblationCfg, "ablation")
    root = Path(run_dir or cfg.run_dir or Path("runs") / "ablations" / cfg.name)
    if cfg.seed_key == AUTO:
        cfg = cfg.model_copy(update={"seed_key": varied_seeds(cfg, Path(path), root)})
    return checked(resolve_ablation(cfg, Path(path), root))


def varied_seeds(cfg: AblationCfg, path: Path, root: Path) -> list[str]:
    """`seed_key: auto`: the seed keys of the trained steps (Step.seed) the variants build apart, upstream first; in
    a seed study, of every step it trains. A seed then repeats what is compared, and only that: the recipe's `seed`
    would rebuild the corpus too, and its noise is not the variants' difference."""
    one = checked(resolve_ablation(cfg.model_copy(update={"seeds": 1}), path, root))
    ids = [plan_ids(steps_of(one, run)) for run in one.runs]
    steps = [s for run in one.runs for s in steps_of(one, run)]
    apart = {s.name for s in steps if len(one.runs) == 1 or len({i.get(s.name) for i in ids}) > 1}
    keys = list(dict.fromkeys(s.seed for s in steps if s.seed and s.name in apart))
    if not keys and cfg.seeds > 1:
        raise SmolflowError(f"{path}: seed_key auto: the variants train no step apart within `until`; name the seed_key")
    return keys


def checked(ablation: Ablation) -> Ablation:
    if ablation.cfg.until is not None and ablation.cfg.until not in STAGES:
        raise SmolflowError(f"{ablation.path}: until: unknown stage {ablation.cfg.until!r}; stages: {', '.join(STAGES)}")
    for run in ablation.runs:
        build_graph(run.recipe)
    return ablation


def store_of(recipe: Recipe, root: Path) -> Path:
    """The step store runs under ROOT share: the recipe's project-wide `storage.store`, else ROOT/steps."""
    return Path(recipe.storage.store) if recipe.storage.store else root / STEPS


def store_of_ablation(ablation: Ablation) -> Path:
    return store_of(ablation.runs[0].recipe, ablation.root)


def link_stores(run_dir: Path, store: Path, root: Path) -> None:
    """RUN_DIR's steps and evaluation results as links to the step store and ROOT's result store."""
    store.mkdir(parents=True, exist_ok=True)
    (root / RESULTS).mkdir(parents=True, exist_ok=True)
    (run_dir / RESULTS).parent.mkdir(parents=True, exist_ok=True)
    for link, target in ((run_dir / STEPS, store), (run_dir / RESULTS, root / RESULTS)):
        if not link.is_symlink():
            if link.exists():
                raise SmolflowError(f"{link} exists and is not a link to {target}: use another run dir for this ablation")
            link.symlink_to(os.path.relpath(target, link.parent))


def prepare(ablation: Ablation) -> None:
    """The run dirs, each linked to the shared step store and result store."""
    root, store = ablation.root, store_of_ablation(ablation)
    for run in ablation.runs:
        link_stores(root / run.name, store, root)
    previous = json.loads((root / "ablation.json").read_text()) if (root / "ablation.json").is_file() else {}
    write_json_atomic(
        root / "ablation.json",
        {
            "wall_seconds": previous.get("wall_seconds", []),  # one per `smolflow ablate`, the first the full build
            "file": str(ablation.path),
            "config": ablation.cfg.model_dump(mode="json"),
            "runs": [{"name": r.name, "variant": r.variant, "seed": r.seed, "overrides": list(r.overrides)} for r in ablation.runs],
        },
    )


def stages_of(ablation: Ablation) -> list[str]:
    until = ablation.cfg.until
    return list(STAGES[: STAGES.index(until) + 1] if until else STAGES)


def steps_of(ablation: Ablation, run: AblationRun) -> list[Step]:
    """The steps a run of the ablation builds (those of its stages up to `until`), upstream first."""
    stages = set(stages_of(ablation))
    return [s for s in build_graph(run.recipe).steps if s.stage in stages]


def explain(ablation: Ablation) -> list[str]:
    """The runs and their overrides, what each would do with each step (`plan_table`), and the noise floor."""
    lines = [
        f"ablation {ablation.cfg.name}: {len(ablation.runs)} runs of {ablation.base} in {ablation.root}, "
        f"stages {', '.join(dict.fromkeys([*stages_of(ablation), 'evaluate']))}",
        *(f"  {r.name}: {' '.join(r.overrides) or '(the base recipe)'}" for r in ablation.runs),
        "",
    ]
    table, per_run, users = plan_table(ablation)
    return lines + table + [_noise_floor(ablation, per_run, users)]


def plan_table(ablation: Ablation):
    """A table of what each run would do with each step: `build`, `cached` (in the store), or `shared`
    (built once, by the first run that needs it); then what sharing saves. Steps are matched by plan id
    (infra/steps.py `plan_ids`): equal configs and equal upstream steps. Also returns, per run, its steps
    and their ids and states, and the runs using each distinct step."""
    store = store_of_ablation(ablation)
    users: dict[tuple[str, str], list[str]] = {}
    per_run, names = [], []
    for run in ablation.runs:
        steps = steps_of(ablation, run)
        ids = plan_ids(steps)
        mirror = Mirror(run.recipe.storage.mirror, run.recipe.storage.s3) if run.recipe.storage.mirror else None
        state = {s.step.name: s.state for s in statuses(ablation.root / run.name, steps, mirror, store)}
        per_run.append((run, steps, ids, state))
        names += [s.name for s in steps if s.name not in names]
        for step in steps:
            users.setdefault((step.name, ids[step.name]), []).append(run.name)
    seen: set[tuple[str, str]] = set()
    columns: list[list[str]] = []  # per run, its cell of each step in `names`
    builds = 0
    for _, steps, ids, state in per_run:
        column = dict.fromkeys(names, "")
        for step in steps:
            key = (step.name, ids[step.name])
            cell = "cached" if state[step.name] == "cached" else "shared" if key in seen else "build"
            builds += cell == "build"
            seen.add(key)
            column[step.name] = cell + ("*" if len(users[key]) > 1 else "")
        columns.append(list(column.values()))
    heads, cols = _grouped([r.name for r in ablation.runs], columns)
    widths = [max(9, len(h)) + 2 for h in heads]
    lines = [(f"{'step':<24}" + "".join(f"{h:<{w}}" for h, w in zip(heads, widths))).rstrip()]
    lines += [(f"{n:<24}" + "".join(f"{c[i]:<{w}}" for c, w in zip(cols, widths))).rstrip() for i, n in enumerate(names)]
    uses, distinct = sum(len(u) for u in users.values()), len(users)
    lines += [
        "(* the step is the same in several runs: built once, linked into each)",
        f"{uses} steps in all runs, {distinct} distinct: sharing saves {uses - distinct} builds; {builds} to build now, "
        f"{distinct - builds} cached in {store}.",
    ]
    distinct_tokens, now, total = _pretraining_tokens(per_run)
    if total:
        shared = (
            f"{distinct_tokens:,} in the distinct steps instead of {total:,} for independent runs"
            if distinct_tokens < total
            else f"{total:,} (the runs share no pretraining step)"
        )
        todo = "all to train now" if now == distinct_tokens else f"{now:,} of them to train now, the rest cached" if now else "all cached"
        lines.append(f"Pretraining tokens: {shared}; {todo}.")
    return lines, per_run, users


def _grouped(names: list[str], columns: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Three or more neighbouring runs that do the same with every step share one column, headed `first..last (n)`:
    a swarm's 32 proxies fit a terminal."""
    heads: list[str] = []
    cols: list[list[str]] = []
    i = 0
    while i < len(names):
        j = i
        while j + 1 < len(names) and columns[j + 1] == columns[i]:
            j += 1
        if j - i >= 2:
            heads.append(f"{names[i]}..{names[j]} ({j - i + 1})")
            cols.append(columns[i])
        else:
            heads += names[i : j + 1]
            cols += columns[i : j + 1]
        i = j + 1
    return heads, cols


def _noise_floor(ablation: Ablation, per_run, users) -> str:
    """What measures the noise floor a verdict must exceed, and what it costs: the baseline's seeds."""
    base = [(run, steps, ids) for run, steps, ids, _ in per_run if run.variant == ablation.baseline]
    per_seed = {step.name for run, steps, ids in base for step in steps if len(users[(step.name, ids[step.name])]) == 1}
    if len(base) < 2:
        run, steps, _ = base[0]
        scored = run.recipe.evaluation.checkpoint_tasks and any(s.checkpoints for s in steps)
        how = (
            f"for the pretrained model's tasks, the jitter of its last {NOISE_WINDOW} checkpoints' scores about their trend where it has "
            f"{2 * NOISE_WINDOW} or more (no extra cost; it misses what another initialisation moves a score by); else none, "
            "and those verdicts will say so"
            if scored
            else "none: verdicts will say so"
        )
        keys = ablation.cfg.seed_keys
        more = (
            f"`seeds: 2` measures it from seeds (varying {', '.join(keys)}) at the cost of another run of each variant's own steps"
            if keys
            else "seeds would not measure it: the variants train no step apart"
        )
        return f"Noise floor: one seed of {ablation.baseline}: {how}; {more}."
    return (
        f"Noise floor: measured from {ablation.baseline}'s {len(base)} seeds (varying {', '.join(ablation.cfg.seed_keys)}); "
        f"their own steps, built per seed: {', '.join(sorted(per_seed)) or 'none'}."
    )


def _pretraining_tokens(per_run) -> tuple[int, int, int]:
    """(tokens of the distinct pretraining steps, those of them not cached, tokens independent runs would train)."""
    distinct = now = total = 0
    seen = set()
    for _, steps, ids, state in per_run:
        for step in steps:
            if step.checkpoints:
                train = step.config.train
                tokens = train.schedule.steps * train.batch_size * train.seq_len
                total += tokens
                if (step.name, ids[step.name]) not in seen:
                    distinct += tokens
                    now += tokens if state[step.name] != "cached" else 0
                seen.add((step.name, ids[step.name]))
    return distinct, now, total


@flow(name="ablation")
def ablation_flow(ablation: str, run_dir: str | None = None) -> str:
    """Run every variant x seed of the ablation file ABLATION, each distinct step built once, then write
    the comparison report; returns its path. Runs go `concurrency` at a time (default: one after another)."""
    abl = open_ablation(ablation, run_dir)
    run_all(abl)
    return str(report(abl))


def run_all(abl: Ablation, keep_going: bool = False) -> dict[str, str]:
    """Every run of ABL through the full pipeline (up to its `until`, then evaluation), `concurrency` at a
    time, after linking their run dirs to the shared stores; each invocation's wall time is recorded.
    A run that fails (its tasks' retries spent) fails the call once the others ended; with KEEP_GOING (a
    swarm, where one proxy less still fits) it is logged and returned instead: run name -> error."""
    log = get_run_logger()
    stop_on_signals()  # a SIGTERM stops the runs in flight (their trainers checkpoint) and starts no more
    prepare(abl)
    for line in explain(abl):
        log.info(line)
    until = abl.cfg.until
    started = time.time()
    failed: dict[str, str] = {}
    ended: list[str] = []  # appended by the runs' threads (a list's append is atomic)

    def one(run) -> None:
        if STOPPING.is_set():
            return
        named = full_pipeline.with_options(flow_run_name=f"{abl.cfg.name}/{run.name}")
        try:
            named(str(abl.base), str(abl.root / run.name), list(run.overrides), until)
        except Exception as err:  # a cancel or an interrupt is no run's failure: it ends the call
            if not keep_going or STOPPING.is_set():
                raise
            failed[run.name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log.error("ablation %s: run %s failed, the others go on: %s", abl.cfg.name, run.name, failed[run.name])
        ended.append(run.name)
        log.info(progress(abl.cfg.name, len(ended), len(abl.runs), len(failed), time.time() - started))

    if abl.cfg.concurrency == 1:
        for run in abl.runs:
            one(run)
    else:  # each thread runs its subflow in its own copy of this flow run's context
        with ThreadPoolExecutor(abl.cfg.concurrency) as pool:
            futures = [pool.submit(contextvars.copy_context().run, one, run) for run in abl.runs]
            for future in futures:
                future.result()
    seconds = round(time.time() - started, 1)
    _record_wall_time(abl, seconds)
    log.info("ablation %s: %d runs in %.0f s%s", abl.cfg.name, len(abl.runs), seconds, f", {len(failed)} failed" if failed else "")
    return failed


def progress(name: str, ended: int, total: int, failed: int, seconds: float) -> str:
    """A long ablation's or swarm's line after each run: how many ended, and the time left at the pace so far (runs
    whose steps were all cached end at once, so the estimate firms up as runs that train end)."""
    left = total - ended
    pace = f", about {seconds / ended * left / 60:.1f} min left at this pace" if left else ""
    return f"ablation {name}: {ended} of {total} runs ended{f' ({failed} failed)' if failed else ''} in {seconds / 60:.1f} min{pace}"


def _record_wall_time(abl: Ablation, seconds: float) -> None:
    path = abl.root / "ablation.json"
    data = json.loads(path.read_text())
    data.setdefault("wall_seconds", []).append(seconds)
    write_json_atomic(path, data)


def report(abl: Ablation) -> Path:
    """The comparison report of the ablation as its run dirs hold it now."""
    if not (abl.root / "ablation.json").is_file():
        raise SmolflowError(f"{abl.root}: this ablation has not run yet: run `smolflow ablate {abl.path}` first")
    runs = [AblationRunDir(run.name, run.variant, abl.root / run.name, steps_of(abl, run)) for run in abl.runs]
    data = json.loads((abl.root / "ablation.json").read_text())
    select = abl.runs[0].recipe.evaluation.select  # variants share one evaluation
    return publish_comparison(abl.cfg.name, abl.root, runs, abl.baseline, data.get("wall_seconds", []), select)
