"""Post-training flows: SFT -> preference pairs -> APO -> GRPO, each runnable on its own."""

from __future__ import annotations

from prefect import flow

from infra.steps import RunContext
from tasks import postrain as t
from tasks.evaluate import evaluate_model


def _base(ctx: RunContext):
    return ctx.load_step(f"pretrain_{ctx.recipe.pretrain.stages[-1].name}", needed_by="sft")


@flow(name="sft")
def sft_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Chat data and supervised fine-tuning of the pretrained model; returns the SFT model's folder."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    base = _base(ctx)  # fails first, naming the stage to run, when the run dir has no pretrained model
    sft = t.sft(ctx, t.chat_data(ctx), base)
    evaluate_model(ctx, sft)
    return str(sft.path / "final")


@flow(name="preference")
def preference_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """Strong vs weak answers to the training prompts; returns the pairs file."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    data, sft = ctx.load_step("chat_data", "preference"), ctx.load_step("sft", "preference")
    return str(t.preference(ctx, data, sft).path / "pairs.jsonl")


@flow(name="apo")
def apo_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """APO on the preference pairs, from the SFT model; returns the APO model's folder."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    data, pairs, sft = (ctx.load_step(name, "apo") for name in ("chat_data", "preference", "sft"))
    apo = t.apo(ctx, data, pairs, sft)
    evaluate_model(ctx, apo)
    return str(apo.path / "final")


@flow(name="grpo")
def grpo_flow(recipe: str, run_dir: str | None = None, overrides: list[str] | None = None) -> str:
    """GRPO from the APO model, then the post-training report; returns the report's path."""
    ctx = RunContext.load(recipe, run_dir, overrides or [])
    data, pairs, sft, apo = (ctx.load_step(name, "grpo") for name in ("chat_data", "preference", "sft", "apo"))
    grpo = t.grpo(ctx, data, apo)
    evaluate_model(ctx, grpo)
    return str(t.report(ctx, sft, pairs, apo, grpo))
