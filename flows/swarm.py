"""Mixture swarms: curate once, draw N proxy mixtures within the repetition cap, train every proxy as a run
of an ablation (shared steps built once, `concurrency` at a time, each pretraining phase wherever the
recipe's launcher sends it), then fit mixture -> target and propose a mixture (tasks/evaluation/swarm.py).

The swarm's folder, ROOT (default runs/swarms/NAME), holds `curation/` (the run that measures how many
tokens each source has), one run dir per proxy (`p000` is the prior), the shared `steps/` and
`evals/results/`, and `report/` (swarm.md, ratios.csv, metrics.csv in Olmix's format).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prefect import flow, get_run_logger

import flows.ablation
from flows.ablation import checked, link_stores, run_all, steps_of, store_of
from flows.graph import build_graph
from flows.pipeline import STAGE_FLOWS, Overrides
from infra.ablation import Ablation, AblationCfg, AblationRun, VariantCfg, resolve_ablation
from infra.steps import MANIFEST, finished, part_fingerprint
from infra.swarm import Draws, Swarm, bounds_of, carried, draw_mixtures, load_swarm, proxy_name, rounded
from tasks.curation.mixtures import MixtureError, resolve_mixtures, windows
from tasks.curation.pipelines import source_data
from tasks.evaluation.compare import AblationRunDir, model_results
from tasks.evaluation.results import main_metric, run_results
from tasks.evaluation.swarm import (
    FAMILIES,
    Evidence,
    Fit,
    changed_since,
    choose,
    draws_on,
    fit,
    last_proposal,
    last_report,
    propose,
    publish,
    reuse_hint,
    weighted,
)
from tasks.pretrain import mixture_phases

CURATION = "curation"
VALIDATE = "validate"  # ROOT/validate: the proposal beside the prior and the natural mixture at a larger scale
CAP = "over the repetition cap (pretrain.max_epochs)"
SAME = "the same training data as an earlier proxy (every source's seq_len windows)"


def available_tokens(swarm: Swarm) -> dict[str, int]:
    """Tokens per source after curation: the base recipe's curate stage in ROOT/curation, built into the
    store the proxies share (so the proxies find every curation step but their mixtures cached)."""
    run_dir = swarm.root / CURATION
    link_stores(run_dir, store_of(swarm.recipe, swarm.root), swarm.root)
    STAGE_FLOWS["curate"].with_options(flow_run_name=f"{swarm.cfg.name}/{CURATION}")(str(swarm.base), str(run_dir), list(swarm.cfg.set))
    return known_tokens(swarm)


def domain_fingerprints(swarm: Swarm) -> dict[str, str]:
    """Each source's tokens as the proxies read them: the digest a proxy's identity takes of that source's part of
    the tokenize step (`reads`), so the evidence names the data it was measured on, not just its name."""
    tokens = finished(swarm.root / CURATION, build_graph(swarm.recipe).curation["tokenized"])
    return {s: part_fingerprint(tokens, (source_data(s),)) for s in swarm.sources}


def known_tokens(swarm: Swarm) -> dict[str, int] | None:
    """Tokens per source from the swarm's curation run, if it finished (the dry run and `--report` read them)."""
    tokens = finished(swarm.root / CURATION, build_graph(swarm.recipe).curation["tokenized"])
    return {name: s.tokens for name, s in tokens.summary.sources.items()} if tokens else None


def repetition_cap(swarm: Swarm, available: dict[str, int], scale: int = 1):
    """The mixtures step's own check (tasks/curation/mixtures.py) on the recipe's phases, their tokens x SCALE,
    with the searched phase's mixture changed."""
    phases = [ph.model_copy(update={"tokens": ph.tokens * scale}) for ph in mixture_phases(swarm.recipe.pretrain)]
    max_epochs = swarm.recipe.pretrain.max_epochs

    def admissible(w: np.ndarray) -> str | None:
        changed = list(phases)
        changed[swarm.cfg.phase] = phases[swarm.cfg.phase].model_copy(update={"mixture": swarm.mixture(w)})
        try:
            resolve_mixtures(changed, max_epochs, available)
        except MixtureError:
            return CAP
        return None

    return admissible


