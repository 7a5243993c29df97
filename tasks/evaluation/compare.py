"""The comparison report of an ablation: each variant's scores with standard errors, the difference from
the baseline variant with a 95% interval, loss curves overlaid, cost and what was shared.

Everything is read from the runs' dirs (step manifests, metrics, the shared evaluation results),
so it can be rebuilt at any time. A variant's score is the mean over its seeds; its standard
error combines the spread across seeds (s/sqrt(n), when n > 1) with the item-sampling error lm-eval
reports (or, for the held-out prompts, the binomial one: statsmodels' Agresti-Coull interval),
averaged over seeds and divided by sqrt(n).

A difference is compared over the items both variants answered where every seed kept its items
(tasks/evaluation/stats.py: a paired bootstrap, McNemar's test for right/wrong items, the unpaired
interval beside it); otherwise its interval is diff +- 1.96 sqrt(SE_a^2 + SE_b^2). The baseline's
seeds measure the noise floor (the difference seeds alone exceed 5% of the time: stats.noise_floor):
"better" or "worse" needs the interval to exclude 0 and the difference to exceed that floor.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.steps import Step, StepOutput, finished
from infra.storage import write_json_atomic, write_text_atomic
from infra.summaries import HeldoutEval, PhaseSummary, TrainedSummary
from tasks.common import run_logger
from tasks.evaluation.audit import NO_SIGNAL, NOISE_WINDOW, audit, audit_table, series
from tasks.evaluation.plots import artifact, save, table_artifact
from tasks.evaluation.report import eval_records, ladder, not_compared, rung_change, step_metrics, trained_apart
from tasks.evaluation.results import local_fingerprint, main_metric, run_results, stderr_of
from tasks.evaluation.stats import Items, checkpoint_floor, items_of, noise_floor, paired, verdict

LOWER_IS_BETTER = ("bits_per_byte", "loss")


@dataclass(frozen=True)
class AblationRunDir:
    name: str
    variant: str
    run_dir: Path
    steps: list[Step]  # the steps it ran, upstream first


@dataclass
class Score:
    """One metric of one model of one run, with its standard error."""

    value: float
    stderr: float | None
    items: Items | None = None  # each item's outcome, where the evaluation kept them (paired comparisons)


@dataclass
class Row:
    """One metric compared across variants: model label, task (or `held-out`), metric name."""

    model: str
    task: str
    metric: str
    scores: dict[str, list[Score]] = field(default_factory=lambda: defaultdict(list))  # variant -> one per seed

    def summary(self, variant: str) -> tuple[float, float | None]:
        scores = self.scores[variant]
        values = [s.value for s in scores]
        mean = statistics.fmean(values)
        errs = [s.stderr for s in scores if s.stderr is not None]
        var = (statistics.variance(values) / len(values)) if len(values) > 1 else 0.0
        if errs:
            var += statistics.fmean(e * e for e in errs) / len(values)
        elif len(values) == 1:
            return mean, None
        return mean, math.sqrt(var)


def _models(run: AblationRunDir) -> dict[str, tuple[str, StepOutput]]:
    """label -> (content fingerprint, step output) of each finished model of the run."""
    out = {}
    for step in run.steps:
        if step.model and (o := finished(run.run_dir, step)) and o.final.is_dir():
            out[step.model] = (local_fingerprint(o.final), o)
    return out


def model_results(run: AblationRunDir, label: str) -> dict[str, dict[str, Any]]:
    """task -> metrics of the run's model LABEL from the run's result store ({} until it is finished and scored)."""
    found = _models(run).get(label)
    record = run_results(run.run_dir).get(found[0]) if found else None
    return {task: entry["metrics"] for task, entry in (record or {"tasks": {}})["tasks"].items()}


def _rows(runs: list[AblationRunDir]) -> tuple[list[Row], list[str]]:
    """Rows for every metric of every model that differs between runs; and the labels of models identical in all."""
    models = {r.name: _models(r) for r in runs}
    labels = [label for label in models[runs[0].name] if all(label in m for m in models.values())]
    identical = [label for label in labels if len({models[r.name][label][0] for r in runs}) == 1]
    rows: dict[tuple[str, str, str], Row] = {}
    for run in runs:
        results = run_results(run.run_dir)
        for label in labels:
            if label in identical:
                continue
            fp, output = models[run.name][label]
            if isinstance(output.summary, TrainedSummary):
                e = output.summary.eval
                se = _binomial_stderr(e.accuracy, e.items) if e.items else None
                rows.setdefault((label, "held-out", "accuracy"), Row(label, "held-out", "accuracy")).scores[run.variant].append(
                    Score(e.accuracy, se, items_of(e.outcomes))
                )
            record = results.get(fp) or {"tasks": {}}
            for task, entry in sorted(record["tasks"].items()):
                if main := main_metric(entry["metrics"]):
                    key, value = main
                    row = rows.setdefault((label, task, key), Row(label, task, key))
                    row.scores[run.variant].append(Score(value, stderr_of(entry["metrics"], key), items_of(entry.get("items"))))
    variants = list(dict.fromkeys(r.variant for r in runs))
    complete = [row for row in rows.values() if all(row.scores.get(v) for v in variants)]
    return complete, identical


def _binomial_stderr(p: float, n: int) -> float:
    """From statsmodels' Agresti-Coull interval: unlike sqrt(p(1-p)/n) it is not 0 when no (or every) prompt is right."""
    from statsmodels.stats.proportion import proportion_confint

    low, high = proportion_confint(round(p * n), n, alpha=0.05, method="agresti_coull")
    return (high - low) / (2 * 1.959964)


