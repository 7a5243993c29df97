"""The run's report card: one Markdown page with PNG plots, rebuilt from what the run dir holds.

Everything is read from files the steps already wrote (step manifests, the trainer's
metrics.jsonl, evaluation results), so `smolflow report RUN_DIR` rebuilds it at any time, for a
finished run or one still training, and sections with no data yet say so instead of failing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from infra.steps import METRICS, Step, StepOutput, finished, out_of_date, rebuild_command
from infra.storage import write_text_atomic
from infra.summaries import ChatDataSummary, CurationSummary, HeldoutEval, PhaseSummary, TrainedSummary
from postrain.data import sign_slips_note
from tasks.evaluation.audit import BEYOND, audit, audit_table
from tasks.evaluation.plots import save
from tasks.evaluation.results import made_by, main_metric, run_results, stderr_of
from tasks.evaluation.stats import Paired, items_of, paired, verdict


@dataclass
class Card:
    path: Path
    markdown: str
    plots: list[Path] = field(default_factory=list)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)


def build_report(run_dir: Path, name: str, graph: list[Step]) -> Card:
    """The card of the run `name` in RUN_DIR, whose steps (in DAG order) are `graph`."""
    import matplotlib

    matplotlib.use("Agg")
    out = run_dir / "reports"
    plots_dir = out / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    card = Card(path=out / "card.md", markdown="")
    steps = {s.name: o for s in graph if (o := finished(run_dir, s))}
    evals = eval_records(run_dir, graph)
    order = [s.checkpoints for s in graph if s.checkpoints] + [s.model for s in graph if s.model]
    lines = [f"# Report card: {name}", "", f"Run dir `{run_dir}`, built {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    lines += _summary(run_dir, graph, steps, evals)
    lines += _curation([s for s in graph if issubclass(s.summary_type, CurationSummary)], steps)
    lines += _pretraining(run_dir, [s for s in graph if s.checkpoints], plots_dir, card)
    lines += _evaluations(evals, order, phase_ends([steps[s.name] for s in graph if s.checkpoints and s.name in steps]), plots_dir, card)
    lines += _early_signal(evals, plots_dir, card)
    chats = [o.summary for o in steps.values() if isinstance(o.summary, ChatDataSummary)]
    slips = sum(c.sign_slips for c in chats)
    notes = [sign_slips_note(slips)] if slips else []
    notes += [f"**Chat data off the recipe's mix:** {line}" for c in chats for line in c.mixture_shortfalls]
    lines += _post_training([(s.model, steps[s.name]) for s in graph if s.model and s.name in steps], evals, plots_dir, card, notes)
    lines += _wall_time(steps, plots_dir, card)
    card.markdown = "\n".join(lines) + "\n"
    write_text_atomic(card.path, card.markdown)
    return card


def phase_ends(phases: list[StepOutput]) -> list[tuple[str, int]]:
    """(phase, tokens) where each finished pretraining phase ended, counted as its checkpoints count
    tokens: the global step (the steps of the phases before it, plus its own) x its tokens per step."""
    ends, steps = [], 0
    for out in phases:
        s = out.summary
        if isinstance(s, PhaseSummary) and s.steps:
            steps += s.steps
            ends.append((s.phase, round(steps * s.tokens / s.steps)))
    return ends


def eval_records(run_dir: Path, graph: list[Step]) -> list[dict]:
    """This run's results: a result store shared with other runs (an ablation's) holds theirs too."""
    ours = {made_by(folder) for s in graph for folder in (run_dir / s.name, run_dir / ".partial" / s.name)} - {None}
    records = run_results(run_dir).all()
    return [r for r in records if r["model"].get("step_id") in ours or r["model"].get("step_id") is None]


def _training_order(model: dict, order: list[str]) -> tuple:
    """Checkpoints by phase and step, then the finished models from base to the last post-training step."""
    rank = order.index(model["stage"]) if model["stage"] in order else len(order)
    return (model["kind"] != "checkpoint", rank, model.get("step") or 0)


def _summary(run_dir: Path, graph: list[Step], steps: dict[str, StepOutput], evals: list) -> list[str]:
    total = sum(o.seconds for o in steps.values())
    done = f"**{len(steps)} of {len(graph)} steps finished** ({', '.join(steps) or 'none yet'})"
    lines = [f"{done}, {total / 60:.1f} min of step time; {len(evals)} models evaluated.", ""]
    stale = [f"{s.step.name} ({s.why()})" for s in out_of_date(run_dir, graph)]
    if stale:  # one stage rerun on its own leaves the later ones built on what it replaced
        lines += [
            f"**Out of date with the run's recipe:** {', '.join(stale)}. Their figures below are of the versions built "
            f"before; `{rebuild_command(run_dir)}` rebuilds them on that recipe.",
            "",
        ]
    return lines


def _curation(curate: list[Step], steps: dict[str, StepOutput]) -> list[str]:
    rows = []
    for name in [c.name for c in curate if c.name in steps]:
        s = steps[name].summary
        docs_in, docs_out = s.documents() if isinstance(s, CurationSummary) else (None, None)
        counts = " | ".join(f"{n:,}" if n else "" for n in (docs_in, docs_out))
        rows.append(f"| {name} | {counts} | {steps[name].seconds:.0f} |")
    if not rows:
        return ["## Curation", "", "_not run yet_", ""]
    return ["## Curation", "", "| step | documents in | documents out | seconds |", "|---|---|---|---|", *rows, ""]


def step_metrics(run_dir: Path, step: str) -> list[dict]:
    """A pretraining step's logged metrics (metrics.jsonl), finished or still building."""
    for folder in (run_dir / step, run_dir / ".partial" / step):
        path = folder / METRICS
        if path.is_file():
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return []


