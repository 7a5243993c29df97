"""The pretrain stage's flow: stages 1-3 on one warmup-stable-decay schedule, then long context."""

from __future__ import annotations

import threading

from prefect import flow

from infra.steps import RunContext, StepOutput
from tasks import evaluate
from tasks import pretrain as t
from tasks.curate import mixtures as resolve_mixtures


def pretrain(ctx: RunContext) -> list[StepOutput]:
    tokenized = ctx.load_step("tokenize", needed_by="pretrain")
    tok = ctx.load_step("tokenizer", needed_by="pretrain")
    mixtures = resolve_mixtures(ctx, tokenized)  # cached unless the recipe's stages changed since curation
    stages, previous = [], None
    stop = threading.Event()
    follower = evaluate.follow_checkpoints.submit(ctx, stop)  # scores checkpoints while the trainer runs
    try:
        for index in range(len(ctx.recipe.pretrain.stages)):
            previous = t.train_stage(ctx, index, mixtures, tokenized, tok, previous)
            stages.append(previous)
    finally:
        stop.set()
        follower.wait()
    t.report(ctx, stages)
    return stages


@flow(name="pretrain")
def pretrain_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Pretrain RECIPE's model on the curated mixtures in RUN_DIR; returns the final model's folder."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    return str(pretrain(ctx)[-1].path / "final")
