"""Comparisons that say how sure they are: paired over the items two models both answered, beside the
unpaired interval, with McNemar's test for right/wrong items and a noise floor measured across seeds.

An item's outcome is a (numerator, weight) pair, so one ratio serves every metric: accuracy and exact
match are (0 or 1, 1), bits per byte is (-log2 likelihood, bytes) of one document, and a metric is
sum(numerators) / sum(weights). Two models are compared on the items both were scored on (matched by a
stable id: lm-eval's hash of the document, a hash of a held-out prompt); with several seeds an item's
numerator is its mean over the seeds. The paired interval is scipy's bootstrap over items (the same
resampled items for both models); the unpaired one is Welch's t over the items' linearised values, what
a comparison that ignores the pairing would report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_ITEMS = 10  # fewer items in common: no item-level comparison
RESAMPLES = 2000


Items = dict[str, tuple[float, float]]  # item id -> (numerator, weight)


def items_of(record: dict[str, list] | None) -> Items | None:
    """The stored form (infra.summaries.outcomes) as a mapping; None where none was kept."""
    if not record:
        return None
    return {i: (n, d) for i, n, d in zip(record["id"], record["num"], record["den"], strict=True)}


@dataclass
class Paired:
    diff: float  # other - base
    ci95: tuple[float, float]  # paired bootstrap over items
    unpaired_ci95: tuple[float, float]  # Welch's t over the same items, pairing ignored
    items: int
    mde: float  # the smallest difference the paired test detects 80% of the time at this item count (alpha 0.05)
    mcnemar_p: float | None  # right/wrong items, one seed each: McNemar's exact test


def _seed_means(runs: list[Items], ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    num = np.array([[run[i][0] for i in ids] for run in runs]).mean(axis=0)
    return num, np.array([runs[0][i][1] for i in ids])


def _ratio_diff(na, da, nb, db, axis=-1):
    return nb.sum(axis=axis) / db.sum(axis=axis) - na.sum(axis=axis) / da.sum(axis=axis)


def paired(base: list[Items], other: list[Items]) -> Paired | None:
    """BASE and OTHER: each seed's items. None when fewer than MIN_ITEMS items are common to all of them."""
    from scipy import stats
    from statsmodels.stats.contingency_tables import mcnemar
    from statsmodels.stats.power import TTestPower

    ids = sorted(set.intersection(*(set(run) for run in [*base, *other])))
    if len(ids) < MIN_ITEMS:
        return None
    na, da = _seed_means(base, ids)
    nb, db = _seed_means(other, ids)
    diff = float(_ratio_diff(na, da, nb, db))
    if np.allclose(na, nb):  # identical outcomes: the bootstrap has nothing to resample
        interval = (diff, diff)
    else:
        boot = stats.bootstrap(
            (na, da, nb, db), _ratio_diff, paired=True, vectorized=True, n_resamples=RESAMPLES, method="percentile", random_state=0
        )
        interval = (float(boot.confidence_interval.low), float(boot.confidence_interval.high))
    # linearised item values of each ratio (the delta method): their means differ by `diff`
    la, lb = (na - na.sum() / da.sum() * da) / da.mean(), (nb - nb.sum() / db.sum() * db) / db.mean()
    welch = stats.ttest_ind(lb + diff, la, equal_var=False).confidence_interval(0.95)
    sd = float(np.std(lb - la, ddof=1))
    mde = TTestPower().solve_power(nobs=len(ids), alpha=0.05, power=0.8) * sd if sd > 0 else 0.0
    p = None
    binary = all(len(runs) == 1 for runs in (base, other)) and np.all(da == 1) and np.isin(na, (0, 1)).all() and np.isin(nb, (0, 1)).all()
    if binary:
        table = [[int(((na == x) & (nb == y)).sum()) for y in (1, 0)] for x in (1, 0)]  # base right/wrong x other right/wrong
        p = float(mcnemar(table, exact=True).pvalue)
    return Paired(diff, interval, (float(welch.low), float(welch.high)), len(ids), float(mde), p)


def noise_floor(values: list[float], n_base: int, n_other: int) -> float | None:
    """What seeds alone move a difference by: the difference between a mean over N_BASE seeds and one over N_OTHER
    seeds of the same variant exceeds it in 5% of such comparisons (Student's t on the spread of VALUES, the
    baseline's seed scores; scipy). None with fewer than two seeds: nothing measured. A paired interval over
    items sees only item sampling; two seeds are two models, and this is how far apart they fall."""
    from scipy import stats

    if len(values) < 2:
        return None
    spread = float(np.std(values, ddof=1))
    return float(stats.t.ppf(0.975, len(values) - 1) * spread * np.sqrt(1 / n_base + 1 / n_other))


def jitter(x: list[float], y: list[float]) -> float:
    """The spread of Y around its straight-line trend in X (the residual standard deviation about scipy's
    least-squares line): what a score moves by from one checkpoint to the next once its trend is taken out. The
    raw spread of a run's last checkpoints is mostly its climb (math bits per byte: 2.1 of "noise" on a 0.4 effect)."""
    from scipy import stats

    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    fit = stats.linregress(xs, ys)
    residuals = ys - (fit.intercept + fit.slope * xs)
    return float(np.sqrt((residuals**2).sum() / (len(ys) - 2)))


def checkpoint_floor(x: list[float], y: list[float]) -> float:
    """noise_floor for one seed against one, from a run's last checkpoints (scores Y at tokens X) instead of seeds:
    Student's t on their jitter about the trend (two degrees of freedom spent on the line)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, len(y) - 2) * jitter(x, y) * np.sqrt(2))


def verdict(diff: float, ci95: tuple[float, float], floor: float | None, lower_is_better: bool, mcnemar_p: float | None = None) -> str:
    """better / worse only when the interval excludes 0 and the difference exceeds the noise floor; for right/wrong
    answers McNemar's exact test must agree at 5% too: with few answers changed, the percentile bootstrap's interval
    can leave out 0 where the exact test does not (5 answers made right and none wrong on 400: p = 0.06)."""
    if ci95[0] <= 0 <= ci95[1] or (mcnemar_p is not None and mcnemar_p >= 0.05):
        return "within noise"
    if floor is not None and abs(diff) <= floor:
        return "below the noise floor"
    word = "better" if (diff < 0) == lower_is_better else "worse"
    return word if floor is not None else f"{word} (no noise floor: one baseline seed)"