def pretraining_table(per_phase: dict[str, list[dict]]) -> list[str]:
    """The pretraining phases as a table from their logged metrics (phase -> metrics.jsonl lines), the one renderer
    of it (report card, pretraining report). Medians: one slow window does not set a figure."""
    rows = ["| phase | steps logged | tokens (end) | last loss | tokens/s | s/step | MFU | of peak per rank |", "|---" * 8 + "|"]
    for name, metrics in per_phase.items():
        if not metrics:
            continue
        keys = ("tokens_per_s", "mfu", "step_s", "peak_flops_per_rank")
        speed, mfu, step_s, peak = (median([m.get(k, math.nan) for m in metrics]) for k in keys)
        last = metrics[-1]
        rows.append(
            f"| {name} | {len(metrics)} | {last['tokens']:,} | {last['loss']:.3f} | {speed:,.0f} | {step_s:.2f} | {mfu:.1%} | "
            f"{peak / 1e9:,.1f} GFLOP/s |"
        )
    return rows


def _pretraining(run_dir: Path, phases: list[Step], plots_dir: Path, card: Card) -> list[str]:
    import matplotlib.pyplot as plt

    per_stage = {s.checkpoints: step_metrics(run_dir, s.name) for s in phases}
    if not any(per_stage.values()):
        return ["## Pretraining", "", "_no training metrics yet_", ""]
    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for name, metrics in per_stage.items():
        if metrics:
            loss_ax.plot([m["tokens"] for m in metrics], [m["loss"] for m in metrics], label=name)
            speed_ax.bar(name, median([m.get("tokens_per_s", math.nan) for m in metrics]))
    rows = pretraining_table(per_stage)
    loss_ax.set(xlabel="tokens", ylabel="training loss", title="Loss per phase")
    loss_ax.legend()
    speed_ax.set(ylabel="tokens/s (median)", title="Throughput per phase")
    path = _save(fig, plots_dir / "pretrain.png", card)
    return ["## Pretraining", "", f"![loss and throughput]({path.relative_to(card.path.parent)})", "", *rows, ""]


