"""The pipeline as data: every step of a recipe, its stage, config, upstream steps and output folder.

This is the one place a step's name, a stage's order or a step's output folder (`RUN/NAME`) is
spelled. The flows run selections of it (a stage's steps), and the missing-upstream check, model
discovery for evaluation, the report card, the dry run and the S3 mirror iterate it. A step's
config is built here from the recipe and holds exactly what its function reads, so its identity
(infra/steps.py) follows from the recipe with nothing written by hand.

Adding a post-training trainer takes three files: the trainer (`postrain/NAME.py`, a function that
trains on one rank), its recipe section (a TrainerCfg subclass naming that function, as a field of
PostrainCfg in infra/recipe.py: the registry the planner, the batch check and the launcher read), and
here one `add(postrain.trained(...))` line plus its stage in STAGES. Its flow, deployment, dry run,
evaluation and report card follow from the graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from infra.recipe import Recipe
from infra.steps import Run, Status, Step, StepOutput, require
from tasks import curate, postrain, pretrain
from tasks.curation.filters import check_filters
from tasks.evaluate import Models
from tasks.evaluation.harness import check_generation_room

# Pipeline stages in DAG order: each is a Prefect flow (`smolflow stage NAME`) building its steps.
EVALUATE = "evaluate"  # the stage that scores what the others left (no steps of its own)
STAGES = ("curate", "pretrain", "sft", "preference", "apo", "grpo", EVALUATE)


@dataclass(frozen=True)
class Graph:
    steps: list[Step]  # every step, upstream first
    curation: dict[str, Step]  # the curation report's inputs by role (tasks/curation/report.py)
    phases: list[Step]  # one per pretraining phase
    ladder: list[Step]  # the post-trained models in training order (the ladder above the base model)
    pairs: Step
    models: Models  # where evaluation finds checkpoints and models

    def stage(self, name: str) -> list[Step]:
        return [s for s in self.steps if s.stage == name]


def build_graph(recipe: Recipe) -> Graph:
    """Every step of RECIPE; also checks what only stage code can (filter parameters against datatrove, room for the
    model tasks' generations in the pretrained model's context)."""
    check_filters(recipe.curate.filters)
    c, p, post, ex = recipe.curate, recipe.pretrain, recipe.postrain, recipe.executor
    names = [s.name for s in recipe.sources]
    steps: list[Step] = []

    def add(step: Step) -> Step:
        steps.append(step)
        return step

    embedded = {}
    if any(s.format == "embedded" for s in recipe.sources):
        config = curate.CorpusStepCfg(
            embedded=recipe.embedded, eval_sets=c.decontaminate.eval_sets, seed=recipe.seed, shards=ex.tasks, workers=ex.workers
        )
        embedded["embedded"] = add(Step("corpus", "curate", curate.build_corpus, config, watch=curate.corpus_files))
    config = curate.IngestStepCfg(sources=recipe.sources, executor=ex, strict=c.strict, s3=recipe.storage.s3)
    ingest = add(Step("ingest", "curate", curate.ingest, config, embedded, watch=curate.source_files))
    config = curate.FilterStepCfg(filters={s.name: c.filters[s.domain] for s in recipe.sources}, executor=ex)
    filtered = add(Step("filter", "curate", curate.filter_docs, config, {"docs": ingest}))
    deduped = add(Step("dedup", "curate", curate.dedup, curate.DedupStepCfg(dedup=c.dedup, executor=ex), {"docs": filtered}))
    config = curate.DecontaminateStepCfg(decontaminate=c.decontaminate, executor=ex)
    decont = add(Step("decontaminate", "curate", curate.decontaminate, config, {"docs": deduped}, watch=_eval_sets))
    config = curate.TokenizerStepCfg(tokenizer=c.tokenizer, sources=names)
    docs = {} if c.tokenizer.path else {"docs": decont}
    bpe = add(Step("tokenizer", "curate", curate.train_tokenizer, config, docs, watch=curate.tokenizer_file))
    config = curate.TokenizeStepCfg(sources=names, seed=recipe.seed, heldout_fraction=c.heldout_fraction, executor=ex)
    tokens = add(Step("tokenize", "curate", curate.tokenize, config, {"docs": decont, "bpe": bpe}))
    config = curate.MixturesStepCfg(phases=pretrain.mixture_phases(p), max_epochs=p.max_epochs)
    mixed = add(Step("mixtures", "curate", curate.mixtures, config, {"tokens": tokens}))

    phases: list[Step] = []
    train = pretrain.train_configs(recipe)
    check_generation_room(recipe.evaluation, *pretrain.final_context(train))
    for i, cfg in enumerate(train):
        deps = {"tokens": tokens, "bpe": bpe, "budget": mixed} | ({"previous": phases[-1]} if phases else {})
        config = pretrain.PhaseStepCfg(train=cfg, launcher=p.launcher, storage=recipe.storage)
        last = i == len(train) - 1
        phases.append(
            add(
                Step(
                    f"pretrain_{cfg.phase}",
                    "pretrain",
                    pretrain.train_phase,
                    config,
                    deps,
                    checkpoints=cfg.phase,
                    model="base" if last else None,
                    seed="pretrain.seed",
                    reads=functools.partial(pretrain.phase_reads, sources=names),
                )
            )
        )

    config = postrain.ChatDataStepCfg(data=post.data, eval_sets=c.decontaminate.eval_sets, seed=recipe.seed)
    chats = add(Step("chat_data", "sft", postrain.chat_data, config, watch=postrain.eval_sets))
    sft = add(postrain.trained(recipe, "sft", {"chats": chats, "base": phases[-1]}, start="base", score_start=True))
    config = postrain.PreferenceStepCfg(preference=post.preference)
    pairs = add(Step("preference", "preference", postrain.preference, config, {"chats": chats, "policy": sft}))
    apo = add(postrain.trained(recipe, "apo", {"chats": chats, "pairs": pairs, "policy": sft}, data="pairs"))
    add(postrain.trained(recipe, "grpo", {"chats": chats, "policy": apo}))

    curation = {"ingested": ingest, "filtered": filtered, "deduped": deduped, "decontaminated": decont, "tokenized": tokens, "mixed": mixed}
    ladder = [s for s in steps if s.model and not s.checkpoints]  # the post-trained models, in training order
    return Graph(steps, curation, phases, ladder, pairs, Models(steps, heldout=tokens))


def _eval_sets(cfg: curate.DecontaminateStepCfg) -> dict[str, str]:
    return {"eval_sets": curate.eval_set_fingerprint(cfg.decontaminate.eval_sets)}


def upstream_steps(graph: Graph, stages: list[str]) -> dict[str, Step]:
    """The steps of other stages that `stages` read, by name."""
    return {d.name: d for s in graph.steps if s.stage in stages for d in s.deps.values() if d.stage not in stages}


def upstream(run: Run, graph: Graph, stages: list[str], obtain: bool = True, decided: list[Status] | None = None) -> dict[str, StepOutput]:
    """The outputs that `stages` read from other stages, each current with the recipe (in the store, or pulled
    from the mirror when OBTAIN), or UpstreamMissing naming the stage to run first. Decided as a build
    decides (infra/steps.py `decide`), before a stage starts anything; DECIDED: the graph's statuses, if known."""
    deps = upstream_steps(graph, stages)
    known = {s.step.name: s for s in (decided if decided is not None else run.statuses(graph.steps))} if deps else {}
    for name in deps:
        require(run.run_dir, known[name], needed_by=" and ".join(stages))
    return {name: run.obtain(known[name]) for name in deps} if obtain else {}