def checkpoint_floors(records: list[dict], pretrained: list[str]) -> dict[tuple[str, str, str], float]:
    """A baseline with one seed: (model, task, metric) -> a noise floor from its last NOISE_WINDOW checkpoints' scores,
    their jitter about their trend (stats.checkpoint_floor), for the PRETRAINED models' rows. It costs nothing more,
    but sees only what the last steps move a score by, not what another initialisation does; and only where those
    checkpoints are the second half of the run or later: over fewer, a line does not fit the climb (bench/verdicts.py:
    on runs of 4 checkpoints, 5x the seeds' floor, 2 in 25 planted effects found)."""
    out = {}
    for (task, metric), by_tokens in series(records).items():
        tokens = sorted(by_tokens)[-NOISE_WINDOW:]
        if len(by_tokens) >= 2 * NOISE_WINDOW and (floor := checkpoint_floor(tokens, [by_tokens[t] for t in tokens])):
            out |= {(model, task, metric): floor for model in pretrained}
    return out


def compare_rows(
    rows: list[Row], variants: list[str], baseline: str, one_seed_floors: dict[tuple[str, str, str], float] | None = None
) -> list[dict[str, Any]]:
    """One table row per (metric, variant): mean, SE, seeds, difference from the baseline with its 95% interval.
    The noise floor comes from the baseline's seeds; with one seed, from ONE_SEED_FLOORS (checkpoint_floors) where given."""
    table = []
    for row in rows:
        base_mean, base_se = row.summary(baseline)
        lower = row.metric in LOWER_IS_BETTER
        for variant in variants:
            floor = noise_floor([s.value for s in row.scores[baseline]], len(row.scores[baseline]), len(row.scores[variant]))
            floor_from = "seeds"
            if floor is None and (floor := (one_seed_floors or {}).get((row.model, row.task, row.metric))) is not None:
                floor_from = f"last {NOISE_WINDOW} checkpoints"
            mean, se = row.summary(variant)
            entry = {
                "model": row.model,
                "task": row.task,
                "metric": row.metric,
                "variant": variant,
                "seeds": len(row.scores[variant]),
                "mean": round(mean, 4),
                "stderr": None if se is None else round(se, 4),
                "seeds_only": all(s.stderr is None for s in row.scores[variant]),  # no item-sampling error known
            }
            if floor is not None:
                entry |= {"noise_floor": round(floor, 4), "floor_from": floor_from}
            if variant != baseline:
                entry |= _difference(row, baseline, variant, mean - base_mean, se, base_se, floor, lower)
            table.append(entry)
    return table


