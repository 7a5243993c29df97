"""Post-training's steps: chat data, SFT, preference pairs, APO and GRPO (code in postrain/).

Each training step scores its model on the held-out prompts (`heldout_eval`: accuracy, mean answer
length), which is part of its config and so of its identity, and leaves an HF checkpoint the next
step reads. Trainers resume from their newest complete checkpoint when a step is rerun after a
crash or a kill. Inputs come by role: `chats` (chat data), `base`, `policy` (the model to start
from), `pairs`.
"""

from __future__ import annotations

import functools
import gc
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

from pydantic import create_model

from infra.launch import Tail, accelerate_command, before_launch, check_exit, free_port, launch_env, run_streaming
from infra.recipe import AccelerateCfg, ChatDataCfg, GenerationCfg, PreferenceCfg, Recipe, Strict, TrainerCfg, operational
from infra.steps import FINAL, JOB, LAUNCH_CONFIG, LAUNCH_LOG, NoInputs, Step, StepOutput
from infra.storage import write_json_atomic
from infra.summaries import ChatDataSummary, HeldoutEval, PreferenceSummary, TrainedSummary
from postrain import data as chat
from postrain.common import heldout_accuracy
from postrain.generation import make_backend, resolve_backend
from postrain.preference import answers, build_pairs
from postrain.run import RESULT, PostJob
from tasks.card import write_card
from tasks.common import run_logger, stage_task, tracking_env, tracking_project
from tasks.curate import eval_set_fingerprint
from tasks.curation.corpus import read_eval_questions
from tasks.evaluation.plots import artifact, table_artifact
from tasks.evaluation.report import falls, ladder, ladder_plot, ladder_table, trained_apart

Inputs = Mapping[str, StepOutput]


class PreferenceInputs(TypedDict):
    chats: StepOutput
    policy: StepOutput  # the SFT model: its final and early ("weak") copies answer


class ChatsInput(TypedDict):
    chats: StepOutput  # chat_data: the held-out prompts every trained model is scored on


class TrainedInputs(ChatsInput, total=False):
    base: StepOutput  # a model to start from (`start`), as the pretrained base for SFT
    policy: StepOutput  # or the post-trained model before
    pairs: StepOutput  # the preference pairs APO trains on (`data`)


# the files the data steps leave, declared once: chat_data's training and held-out chats, preference's pairs
TRAIN, HELDOUT, PAIRS = "train.jsonl", "heldout.jsonl", "pairs.jsonl"
DATA = {"chats": TRAIN, "pairs": PAIRS}  # what a trainer reads from an input of that role


def score(cfg: GenerationCfg, model_path: Path, chats: StepOutput) -> HeldoutEval:
    """Held-out accuracy and answer length of one model, its backend released afterwards."""
    backend = make_backend(cfg.backend, str(model_path), cfg.batch_size, run_logger().info)
    try:
        return HeldoutEval.model_validate(
            heldout_accuracy(backend, backend.tokenizer, chat.read_jsonl(chats.path / HELDOUT), cfg.max_new_tokens)
        )
    finally:
        del backend
        gc.collect()


class ChatDataStepCfg(Strict):
    data: ChatDataCfg
    eval_sets: list[str]  # prompts near an eval question are dropped
    seed: int


def eval_sets(cfg: ChatDataStepCfg) -> dict[str, str]:
    return {"eval_sets": eval_set_fingerprint(cfg.eval_sets)}


def chat_data(cfg: ChatDataStepCfg, inputs: NoInputs, out: Path) -> ChatDataSummary:
    d = cfg.data
    items = chat.generate(d.generated + d.heldout, d.families, d.max_value, cfg.seed, d.operators)
    for hub in d.hub:
        items += chat.load_hub_chat(hub.path, hub.split, hub.limit)
    kept, counts = chat.dedup_and_decontaminate(items, read_eval_questions(cfg.eval_sets), d.dedup_threshold)
    heldout, train = kept[: d.heldout], kept[d.heldout :]
    slips = chat.plant_sign_slips(train, d.sign_slips, cfg.seed)
    chat.write_jsonl(out / TRAIN, train)
    chat.write_jsonl(out / HELDOUT, heldout)
    families = dict(Counter(item["family"] for item in train))
    summary = ChatDataSummary(
        generated=len(items),
        **counts,
        train=len(train),
        heldout=len(heldout),
        sign_slips=slips,
        families=families,
        mixture_shortfalls=chat.mixture_shortfalls(families, d.families),
    )
    run_logger().info("chat data: %s", summary)
    for line in summary.mixture_shortfalls:
        run_logger().warning("chat data mixture: %s", line)
    return summary