def new_data(swarm: Swarm):
    """Refuses a draw that trains on the same windows of each source as an earlier admitted one (weights closer than one
    window apart): its proxy would repeat that one's run, and the fit would count one measurement twice. Checked last,
    so every draw it sees is admitted unless it says why not."""
    phase = mixture_phases(swarm.recipe.pretrain)[swarm.cfg.phase]
    seen: set[tuple] = set()

    def admissible(w: np.ndarray) -> str | None:
        key = tuple(windows(phase.model_copy(update={"mixture": swarm.mixture(w)})).items())
        if key in seen:
            return SAME
        seen.add(key)
        return None

    return admissible


def open_swarm(
    path: str, run_dir: str | None = None, available: dict[str, int] | None = None, overrides: list[str] | None = None
) -> tuple[Swarm, Draws, Ablation]:
    """The swarm, its proxies' mixtures (within the cap when AVAILABLE is known) and the ablation that trains them."""
    swarm = load_swarm(path, run_dir, overrides)
    cap = repetition_cap(swarm, available) if available is not None else (lambda w: None)
    fresh = new_data(swarm)
    draws = draw_mixtures(swarm, swarm.cfg.proxies, swarm.cfg.seed, lambda w: cap(w) or fresh(w))
    return swarm, draws, checked(resolve_ablation(swarm.ablation_cfg(draws.mixtures), swarm.path, swarm.root))


def explain(swarm: Swarm, draws: Draws, known_tokens: bool) -> list[str]:
    """What the swarm would run: its proxies' mixtures, what was redrawn and why."""
    cfg = swarm.cfg
    lines = [
        f"swarm {cfg.name}: {cfg.proxies} proxies of {swarm.base.name} in {swarm.root}, searching phase {cfg.phase} "
        f"({swarm.recipe.pretrain.phases[cfg.phase].name}) over {', '.join(swarm.sources)}",
        f"  draws: Dirichlet({cfg.concentration:g} x prior {swarm.as_dict(swarm.prior)}), seed {cfg.seed}; {proxy_name(0)} is the prior",
        *(f"  frozen: {g} move as one weight, in the prior's proportions {shares}" for g, shares in swarm.groups.frozen.items()),
        f"  each proxy trains {', '.join(ph.name for ph in swarm.recipe.pretrain.phases)}"
        + ("" if cfg.later_phases else " (the phases after the searched one are left out: later_phases: false)"),
        *(f"  {proxy_name(i)}: {swarm.as_dict(w)}" for i, w in enumerate(draws.mixtures)),
        f"  redrawn: {', '.join(f'{n} {why}' for why, n in draws.redrawn.items()) or 'none'}",
    ]
    if not known_tokens:
        lines.append("  (the repetition cap is checked once curation has counted each source's tokens: some draws may change)")
    if v := cfg.validation:
        lines.append(f"  then: the proposal, the prior and the natural mixture at {v.scale}x the proxies' tokens, {v.seeds} seeds each")
    return lines


def since_last_report(swarm: Swarm, draws: Draws) -> str:
    """What changed in the data since the swarm's last report, said before the proxies train: the sources whose tokens
    changed (the proxies that draw on them train again) or that joined the phase, and the keys of the cheaper search."""
    last = last_report(swarm.root)
    changed = changed_since(last, domain_fingerprints(swarm))
    added = [s for s in swarm.sources if last.get("domains") and s not in last["domains"]]
    said = []
    if changed:
        reads = int(draws_on(draws.mixtures, swarm.sources, changed).sum())
        said.append(
            f"the tokens of {', '.join(changed)} changed since the last report: the {reads} of {len(draws.mixtures)} proxies that "
            "draw on them train again"
        )
    if added:
        said.append(f"{', '.join(added)} joined the phase since the last report")
    if not said:
        return ""
    before = last_proposal(last)
    prior = carried(before, swarm.recipe.pretrain.phases[swarm.cfg.phase].mixture) if before else None
    return f"{'; '.join(said)}. {reuse_hint(changed + added, swarm.sources, prior)}".rstrip()