def _difference(row: Row, baseline: str, variant: str, diff: float, se, base_se, floor: float | None, lower: bool) -> dict[str, Any]:
    """Paired over items where every seed of both kept its items; else from the two standard errors."""
    runs = [[s.items for s in row.scores[v]] for v in (baseline, variant)]
    out: dict[str, Any] = {"diff": round(diff, 4)}
    if all(all(r) for r in runs) and (p := paired(*runs)):
        out |= {"diff": round(p.diff, 4), "ci95": [round(x, 4) for x in p.ci95], "unpaired_ci95": [round(x, 4) for x in p.unpaired_ci95]}
        out |= {"method": f"paired, {p.items} items", "mde": round(p.mde, 4)}
        out["mcnemar_p"] = None if p.mcnemar_p is None else round(p.mcnemar_p, 4)
        return out | {"verdict": verdict(p.diff, p.ci95, floor, lower, p.mcnemar_p)}
    if se is None or base_se is None:
        return out | {"verdict": "no error estimate"}
    half = 1.96 * math.sqrt(se * se + base_se * base_se)
    ci95 = (diff - half, diff + half)
    return out | {"ci95": [round(x, 4) for x in ci95], "method": "standard errors", "verdict": verdict(diff, ci95, floor, lower)}


def _curves(run: AblationRunDir, step: Step, output: StepOutput | None) -> tuple[str, list[tuple[float, float]]]:
    """The training curve of a step: pretraining loss vs tokens, TRL loss (or GRPO reward) vs step."""
    if output is None:
        return "", []
    if step.checkpoints:
        return "loss vs tokens", [(m["tokens"], m["loss"]) for m in step_metrics(run.run_dir, step.name)]
    s = output.summary
    if isinstance(s, TrainedSummary):
        for key, curve in (("loss", s.loss), ("reward", s.reward)):
            if curve:
                return f"{key} vs step", list(curve)
    return "", []


Done = dict[str, dict[str, StepOutput]]  # run name -> step name -> its finished output


def _finished(runs: list[AblationRunDir]) -> Done:
    return {r.name: {s.name: o for s in r.steps if (o := finished(r.run_dir, s))} for r in runs}


def _cost(runs: list[AblationRunDir], done: Done) -> tuple[list[dict[str, Any]], float, float]:
    """Per run: seconds of its steps as if run alone, tokens pretrained; and the seconds of distinct steps."""
    rows, distinct = [], {}
    users = Counter(o.step_id for outputs in done.values() for o in outputs.values())
    for run in runs:
        seconds = tokens = shared = 0.0
        for step in run.steps:
            out = done[run.name].get(step.name)
            if out is None:
                continue
            seconds += out.seconds
            distinct[out.step_id] = out.seconds
            tokens += out.summary.tokens if isinstance(out.summary, PhaseSummary) else 0
            shared += out.seconds if users[out.step_id] > 1 else 0
        rows.append(
            {
                "run": run.name,
                "variant": run.variant,
                "step_seconds": round(seconds),
                "shared_seconds": round(shared),
                "tokens": int(tokens),
            }
        )
    return rows, sum(r["step_seconds"] for r in rows), sum(distinct.values())