class TrainedStepCfg(Strict):
    """What the training steps share: their launcher, how they score their model on the held-out prompts, the seed.
    Each training step's config adds its trainer's recipe section under the same name (`trained`)."""

    launcher: AccelerateCfg
    heldout_eval: GenerationCfg
    seed: int
    tracking: str | None = operational(None)  # the trackio project the trainer logs to (None: no dashboard)


def train(cfg: TrainedStepCfg, stage: str, trainer: TrainerCfg, model: Path, data: Path, out: Path, run_dir: Path | None = None) -> dict:
    """Run the STAGE trainer (postrain/run.py) on the launcher's ranks; its result once `out/final` is saved. Its
    curves go to the run's dashboard (RUN_DIR/trackio) when `cfg.tracking` names a project."""
    log, result = run_logger(), out / RESULT
    before_launch(out, result)
    config = trainer.model_dump()
    job = PostJob(stage=stage, model=str(model), data=str(data), config=config, out=str(out), seed=cfg.seed, tracking=cfg.tracking)
    (out / JOB).write_text(job.model_dump_json(indent=2))
    import torch

    bf16 = torch.cuda.is_available()  # as trl_args decides on the ranks
    command = accelerate_command(cfg.launcher, "postrain.run", [str(out / JOB)], out / LAUNCH_CONFIG, free_port(), bf16)
    log.info("%s on %d rank(s), ZeRO-%d: %s", stage, cfg.launcher.nproc, cfg.launcher.zero_stage, " ".join(command))
    tracking = tracking_env(run_dir or out) if cfg.tracking else {}
    env = launch_env(cfg.launcher, {"TQDM_MININTERVAL": "15", **tracking})  # progress every 15 s
    tail = Tail(log.info)
    code = run_streaming(command, env, tail, grace_s=cfg.launcher.stop_grace_s, log=out / LAUNCH_LOG)
    check_exit(stage, code, out, [out], result, tail)
    return json.loads(result.read_text())


def scored(cfg: TrainedStepCfg, result: dict, out: Path, inputs: Inputs) -> TrainedSummary:
    """The trainer's result plus the held-out score of the model it left in `out/final`, which gets its card."""
    summary = TrainedSummary.model_validate({**result, "eval": score(cfg.heldout_eval, out / FINAL, inputs["chats"])})
    run_logger().info("%s: held-out accuracy %.1f%%", out.name, 100 * summary.eval.accuracy)
    write_card(out, cfg, summary, inputs)
    return summary


def trained(
    recipe: Recipe, stage: str, deps: Mapping[str, Step], data: str = "chats", start: str = "policy", score_start: bool = False
) -> Step:
    """The step that trains the recipe's STAGE trainer (the `postrain.STAGE` section, a TrainerCfg registered in
    infra/recipe.py): from the model of input START, on the file input DATA holds (`DATA`); it scores the model on
    the held-out prompts (with SCORE_START, the starting model too) and leaves it in `final/`, labelled STAGE."""
    if not {start, data} <= set(deps):
        raise ValueError(f"step {stage}: starts from input {start!r} and trains on {data!r}, but its inputs are {sorted(deps)}")
    section = getattr(recipe.postrain, stage)
    cfg_type = create_model(f"{stage.upper()}StepCfg", __base__=TrainedStepCfg, **{stage: (type(section), ...)})
    seed = recipe.seed if section.seed is None else section.seed
    tracking = tracking_project(recipe.name) if recipe.postrain.tracking == "trackio" else None
    # the section without its own seed: `seed` is the one the trainer uses, so a seed written out as the recipe's
    # (the value an unset one falls back to) is the same step as the unset one
    unseeded = section.model_copy(update={"seed": None})
    config = cfg_type(
        launcher=recipe.postrain.launcher, heldout_eval=recipe.postrain.heldout_eval, seed=seed, tracking=tracking, **{stage: unseeded}
    )
    fn = functools.partial(train_step, stage=stage, data=data, start=start, score_start=score_start)
    return Step(stage, stage, fn, config, deps, model=stage, seed=f"postrain.{stage}.seed")


