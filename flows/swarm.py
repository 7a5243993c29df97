"""Mixture swarms: curate once, draw N proxy mixtures within the repetition cap, train every proxy as a run
of an ablation (shared steps built once, `concurrency` at a time, each pretraining phase wherever the
recipe's launcher sends it), then fit mixture -> target and propose a mixture (tasks/evaluation/swarm.py).

The swarm's folder, ROOT (default runs/swarms/NAME), holds `curation/` (the run that measures how many
tokens each source has), one run dir per proxy (`p000` is the prior), the shared `steps/` and
`evals/results/`, and `report/` (swarm.md, ratios.csv, metrics.csv in Olmix's format).
"""

from __future__ import annotations

import numpy as np
from prefect import flow, get_run_logger

from flows.ablation import checked, link_stores, run_all, store_of
from flows.graph import build_graph
from flows.pipeline import STAGE_FLOWS
from infra.ablation import Ablation, resolve_ablation
from infra.steps import finished
from infra.swarm import Draws, Swarm, bounds_of, draw_mixtures, load_swarm, proxy_name
from tasks.curation.mixtures import MixtureError, resolve_mixtures
from tasks.evaluation.compare import AblationRunDir, model_results
from tasks.evaluation.results import main_metric
from tasks.evaluation.swarm import FAMILIES, Evidence, choose, fit, propose, publish
from tasks.pretrain import mixture_phases

CURATION = "curation"
CAP = "over the repetition cap (pretrain.max_epochs)"


def available_tokens(swarm: Swarm) -> dict[str, int]:
    """Tokens per source after curation: the base recipe's curate stage in ROOT/curation, built into the
    store the proxies share (so the proxies find every curation step but their mixtures cached)."""
    run_dir = swarm.root / CURATION
    link_stores(run_dir, store_of(swarm.recipe, swarm.root), swarm.root)
    STAGE_FLOWS["curate"].with_options(flow_run_name=f"{swarm.cfg.name}/{CURATION}")(str(swarm.base), str(run_dir), list(swarm.cfg.set))
    return known_tokens(swarm)


def known_tokens(swarm: Swarm) -> dict[str, int] | None:
    """Tokens per source from the swarm's curation run, if it finished (the dry run and `--report` read them)."""
    tokens = finished(swarm.root / CURATION, build_graph(swarm.recipe).curation["tokenized"])
    return {name: s.tokens for name, s in tokens.summary.sources.items()} if tokens else None


def repetition_cap(swarm: Swarm, available: dict[str, int]):
    """The mixtures step's own check (tasks/curation/mixtures.py) on the recipe's phases with one mixture changed."""
    phases = mixture_phases(swarm.recipe.pretrain)
    max_epochs = swarm.recipe.pretrain.max_epochs

    def admissible(w: np.ndarray) -> str | None:
        changed = list(phases)
        changed[swarm.cfg.phase] = phases[swarm.cfg.phase].model_copy(update={"mixture": swarm.as_dict(w)})
        try:
            resolve_mixtures(changed, max_epochs, available)
        except MixtureError:
            return CAP
        return None

    return admissible


def open_swarm(path: str, run_dir: str | None = None, available: dict[str, int] | None = None) -> tuple[Swarm, Draws, Ablation]:
    """The swarm, its proxies' mixtures (within the cap when AVAILABLE is known) and the ablation that trains them."""
    swarm = load_swarm(path, run_dir)
    admissible = repetition_cap(swarm, available) if available is not None else (lambda w: None)
    draws = draw_mixtures(swarm, swarm.cfg.proxies, swarm.cfg.seed, admissible)
    return swarm, draws, checked(resolve_ablation(swarm.ablation_cfg(draws.mixtures), swarm.path, swarm.root))


def explain(swarm: Swarm, draws: Draws, known_tokens: bool) -> list[str]:
    """What the swarm would run: its proxies' mixtures, what was redrawn and why."""
    cfg = swarm.cfg
    lines = [
        f"swarm {cfg.name}: {cfg.proxies} proxies of {swarm.base.name} in {swarm.root}, searching phase {cfg.phase} "
        f"({swarm.recipe.pretrain.phases[cfg.phase].name}) over {', '.join(swarm.sources)}",
        f"  draws: Dirichlet({cfg.concentration:g} x prior {swarm.as_dict(swarm.prior)}), seed {cfg.seed}; {proxy_name(0)} is the prior",
        *(f"  {proxy_name(i)}: {swarm.as_dict(w)}" for i, w in enumerate(draws.mixtures)),
        f"  redrawn: {', '.join(f'{n} {why}' for why, n in draws.redrawn.items()) or 'none'}",
    ]
    if not known_tokens:
        lines.append("  (the repetition cap is checked once curation has counted each source's tokens: some draws may change)")
    return lines


