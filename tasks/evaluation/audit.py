"""Which eval tasks carry signal at this scale: the playbook's four checks, over a run's checkpoints.

For each task (its main metric) over the pretraining checkpoints of one or more runs (seeds or variants
of an ablation, which share their checkpoint schedule):
- monotonicity: Spearman's rho of the score against tokens (scipy), signed so that +1 is steady improvement;
- noise: the standard deviation over a variant's seeds at the same checkpoint, or, with one run per variant, the
  jitter of each run's last NOISE_WINDOW checkpoints about their trend (stats.jitter; their raw spread is mostly
  the climb, and the spread across variants is the ablation's effect); never below the
  standard error lm-eval reports for one checkpoint's score (a score that rests on a few items and
  happens to repeat is not noise-free: 0.375 at four checkpoints of 8 items made a signal/noise of 1e8);
- signal-to-noise: the improvement from the first checkpoint to the last, in units of that noise;
- distance from chance, in the same units (multiple-choice tasks, whose chance level lm-eval's docs give);
- ranking consistency, with two or more runs: Kendall's tau between the runs' order at successive
  checkpoints (scipy), averaged: does A > B early stay so later?

A task is "usable early" when it is monotone, beyond noise and (where it has a chance level) above it by
the first half of training; "usable late" when that holds only later; else "no signal at this scale".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.evaluation.results import main_metric, stderr_of
from tasks.evaluation.stats import jitter

LOWER_IS_BETTER = ("bits_per_byte",)
NOISE_WINDOW = 4  # one run: the noise is the jitter of its last checkpoints about their trend
MONOTONE = 0.6  # Spearman's rho at least this
BEYOND = 2.0  # signal, and distance from chance, in noise units
NO_SIGNAL = "no signal at this scale"


@dataclass
class TaskAudit:
    task: str
    metric: str
    runs: int
    checkpoints: int
    monotonicity: float  # Spearman's rho, +1: improves at every checkpoint
    noise: float
    snr: float  # improvement first -> last checkpoint / noise
    above_chance: float | None  # (last score - chance) / noise, in the metric's better direction
    ranking: float | None  # mean Kendall tau between successive checkpoints' run orders (>= 2 runs)
    signal_from: float | None  # share of training after which the task stays beyond noise (and chance)
    verdict: str

    def row(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def series(records: list[dict]) -> dict[tuple[str, str], dict[int, float]]:
    """(task, metric) -> tokens -> score, from one run's result records (pretraining checkpoints only)."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for record in records:
        model = record["model"]
        if model.get("kind") != "checkpoint" or model.get("tokens") is None:
            continue
        for task, entry in record["tasks"].items():
            if main := main_metric(entry["metrics"]):
                out.setdefault((task, main[0]), {})[int(model["tokens"])] = main[1]
    return out


def chance_of(records: list[dict], task: str) -> float | None:
    return next((r["tasks"][task]["metrics"].get("chance") for r in records if task in r["tasks"]), None)


def sampling_error(runs: list[list[dict]], task: str, metric: str) -> float:
    """The median standard error lm-eval reported for TASK's METRIC over the runs' checkpoints (0 where it gives none)."""
    errors = [
        e
        for records in runs
        for r in records
        if r["model"].get("kind") == "checkpoint" and task in r["tasks"]
        if (e := stderr_of(r["tasks"][task]["metrics"], metric)) is not None
    ]
    return float(np.median(errors)) if errors else 0.0