def _evaluations(evals: list, order: list[str], boundaries: list[tuple[str, int]], plots_dir: Path, card: Card) -> list[str]:
    """Each eval vs tokens with lm-eval's standard error, the chance level (multiple choice) and the
    ends of the pretraining phases (BOUNDARIES: phase, cumulative tokens); then a table per model."""
    import matplotlib.pyplot as plt

    for record in sorted(evals, key=lambda r: _training_order(r["model"], order)):
        model = record["model"]
        for task, entry in sorted(record["tasks"].items()):
            main = main_metric(entry["metrics"])
            if main:
                row = {"model": model["label"], "tokens": model.get("tokens"), "task": task, "metric": main[0], "value": round(main[1], 4)}
                row |= {"stderr": stderr_of(entry["metrics"], main[0]), "chance": entry["metrics"].get("chance")}
                card.eval_rows.append(row)
    if not card.eval_rows:
        return ["## Evaluations", "", "_no evaluation results yet_", ""]
    series: dict[str, list[dict]] = {}
    for row in card.eval_rows:
        if row["tokens"]:
            series.setdefault(f"{row['task']} ({row['metric']})", []).append(row)
    lines = ["## Evaluations", ""]
    if series:
        cols = 3
        nrows = (len(series) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
        for ax, (name, rows) in zip(axes.flat, sorted(series.items())):
            rows.sort(key=lambda r: r["tokens"])
            errors = [r["stderr"] or 0.0 for r in rows]
            ax.errorbar([r["tokens"] for r in rows], [r["value"] for r in rows], yerr=errors, marker="o", capsize=2, label="± stderr")
            chance = next((r["chance"] for r in rows if r["chance"] is not None), None)
            if chance is not None:
                ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance {chance:.2f}")
            for phase, end in boundaries:
                ax.axvline(end, color="tab:orange", linestyle=":", linewidth=1)
                ax.text(end, 1.0, f" {phase}", transform=ax.get_xaxis_transform(), fontsize=6, rotation=90, va="top")
            ax.set_title(name.removeprefix("smol_"), fontsize=9)
            ax.set_xlabel("tokens", fontsize=8)
            ax.legend(fontsize=6, loc="best")
        for ax in list(axes.flat)[len(series) :]:
            ax.axis("off")
        path = _save(fig, plots_dir / "evals.png", card)
        lines += [f"![evals vs tokens]({path.relative_to(card.path.parent)})", ""]
    tasks = sorted({r["task"] for r in card.eval_rows})
    by_model: dict[str, dict[str, float]] = {}
    for row in card.eval_rows:
        by_model.setdefault(row["model"], {})[row["task"]] = row["value"]
    lines += ["| model | " + " | ".join(t.removeprefix("smol_") for t in tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for model, values in by_model.items():
        lines.append(f"| {model} | " + " | ".join(f"{values[t]:.3f}" if t in values else "" for t in tasks) + " |")
    return lines + [
        "",
        "acc: accuracy (cloze `_cf`, lettered `_mcf`); exact_match: generative; bits_per_byte: held-out perplexity (lower is better).",
        "",
    ]


def ladder(models: list[tuple[str, StepOutput]]) -> list[tuple[str, HeldoutEval]]:
    """(label, held-out eval) from the base model up: the first trained step also scored its starting point."""
    rungs: list[tuple[str, HeldoutEval]] = []
    for label, out in models:
        s = out.summary
        if not isinstance(s, TrainedSummary):
            continue  # the pretrained base: scored by the first trained step
        if not rungs and s.eval_before is not None:
            rungs.append(("base", s.eval_before))
        rungs.append((label, s.eval))
    return rungs


def trained_apart(models: list[tuple[str, StepOutput]]) -> set[str]:
    """The rungs not trained from the version of the rung below that the run links (their lineage names another):
    after one stage is rebuilt alone, the later ones were trained from what it replaced, and the two are not parent
    and child. A manifest from before lineage was kept says nothing, and is compared."""
    apart, below = set(), None
    for label, out in models:
        if isinstance(out.summary, TrainedSummary):
            if below is not None and out.lineage.get(below.name, below.step_id) != below.step_id:
                apart.add(label)
            below = out
    return apart


def not_compared(below: str) -> str:
    """What a ladder says of a rung trained apart from the rung BELOW it (`trained_apart`), in every table of one."""
    return f"not compared: trained from another {below} (out of date)"


def falls(rungs: list[tuple[str, HeldoutEval]], apart: Collection[str] = ()) -> str | None:
    """Each rung under the one below it, in words: a stage that costs accuracy must not hide in a table of figures.
    APART (`trained_apart`): rungs not trained from the one below, whose difference says nothing of a stage."""
    under = [
        f"{name} is {100 * (below.accuracy - e.accuracy):.1f} points under {below_name}"
        for (below_name, below), (name, e) in zip(rungs, rungs[1:])
        if e.accuracy < below.accuracy and name not in apart
    ]
    return f"Held-out accuracy falls: {'; '.join(under)}." if under else None


def ladder_table(
    rungs: list[tuple[str, HeldoutEval]], generative: dict[str, float] | None = None, apart: Collection[str] = ()
) -> list[str]:
    """The post-training ladder as a table, the one renderer of it (report card, post-training report): held-out
    accuracy overall and by family, lm-eval's math exact match where scored (GENERATIVE), answer length, each rung
    against the one below on the same prompts (paired) unless it was trained apart from it (APART); then any fall."""
    generative = generative or {}
    rows = ["| model | held-out accuracy | by family | lm-eval math | mean answer tokens | vs the rung below (paired) |"]
    rows.append("|---|---|---|---|---|---|")
    below: tuple[str, HeldoutEval] | None = None
    for n, e in rungs:
        family = ", ".join(f"{k} {v:.1%}" for k, v in e.by_family.items())
        math_em = f"{generative[n]:.1%}" if n in generative else ""
        vs = not_compared(below[0]) if n in apart and below else rung_step(below[1] if below else None, e)
        rows.append(f"| {n} | {e.accuracy:.1%} | {family} | {math_em} | {e.mean_answer_tokens:.1f} | {vs} |")
        below = (n, e)
    if fell := falls(rungs, apart):
        rows += ["", f"**{fell}**"]
    if any(e.outcomes for _, e in rungs):
        note = "Paired: over the prompts both rungs answered, 95% bootstrap interval and McNemar's p (one pipeline seed: no noise floor;"
        note += " `smolflow ablate configs/ablations/ladder_seeds.yaml` repeats the ladder over seeds)."
        rows += ["", note]
    return rows


def rung_change(below: HeldoutEval | None, e: HeldoutEval) -> tuple[Paired, str] | None:
    """A rung's accuracy change from the one below it over the same held-out prompts, and its verdict (up, down,
    within noise); None where either kept no outcomes."""
    if below is None or not (below.outcomes and e.outcomes):
        return None
    p = paired([items_of(below.outcomes)], [items_of(e.outcomes)])
    if p is None:
        return None
    said = verdict(p.diff, p.ci95, None, lower_is_better=False, mcnemar_p=p.mcnemar_p).replace("better", "up").replace("worse", "down")
    return p, said.split(" (")[0]


def rung_step(below: HeldoutEval | None, e: HeldoutEval) -> str:
    """A rung's change from the one below it, with how sure it is; blank where either kept no outcomes."""
    if (change := rung_change(below, e)) is None:
        return ""
    p, said = change
    return f"{p.diff:+.1%} [{p.ci95[0]:+.1%}, {p.ci95[1]:+.1%}], McNemar p={p.mcnemar_p:.2g}: {said}"


def ladder_plot(rungs: list[tuple[str, HeldoutEval]], path: Path, generative: dict[str, float] | None = None) -> Path:
    """The ladder's held-out accuracy (and lm-eval's math exact match where scored) and answer length per rung, the
    one plot of it (report card, post-training report)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    generative = generative or {}
    fig, (acc_ax, len_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [n for n, _ in rungs]
    acc_ax.bar(names, [e.accuracy for _, e in rungs], label="held-out prompts")
    if generative:
        scored = [n for n in names if n in generative]
        acc_ax.plot(scored, [generative[n] for n in scored], "ko-", label="lm-eval math (exact match)")
    acc_ax.set(title="Accuracy", ylim=(0, 1))
    acc_ax.legend(fontsize=8)
    len_ax.bar(names, [e.mean_answer_tokens for _, e in rungs])
    len_ax.set(title="Mean answer length (tokens)")
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path)


def _post_training(models: list[tuple[str, StepOutput]], evals: list, plots_dir: Path, card: Card, notes: list[str]) -> list[str]:
    """NOTES: what the SFT data holds that a reader must know (planted sign slips, a family short of the recipe's share),
    said beside the ladder so no reader takes SFT's lost signs for a defect or misreads a family's accuracy."""
    rungs = ladder(models)
    if not rungs:
        return ["## Post-training", "", "_not run yet_", ""]
    gen = {}
    for record in evals:
        scores = [e["metrics"]["exact_match/answer"] for t, e in record["tasks"].items() if "exact_match/answer" in e["metrics"]]
        if record["model"]["kind"] == "model" and scores:
            gen[record["model"]["label"]] = sum(scores) / len(scores)
    path = ladder_plot(rungs, plots_dir / "postrain.png", gen)
    card.plots.append(path)
    rows = ladder_table(rungs, gen, trained_apart(models))
    for note in notes:
        rows += ["", note]
    return ["## Post-training ladder", "", f"![ladder]({path.relative_to(card.path.parent)})", "", *rows, ""]


def _early_signal(evals: list[dict], plots_dir: Path, card: Card) -> list[str]:
    """Which eval tasks carry signal at this scale (tasks/evaluation/audit.py), as `smolflow evals audit` prints it."""
    import matplotlib.pyplot as plt

    audits = audit([evals])
    lines = ["## Early-signal checks", "", *audit_table(audits), ""]
    if audits:
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(audits) + 1.2))
        colors = {"usable early": "C2", "usable late": "C1"}
        ax.barh([a.task for a in audits], [a.snr for a in audits], color=[colors.get(a.verdict, "grey") for a in audits])
        ax.axvline(BEYOND, color="black", linewidth=0.8, linestyle="--")
        ax.invert_yaxis()
        legend = f"green: usable early, orange: late, grey: no signal (dashed: {BEYOND:g})"
        ax.set(title="Signal / noise over the checkpoints", xlabel=legend)
        lines += [f"![early-signal checks]({_save(fig, plots_dir / 'audit.png', card).relative_to(card.path.parent)})", ""]
    return lines


def _wall_time(steps: dict[str, StepOutput], plots_dir: Path, card: Card) -> list[str]:
    import matplotlib.pyplot as plt

    timed = [(name, o.seconds) for name, o in steps.items()]
    if not timed:
        return []
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(timed) + 1))
    ax.barh([n for n, _ in timed], [s for _, s in timed])
    ax.invert_yaxis()
    ax.set(xlabel="seconds", title="Wall time per step (last build)")
    path = _save(fig, plots_dir / "wall_time.png", card)
    return ["## Wall time per step", "", f"![wall time]({path.relative_to(card.path.parent)})", ""]


def _save(fig, path: Path, card: Card) -> Path:
    card.plots.append(save(fig, path))
    return path
