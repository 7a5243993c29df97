"""Prefect tasks of the curate stage: each declares a step's config and inputs and calls plain code.

Step order: corpus → ingest → filter → dedup → decont → tokenizer → tokenize → mixtures → report.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.errors import DataError
from infra.steps import RunContext, StepOutput, write_json_atomic
from infra.storage import fingerprint_files, fingerprint_url
from tasks.common import run_logger, stage_task
from tasks.curation import corpus, pipelines, tokenizer
from tasks.curation.mixtures import resolve_mixtures
from tasks.curation.readers import DEFAULT_GLOBS
from tasks.curation.report import curation_report, mixture_rows


def _eval_fingerprint(paths: list[str]) -> str:
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise DataError(f"curate.decontamination.eval_sets: {missing[0]} not found (paths are relative to {Path.cwd()})")
    return fingerprint_files((Path(p).name, Path(p)) for p in paths)


@stage_task("corpus")
def build_corpus(ctx: RunContext) -> StepOutput | None:
    """The embedded corpus, if any source of the recipe uses it."""
    recipe = ctx.recipe
    if not any(s.format == "embedded" for s in recipe.sources):
        return None
    cfg, evals = recipe.embedded, recipe.curate.decontamination.eval_sets
    root = corpus.stdlib_root()
    max_bytes = int(cfg.stdlib_max_mb * 2**20) if cfg.stdlib_max_mb else None
    stdlib = fingerprint_files((p.relative_to(root).as_posix(), p) for p in corpus.stdlib_files(root, max_bytes))

    def build(out: Path) -> dict:
        counts = corpus.build_corpus(
            root,
            max_bytes,
            cfg.math_problems,
            cfg.problems_per_doc,
            cfg.max_value,
            recipe.seed,
            corpus.read_eval_questions(evals),
            out,
            recipe.executor.tasks,
        )
        run_logger().info("embedded corpus: %s documents", counts)
        return {"docs": counts, "stdlib": str(root)}

    config = {"embedded": cfg.model_dump(), "seed": recipe.seed, "shards": recipe.executor.tasks}
    return ctx.step("corpus", config, {"stdlib": stdlib, "eval_sets": _eval_fingerprint(evals)}, build)


@stage_task("ingest")
def ingest(ctx: RunContext, embedded: StepOutput | None) -> StepOutput:
    """Every raw source read into uniform JSONL; malformed records counted, never dropped silently."""
    recipe = ctx.recipe
    paths, inputs = {}, {}
    for source in recipe.sources:
        if source.format == "embedded":
            paths[source.name] = str(embedded.path / source.domain)
            inputs[source.name] = embedded.fingerprint
        else:
            paths[source.name] = source.path
            try:
                inputs[source.name] = fingerprint_url(source.path, source.glob or DEFAULT_GLOBS[source.format], recipe.storage.s3)
            except FileNotFoundError:
                raise DataError(f"source {source.name!r} ({source.path}): no such file or folder") from None
    config = {"sources": [s.model_dump() for s in recipe.sources], "strict": recipe.curate.strict}
    out = ctx.step("ingest", config, inputs, lambda out: pipelines.ingest(recipe, paths, out))
    for name, s in out.summary["sources"].items():
        run_logger().info("ingest %s: %d documents from %d files, %d malformed", name, s["docs"], s["files"], s["malformed"])
    return out


@stage_task("filter")
def filter_docs(ctx: RunContext, ingested: StepOutput) -> StepOutput:
    recipe = ctx.recipe
    config = {"filters": {s.name: {"domain": s.domain, "filters": recipe.curate.filters[s.domain]} for s in recipe.sources}}
    out = ctx.step("filter", config, {"ingest": ingested}, lambda out: pipelines.filter_docs(recipe, ingested.path, out))
    sources = out.summary["sources"]
    for name, s in sources.items():
        run_logger().info("filter %s: %d in, %d out", name, s["docs_in"], s["docs_out"])
    if sum(s["docs_out"] for s in sources.values()) == 0:
        counts = "; ".join(f"{n}: {s['docs_in']} in, removed {s['removed']}" for n, s in sources.items())
        raise DataError(f"every document was filtered out ({counts}); loosen curate.filters")
    return out


@stage_task("dedup")
def dedup(ctx: RunContext, filtered: StepOutput) -> StepOutput:
    recipe = ctx.recipe
    config = recipe.curate.dedup.model_dump()
    out = ctx.step("dedup", config, {"filter": filtered}, lambda out: pipelines.dedup(recipe, filtered.path, out))
    run_logger().info("dedup: %d in, removed %s", out.summary["docs_in"], out.summary["removed"])
    return out


@stage_task("decontaminate")
def decontaminate(ctx: RunContext, deduped: StepOutput) -> StepOutput:
    recipe = ctx.recipe
    cfg = recipe.curate.decontamination
    inputs = {"dedup": deduped, "eval_sets": _eval_fingerprint(cfg.eval_sets)}
    if cfg.enabled:
        build = lambda out: pipelines.decontaminate(recipe, deduped.path, out)  # noqa: E731
    else:
        build = lambda out: pipelines.passthrough(deduped.path, out)  # noqa: E731
    out = ctx.step("decont", cfg.model_dump(), inputs, build)
    run_logger().info("decontamination: removed %s", out.summary.get("hits", {}))
    return out


@stage_task("tokenizer")
def train_tokenizer(ctx: RunContext, decont: StepOutput) -> StepOutput:
    cfg = ctx.recipe.curate.tokenizer
    if cfg.path:
        inputs = {"tokenizer": fingerprint_files([("tokenizer.json", Path(cfg.path))])}
        return ctx.step("tokenizer", cfg.model_dump(), inputs, lambda out: tokenizer.copy_existing(cfg.path, out) or {"path": cfg.path})

    def build(out: Path) -> dict:
        dirs = [decont.path / pipelines.DATA / s.name for s in ctx.recipe.sources]
        texts = tokenizer.sample_texts(dirs, int(cfg.train.sample_mb * 2**20))
        bpe = tokenizer.train_bpe(texts, cfg.train.vocab_size, cfg.train.min_frequency)
        tokenizer.save_hf(bpe, out)
        return {"vocab_size": bpe.get_vocab_size()}

    return ctx.step("tokenizer", cfg.model_dump(), {"decont": decont}, build)


@stage_task("tokenize")
def tokenize(ctx: RunContext, decont: StepOutput, tok: StepOutput) -> StepOutput:
    recipe = ctx.recipe
    out = ctx.step(
        "tokenize",
        {"seed": recipe.seed, "heldout_fraction": recipe.curate.heldout_fraction},
        {"decont": decont, "tokenizer": tok},
        lambda out: pipelines.tokenize(recipe, decont.path, tok.path / "tokenizer.json", out),
    )
    for name, s in out.summary["sources"].items():
        run_logger().info("tokenize %s: %d documents, %d tokens", name, s["docs"], s["tokens"])
    return out


@stage_task("mixtures")
def mixtures(ctx: RunContext, tokenized: StepOutput) -> StepOutput:
    pretrain = ctx.recipe.pretrain
    available = {name: s["tokens"] for name, s in tokenized.summary["sources"].items()}

    def build(out: Path) -> dict:
        manifest = resolve_mixtures(pretrain, available)
        write_json_atomic(out / "mixtures.json", manifest)
        return manifest

    config = {"stages": [s.model_dump() for s in pretrain.stages], "seq_len": pretrain.seq_len, "max_epochs": pretrain.max_epochs}
    out = ctx.step("mixtures", config, {"tokenize": tokenized}, build)
    for warning in out.summary["warnings"]:
        run_logger().warning("mixture: %s", warning)
    return out


@stage_task("curation-report", retries=1)
def report(ctx: RunContext, steps: dict[str, StepOutput]) -> Path:
    """Markdown report in the run dir, also published as Prefect artifacts."""
    markdown = curation_report(steps, ctx.recipe.curate.examples_per_filter)
    path = ctx.run_dir / "reports" / "curate.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown)
    (path.with_suffix(".json")).write_text(json.dumps({k: v.summary for k, v in steps.items()}, indent=2))
    key = f"{ctx.recipe.name}-curation".replace("_", "-")
    create_markdown_artifact(markdown, key=key, description="Curation report")
    create_table_artifact(mixture_rows(steps["mixtures"].summary), key=f"{key}-mixtures", description="Tokens drawn per stage and source")
    run_logger().info("curation report: %s", path.resolve())
    return path
