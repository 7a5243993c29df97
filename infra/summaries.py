"""What each step hands downstream, typed: the summary its function returns, stored in its manifest.

A step function declares its summary model as its return type; the executor validates what it
returns against that model before the commit and stores the model's name and VERSION beside it
(`summary_schema`). Readers (reports, model cards, the ablation comparison, the next step) get the
model back, so a renamed or missing field fails where it is read, naming the step, instead of
blanking a table. Bump a model's VERSION when a field changes meaning: a manifest written by a
newer schema than the code knows is refused, an older one is read through the field defaults.

These are schema, like infra/recipe.py: every stage's models live here so that any process (a
report, `smolflow eval`) reads any manifest without importing the stage that wrote it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

SUMMARIES: dict[str, type[Summary]] = {}  # model name -> model, for reading manifests


class Summary(BaseModel):
    """An open summary: a step function that declares no model (a test's toy step) keeps its dict's keys."""

    model_config = ConfigDict(extra="allow", frozen=True)
    VERSION: ClassVar[int] = 1

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        SUMMARIES[cls.__name__] = cls

    @classmethod
    def schema_name(cls) -> str:
        return f"{cls.__name__}/{cls.VERSION}"


SUMMARIES["Summary"] = Summary


class Closed(Summary):
    """A declared summary: every field named, nothing else accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --- curation ----------------------------------------------------------------------------------


class CurationSummary(Closed):
    """A curation step's: the report card's curation table lists the steps that return one."""

    def documents(self) -> tuple[int | None, int | None]:
        """Documents in and out, where the step counts them."""
        return None, None


class CorpusSummary(CurationSummary):
    docs: dict[str, int]  # domain -> documents written
    stdlib: str  # the folder the code and prose came from

    def documents(self) -> tuple[int | None, int | None]:
        return None, sum(self.docs.values())


class SourceIngest(Closed):
    files: int
    docs: int
    malformed: int
    errors: list[dict[str, Any]]  # the first malformed records, with file and line


class IngestSummary(CurationSummary):
    sources: dict[str, SourceIngest]

    def documents(self) -> tuple[int | None, int | None]:
        return None, sum(s.docs for s in self.sources.values())


class FilterRemoval(Closed):
    total: int
    reasons: dict[str, int]


class SourceFilter(Closed):
    docs_in: int
    docs_out: int
    removed: dict[str, FilterRemoval]  # filter -> what it removed


class FilterSummary(CurationSummary):
    sources: dict[str, SourceFilter]

    def documents(self) -> tuple[int | None, int | None]:
        return sum(s.docs_in for s in self.sources.values()), sum(s.docs_out for s in self.sources.values())


class DedupSummary(CurationSummary):
    """A disabled dedup passes the documents through: then only `docs_out` is known."""

    docs_out: dict[str, int]
    docs_in: int = 0
    removed: dict[str, int] = {}  # exact / minhash -> documents
    rates: dict[str, float] = {}
    seconds: dict[str, float] = {}  # datatrove stage -> seconds

    def documents(self) -> tuple[int | None, int | None]:
        return self.docs_in or None, sum(self.docs_out.values())


class DecontaminateSummary(CurationSummary):
    docs_out: dict[str, int]
    docs_in: int = 0
    hits: dict[str, int] = {}  # eval set -> documents removed
    hits_short: dict[str, int] = {}
    hits_by_source: dict[str, int] = {}
    indexed_ngrams: dict[str, dict[str, int]] = {}  # eval set -> items, n-grams, items shorter than n

    def documents(self) -> tuple[int | None, int | None]:
        return self.docs_in or None, sum(self.docs_out.values())


class TokenizerSummary(CurationSummary):
    vocab_size: int | None = None  # trained here
    path: str | None = None  # or copied from the recipe's tokenizer.path


class SourceTokens(Closed):
    tokens: int
    docs: int
    heldout_docs: int = 0


class TokenizeSummary(CurationSummary):
    sources: dict[str, SourceTokens]

    def documents(self) -> tuple[int | None, int | None]:
        return None, sum(s.docs for s in self.sources.values())


class MixtureSource(Closed):
    weight: float
    tokens: int
    available: int
    epochs: float
    cumulative_epochs: float


class MixturePhaseDraw(Closed):
    name: str
    tokens: int
    seq_len: int
    sources: dict[str, MixtureSource]


class MixturesSummary(CurationSummary):
    phases: list[MixturePhaseDraw]
    warnings: list[str]


# --- pretraining -------------------------------------------------------------------------------


class PhaseSummary(Closed):
    phase: str
    steps: int
    tokens: int
    seq_len: int
    final_loss: float | None  # the loss's running mean at the end; None if every update was dropped
    stopped_early: bool
    dropped_steps: list[int]
    failed_uploads: list[str]  # checkpoints the mirror never received
    checkpoint_seconds: float | None  # mean save time; None if none was saved


# --- post-training -----------------------------------------------------------------------------


class ChatDataSummary(Closed):
    generated: int
    contaminated: int
    duplicates: int
    train: int
    heldout: int
    sign_slips: int
    families: dict[str, int]  # training examples per family
    mixture_shortfalls: list[str]


class PreferenceSummary(Closed):
    backend: str
    prompts: int
    pairs: int
    dropped: dict[str, int]  # reason -> pairs
    strong_accuracy: float
    weak_accuracy: float


def item_id(value: Any) -> str:
    """A stable id for an evaluation item from its content: the same prompt in two runs has the same id."""
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def outcomes(ids: list[str], num: list[float], den: list[float] | None = None) -> dict[str, list]:
    """Each item's outcome as stored (manifests, result records): ids, numerators and weights; a metric is
    sum(num) / sum(den) (accuracy: 0/1 and 1; bits per byte: -log2 likelihood and bytes of a document)."""
    return {"id": ids, "num": [round(float(n), 6) for n in num], "den": [float(d) for d in den] if den else [1.0] * len(ids)}


class HeldoutEval(Closed):
    """Greedy answers to the held-out prompts."""

    items: int
    accuracy: float
    mean_answer_tokens: float
    answered: float  # share with an extractable final answer
    by_family: dict[str, float]
    examples: list[dict[str, str]]
    outcomes: dict[str, list[Any]] | None = None  # each prompt right or wrong (`outcomes`): paired comparisons


Curve = list[tuple[float, float]]  # (step, value)


class TrainedSummary(Closed):
    """A post-training step: its trainer's logged curves (those it logs) and the held-out score."""

    eval: HeldoutEval
    eval_before: HeldoutEval | None = None  # the starting model's, where the step scores it
    resumed_from: str | None = None
    loss: Curve = []
    chosen_logps: Curve = []
    rejected_logps: Curve = []
    reward: Curve = []
    completion_length: Curve = []


def read_summary(raw: dict[str, Any], schema: str | None, where: str) -> Summary:
    """The model a manifest's summary was written with. A manifest from before schemas names none: it reads
    as the one declared model that accepts it, else as an open Summary."""
    if schema is None:
        declared = [kind for kind in SUMMARIES.values() if issubclass(kind, Closed) and kind not in (Closed, CurationSummary)]
        fits = [kind for kind in declared if _fits(kind, raw)]
        return fits[0].model_validate(raw) if len(fits) == 1 else Summary.model_validate(raw)
    name, _, version = schema.partition("/")
    kind = SUMMARIES.get(name)
    if kind is None or int(version) > kind.VERSION:
        known = kind.schema_name() if kind else "no such model"
        raise ValueError(f"{where}: summary schema {schema} is unknown to this code ({known}): read it with the code that wrote it")
    return kind.model_validate(raw)


def _fits(kind: type[Summary], raw: dict[str, Any]) -> bool:
    try:
        kind.model_validate(raw)
    except ValueError:
        return False
    return True
