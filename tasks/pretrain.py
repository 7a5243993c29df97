"""Prefect tasks of the pretrain stage: one step per pretraining stage, each a launched trainer.

A stage's step folder holds its final HF model, metrics and summary, plus its checkpoints (not
fingerprinted; mirrored as they are written). A failed or killed trainer fails the task; the
retry finds the same partial folder and the trainer resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect.artifacts import create_table_artifact

from infra.errors import SmolflowError
from infra.launch import free_port, launch_command, launch_env, run_streaming
from infra.recipe import PretrainCfg, Recipe
from infra.steps import RunContext, StepOutput, building_step_id
from model.train import TrainJob
from tasks.common import run_logger, stage_task

# Checkpoints kept beyond keep_last while the eval follower catches up (tasks/evaluate.py).
HOLD_FOR_EVAL = 4


def following(recipe: Recipe) -> bool:
    return recipe.evaluation.follow and bool(recipe.evaluation.checkpoint_tasks)


class TrainerFailed(SmolflowError):
    """The trainer process exited non-zero: a retry resumes it from its newest checkpoint."""

    retryable = True


def world_size(p: PretrainCfg) -> int:
    if p.launcher.hostfile and Path(p.launcher.hostfile).is_file():
        slots = [line.split("slots=")[-1] for line in Path(p.launcher.hostfile).read_text().splitlines() if "slots=" in line]
        return sum(int(s.split()[0]) for s in slots) or p.launcher.nproc
    return p.launcher.nproc


def stage_steps(recipe: Recipe, mixtures: dict) -> list[dict]:
    """Per stage: windows drawn from each source, optimizer steps, and the step offset of the global schedule."""
    p, world = recipe.pretrain, world_size(recipe.pretrain)
    plans, offset = [], 0
    for stage, manifest in zip(p.stages, mixtures["stages"], strict=True):
        seq_len = p.stage_seq_len(stage)
        samples = {name: row["tokens"] // seq_len for name, row in manifest["sources"].items()}
        per_step = p.stage_micro_batch(stage) * p.grad_accum * world
        steps = sum(samples.values()) // per_step
        if steps == 0:
            raise SmolflowError(f"pretrain stage {stage.name}: {stage.tokens:,} tokens make no full step of {per_step * seq_len:,}")
        plans.append({"samples": samples, "steps": steps, "offset": offset})
        if not stage.long_context:
            offset += steps
    return plans


def trainer_env(ctx: RunContext) -> dict[str, str]:
    """Credentials reach the trainer through its environment, never through the job file."""
    s3 = ctx.recipe.storage.s3
    env = {"TRACKIO_DIR": str((ctx.run_dir / "trackio").resolve())}
    if s3.key is not None:
        env["AWS_ACCESS_KEY_ID"] = s3.key.get_secret_value()
    if s3.secret is not None:
        env["AWS_SECRET_ACCESS_KEY"] = s3.secret.get_secret_value()
    return env


@stage_task("pretrain-stage")
def train_stage(
    ctx: RunContext, index: int, mixtures: StepOutput, tokenized: StepOutput, tok: StepOutput, previous: StepOutput | None
) -> StepOutput:
    recipe, p = ctx.recipe, ctx.recipe.pretrain
    stage = p.stages[index]
    plans = stage_steps(recipe, json.loads((mixtures.path / "mixtures.json").read_text()))
    total_main = sum(pl["steps"] for pl, s in zip(plans, p.stages) if not s.long_context)
    config = {
        "model": recipe.model.model_dump(),
        "pretrain": p.model_dump(exclude={"stages", "tracking", "log_every"}),
        "stage": stage.model_dump(),
        "index": index,
        "seed": recipe.seed,
        "steps": plans[index],
        "total_main_steps": total_main,
    }
    inputs = {"mixtures": mixtures, "tokenize": tokenized, "tokenizer": tok}
    if previous is not None:
        inputs["previous"] = previous
    log = run_logger()

    def build(out: Path) -> dict:
        sid = building_step_id(out)
        init_from = init_remote = None
        if previous is not None:
            init_from = str(previous.path / ("final" if stage.long_context else "checkpoints"))
            init_remote = f"checkpoints/{previous.name}-{previous.step_id}"
        job = TrainJob(
            run_name=recipe.name,
            stage_index=index,
            seed=recipe.seed,
            model=recipe.model,
            pretrain=p,
            sources={name: str(tokenized.path / "data" / name) for name in stage.mixture},
            samples=plans[index]["samples"],
            tokenizer_dir=str(tok.path),
            out_dir=str(out),
            checkpoint_dir=str(out / "checkpoints"),
            init_from=init_from,
            init_remote=init_remote,
            remote_name=f"checkpoints/pretrain_{stage.name}-{sid}",
            step_offset=plans[index]["offset"],
            total_main_steps=total_main,
            last_stage=index == len(p.stages) - 1,
            mirror=recipe.storage.mirror,
            s3_endpoint=recipe.storage.s3.endpoint_url,
            s3_region=recipe.storage.s3.region,
            peak_flops=p.hardware.peak_tflops * 1e12 if p.hardware.peak_tflops else None,
            hold_unevaluated=HOLD_FOR_EVAL if following(recipe) else 0,
        )
        job_path = out / "job.json"
        job_path.write_text(job.model_dump_json(indent=2))
        command = launch_command(p.launcher, "model.train", [str(job_path)], port=free_port())
        log.info("pretrain %s: %s", stage.name, " ".join(command))
        code = run_streaming(command, launch_env(p.launcher, trainer_env(ctx)), log.info)
        if code != 0:
            raise TrainerFailed(f"pretrain {stage.name}: trainer exited with code {code}; a retry resumes from its newest checkpoint")
        return json.loads((out / "summary.json").read_text())

    return ctx.step(f"pretrain_{stage.name}", config, inputs, build)


@stage_task("pretrain-report", retries=1)
def report(ctx: RunContext, stages: list[StepOutput]) -> Path:
    rows = [
        {
            "stage": s.name.removeprefix("pretrain_"),
            "steps": s.summary["steps"],
            "tokens": s.summary["tokens"],
            "seq_len": s.summary["seq_len"],
            "final_loss": round(s.summary["final_loss"], 4),
            "seconds": s.seconds,
            "cached": s.cached,
        }
        for s in stages
    ]
    lines = ["# Pretraining", "", "| stage | steps | tokens | seq len | final loss | seconds |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['stage']} | {r['steps']:,} | {r['tokens']:,} | {r['seq_len']} | {r['final_loss']} | {r['seconds']:.0f} |" for r in rows
    ]
    path = ctx.run_dir / "reports" / "pretrain.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + f"\n\nFinal model: `{stages[-1].path / 'final'}`\n")
    create_table_artifact(rows, key=f"{ctx.recipe.name}-pretrain".replace("_", "-"), description="Pretraining stages")
    run_logger().info("pretrain report: %s", path.resolve())
    return path