@flow(name="swarm")
def swarm_flow(swarm: str, run_dir: str | None = None, overrides: Overrides = None) -> str:
    """Train the proxies of the swarm file SWARM, fit mixture -> target on their scores and propose a mixture,
    then train the proposal beside the prior and the natural mixture at a larger scale (`validation`); returns
    the report's path. A rerun reuses every run already trained (same draws, same step identities)."""
    log = get_run_logger()
    available = available_tokens(load_swarm(swarm, run_dir, overrides))
    sw, draws, abl = open_swarm(swarm, run_dir, available, overrides)
    for line in explain(sw, draws, known_tokens=True):
        log.info(line)
    if news := since_last_report(sw, draws):
        log.warning("swarm %s: %s", sw.cfg.name, news)
    failed = run_all(abl, keep_going=True)  # a failed proxy is one point less for the fit, not a failed swarm
    proposal = analyse(sw, draws, abl, available)  # the proxies' evidence is fitted once
    path = report(sw, draws, abl, available, proposal, failed)  # readable while the validation trains
    if sw.cfg.validation:
        check, refused = validation(sw, available, proposal)
        for name, why in refused.items():
            log.warning("swarm %s: the %s mixture is not validated: %s", sw.cfg.name, name, why)
        failed |= {f"{VALIDATE}/{run}": why for run, why in run_all(check, keep_going=True).items()}
        flows.ablation.report(check)
        path = report(sw, draws, abl, available, proposal, failed)
    if failed:
        log.warning("swarm %s: %d run(s) failed (%s); a rerun retries them, reusing the rest", sw.cfg.name, len(failed), ", ".join(failed))
    return str(path)


def target_scores(swarm: Swarm, root: Path, run: AblationRun) -> dict[str, tuple[str, float]]:
    """task -> (metric, value) of the run's final pretrained model on the swarm's target tasks, where scored."""
    graph = build_graph(run.recipe)
    tasks = model_results(AblationRunDir(run.name, run.variant, root / run.name, graph.steps), graph.phases[-1].model)
    return {t: main for t in swarm.cfg.targets if t in tasks and (main := main_metric(tasks[t]))}


def evidence(swarm: Swarm, draws: Draws, abl: Ablation) -> Evidence:
    """Each proxy's final pretrained model's scores on the target tasks, from the shared result store."""
    names, mixtures, rows, missing, metric = [], [], [], [], {}
    for i, run in enumerate(abl.runs):
        scores = target_scores(swarm, abl.root, run)
        metric |= {t: m for t, (m, _) in scores.items()}
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
        {t: np.array([r[t][1] for r in rows]) for t in swarm.cfg.targets},
        metric,
        missing,
        domain_fingerprints(swarm),
    )


@dataclass
class Proposal:
    """What the proxies say: their evidence, both fits, the chosen one and the mixture it proposes."""

    evidence: Evidence
    fits: list[Fit]
    chosen: Fit
    mixture: np.ndarray
    predicted: float
    candidates: int


def analyse(swarm: Swarm, draws: Draws, abl: Ablation, available: dict[str, int]) -> Proposal:
    ev = evidence(swarm, draws, abl)
    if len(ev.names) < 4:
        unscored = sorted(set(swarm.cfg.targets) - set(ev.metric))
        raise MixtureError(
            f"swarm {swarm.cfg.name}: {len(ev.names)} of {len(abl.runs)} proxies have a score for every target task; a fit needs 4"
            + (f" ({', '.join(unscored)}: no proxy has a score for it; see the proxies' evaluation logs)" if unscored else "")
        )
    fits = [fit(family, ev.mixtures, ev.scores, swarm.cfg.targets, swarm.groups) for family in FAMILIES]
    chosen = choose(fits)
    low, high = bounds_of(swarm.cfg, swarm.sources)
    cap = repetition_cap(swarm, available)
    best, predicted, candidates = propose(
        chosen.predict, swarm.prior, swarm.groups, swarm.cfg.concentration, low, high, cap, swarm.cfg.seed
    )
    return Proposal(ev, fits, chosen, rounded(best), predicted, candidates)  # weights a recipe accepts as written


