"""The curation report: what every step kept and removed, with examples, as Markdown."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from infra.steps import StepOutput
from infra.summaries import MixturesSummary


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def examples(folder: Path, limit: int, chars: int = 160) -> list[str]:
    """The first removed documents of a folder of JSONL shards, shortened for the report."""
    found: list[str] = []
    for path in sorted(folder.rglob("*.jsonl.gz")) if folder.exists() else []:
        with gzip.open(path, "rt") as f:
            for line in f:
                doc = json.loads(line)
                text = " ".join(doc["text"].split())
                found.append(f"`{doc['id']}`: {text[:chars]}{'…' if len(text) > chars else ''}")
                if len(found) >= limit:
                    return found
    return found


def mixture_rows(mixtures: MixturesSummary) -> list[dict[str, Any]]:
    return [{"phase": p.name, "source": source, **row.model_dump()} for p in mixtures.phases for source, row in p.sources.items()]


def curation_report(
    ingested: StepOutput,
    filtered: StepOutput,
    deduped: StepOutput,
    decontaminated: StepOutput,
    tokenized: StepOutput,
    mixed: StepOutput,
    steps: list[StepOutput],
    examples_per_filter: int,
) -> str:
    """The report of one curate run; `steps` lists every step of the stage for the timing table."""
    ingest, filt, dedup, decont = ingested.summary, filtered.summary, deduped.summary, decontaminated.summary
    tokens, mixtures = tokenized.summary, mixed.summary
    out = ["# Curation report", ""]

    out += ["## Sources", ""]
    out.append(
        _table(
            ["source", "files", "documents", "malformed records"],
            [[n, s.files, s.docs, s.malformed] for n, s in ingest.sources.items()],
        )
    )
    for name, s in ingest.sources.items():
        for err in s.errors:
            where = f"{err['file']}:{err['line']}" if err["line"] else err["file"]
            out.append(f"- {name}: `{where}`: {err['error']}")
    out.append("")

    out += ["## Quality filters", ""]
    for name, s in filt.sources.items():
        out.append(f"### {name}: {s.docs_in:,} in, {s.docs_out:,} out")
        rows = [[f, r.total, ", ".join(f"{k}: {v:,}" for k, v in r.reasons.items())] for f, r in s.removed.items()]
        out += ["", _table(["quality filter", "removed", "reasons"], rows), ""]
        for f in s.removed:
            for ex in examples(filtered.path / "removed" / name / f, examples_per_filter):
                out.append(f"- {f}: {ex}")
        out.append("")

    out += ["## Deduplication", ""]
    rows = [[k, n, f"{dedup.rates[k]:.2%}"] for k, n in dedup.removed.items()]
    out += [f"{dedup.docs_in:,} documents in.", "", _table(["stage", "removed", "rate"], rows), ""]
    for k in dedup.removed:
        out += [f"- {k}: {ex}" for ex in examples(deduped.path / "removed" / k, examples_per_filter)]
    if dedup.seconds:  # a disabled dedup times nothing
        out += ["", "Wall time per datatrove stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in dedup.seconds.items()) + "."]
    out.append("")

    out += ["## Decontamination", ""]
    rows = [
        [task, v["items"], v["ngrams"], v["short_items"], decont.hits.get(task, 0), decont.hits_short.get(task, 0)]
        for task, v in decont.indexed_ngrams.items()
    ]
    head = ["eval set", "items", "n-grams indexed", "items shorter than n (exact match)", "documents removed", "of them by a short item"]
    out += [_table(head, rows), ""]
    out += [f"- {ex}" for ex in examples(decontaminated.path / "removed", examples_per_filter)]
    out.append("")

    out += ["## Tokens per source", ""]
    out.append(_table(["source", "documents", "tokens"], [[n, s.docs, s.tokens] for n, s in tokens.sources.items()]))
    out += ["", "## Mixtures", ""]
    out.append(
        _table(
            ["phase", "source", "weight", "tokens", "available", "epochs", "epochs so far"],
            [
                [
                    r["phase"],
                    r["source"],
                    f"{r['weight']:.0%}",
                    r["tokens"],
                    r["available"],
                    f"{r['epochs']:.2f}",
                    f"{r['cumulative_epochs']:.2f}",
                ]
                for r in mixture_rows(mixtures)
            ],
        )
    )
    out += [""] + [f"- ⚠️ {w}" for w in mixtures.warnings]

    out += ["", "## Steps", ""]
    out.append(
        _table(
            ["step", "step id", "cached", "seconds"],
            [[s.name, s.step_id, "yes" if s.cached else "no", f"{s.seconds:.1f}"] for s in steps],
        )
    )
    return "\n".join(out) + "\n"