def audit(runs: list[list[dict]], variants: list[str] | None = None) -> list[TaskAudit]:
    """RUNS: each run's result records (its result store's). Tasks scored at 3 or more checkpoints common to all runs.
    VARIANTS (an ablation's, one per run): seeds measure noise only within a variant; the spread across variants
    is what the ablation changed, not noise. Default: every run a seed of one variant."""
    from scipy import stats

    runs, variants = _distinct(runs, variants or [""] * len(runs))
    per_run = [series(records) for records in runs]
    keys = sorted(set.intersection(*(set(s) for s in per_run))) if per_run else []
    out = []
    for task, metric in keys:
        tokens = sorted(set.intersection(*(set(s[(task, metric)]) for s in per_run)))
        if len(tokens) < 3:
            continue
        sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
        scores = np.array([[s[(task, metric)][t] for t in tokens] for s in per_run]) * sign  # runs x checkpoints, higher better
        mean = scores.mean(axis=0)
        rho = float(stats.spearmanr(tokens, mean).statistic) if np.ptp(mean) > 0 else 0.0
        seeded = [[i for i, v in enumerate(variants) if v == name] for name in dict.fromkeys(variants)]
        seeded = [rows for rows in seeded if len(rows) > 1]
        if seeded:  # the spread over a variant's seeds at each checkpoint
            noise = float(np.mean([scores[rows].std(axis=0, ddof=1).mean() for rows in seeded]))
        else:  # one run per variant: each run's last checkpoints about their trend (the climb is signal, not noise)
            noise = float(np.mean([jitter(tokens[-NOISE_WINDOW:], row[-NOISE_WINDOW:]) for row in scores]))
        noise = max(noise, sampling_error(runs, task, metric), 1e-9)
        chance = chance_of(runs[0], task)
        edge = chance * sign if chance is not None else mean[0]  # what a useful score must clear: chance, else the first score
        clear = mean - edge > BEYOND * noise
        beyond = [i for i in range(len(tokens)) if clear[i:].all()]
        signal_from = tokens[beyond[0]] / tokens[-1] if beyond else None
        ranking = None
        if len(runs) > 1:
            taus = [stats.kendalltau(scores[:, i], scores[:, i + 1]).statistic for i in range(len(tokens) - 1)]
            taus = [t for t in taus if not math.isnan(t)]
            ranking = float(np.mean(taus)) if taus else None
        snr = float((mean[-1] - mean[0]) / noise)
        above = float((mean[-1] - chance * sign) / noise) if chance is not None else None
        if rho < MONOTONE or snr < BEYOND or signal_from is None:
            verdict = NO_SIGNAL
        else:
            verdict = "usable early" if signal_from <= 0.5 else "usable late"
        out.append(TaskAudit(task, metric, len(runs), len(tokens), rho, noise, snr, above, ranking, signal_from, verdict))
    return out


def _distinct(runs: list[list[dict]], variants: list[str]) -> tuple[list[list[dict]], list[str]]:
    """One run per distinct set of checkpoints (and its variant): variants that share their pretraining are one run."""
    seen, out, names = set(), [], []
    for records, variant in zip(runs, variants, strict=True):
        key = frozenset(r["fingerprint"] for r in records if r["model"].get("kind") == "checkpoint")
        if key not in seen:
            seen.add(key)
            out.append(records)
            names.append(variant)
    return out, names


def audit_table(audits: list[TaskAudit]) -> list[str]:
    """The audit as a Markdown table, the one renderer of it (report card, `smolflow evals audit`)."""
    if not audits:
        return ["_fewer than 3 evaluated checkpoints: nothing to audit yet_"]
    rows = [
        "| task | metric | checkpoints x runs | monotonicity (Spearman) | noise | signal / noise | above chance (noise units) "
        "| ranking (Kendall) | beyond noise from | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in audits:
        above = "" if a.above_chance is None else f"{a.above_chance:+.1f}"
        ranking = "" if a.ranking is None else f"{a.ranking:+.2f}"
        since = "never" if a.signal_from is None else f"{a.signal_from:.0%} of tokens"
        rows.append(
            f"| {a.task} | {a.metric} | {a.checkpoints} x {a.runs} | {a.monotonicity:+.2f} | {a.noise:.4f} | {a.snr:+.1f} | {above} "
            f"| {ranking} | {since} | {a.verdict} |"
        )
    return rows
