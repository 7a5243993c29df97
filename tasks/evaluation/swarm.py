"""A swarm's evidence, fits and proposal: proxies' mixtures -> their scores, two regressions chosen by
out-of-fold rank agreement, the mixture the chosen one predicts best, and the report.

With `frozen` sources the fits and the draws vary the groups' weights (infra/swarm.py: Groups), not each
source's. The target is a weighted mean of the swarm's target tasks' main metrics (lower is better: bits per
byte). Each task gets its own regression and the target's prediction is their weighted mean, so a
per-source fit can be reused when another source's data changes. Two model families:
- log-linear (Olmix's form): log y = w . t, one coefficient per source (the weights sum to 1, so
  no separate intercept); least squares.
- gradient boosting (lightgbm), sized for tens of points.
The family whose out-of-fold predictions of the target rank the proxies best (Spearman) proposes the
mixture: the candidate with the lowest predicted target among Dirichlet draws around the prior that
pass the bounds and the repetition cap.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from infra.storage import write_json_atomic
from infra.swarm import PROPOSAL, Groups, proxy_name
from tasks.evaluation.plots import artifact, save

Model = Callable[[np.ndarray], np.ndarray]  # mixtures (n, sources) -> predictions (n,)
Fitter = Callable[[np.ndarray, np.ndarray], Model]
CANDIDATES = 20_000
REPORT = Path("report")  # ROOT/report: swarm.md and its plots, swarm.json, ratios.csv, metrics.csv
SUMMARY = REPORT / "swarm.json"  # what the next report compares with, and another swarm's `prior` can name


def loglinear(w: np.ndarray, y: np.ndarray) -> Model:
    t, *_ = np.linalg.lstsq(w, np.log(y), rcond=None)
    return lambda x: np.exp(x @ t)


def boosting(w: np.ndarray, y: np.ndarray) -> Model:
    import lightgbm

    model = lightgbm.LGBMRegressor(
        n_estimators=200, learning_rate=0.05, num_leaves=4, min_child_samples=2, min_data_in_bin=1, random_state=0, n_jobs=1, verbose=-1
    )
    model.fit(w, y)
    return lambda x: model.predict(x)


FAMILIES: dict[str, Fitter] = {"log-linear": loglinear, "lightgbm": boosting}


@dataclass
class Fit:
    family: str
    out_of_fold: np.ndarray  # the target's prediction for each proxy by models that never saw it
    spearman: float  # of out_of_fold against the measured target (NaN when a prediction is constant)
    per_task: dict[str, float]  # each task's out-of-fold Spearman
    predict: Model  # the target, from models fitted on every proxy


def folds_of(n: int, k: int = 5) -> list[np.ndarray]:
    """K contiguous folds (leave-one-out for fewer than K points): the proxies are already in random order."""
    return [f for f in np.array_split(np.arange(n), min(k, n)) if len(f)]


def rank_agreement(predicted: np.ndarray, measured: np.ndarray) -> float:
    if np.ptp(predicted) == 0 or np.ptp(measured) == 0:
        return math.nan
    return float(spearmanr(predicted, measured).statistic)


def weighted(weights: dict[str, float], values: dict[str, Any]) -> Any:
    """The target: the tasks' values (numbers or arrays) averaged with the swarm's weights."""
    return sum(weights[t] * values[t] for t in weights) / sum(weights.values())


def fit(family: str, mixtures: np.ndarray, scores: dict[str, np.ndarray], weights: dict[str, float], groups: Groups) -> Fit:
    """Per-task models of FAMILY on the GROUPS' weights; the target's out-of-fold predictions and the full-data predictor
    (of mixtures of sources)."""
    fitter = FAMILIES[family]
    w = groups.of(mixtures)
    target = weighted(weights, scores)
    oof = {t: np.empty(len(w)) for t in weights}
    for held in folds_of(len(w)):
        train = np.setdiff1d(np.arange(len(w)), held)
        for task in weights:
            oof[task][held] = fitter(w[train], scores[task][train])(w[held])
    combined = weighted(weights, oof)
    models = {t: fitter(w, scores[t]) for t in weights}
    return Fit(
        family,
        combined,
        rank_agreement(combined, target),
        {t: rank_agreement(oof[t], scores[t]) for t in weights},
        lambda x: weighted(weights, {t: m(groups.of(x)) for t, m in models.items()}),
    )


TRUSTED = 0.5  # out-of-fold Spearman from which a fit's proposal is called evidence (marin's swarms reach 0.81-0.92)


def trusts(f: Fit) -> bool:
    return not math.isnan(f.spearman) and f.spearman >= TRUSTED


def choose(fits: list[Fit]) -> Fit:
    """The family with the best out-of-fold rank agreement (a NaN never wins; log-linear on ties)."""
    return max(fits, key=lambda f: -math.inf if math.isnan(f.spearman) else f.spearman)


def propose(
    predict: Model, prior: np.ndarray, groups: Groups, concentration: float, low: np.ndarray, high: np.ndarray, admissible, seed: int
) -> tuple[np.ndarray, float, int]:
    """The admissible candidate with the lowest prediction among Dirichlet draws of the groups' weights around the
    prior's (the prior itself included); returns it, its prediction, and how many candidates were admissible."""
    rng = np.random.default_rng([seed, 1])
    pool = np.vstack([prior, groups.expand(rng.dirichlet(concentration * groups.of(prior), CANDIDATES))])
    pool = pool[((pool >= low - 1e-12) & (pool <= high + 1e-12)).all(axis=1)]
    predicted = predict(pool)
    kept = 0
    for i in np.argsort(predicted):  # the best first; the cap is checked only as far as needed
        if admissible(pool[i]) is None:
            return pool[i], float(predicted[i]), len(pool) - kept
        kept += 1
    raise ValueError("no admissible candidate mixture")