def validation(swarm: Swarm, available: dict[str, int], proposal: Proposal) -> tuple[Ablation, dict[str, str]]:
    """The proposed, prior (the recipe's hand-set mixture, or the one the swarm file names) and natural (token-proportional)
    mixtures as an ablation at `validation.scale` x the proxies' tokens, `validation.seeds` seeds each, in the proxies' step
    store; a mixture the repetition cap refuses at that scale is left out (returned with the reason)."""
    v = swarm.cfg.validation
    natural = rounded(np.array([available[s] for s in swarm.sources], dtype=float) / sum(available[s] for s in swarm.sources))
    cap = repetition_cap(swarm, available, v.scale)
    mixtures = {"proposed": proposal.mixture, "prior": swarm.prior, "natural": natural}
    refused = {name: why for name, w in mixtures.items() if (why := cap(w))}
    scale = [f"pretrain.phases.{i}.tokens={ph.tokens * v.scale}" for i, ph in enumerate(swarm.recipe.pretrain.phases)]
    store = f"storage.store={store_of(swarm.recipe, swarm.root).resolve()}"
    # the targets are judged as the swarm chose them: the early-signal checks need checkpoints a proxy-sized run lacks
    judged = "evaluation.select=all"
    cfg = AblationCfg(
        name=f"{swarm.cfg.name}-validate",
        base=swarm.cfg.base,
        description=f"the swarm's proposal beside the prior and the natural mixture at {v.scale}x the proxies' tokens",
        set=[*swarm.cfg.set, *scale, store, judged],
        variants=[VariantCfg(name=n, set=[swarm.mixture_override(w)]) for n, w in mixtures.items() if n not in refused],
        baseline="prior" if "prior" not in refused else None,
        seeds=v.seeds,
        seed_key="pretrain.seed",
        until="pretrain",
        concurrency=swarm.cfg.concurrency,
    )
    return checked(resolve_ablation(cfg, swarm.path, swarm.root / VALIDATE)), refused


def validated(swarm: Swarm, proposal: Proposal, check: Ablation) -> list[str]:
    """The validation's section of the report: measured targets at scale, the paired verdicts against the prior,
    and how often the proxies' fit ordered two mixtures as the larger runs did."""
    measured: dict[str, list[float]] = {}
    mixture: dict[str, np.ndarray] = {}
    for run in check.runs:
        scores = target_scores(swarm, check.root, run)
        mixture[run.variant] = np.array([run.recipe.pretrain.phases[swarm.cfg.phase].mixture[s] for s in swarm.sources])
        if len(scores) == len(swarm.cfg.targets):
            measured.setdefault(run.variant, []).append(weighted(swarm.cfg.targets, {t: v for t, (_, v) in scores.items()}))
    if not measured:
        return ["## Validation", "", f"_no validation run is scored yet ({check.root})_"]
    names = [n for n in mixture if n in measured]
    predicted = {n: float(proposal.chosen.predict(mixture[n][None, :])[0]) for n in names}
    mean = {n: float(np.mean(measured[n])) for n in names}
    pairs = list(itertools.combinations(names, 2))
    agree = sum((predicted[a] < predicted[b]) == (mean[a] < mean[b]) for a, b in pairs)
    v = swarm.cfg.validation
    lines = [
        f"## Validation at {v.scale}x the proxies' tokens, {v.seeds} seeds",
        "",
        "| mixture | " + " | ".join(swarm.sources) + " | predicted by the proxies' fit | measured target (mean ± sd) |",
        "|---" * (3 + len(swarm.sources)) + "|",
    ]
    for n in names:
        sd = float(np.std(measured[n], ddof=1)) if len(measured[n]) > 1 else math.nan
        cells = " | ".join(f"{x:.3f}" for x in mixture[n])
        lines.append(f"| {n} | {cells} | {predicted[n]:.4f} | {mean[n]:.4f} ± {sd:.4f} ({len(measured[n])}) |")
    winner = min(names, key=mean.get)
    comparison = check.root / "report" / "ablation.json"
    verdicts = []
    if comparison.is_file():
        label = build_graph(check.runs[0].recipe).phases[-1].model
        rows = json.loads(comparison.read_text())["rows"]
        verdicts = [
            f"{e['task']} {e['diff']:+.4f}" + (f" [{e['ci95'][0]:+.4f}, {e['ci95'][1]:+.4f}]" if "ci95" in e else "") + f" ({e['verdict']})"
            for e in rows
            if e["model"] == label and e["variant"] == "proposed" and e["task"] in swarm.cfg.targets and "verdict" in e
        ]
    lines += [
        "",
        f"Lowest measured target, mean over seeds: **{winner}**"
        + (" (the proposal)" if winner == "proposed" else " (not the proposal)" if "proposed" in names else "")
        + "; whether a difference is beyond the seeds' noise, the paired verdicts say.",
        f"Proposed minus prior, per target task, 95% interval (paired over the same documents; `{VALIDATE}/report/ablation.md`): "
        + ("; ".join(verdicts) or "not compared yet")
        + ".",
        f"The proxies' fit orders {agree} of {len(pairs)} pairs of these mixtures as the larger runs do"
        f" ({agree / max(len(pairs), 1):.0%}).",
    ]
    return lines


