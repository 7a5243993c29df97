"""The curate stage's flow: raw text to tokenized sources and per-stage mixtures."""

from __future__ import annotations

from prefect import flow

from infra.steps import RunContext, StepOutput
from tasks import curate as t


def curate(ctx: RunContext) -> dict[str, StepOutput]:
    embedded = t.build_corpus(ctx)
    ingested = t.ingest(ctx, embedded)
    filtered = t.filter_docs(ctx, ingested)
    deduped = t.dedup(ctx, filtered)
    decont = t.decontaminate(ctx, deduped)
    tok = t.train_tokenizer(ctx, decont)
    tokenized = t.tokenize(ctx, decont, tok)
    mixed = t.mixtures(ctx, tokenized)
    steps = {"corpus": embedded} if embedded else {}
    steps |= {
        "ingest": ingested,
        "filter": filtered,
        "dedup": deduped,
        "decont": decont,
        "tokenizer": tok,
        "tokenize": tokenized,
        "mixtures": mixed,
    }
    t.report(ctx, steps)
    return steps


@flow(name="curate")
def curate_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Curate RECIPE's sources into RUN_DIR; returns the path of the curation report."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    curate(ctx)
    return str(ctx.run_dir / "reports" / "curate.md")