def publish_comparison(
    name: str, root: Path, runs: list[AblationRunDir], baseline: str, wall_seconds: list[float], select: str = "all"
) -> Path:
    """Write ROOT/report/ablation.md (+ PNGs, + JSON) and publish it as Prefect artifacts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = root / "report"
    out.mkdir(parents=True, exist_ok=True)
    variants = list(dict.fromkeys(r.variant for r in runs))
    rows, identical = _rows(runs)
    records = {r.name: eval_records(r.run_dir, r.steps) for r in runs}
    base_runs = [r for r in runs if r.variant == baseline]
    pretrained = [s.model for s in runs[0].steps if s.checkpoints and s.model]
    floors = checkpoint_floors(records[base_runs[0].name], pretrained) if len(base_runs) == 1 else None
    table = compare_rows(rows, variants, baseline, floors)
    audits = audit(list(records.values()), [r.variant for r in runs])
    silent = {a.task for a in audits if a.verdict == NO_SIGNAL}
    if select == "auto":
        table = judge_only_usable(table, silent)
    lines = [
        f"# Ablation: {name}",
        "",
        f"Built {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from `{root}`. Baseline: **{baseline}**.",
        "",
    ]
    lines += ["| run | variant |", "|---|---|"] + [f"| {r.name} | {r.variant} |" for r in runs] + [""]

    # steps shared by all runs, and those that differ
    done = _finished(runs)
    versions = {step.name: len({o.step_id for r in runs if (o := done[r.name].get(step.name))}) for step in runs[0].steps}
    shared = [name for name, n in versions.items() if n == 1]
    differ = [step for step in runs[0].steps if versions[step.name] > 1]
    lines += ["## What was shared", "", f"Built once for all runs: {', '.join(shared) or 'nothing'}.", ""]
    per_run = ", ".join(f"{s.name} ({versions[s.name]} versions)" for s in differ)
    lines += [f"Built per variant or seed: {per_run or 'nothing'}.", ""]
    if identical:
        lines += [f"Models identical in every run (not compared): {', '.join(identical)}.", ""]

    # scores
    lines += ["## Results", ""]
    if not table:
        lines += ["_no evaluation results that differ between variants yet_", ""]
    else:
        lines += [
            "| model | task | metric | variant | seeds | score ± SE | diff vs baseline [95% interval] | unpaired 95% | noise floor "
            "| verdict |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in table:
            se = f" ± {e['stderr']:.4f}{' †' if e['seeds_only'] else ''}" if e["stderr"] is not None else ""
            what = f"{e['model']} | {e['task']} | {e['metric']} | {e['variant']} | {e['seeds']}"
            lines.append(f"| {what} | {e['mean']:.4f}{se} | {_diff_cells(e)} | {e.get('verdict', '')} |")
        lines += [
            "",
            "Paired: over the items both variants answered (bootstrap; McNemar's p for right/wrong items; the smallest "
            "difference it detects 80% of the time in brackets). Noise floor: what the baseline's seeds alone exceed 5% of the time"
            + (
                f"; with one seed, what its last {NOISE_WINDOW} checkpoints' jitter about their trend gives (‡): that misses what "
                "another initialisation moves a score by, so `seeds: 2` or more is the surer floor."
                if floors
                else "."
            ),
        ]
        if any(e["seeds_only"] and e["stderr"] is not None for e in table):
            lines += ["", "† spread over seeds only: lm-eval gives no standard error for this metric, so item sampling is not in it."]
        if len(variants) > 1:
            lines += ["", *_conclusion(table), ""]
            lines += [f"![scores]({save(_forest([e for e in table if 'diff' in e], baseline, plt), out / 'scores.png').name})", ""]
        else:
            study = f"**A seed study** ({len(runs)} seeds of one variant): nothing is compared; each row's noise floor is what"
            lines += ["", f"{study} a variant with as many seeds must differ by to get a verdict.", ""]
    lines += ["## Which tasks carry signal", "", *audit_table(audits), ""]
    if select == "auto":
        lines += [f"Left out of the verdicts (`evaluation.select: auto`): {', '.join(sorted(silent)) or 'none'}.", ""]
    elif silent:
        lines += [f"Judged although they show no signal at this scale (`evaluation.select: all`): {', '.join(sorted(silent))}.", ""]

    ladders, apart = _ladders(runs, done)
    ladder_rows = []
    if ladders:
        ladder_lines, ladder_rows = ladder_by_run(ladders, apart)
        lines += ["## The post-training ladder in every run", "", *ladder_lines, ""]
        lines += [f"![ladders]({save(_ladder_plot(ladders, plt), out / 'ladders.png').name})", ""]

    # training curves of the steps that differ
    curves = [s for s in differ if _curves(runs[0], s, done[runs[0].name].get(s.name))[1]]
    if curves:
        fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.5), squeeze=False)
        colors = {v: f"C{i}" for i, v in enumerate(variants)}
        for ax, step in zip(axes[0], curves, strict=True):
            for run in runs:
                what, points = _curves(run, step, done[run.name].get(step.name))
                if points:
                    ax.plot([x for x, _ in points], [y for _, y in points], color=colors[run.variant], alpha=0.8, label=run.name)
            ax.set(title=f"{step.name}: {what}")
            ax.legend(fontsize=7)
        lines += ["## Training curves (steps that differ)", "", f"![curves]({save(fig, out / 'curves.png').name})", ""]

    # cost
    cost, alone, distinct = _cost(runs, done)
    lines += [
        "## Cost",
        "",
        "| run | variant | step seconds (as if alone) | of which shared | pretraining tokens |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {c['run']} | {c['variant']} | {c['step_seconds']} | {c['shared_seconds']} | {c['tokens']:,} |" for c in cost]
    lines += [
        "",
        f"Independent runs would build {alone:,.0f} s of steps; the ablation built {distinct:,.0f} s of distinct steps "
        f"({alone / max(distinct, 1):.2f}x less)." + _wall(wall_seconds),
        "",
    ]
    markdown = "\n".join(lines) + "\n"
    path = out / "ablation.md"
    write_text_atomic(path, markdown)
    write_json_atomic(
        out / "ablation.json",
        {
            "rows": table,
            "ladder": ladder_rows,
            "audit": [a.row() for a in audits],
            "shared": shared,
            "differ": {s.name: versions[s.name] for s in differ},  # step -> its versions across the runs
            "cost": cost,
            "alone_seconds": alone,
            "distinct_seconds": distinct,
        },
    )
    _artifacts(name, markdown, out, table)
    run_logger().info("ablation report: %s", path.resolve())
    return path


Ladder = list[tuple[str, HeldoutEval]]  # (model label, held-out eval) from the base model up


def _ladders(runs: list[AblationRunDir], done: Done) -> tuple[dict[str, Ladder], dict[str, set[str]]]:
    """run name -> its post-training ladder, for the runs that post-trained; and run name -> its rungs trained apart
    from the one below (`trained_apart`: a stage rebuilt alone in the run's dir)."""
    out, apart = {}, {}
    for run in runs:
        models = [(s.model, o) for s in run.steps if s.model and (o := done[run.name].get(s.name))]
        rungs = ladder(models)
        if len(rungs) > 1:
            out[run.name], apart[run.name] = rungs, trained_apart(models)
    return out, apart


def ladder_by_run(ladders: dict[str, Ladder], apart: dict[str, set[str]] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """Each rung against the one below it in every run: held-out accuracy (paired over the same prompts, McNemar)
    and answer length. A rung holds when it is up beyond the prompts' sampling noise in every run: one model's
    climb, as on the machine a recipe was tuned on, says nothing of another's. A rung a run trained apart from the
    one below (APART, run -> rungs) is not compared there, so it does not hold."""
    apart = apart or {}
    names = [n for n, _ in max(ladders.values(), key=len)]
    lines = [
        "| rung | " + " | ".join(ladders) + " | up in every run | answers not longer in every run |",
        "|---|" + "---|" * (len(ladders) + 2),
    ]
    rows = []
    for i in range(1, len(names)):
        cells, ups, shorter = {}, [], []
        for run, rungs in ladders.items():
            if len(rungs) <= i:
                cells[run] = "not trained yet"
                ups.append(False)
                continue
            if rungs[i][0] in apart.get(run, ()):
                cells[run] = not_compared(rungs[i - 1][0])
                ups.append(False)
                continue
            below, e = rungs[i - 1][1], rungs[i][1]
            p, said = rung_change(below, e) or (None, "no outcomes kept")
            diff = p.diff if p else e.accuracy - below.accuracy
            cells[run] = (
                f"{below.accuracy:.1%} → {e.accuracy:.1%} ({diff:+.1%}: {said}); {below.mean_answer_tokens:.1f} → "
                f"{e.mean_answer_tokens:.1f} tokens"
            )
            ups.append(said == "up")
            shorter.append(e.mean_answer_tokens <= below.mean_answer_tokens)
        rung = f"{names[i]} over {names[i - 1]}"
        holds, brief = all(ups), all(shorter) and len(shorter) == len(ladders)
        rows.append({"rung": rung, "runs": cells, "up_in_every_run": holds, "not_longer_in_every_run": brief})
        lines.append(
            f"| {rung} | "
            + " | ".join(cells.values())
            + f" | {'yes' if holds else f'no ({sum(ups)} of {len(ups)})'} | {'yes' if brief else 'no'} |"
        )
    held = [r["rung"] for r in rows if r["up_in_every_run"]]
    not_held = [r["rung"] for r in rows if not r["up_in_every_run"]]
    lines += [
        "",
        "Each cell: held-out accuracy below → this rung (the paired difference over the same prompts and its verdict: 95% "
        "bootstrap interval and McNemar's test), then mean answer tokens.",
        "",
        f"**Holds in every run:** {', '.join(held) or 'no rung'}. **Does not:** {', '.join(not_held) or 'none'}.",
    ]
    return lines, rows


def _ladder_plot(ladders: dict[str, Ladder], plt) -> Any:
    """Held-out accuracy per rung, one line per run."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run, rungs in ladders.items():
        ax.plot([n for n, _ in rungs], [e.accuracy for _, e in rungs], marker="o", label=run)
    ax.set(title="Post-training ladder per run", ylabel="held-out accuracy")
    ax.legend(fontsize=7)
    return fig


def _forest(diffs: list[dict[str, Any]], baseline: str, plt) -> Any:
    """Each variant's difference from the baseline with its 95% interval, one line per metric."""
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(diffs) + 1.5))
    for i, e in enumerate(diffs):
        low, high = e.get("ci95", [e["diff"], e["diff"]])
        color = {"better": "C2", "worse": "C3"}.get(e.get("verdict", "").split(" ")[0], "grey")
        ax.errorbar(e["diff"], i, xerr=[[e["diff"] - low], [high - e["diff"]]], fmt="o", color=color, capsize=3)
    ax.axvline(0, color="black", linewidth=0.8)
    labels = [f"{e['variant']}: {e['model']} {e['task'].removeprefix('smol_')} ({e['metric'].split('/')[0]})" for e in diffs]
    ax.set_yticks(range(len(diffs)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(title=f"Difference from {baseline}, 95% interval", xlabel="green: better, red: worse, grey: within noise")
    return fig


def _wall(seconds: list[float]) -> str:
    if not seconds:
        return ""
    reruns = f" (then {', '.join(f'{s:,.0f} s' for s in seconds[1:])} for reruns)" if len(seconds) > 1 else ""
    return f" Wall time of `smolflow ablate`: {seconds[0]:,.0f} s{reruns}."


def judge_only_usable(table: list[dict[str, Any]], silent: set[str]) -> list[dict[str, Any]]:
    """`evaluation.select: auto`: no verdict on a task the early-signal checks found without signal."""
    return [e | {"verdict": f"not judged: {NO_SIGNAL}"} if e["task"] in silent and "verdict" in e else e for e in table]


def _diff_cells(e: dict[str, Any]) -> str:
    """The difference with its interval (and how it was taken), the unpaired interval, the noise floor."""
    if "diff" not in e:
        floor = f"{e['noise_floor']:.4f}{' ‡' if e['floor_from'] != 'seeds' else ''}" if e.get("noise_floor") is not None else ""
        return f"baseline | | {floor}"
    ci = f" [{e['ci95'][0]:+.4f}, {e['ci95'][1]:+.4f}]" if "ci95" in e else ""
    how = f", {e['method']}" if "method" in e else ""
    how += f", McNemar p={e['mcnemar_p']:.3g}" if e.get("mcnemar_p") is not None else ""
    how += f" (detects ±{e['mde']:.4f})" if e.get("mde") else ""
    unpaired = f"[{e['unpaired_ci95'][0]:+.4f}, {e['unpaired_ci95'][1]:+.4f}]" if "unpaired_ci95" in e else ""
    floor = f"{e['noise_floor']:.4f}" if e.get("noise_floor") is not None else "one seed"
    floor += " ‡" if e.get("floor_from", "seeds") != "seeds" else ""
    return f"{e['diff']:+.4f}{ci}{how} | {unpaired} | {floor}"


def _conclusion(table: list[dict[str, Any]]) -> list[str]:
    """Plain sentences: which differences are outside noise, and that the rest are not."""
    found = [e for e in table if e.get("verdict", "").split(" ")[0] in ("better", "worse")]
    lines = [
        f"- **{e['variant']}** is {e['verdict']} than the baseline on {e['model']} {e['task']} {e['metric']} "
        f"({e['diff']:+.4f}, 95% interval [{e['ci95'][0]:+.4f}, {e['ci95'][1]:+.4f}], {e['method']})."
        for e in found
    ]
    noise = sum(1 for e in table if e.get("verdict") == "within noise")
    if noise:
        lines.append(
            f"- {noise} difference(s) are within noise: the interval includes 0; more seeds or eval items would be needed to tell."
        )
    floor = sum(1 for e in table if e.get("verdict") == "below the noise floor")
    if floor:
        lines.append(f"- {floor} difference(s) exclude 0 but are no larger than the baseline's seed-to-seed difference: not a verdict.")
    return ["**Conclusion**", "", *lines] if lines else ["**Conclusion**: no difference could be estimated."]


def _artifacts(name: str, markdown: str, folder: Path, table: list[dict[str, Any]]) -> None:
    key = f"{name}-ablation".replace("_", "-").lower()
    artifact(markdown, folder, key, f"Ablation {name}")
    if table:
        table_artifact([{k: str(v) for k, v in e.items()} for e in table], key=f"{key}-results", description="Scores per variant")