def train_step(
    cfg: TrainedStepCfg, inputs: TrainedInputs, out: Path, stage: str, data: str, start: str, score_start: bool
) -> TrainedSummary:
    model, chats = inputs[start].final, inputs["chats"]
    before = {}
    if score_start:
        before = {"eval_before": score(cfg.heldout_eval, model, chats)}
        run_logger().info("%s: the starting model's held-out accuracy %.1f%%", stage, 100 * before["eval_before"].accuracy)
    run_dir = chats.path.parent  # inputs are linked from the run: RUN/NAME
    result = train(cfg, stage, getattr(cfg, stage), model, inputs[data].path / DATA[data], out, run_dir)
    return scored(cfg, {**result, **before}, out, inputs)


class PreferenceStepCfg(Strict):
    preference: PreferenceCfg


def preference(cfg: PreferenceStepCfg, inputs: PreferenceInputs, out: Path) -> PreferenceSummary:
    """Strong vs weak answers; unset strong/weak mean the SFT model and its early copy (the `policy` input)."""
    p, policy = cfg.preference, inputs["policy"].path
    items = chat.read_jsonl(inputs["chats"].path / TRAIN)[: p.prompts]
    prompts = [i["prompt"] for i in items]
    engine = resolve_backend(p.backend)
    run_logger().info("preference: %d prompts, answers through %s", len(prompts), engine)
    backend = lambda path: make_backend(engine, path, p.batch_size, run_logger().info)  # noqa: E731
    strong_out = answers(backend, p.strong or str(inputs["policy"].final), prompts, p.max_new_tokens, p.temperature)
    weak_out = answers(backend, p.weak or str(policy / "weak"), prompts, p.max_new_tokens, p.temperature)
    pairs, stats = build_pairs(items, strong_out, weak_out, p.dedup_threshold)
    stats["backend"] = engine
    if not pairs:
        raise ValueError(f"no preference pairs survived: {stats}")
    chat.write_jsonl(out / PAIRS, pairs)
    run_logger().info("preference pairs: %s", stats)
    return PreferenceSummary.model_validate(stats)


@stage_task("postrain-report", retries=1)
def report(run_dir: Path, name: str, models: list[tuple[str, StepOutput]], pairs: StepOutput, steps: list[StepOutput]) -> Path:
    """The post-training ladder: base -> SFT -> APO -> GRPO, accuracy and answer length."""
    rungs, apart = ladder(models), trained_apart(models)
    rows = [
        {
            "model": label,
            "accuracy": round(e.accuracy, 4),
            "mean_answer_tokens": round(e.mean_answer_tokens, 1),
            **{f"acc_{k}": round(v, 3) for k, v in e.by_family.items()},
        }
        for label, e in rungs
    ]
    path = run_dir / "reports" / "postrain.md"
    ladder_plot(rungs, path.parent / "plots" / "ladder.png")
    lines = ["# Post-training", "", "![ladder](plots/ladder.png)", "", *ladder_table(rungs, apart=apart)]
    if fell := falls(rungs, apart):
        run_logger().warning("post-training ladder: %s", fell)
    lines += ["", f"Preference pairs: {pairs.summary.model_dump_json()}", "", "| step | step id | seconds to build |", "|---|---|---|"]
    # no "cached" column: the earlier stages' steps are read back from the run dir even when this run built them
    lines += [f"| {s.name} | {s.step_id} | {s.seconds:.0f} |" for s in steps]
    for label, out in models:  # the rungs trained on a reward (GRPO)
        if rewards := out.summary.reward:
            lines += ["", f"{label} reward by step: " + ", ".join(f"{s}: {r:.3f}" for s, r in rewards)]
    for label, e in rungs:
        lines += ["", f"**{label}** examples:"] + [f"- `{x['prompt']}` → `{x['completion']}`" for x in e.examples]
    markdown = "\n".join(lines) + "\n"
    path.write_text(markdown)
    write_json_atomic(path.with_suffix(".json"), {"ladder": rows, "seconds": {s.name: s.seconds for s in steps}})
    key = f"{name}-postrain".replace("_", "-")
    artifact(markdown, path.parent, key, "Post-training ladder")
    table_artifact(rows, key=f"{key}-ladder", description="Held-out accuracy per post-training step")
    run_logger().info("post-training report: %s", path.resolve())
    return path