@dataclass(frozen=True)
class Evidence:
    """What the proxies measured: each finished proxy's mixture and its target tasks' main metrics."""

    names: list[str]  # the first is the prior's proxy, when it has every score
    sources: list[str]
    mixtures: np.ndarray
    scores: dict[str, np.ndarray]  # task -> (proxies,)
    metric: dict[str, str]  # task -> the main metric's name
    missing: list[str]  # proxies without every target score
    domains: dict[str, str]  # source -> digest of the tokens the proxies trained on


def write_olmix_csv(folder: Path, swarm_name: str, ev: Evidence, target: np.ndarray) -> None:
    """ratios.csv and metrics.csv as Olmix reads them (run_id, name, then one column per domain / metric)."""
    with open(folder / "ratios.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["run_id", "name", *ev.sources])
        for name, w in zip(ev.names, ev.mixtures, strict=True):
            out.writerow([name, f"{swarm_name}/{name}", *(f"{x:.6f}" for x in w)])
    with open(folder / "metrics.csv", "w", newline="") as f:
        out = csv.writer(f)
        tasks = list(ev.scores)
        out.writerow(["run_id", "name", *(f"{t}/{ev.metric[t]}" for t in tasks), "target"])
        for i, name in enumerate(ev.names):
            out.writerow([name, f"{swarm_name}/{name}", *(f"{ev.scores[t][i]:.6f}" for t in tasks), f"{target[i]:.6f}"])


def publish(
    root: Path,
    name: str,
    header: list[str],
    ev: Evidence,
    weights: dict[str, float],
    fits: list[Fit],
    proposal: dict,
    prior: np.ndarray,
    groups: Groups,
    bounds: tuple[np.ndarray, np.ndarray],
    validation: list[str] = (),
) -> Path:
    """ROOT/report/swarm.md (+ predicted-vs-measured plot, swarm.json, ratios.csv, metrics.csv), also as a Prefect artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = root / REPORT
    out.mkdir(parents=True, exist_ok=True)
    total = sum(weights.values())
    target = weighted(weights, ev.scores)
    write_olmix_csv(out, name, ev, target)
    chosen = choose(fits)
    tasks = list(weights)
    lines = [*header]
    for g, shares in groups.frozen.items():
        lines.append(
            f"Frozen (Olmix's mixture reuse): {g} move as one weight, in the prior's proportions "
            f"{' : '.join(f'{x:.3f} {s}' for s, x in shares.items())}; the draws and the fits vary {len(groups.names)} weights, "
            f"not {len(ev.sources)}."
        )
    lines += [f"Measured on the tokens {', '.join(f'{s} {fp[:12]}' for s, fp in ev.domains.items())}.", *_changed(root, ev), ""]
    lines += ["## Proxies", ""]
    lines += ["| proxy | " + " | ".join(ev.sources) + " | " + " | ".join(t.removeprefix("smol_") for t in tasks) + " | target |"]
    lines += ["|---" * (2 + len(ev.sources) + len(tasks)) + "|"]
    for i in np.argsort(target):
        cells = [f"{x:.3f}" for x in ev.mixtures[i]] + [f"{ev.scores[t][i]:.4f}" for t in tasks]
        label = f"{ev.names[i]} (prior)" if ev.names[i] == proxy_name(0) else ev.names[i]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {target[i]:.4f} |")
    if ev.missing:
        lines += ["", f"Left out (no score for every target task yet): {', '.join(ev.missing)}."]
    lines += [
        "",
        f"Target: {' + '.join(f'{weights[t] / total:.2f} x {t} {ev.metric[t]}' for t in tasks)} (lower is better).",
        "",
        f"## Fits ({len(folds_of(len(ev.names)))}-fold, out of fold)",
        "",
        "| model | Spearman, target | " + " | ".join(f"Spearman, {t.removeprefix('smol_')}" for t in tasks) + " |",
        "|---" * (2 + len(tasks)) + "|",
    ]
    fmt = lambda r: "n/a" if math.isnan(r) else f"{r:+.2f}"  # noqa: E731
    for f in fits:
        mark = " (chosen)" if f is chosen else ""
        lines.append(f"| {f.family}{mark} | {fmt(f.spearman)} | " + " | ".join(fmt(f.per_task[t]) for t in tasks) + " |")
    if any(math.isnan(f.spearman) for f in fits):
        lines += ["", "n/a: a constant prediction (too few proxies for the model to split on), which ranks nothing."]
    lines.append("")
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for k, f in enumerate(fits):
        ax.scatter(target, f.out_of_fold, label=f"{f.family} (Spearman {fmt(f.spearman)})", color=f"C{k}", s=18)
    span = [min(target.min(), *(f.out_of_fold.min() for f in fits)), max(target.max(), *(f.out_of_fold.max() for f in fits))]
    ax.plot(span, span, color="black", linewidth=0.8)
    ax.set(xlabel="measured target", ylabel="predicted, out of fold", title="Proxies: predicted vs measured")
    ax.legend(fontsize=7)
    lines += [f"![predicted vs measured]({save(fig, out / 'fit.png').name})", ""]
    best = int(np.argmin(target))
    trusted = trusts(chosen)
    lines += [
        "## Proposed mixture",
        "",
        f"The fits {'rank' if trusted else 'do **not** rank'} the proxies they did not see "
        f"(out-of-fold Spearman {fmt(chosen.spearman)}; trusted from {TRUSTED:+.2f}): "
        + ("the proposal follows the chosen fit." if trusted else "the proposal below is the fit's guess, not evidence; add proxies."),
        "",
        "| source | prior | best proxy | proposed |",
        "|---|---:|---:|---:|",
        *(f"| {s} | {prior[j]:.3f} | {ev.mixtures[best][j]:.3f} | {proposal['mixture'][s]:.3f} |" for j, s in enumerate(ev.sources)),
        "",
        f"Predicted target {proposal['predicted']:.4f} by {chosen.family} (best of {proposal['candidates']:,} admissible candidates); "
        f"measured: best proxy {ev.names[best]} {target[best]:.4f}"
        + (f", the prior {target[0]:.4f}." if ev.names[0] == proxy_name(0) else "."),
        "A prediction is not a measurement: the validation below trains the proposal beside the prior at a larger scale."
        if validation
        else "A prediction is not a measurement: train the proposal beside the prior at a larger scale before adopting it.",
        "",
        f"![response curves]({response_curves(chosen, ev, target, prior, groups, bounds, proposal, out).name})",
        "",
        f"Response curves: the {chosen.family} fit's predicted target as one weight (a source's, or frozen sources' together) "
        "moves across its bounds, the others keeping the prior's proportions; the dots are the proxies as measured (their other "
        "weights vary too).",
    ]
    markdown = "\n".join([*lines, *([""] if validation else []), *validation]) + "\n"
    path = out / "swarm.md"
    path.write_text(markdown)
    write_json_atomic(
        root / SUMMARY,
        {
            "proxies": [
                {
                    "name": n,
                    "mixture": dict(zip(ev.sources, map(float, w), strict=True)),
                    "domains": {s: ev.domains[s] for s, x in zip(ev.sources, w, strict=True) if x > 0},  # the data it read
                    **{t: float(ev.scores[t][i]) for t in tasks},
                }
                for i, (n, w) in enumerate(zip(ev.names, ev.mixtures, strict=True))
            ],
            "target": {"weights": weights, "values": target.tolist()},
            "fits": [
                {"family": f.family, "spearman": _number(f.spearman), "per_task": {t: _number(r) for t, r in f.per_task.items()}}
                for f in fits
            ],
            "domains": ev.domains,
            "chosen": chosen.family,
            "trusted": trusted,
            PROPOSAL: proposal,
            "frozen": groups.frozen,
            "missing": ev.missing,
        },
    )
    artifact(markdown, out, f"{name}-swarm".replace("_", "-").lower(), "Mixture swarm: proxies, fits and the proposed mixture")
    return path


def response(
    predict: Model, prior: np.ndarray, groups: Groups, j: int, span: tuple[float, float], points: int = 60
) -> tuple[np.ndarray, np.ndarray]:
    """Group J's weight across SPAN (kept inside (0, 1)) and PREDICT's target there, the other groups in the prior's proportions."""
    x = np.linspace(max(span[0], 1e-3), min(span[1], 1 - 1e-3), points)
    v = groups.of(prior)
    rest = np.delete(v, j) / np.delete(v, j).sum()
    return x, predict(groups.expand(np.insert((1 - x)[:, None] * rest, j, x, axis=1)))


def response_curves(
    chosen: Fit,
    ev: Evidence,
    target: np.ndarray,
    prior: np.ndarray,
    groups: Groups,
    bounds: tuple[np.ndarray, np.ndarray],
    proposal: dict,
    out: Path,
) -> Path:
    """OUT/response.png: per group (a source, or the frozen sources), the chosen fit's prediction along its weight (the rest
    in the prior's proportions), the proxies' measured targets, the prior and the proposal."""
    import matplotlib.pyplot as plt

    n = len(groups.names)
    low, high = groups.of(bounds[0]), np.minimum(groups.of(bounds[1]), 1)
    measured = groups.of(ev.mixtures)
    marks = {"prior": groups.of(prior), "proposed": groups.of(np.array([proposal["mixture"][s] for s in ev.sources]))}
    fig, axes = plt.subplots(1, n, figsize=(3.0 * n, 3.0), sharey=True, squeeze=False)
    for j, (name, ax) in enumerate(zip(groups.names, axes[0], strict=True)):
        ax.plot(*response(chosen.predict, prior, groups, j, (low[j], high[j])), color="C0", label=chosen.family)
        ax.scatter(measured[:, j], target, s=10, color="grey", label="proxies")
        ax.axvline(marks["prior"][j], color="black", linestyle=":", linewidth=0.8, label="prior")
        ax.axvline(marks["proposed"][j], color="C3", linestyle="--", linewidth=0.8, label="proposed")
        ax.set(xlabel=f"{name} weight", ylabel="target" if j == 0 else None)
    axes[0][0].legend(fontsize=6)
    return save(fig, out / "response.png")


def _number(r: float) -> float | None:
    """JSON has no NaN: an undefined rank agreement is null."""
    return None if math.isnan(r) else r


def last_report(root: Path) -> dict:
    """The swarm's last report (ROOT/report/swarm.json), or {} before the first."""
    last = root / SUMMARY
    return json.loads(last.read_text()) if last.is_file() else {}


def last_proposal(last: dict) -> dict[str, float] | None:
    """The mixture the LAST report proposed, if any."""
    return last.get(PROPOSAL, {}).get("mixture")


def changed_since(last: dict, domains: dict[str, str]) -> list[str]:
    """The sources whose tokens differ from those the LAST report was measured on."""
    before = last.get("domains", {})
    return [s for s in domains if s in before and before[s] != domains[s]]


def draws_on(mixtures: np.ndarray, sources: list[str], some: list[str]) -> np.ndarray:
    """Which mixtures give any of SOME a weight (their proxies read those sources' tokens)."""
    return (mixtures[:, [sources.index(s) for s in some]] > 0).any(axis=1)


def reuse_hint(searched: list[str], sources: list[str], prior: dict[str, float] | None) -> str:
    """Olmix's mixture reuse: the swarm file's two keys that search only SEARCHED against the other sources as PRIOR (the
    last proposal) mixes them."""
    rest = [s for s in sources if s not in searched]
    if len(rest) < 2 or not prior:
        return ""
    return (
        f"To search only {', '.join(searched)} against the other sources as the last report proposed them, with fewer proxies "
        f"(Olmix's mixture reuse): a swarm file with `prior: {{{', '.join(f'{s}: {prior[s]:.4g}' for s in sources if s in prior)}}}` "
        f"and `frozen: [{', '.join(rest)}]`."
    )


def _changed(root: Path, ev: Evidence) -> list[str]:
    """What changed in the data since the last report: its evidence (and every fit on it) was measured on other tokens."""
    last = last_report(root)
    if not (changed := changed_since(last, ev.domains)):
        return []
    reads = draws_on(ev.mixtures, ev.sources, changed)
    kept = [n for n, r in zip(ev.names, reads, strict=True) if not r]
    return [
        f"**Changed since the last report:** the tokens of {', '.join(changed)} (curation made other data). "
        f"{int(reads.sum())} proxies that draw on them were trained on the new tokens; {len(kept)} that leave them out were "
        f"reused as they were ({', '.join(kept) or 'none'}: their data is unchanged, and their scores on the new held-out data "
        "were measured again). Every coefficient fitted before for these sources is stale. "
        + reuse_hint(changed, ev.sources, last_proposal(last))
    ]