def cost(abl: Ablation) -> str:
    """What the proxies cost: their own steps (each one's mixtures and pretraining, seconds from the manifests), the
    steps every proxy shares (built once), their models' evaluations, and the wall time of each invocation."""
    users: dict[Path, int] = {}
    for run in abl.runs:
        for step in steps_of(abl, run):
            if (folder := abl.root / run.name / step.name / MANIFEST).is_file():
                users[folder.resolve()] = users.get(folder.resolve(), 0) + 1
    seconds = {m: float(json.loads(m.read_text()).get("seconds") or 0) for m in users}
    own = [s for m, s in seconds.items() if users[m] == 1]
    shared = [s for m, s in seconds.items() if users[m] > 1]
    evals = [float(record.get("seconds") or 0) for record in run_results(abl.root).all()]
    walls = json.loads((abl.root / "ablation.json").read_text()).get("wall_seconds", [])
    return (
        f"Cost: the proxies' own steps {sum(own):,.0f} s ({len(own)} steps, {sum(own) / max(len(abl.runs), 1):,.0f} s a proxy); "
        f"{len(shared)} steps shared by the proxies, built once ({sum(shared):,.0f} s when built); {len(evals)} evaluations "
        f"{sum(evals):,.0f} s; wall time {', '.join(f'{w:,.0f} s' for w in walls) or 'not recorded'} "
        f"(each `smolflow swarm`, {abl.cfg.concurrency} proxies at a time)."
    )


def report(
    swarm: Swarm, draws: Draws, abl: Ablation, available: dict[str, int], p: Proposal | None = None, failed: dict[str, str] | None = None
) -> Path:
    """The swarm's report as its runs hold it now: proxies, fits, proposal (P, else fitted here) and, once trained,
    its validation; FAILED: the runs that failed in this invocation, with their errors."""
    p = p or analyse(swarm, draws, abl, available)
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
    header.append(cost(abl))
    if failed:
        header.append(f"**Failed** ({len(failed)}; a rerun retries them): " + "; ".join(f"{r}: {why}" for r, why in failed.items()) + ".")
    proposal = {"mixture": swarm.as_dict(p.mixture), "predicted": p.predicted, "candidates": p.candidates, "family": p.chosen.family}
    extra = []
    if swarm.cfg.validation and (swarm.root / VALIDATE).is_dir():
        extra = validated(swarm, p, validation(swarm, available, p)[0])
    bounds = bounds_of(swarm.cfg, swarm.sources)
    return publish(
        swarm.root, swarm.cfg.name, header, p.evidence, swarm.cfg.targets, p.fits, proposal, swarm.prior, swarm.groups, bounds, extra
    )
