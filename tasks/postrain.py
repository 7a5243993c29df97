"""Prefect tasks of post-training: chat data, SFT, preference pairs, APO and GRPO (code in postrain/).

Each step evaluates its model on the held-out prompts (accuracy, mean answer length) and leaves an
HF checkpoint or dataset the next step reads. Trainers resume from their newest complete checkpoint
when a step is rerun after a crash or a kill.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.steps import RunContext, StepOutput, write_json_atomic
from infra.storage import fingerprint_files
from postrain import data as chat
from postrain.apo import run_apo
from postrain.common import evaluate
from postrain.generation import make_backend
from postrain.grpo import run_grpo
from postrain.preference import answers, build_pairs
from postrain.sft import run_sft
from tasks.common import run_logger, stage_task
from tasks.curation.corpus import read_eval_questions


def _evaluate(ctx: RunContext, model_path: Path, heldout: list[dict]) -> dict:
    cfg = ctx.recipe.postrain.preference
    backend = make_backend(cfg.backend, str(model_path), cfg.batch_size)
    try:
        return evaluate(backend, backend.tokenizer, heldout, cfg.max_new_tokens)
    finally:
        del backend
        gc.collect()


def _heldout(data: StepOutput) -> list[dict]:
    return chat.read_jsonl(data.path / "heldout.jsonl")


@stage_task("chat-data")
def chat_data(ctx: RunContext) -> StepOutput:
    cfg, recipe = ctx.recipe.postrain.data, ctx.recipe
    evals = recipe.curate.decontamination.eval_sets
    inputs = {"eval_sets": fingerprint_files((Path(p).name, Path(p)) for p in evals)}

    def build(out: Path) -> dict:
        items = chat.generate(cfg.generated + cfg.heldout, cfg.families, cfg.max_value, recipe.seed)
        for hub in cfg.hub:
            items += chat.load_hub_chat(hub.path, hub.split, hub.limit)
        kept, counts = chat.dedup_and_decontaminate(items, read_eval_questions(evals), cfg.dedup_threshold)
        heldout, train = kept[: cfg.heldout], kept[cfg.heldout :]
        chat.write_jsonl(out / "train.jsonl", train)
        chat.write_jsonl(out / "heldout.jsonl", heldout)
        return {"generated": len(items), **counts, "train": len(train), "heldout": len(heldout)}

    out = ctx.step("chat_data", cfg.model_dump() | {"seed": recipe.seed}, inputs, build)
    run_logger().info("chat data: %s", out.summary)
    return out


@stage_task("sft")
def sft(ctx: RunContext, data: StepOutput, base: StepOutput) -> StepOutput:
    cfg, seed = ctx.recipe.postrain.sft, ctx.recipe.seed

    def build(out: Path) -> dict:
        heldout = _heldout(data)
        before = _evaluate(ctx, base.path / "final", heldout)
        result = run_sft(str(base.path / "final"), chat.read_jsonl(data.path / "train.jsonl"), cfg, out, seed)
        after = _evaluate(ctx, out / "final", heldout)
        return {**result, "eval_before": before, "eval": after}

    out = ctx.step("sft", cfg.model_dump(), {"data": data, "base": base}, build)
    run_logger().info(
        "sft: held-out accuracy %.1f%% -> %.1f%%", 100 * out.summary["eval_before"]["accuracy"], 100 * out.summary["eval"]["accuracy"]
    )
    return out


@stage_task("preference")
def preference(ctx: RunContext, data: StepOutput, sft_out: StepOutput) -> StepOutput:
    cfg = ctx.recipe.postrain.preference
    strong = cfg.strong or str(sft_out.path / "final")
    weak = cfg.weak or str(sft_out.path / "weak")

    def build(out: Path) -> dict:
        items = chat.read_jsonl(data.path / "train.jsonl")[: cfg.prompts]
        prompts = [i["prompt"] for i in items]
        backend = lambda path: make_backend(cfg.backend, path, cfg.batch_size)  # noqa: E731
        strong_out = answers(backend, strong, prompts, cfg.max_new_tokens, cfg.temperature)
        weak_out = answers(backend, weak, prompts, cfg.max_new_tokens, cfg.temperature)
        pairs, stats = build_pairs(items, strong_out, weak_out, cfg.dedup_threshold)
        if not pairs:
            raise ValueError(f"no preference pairs survived: {stats}")
        chat.write_jsonl(out / "pairs.jsonl", pairs)
        return stats

    # unset strong/weak mean the SFT model and its early copy, which `sft` (an input) already identifies
    out = ctx.step("preference", cfg.model_dump(), {"data": data, "sft": sft_out}, build)
    run_logger().info("preference pairs: %s", out.summary)
    return out


@stage_task("apo")
def apo(ctx: RunContext, data: StepOutput, pairs: StepOutput, sft_out: StepOutput) -> StepOutput:
    cfg, seed = ctx.recipe.postrain.apo, ctx.recipe.seed

    def build(out: Path) -> dict:
        result = run_apo(str(sft_out.path / "final"), chat.read_jsonl(pairs.path / "pairs.jsonl"), cfg, out, seed)
        return {**result, "eval": _evaluate(ctx, out / "final", _heldout(data))}

    out = ctx.step("apo", cfg.model_dump(), {"pairs": pairs, "sft": sft_out, "data": data}, build)
    run_logger().info("apo: held-out accuracy %.1f%%", 100 * out.summary["eval"]["accuracy"])
    return out


@stage_task("grpo")
def grpo(ctx: RunContext, data: StepOutput, apo_out: StepOutput) -> StepOutput:
    cfg, seed = ctx.recipe.postrain.grpo, ctx.recipe.seed

    def build(out: Path) -> dict:
        items = [i for i in chat.read_jsonl(data.path / "train.jsonl") if i["answer"]][: cfg.prompts]
        result = run_grpo(str(apo_out.path / "final"), items, cfg, out, seed)
        return {**result, "eval": _evaluate(ctx, out / "final", _heldout(data))}

    out = ctx.step("grpo", cfg.model_dump(), {"apo": apo_out, "data": data}, build)
    run_logger().info("grpo: held-out accuracy %.1f%%", 100 * out.summary["eval"]["accuracy"])
    return out


@stage_task("postrain-report", retries=1)
def report(ctx: RunContext, sft_out: StepOutput, pairs: StepOutput, apo_out: StepOutput, grpo_out: StepOutput) -> Path:
    """The post-training ladder: base -> SFT -> APO -> GRPO, accuracy and answer length."""
    ladder = [
        ("base", sft_out.summary["eval_before"]),
        ("SFT", sft_out.summary["eval"]),
        ("APO", apo_out.summary["eval"]),
        ("GRPO", grpo_out.summary["eval"]),
    ]
    rows = [
        {
            "model": name,
            "accuracy": round(e["accuracy"], 4),
            "mean_answer_tokens": round(e["mean_answer_tokens"], 1),
            **{f"acc_{k}": round(v, 3) for k, v in e["by_family"].items()},
        }
        for name, e in ladder
    ]
    steps = {"sft": sft_out, "preference": pairs, "apo": apo_out, "grpo": grpo_out}
    lines = ["# Post-training", "", "| model | held-out accuracy | mean answer tokens |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['accuracy']:.1%} | {r['mean_answer_tokens']:.1f} |" for r in rows]
    lines += ["", f"Preference pairs: {json.dumps(pairs.summary)}", "", "| step | seconds | cached |", "|---|---|---|"]
    lines += [f"| {n} | {s.seconds:.0f} | {s.cached} |" for n, s in steps.items()]
    rewards = grpo_out.summary.get("reward", [])
    if rewards:
        lines += ["", "GRPO reward by step: " + ", ".join(f"{s}: {r:.3f}" for s, r in rewards)]
    for name, e in ladder:
        lines += ["", f"**{name}** examples:"] + [f"- `{x['prompt']}` → `{x['completion']}`" for x in e["examples"]]
    markdown = "\n".join(lines) + "\n"
    path = ctx.run_dir / "reports" / "postrain.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown)
    write_json_atomic(path.with_suffix(".json"), {"ladder": rows, "seconds": {n: s.seconds for n, s in steps.items()}})
    key = f"{ctx.recipe.name}-postrain".replace("_", "-")
    create_markdown_artifact(markdown, key=key, description="Post-training ladder")
    create_table_artifact(rows, key=f"{key}-ladder", description="Held-out accuracy per post-training step")
    run_logger().info("post-training report: %s", path.resolve())
    return path