@flow(name="swarm")
def swarm_flow(swarm: str, run_dir: str | None = None) -> str:
    """Train the proxies of the swarm file SWARM, fit mixture -> target on their scores and propose a mixture;
    returns the report's path. A rerun reuses every proxy already trained (same draws, same step identities)."""
    log = get_run_logger()
    sw = load_swarm(swarm, run_dir)
    available = available_tokens(sw)
    sw, draws, abl = open_swarm(swarm, run_dir, available)
    for line in explain(sw, draws, known_tokens=True):
        log.info(line)
    run_all(abl)
    return str(report(sw, draws, abl, available))


def evidence(swarm: Swarm, draws: Draws, abl: Ablation) -> Evidence:
    """Each proxy's final pretrained model's scores on the target tasks, from the shared result store."""
    names, mixtures, rows, missing, metric = [], [], [], [], {}
    for i, run in enumerate(abl.runs):
        graph = build_graph(run.recipe)
        tasks = model_results(AblationRunDir(run.name, run.variant, abl.root / run.name, graph.steps), graph.phases[-1].model)
        scores = {}
        for task in swarm.cfg.targets:
            if task in tasks and (main := main_metric(tasks[task])):
                metric[task], scores[task] = main
        if len(scores) < len(swarm.cfg.targets):
            missing.append(run.name)
            continue
        names.append(run.name)
        mixtures.append(draws.mixtures[i])
        rows.append(scores)
    return Evidence(
        names,
        swarm.sources,
        np.array(mixtures),
        {t: np.array([r[t] for r in rows]) for t in swarm.cfg.targets},
        metric,
        missing,
    )


def report(swarm: Swarm, draws: Draws, abl: Ablation, available: dict[str, int]):
    ev = evidence(swarm, draws, abl)
    if len(ev.names) < 4:
        unscored = sorted(set(swarm.cfg.targets) - set(ev.metric))
        raise MixtureError(
            f"swarm {swarm.cfg.name}: {len(ev.names)} of {len(abl.runs)} proxies have a score for every target task; a fit needs 4"
            + (f" ({', '.join(unscored)}: no proxy has a score for it; see the proxies' evaluation logs)" if unscored else "")
        )
    weights = swarm.cfg.targets
    fits = [fit(family, ev.mixtures, ev.scores, weights) for family in FAMILIES]
    chosen = choose(fits)
    low, high = bounds_of(swarm.cfg, swarm.sources)
    best, predicted, candidates = propose(
        chosen.predict, swarm.prior, swarm.cfg.concentration, low, high, repetition_cap(swarm, available), swarm.cfg.seed
    )
    header = [
        f"# Swarm {swarm.cfg.name}: the mixture of phase {swarm.recipe.pretrain.phases[swarm.cfg.phase].name}",
        "",
        f"{len(abl.runs)} proxies of `{swarm.base.name}`"
        + (f" with `{' '.join(swarm.cfg.set)}`" if swarm.cfg.set else "")
        + f"; each differs only in that phase's mixture, drawn from Dirichlet({swarm.cfg.concentration:g} x prior), seed "
        f"{swarm.cfg.seed}; bounds: {', '.join(f'{s} in [{lo:g}, {hi:g}]' for s, (lo, hi) in swarm.cfg.bounds.items()) or 'none'}; "
        f"redrawn: {', '.join(f'{n} {why}' for why, n in draws.redrawn.items()) or 'none'}.",
        f"Tokens per source after curation: {', '.join(f'{s} {n:,}' for s, n in available.items())}.",
    ]
    proposal = {"mixture": swarm.as_dict(best), "predicted": predicted, "candidates": candidates, "family": chosen.family}
    return publish(swarm.root, swarm.cfg.name, header, ev, weights, fits, proposal, swarm.prior)
