"""The curate stage's steps: each a config (what it reads, so what its identity is) and a function.

Order: corpus → ingest → filter → dedup → decontaminate → tokenizer → tokenize → mixtures, then the
report. The graph (flows/graph.py) names the steps and wires them; the functions take their inputs
by role (`docs`, `bpe`, `tokens`), never by step name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from infra.env import cores
from infra.errors import DataError
from infra.recipe import (
    DecontaminateCfg,
    DedupCfg,
    EmbeddedCorpusCfg,
    ExecutorCfg,
    S3Cfg,
    SourceCfg,
    Strict,
    TokenizerCfg,
    operational,
)
from infra.steps import NoInputs, StepOutput
from infra.storage import fingerprint_files, fingerprint_url, write_json_atomic
from infra.summaries import (
    CorpusSummary,
    DecontaminateSummary,
    DedupSummary,
    FilterSummary,
    IngestSummary,
    MixturesSummary,
    TokenizerSummary,
    TokenizeSummary,
)
from tasks.common import run_logger, stage_task
from tasks.curation import corpus, pipelines, tokenizer
from tasks.curation.mixtures import MixturePhase, resolve_mixtures
from tasks.curation.readers import DEFAULT_GLOBS
from tasks.curation.report import curation_report, mixture_rows
from tasks.evaluation.plots import artifact, table_artifact

# each step's inputs by role (flows/graph.py wires them; a Step checks the wiring against these)


class EmbeddedInputs(TypedDict, total=False):
    embedded: StepOutput  # the corpus, when a source is embedded


class Docs(TypedDict):
    docs: StepOutput


class MaybeDocs(TypedDict, total=False):
    docs: StepOutput  # none when the recipe names a tokenizer


class DocsAndTokenizer(TypedDict):
    docs: StepOutput
    bpe: StepOutput


class Tokens(TypedDict):
    tokens: StepOutput


def eval_set_fingerprint(paths: list[str]) -> str:
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise DataError(f"curate.decontaminate.eval_sets: {missing[0]} not found (paths are relative to {Path.cwd()})")
    return fingerprint_files((Path(p).name, Path(p)) for p in paths)


class CorpusStepCfg(Strict):
    embedded: EmbeddedCorpusCfg
    eval_sets: list[str]
    seed: int
    shards: int
    workers: int = operational(1)  # the executor's; the corpus is parsed on this host's cores


def corpus_files(cfg: CorpusStepCfg) -> dict[str, str]:
    """The stdlib source the corpus is read from, and the eval questions it must never emit."""
    root = corpus.stdlib_root()
    files = corpus.stdlib_files(root, _max_bytes(cfg))
    return {
        "stdlib": fingerprint_files((p.relative_to(root).as_posix(), p) for p in files),
        "eval_sets": eval_set_fingerprint(cfg.eval_sets),
    }


def _max_bytes(cfg: CorpusStepCfg) -> int | None:
    return int(cfg.embedded.stdlib_max_mb * 2**20) if cfg.embedded.stdlib_max_mb else None


def build_corpus(cfg: CorpusStepCfg, inputs: NoInputs, out: Path) -> CorpusSummary:
    """The embedded corpus, built from the stdlib and generated math with no network."""
    e, root = cfg.embedded, corpus.stdlib_root()
    questions = corpus.read_eval_questions(cfg.eval_sets)
    workers = min(cfg.workers, cores())
    counts = corpus.build_corpus(
        root, _max_bytes(cfg), e.math_problems, e.problems_per_doc, e.max_value, cfg.seed, questions, out, cfg.shards, workers
    )
    run_logger().info("embedded corpus: %s documents", counts)
    return CorpusSummary(docs=counts, stdlib=str(root))


class IngestStepCfg(Strict):
    sources: list[SourceCfg]
    executor: ExecutorCfg
    strict: bool = operational(False)
    s3: S3Cfg = operational(S3Cfg())


def source_files(cfg: IngestStepCfg) -> dict[str, str]:
    """What each raw source holds (bytes when local, size and ETag when remote): a path alone is no identity."""
    fps = {}
    for source in cfg.sources:
        if source.format == "embedded":
            continue  # the corpus step's fingerprint stands for it
        try:
            fps[source.name] = fingerprint_url(source.path, source.glob or DEFAULT_GLOBS[source.format], cfg.s3)
        except FileNotFoundError:
            raise DataError(f"source {source.name!r} ({source.path}): no such file or folder") from None
    return fps


def ingest(cfg: IngestStepCfg, inputs: EmbeddedInputs, out: Path) -> IngestSummary:
    """Every raw source read into uniform JSONL; malformed records counted, never dropped silently."""
    paths = {s.name: str(inputs["embedded"].path / s.domain) if s.format == "embedded" else s.path for s in cfg.sources}
    summary = IngestSummary.model_validate(pipelines.ingest(cfg.sources, paths, cfg.executor, cfg.s3, cfg.strict, out))
    for name, s in summary.sources.items():
        run_logger().info("ingest %s: %d documents from %d files, %d malformed", name, s.docs, s.files, s.malformed)
    return summary


class FilterStepCfg(Strict):
    filters: dict[str, dict[str, dict[str, Any]]]  # source -> filter -> datatrove parameters (its domain's set)
    executor: ExecutorCfg


def filter_docs(cfg: FilterStepCfg, inputs: Docs, out: Path) -> FilterSummary:
    summary = FilterSummary.model_validate(pipelines.filter_docs(cfg.filters, cfg.executor, inputs["docs"].path, out))
    sources = summary.sources
    for name, s in sources.items():
        run_logger().info("filter %s: %d in, %d out", name, s.docs_in, s.docs_out)
    if sum(s.docs_out for s in sources.values()) == 0:
        removed = {n: {k: r.model_dump() for k, r in s.removed.items()} for n, s in sources.items()}
        counts = "; ".join(f"{n}: {s.docs_in} in, removed {removed[n]}" for n, s in sources.items())
        raise DataError(f"every document was filtered out ({counts}); loosen curate.filters")
    return summary


class DedupStepCfg(Strict):
    dedup: DedupCfg
    executor: ExecutorCfg


def dedup(cfg: DedupStepCfg, inputs: Docs, out: Path) -> DedupSummary:
    summary = DedupSummary.model_validate(pipelines.dedup(cfg.dedup, cfg.executor, inputs["docs"].path, out))
    run_logger().info("dedup: %d in, removed %s", summary.docs_in, summary.removed)
    return summary


class DecontaminateStepCfg(Strict):
    decontaminate: DecontaminateCfg
    executor: ExecutorCfg


def decontaminate(cfg: DecontaminateStepCfg, inputs: Docs, out: Path) -> DecontaminateSummary:
    docs = inputs["docs"].path
    if cfg.decontaminate.enabled:
        summary = DecontaminateSummary.model_validate(pipelines.decontaminate(cfg.decontaminate, cfg.executor, docs, out))
    else:
        summary = DecontaminateSummary.model_validate(pipelines.passthrough(docs, out))
    run_logger().info("decontamination: removed %s", summary.hits)
    return summary


class TokenizerStepCfg(Strict):
    tokenizer: TokenizerCfg
    sources: list[str]


def tokenizer_file(cfg: TokenizerStepCfg) -> dict[str, str]:
    path = cfg.tokenizer.path
    return {"tokenizer_json": fingerprint_files([("tokenizer.json", Path(path))])} if path else {}


def train_tokenizer(cfg: TokenizerStepCfg, inputs: MaybeDocs, out: Path) -> TokenizerSummary:
    """Train a byte-level BPE on the curated text, or copy the tokenizer the recipe names."""
    if cfg.tokenizer.path:
        tokenizer.copy_existing(cfg.tokenizer.path, out)
        return TokenizerSummary(path=cfg.tokenizer.path)
    train = cfg.tokenizer.train
    texts = tokenizer.sample_texts([inputs["docs"].path / pipelines.DATA / s for s in cfg.sources], int(train.sample_mb * 2**20))
    bpe = tokenizer.train_bpe(texts, train.vocab_size, train.min_frequency)
    tokenizer.save_hf(bpe, out)
    return TokenizerSummary(vocab_size=bpe.get_vocab_size())


class TokenizeStepCfg(Strict):
    sources: list[str]
    seed: int
    heldout_fraction: float
    executor: ExecutorCfg


def tokenize(cfg: TokenizeStepCfg, inputs: DocsAndTokenizer, out: Path) -> TokenizeSummary:
    bpe = inputs["bpe"].path / "tokenizer.json"
    summary = TokenizeSummary.model_validate(
        pipelines.tokenize(cfg.sources, cfg.executor, cfg.seed, cfg.heldout_fraction, inputs["docs"].path, bpe, out)
    )
    for name, s in summary.sources.items():
        run_logger().info("tokenize %s: %d documents, %d tokens", name, s.docs, s.tokens)
    return summary


class MixturesStepCfg(Strict):
    phases: list[MixturePhase]
    max_epochs: float


def mixtures(cfg: MixturesStepCfg, inputs: Tokens, out: Path) -> MixturesSummary:
    available = {name: s.tokens for name, s in inputs["tokens"].summary.sources.items()}
    manifest = MixturesSummary.model_validate(resolve_mixtures(cfg.phases, cfg.max_epochs, available))
    write_json_atomic(out / "mixtures.json", manifest.model_dump(mode="json"))
    for warning in manifest.warnings:
        run_logger().warning("mixture: %s", warning)
    return manifest


@stage_task("curation-report", retries=1)
def report(run_dir: Path, name: str, steps: list[StepOutput], examples_per_filter: int, **outputs: StepOutput) -> Path:
    """Markdown report in the run dir, also published as Prefect artifacts (`outputs`: see curation_report)."""
    markdown = curation_report(**outputs, steps=steps, examples_per_filter=examples_per_filter)
    path = run_dir / "reports" / "curate.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown)
    path.with_suffix(".json").write_text(json.dumps({s.name: s.summary.model_dump(mode="json") for s in steps}, indent=2))
    key = f"{name}-curation".replace("_", "-")
    artifact(markdown, path.parent, key, "Curation report")
    table_artifact(mixture_rows(outputs["mixed"].summary), key=f"{key}-mixtures", description="Tokens drawn per phase and source")
    run_logger().info("curation report: %s", path.resolve())
    return path
