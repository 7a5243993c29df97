"""Post-training with real TRL trainers on a tiny model: label masks, pairs, APO, GRPO, resume."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest

from infra.recipe import APOCfg, GRPOCfg, ModelCfg, SFTCfg
from infra.summaries import ChatDataSummary, HeldoutEval, TrainedSummary
from model.network import build_model, model_config, save_pretrained
from postrain import data as chat
from postrain.generation import TransformersBackend
from postrain.preference import answers, build_pairs
from tasks.curation import tokenizer as bpe

TINY = ModelCfg(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A randomly initialised SmolLM3 with the project's tokenizer and chat template, saved in HF format."""
    root = tmp_path_factory.mktemp("base")
    texts = [m["content"] for item in chat.generate(2000, chat_families(), 49, 0) for m in item["messages"]]
    tok = bpe.save_hf(bpe.train_bpe(iter(texts * 3), vocab_size=400, min_frequency=2), root)
    special = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    save_pretrained(build_model(model_config(TINY, len(tok), 256, special_ids=special), seed=0), root)
    return root


def chat_families() -> dict[str, float]:
    return {"arithmetic": 0.5, "word_problem": 0.3, "reverse_word": 0.1, "count_letters": 0.1}


def test_sft_batches_train_assistant_tokens_only(base, tmp_path):
    from postrain.sft import build_trainer

    rows = [
        {"messages": [{"role": "system", "content": "You are terse."}, *item["messages"]]}
        for item in chat.generate(8, chat_families(), 49, 1)
    ]
    cfg = SFTCfg(learning_rate=1e-3, max_steps=1, batch_size=4, weak_checkpoint_step=1)
    trainer = build_trainer(str(base), rows, cfg, tmp_path, seed=0)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    tok = trainer.processing_class
    for ids, labels, row in zip(batch["input_ids"], batch["labels"], rows):
        trained = tok.decode(ids[labels != -100])
        assert trained == row["messages"][-1]["content"] + "<|im_end|>\n"
        untrained = tok.decode(ids[(labels == -100) & (ids != tok.pad_token_id)])
        assert "You are terse." in untrained and row["messages"][1]["content"] in untrained


def test_on_cpu_the_fused_lm_head_projects_only_labelled_tokens_in_one_piece_with_the_same_loss_and_gradient(base, tmp_path, monkeypatch):
    import torch
    import trl.trainer.utils as trl_utils

    import postrain.common as common
    from postrain.sft import build_trainer

    for name in ("_use_triton", "_ChunkedLogProbFunction"):  # TRL's own, even if a test before patched them; restored after
        monkeypatch.setattr(trl_utils, name, getattr(getattr(trl_utils, name), "original", getattr(trl_utils, name)))
    tiled, plain, rows_scored = trl_utils._ChunkedLogProbFunction, common.plain_log_probs, []

    class CountingTiles(tiled):  # how many positions each loss projects, and through which head
        @staticmethod
        def forward(ctx, hidden, *args):
            rows_scored.append(("tiles", hidden.shape[0]))
            return tiled.forward(ctx, hidden, *args)

    def counting_plain(hidden, *args):
        rows_scored.append(("plain", hidden.shape[0]))
        return plain(hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", CountingTiles)
    monkeypatch.setattr(common, "plain_log_probs", counting_plain)
    rows = chat.generate(8, chat_families(), 49, 1)
    cfg = SFTCfg(learning_rate=1e-3, max_steps=1, batch_size=8, weak_checkpoint_step=1)
    trainer = build_trainer(str(base), rows, cfg, tmp_path, seed=0)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    trainer.model.train()  # TRL logs the metrics of a training step

    def loss_grad_metrics():
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        metrics = {k: trainer._metrics["train"][k][-1] for k in ("entropy", "mean_token_accuracy")}
        return loss.detach(), trainer.model.get_output_embeddings().weight.grad.clone(), metrics

    trl_loss, trl_grad, trl_metrics = loss_grad_metrics()
    common.cpu_lm_head()
    loss, grad, metrics = loss_grad_metrics()
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    assert rows_scored == [("tiles", batch["labels"][:, 1:].numel()), ("plain", labelled)]
    assert labelled < rows_scored[0][1] / 2  # answers are the minority of a chat batch
    torch.testing.assert_close(loss, trl_loss)
    torch.testing.assert_close(grad, trl_grad)
    assert metrics == pytest.approx(trl_metrics, rel=1e-5)
    monkeypatch.setattr(common, "PLAIN_HEAD_MAX_LOGITS", labelled * trainer.model.config.vocab_size - 1)
    assert loss_grad_metrics()[0] == pytest.approx(float(trl_loss)) and rows_scored[-1] == ("tiles", labelled)  # too big: TRL's tiles


def test_answers_are_extracted_and_verified():
    assert chat.extract_answer("12 + 5 = 17. The answer is 17.") == "17"
    assert chat.extract_answer("'cat' backwards is 'tac'. The answer is tac.") == "tac"
    assert chat.is_correct("so 9 - 4 = 5. The answer is 5 apples.", "5")
    assert not chat.is_correct("I think it is 6", "6")


def test_prompts_are_deduplicated_and_decontaminated():
    items = [
        chat.example(q, "a. The answer is 1.", "1", "x")
        for q in ("What is 12 + 30?", "What is 12 + 30?", "What is 40 - 7?", "Reverse the word 'print'.")
    ]
    kept, counts = chat.dedup_and_decontaminate(items, ["What is 40 - 7?"], threshold=0.9)
    assert [k["prompt"][0]["content"] for k in kept] == ["What is 12 + 30?", "Reverse the word 'print'."]
    assert counts == {"duplicates": 1, "contaminated": 1}


def test_chat_data_says_when_dedup_leaves_a_family_short_of_the_recipes_share(tmp_path):
    from infra.recipe import ChatDataCfg
    from tasks.postrain import ChatDataStepCfg, chat_data

    def summary(max_value: int) -> ChatDataSummary:
        data = ChatDataCfg(
            generated=1500, heldout=50, max_value=max_value, operators="+-", families={"arithmetic": 0.6, "word_problem": 0.4}
        )
        return chat_data(ChatDataStepCfg(data=data, eval_sets=[], seed=3), {}, tmp_path / str(max_value))

    small, wide = summary(9), summary(99)  # up to 9: 200 distinct arithmetic questions
    assert small.families["arithmetic"] < 250 < wide.families["arithmetic"]
    assert len(small.mixture_shortfalls) == 1 and small.mixture_shortfalls[0].startswith("arithmetic: ")
    assert "the recipe asks 60%" in small.mixture_shortfalls[0] and wide.mixture_shortfalls == []
    # hub chats are outside the recipe's families: they neither dilute a family nor stand for one
    families = {"arithmetic": 0.6, "word_problem": 0.4}
    assert chat.mixture_shortfalls({"arithmetic": 60, "word_problem": 40, "hub": 900}, families) == []
    assert chat.mixture_shortfalls({"hub": 900}, families) == []


def test_sign_slips_flaw_only_training_solutions_never_heldout_or_the_verified_answers(tmp_path):
    from infra.recipe import ChatDataCfg
    from tasks.postrain import ChatDataStepCfg, chat_data

    def run(share: float) -> tuple[dict, list[dict], list[dict]]:
        data = ChatDataCfg(generated=600, heldout=100, operators="-", families={"arithmetic": 1.0}, sign_slips=share)
        cfg = ChatDataStepCfg(data=data, eval_sets=["configs/evals/arithmetic.jsonl"], seed=5)
        summary = chat_data(cfg, {}, tmp_path / str(share))
        return summary, *(chat.read_jsonl(tmp_path / str(share) / f"{split}.jsonl") for split in ("train", "heldout"))

    (clean, train, heldout), (flawed, slipped, heldout_after) = run(0.0), run(0.6)
    negative = [i for i, item in enumerate(train) if item["answer"].startswith("-")]
    wrong = [i for i, item in enumerate(slipped) if not chat.is_correct(item["messages"][-1]["content"], item["answer"])]
    assert clean.sign_slips == 0 and all(chat.is_correct(t["messages"][-1]["content"], t["answer"]) for t in train)
    assert flawed.sign_slips == len(wrong) and 0.45 * len(negative) < len(wrong) < 0.75 * len(negative)
    assert set(wrong) <= set(negative)  # only the sign is lost: the answer read back is the true one without its minus
    assert all(chat.extract_answer(slipped[i]["messages"][-1]["content"]) == train[i]["answer"][1:] for i in wrong)
    assert [t["answer"] for t in slipped] == [t["answer"] for t in train] and heldout_after == heldout


def test_preference_pairs_with_the_transformers_backend(base):
    items = chat.generate(6, {"arithmetic": 1.0}, 49, 2)
    backend = lambda path: TransformersBackend(path, batch_size=4)  # noqa: E731
    generated = answers(backend, str(base), [i["prompt"] for i in items], max_new_tokens=6, temperature=0.0)
    assert len(generated) == 6 and all(isinstance(g, str) for g in generated)
    strong = [i["messages"][1]["content"] for i in items]  # right answers
    weak = [generated[0], generated[1], strong[2], "nonsense", "The answer is -1.", "The answer is -1."]
    strong[3] = "The answer is 100000."  # wrong: never taught as chosen
    pairs, stats = build_pairs(items, strong, weak, dedup_threshold=0.9)
    assert stats["dropped"]["equal answers"] == 1 and stats["dropped"]["chosen answer wrong"] == 1
    assert len(pairs) == 4 and stats["pairs"] == 4
    assert all(p["chosen"][0]["role"] == "assistant" and p["prompt"][0]["role"] == "user" for p in pairs)
    assert stats["strong_accuracy"] == pytest.approx(5 / 6)


def test_an_exported_model_chats_through_a_transformers_pipeline_without_warnings(base):
    """What a user does with a model folder, in a fresh process (transformers warns once per process):
    `pipeline("text-generation")` and a chat through its template, decoding that keeps the text as it is."""
    import json
    import subprocess
    import sys

    script = """if True:
        import sys
        from transformers import pipeline
        generator = pipeline("text-generation", model=sys.argv[1])
        # the pipeline asks for WordPiece clean-up unless told not to (transformers 5.17): the model card says so
        chat = [{"role": "user", "content": "What is 2 + 3?"}]
        turn = generator(chat, do_sample=False, max_new_tokens=16, clean_up_tokenization_spaces=False)[0]["generated_text"][-1]
        assert turn["role"] == "assistant" and isinstance(turn["content"], str), turn
        text = "So 2 + 3 = 5 . Is it ? The answer is 5 !"  # WordPiece clean-up would drop the spaces before . ? !
        assert generator.tokenizer.decode(generator.tokenizer.encode(text, add_special_tokens=False)) == text
    """
    proc = subprocess.run([sys.executable, "-c", script, str(base)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "clean_up_tokenization_spaces" not in proc.stderr, proc.stderr
    assert json.loads((base / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False


def test_publish_uploads_the_folder_with_its_card_and_later_evals_to_a_mock_hub(base, tmp_path, monkeypatch):
    """The hub cannot be reached here: its two calls are recorded instead. What is uploaded is real."""
    import json
    import shutil

    import huggingface_hub
    from huggingface_hub import HfApi

    from infra.errors import SmolflowError
    from infra.storage import fsync_tree
    from tasks.card import publish, publish_card
    from tasks.evaluation.results import ResultStore, local_fingerprint

    run = tmp_path / "run"
    home = run / "steps" / "sft-s1"  # the one layout: RUN/NAME links the version in the run's store
    shutil.copytree(base, home / "final")
    (home / "final" / "training_args.bin").write_bytes(b"pickle")
    (run / "sft").symlink_to(Path("steps") / "sft-s1")
    evaluation = HeldoutEval(items=8, accuracy=0.5, mean_answer_tokens=12.0, answered=1.0, by_family={"arithmetic": 0.5}, examples=[])
    summary = TrainedSummary(eval=evaluation)
    manifest = {"name": "sft", "step_id": "s1", "config": {"sft": {"max_steps": 7}}, "lineage": [], "files": fsync_tree(home)}
    manifest |= {"summary": summary.model_dump(mode="json"), "summary_schema": summary.schema_name()}
    (home / "manifest.json").write_text(json.dumps(manifest))
    folder = run / "sft" / "final"
    before = local_fingerprint(folder)
    (run / "evals" / "results").mkdir(parents=True)
    metrics = {"metrics": {"exact_match/answer": 0.25, "exact_match_stderr/answer": 0.05}}
    (run / "evals" / "results" / f"{before}.json").write_text(json.dumps({"tasks": {"smol_arithmetic_gen": metrics}}))
    assert ResultStore(str(run / "evals" / "results")).get(before)
    steps = ["chat_data", "sft", "grpo"]

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("repo", repo_id, kw)))
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, ops, **kw: calls.append(("commit", repo_id, ops)) or _Commit())
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SmolflowError, match="HF_HUB_OFFLINE"):
        publish(*publish_card(run, "sft", steps), "me/tiny-sft", private=True)
    assert not calls, "nothing is sent offline"
    with pytest.raises(SmolflowError, match="no finished model folder.*finished here: sft"):
        publish_card(run, "grpo", steps)
    for name in ("../run/sft", str(home), "steps/sft-s1"):  # a path, another folder: only a step of the run's graph
        with pytest.raises(SmolflowError, match="is not a step of the run"):
            publish_card(run, name, steps)
    weights = home / "final" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit flipped after the step committed
    with pytest.raises(SmolflowError, match="model.safetensors differs from the manifest"):
        publish_card(run, "sft", steps)
    weights.write_bytes(original)
    (home / "final" / "extra").symlink_to(tmp_path / "elsewhere")  # a link out of the step
    with pytest.raises(SmolflowError, match="extra is a link"):
        publish_card(run, "sft", steps)
    (home / "final" / "extra").unlink()

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    url = publish(*publish_card(run, "sft", steps), "me/tiny-sft", private=True)
    assert url == _Commit.commit_url and calls[0] == ("repo", "me/tiny-sft", {"private": True, "exist_ok": True})
    ops = {op.path_in_repo: op for op in calls[1][2]}
    weights = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"training_args.bin"}
    assert set(ops) == weights | {"README.md"}, "every file of the folder but the pickle, and the card"
    card = ops["README.md"].path_or_fileobj.decode()
    assert card.startswith("---\nlibrary_name: transformers") and "| smol_arithmetic_gen | exact_match/answer | 0.2500 | 0.0500 |" in card
    assert "| sft | max_steps 7 | 50.0% | arithmetic 50% | 12.0 |" in card
    assert local_fingerprint(folder) == before, "the committed folder is never rewritten"


class _Commit:
    commit_url = "https://huggingface.co/me/tiny-sft/commit/0"


def test_column_work_reads_back_the_right_answer_for_every_pair():
    """The worked solutions teach the method: each column's result is right, and the answer is the last
    column's value followed by the units digits of the others (a wrong step would be learned as arithmetic)."""
    import re

    from postrain.problems import column_work

    for op in "+-*":
        for a in range(100):
            for b in range(13 if op == "*" else 100):
                work = column_work(a, op, b)
                steps = re.findall(r"(\d+) ([-+*]) (\d+)(?: \+ (\d+))? = (\d+)", work.split(": ", 1)[1])
                for x, o, y, carry, value in steps:
                    assert {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[o] + int(carry or 0) == int(value), work
                digits = steps[-1][-1] + "".join(s[-1][-1] for s in reversed(steps[:-1]))
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                assert ("-" if answer < 0 else "") + str(int(digits)) == str(answer), work


def test_hub_chat_loading_code_reads_local_files(tmp_path):
    """The real recipe's loader (`datasets`, SmolTalk-style `messages`), on local JSONL and Parquet copies."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": f"The answer is {i + 1}."}]}
        for i in range(5)
    ]
    (tmp_path / "jsonl").mkdir()
    chat.write_jsonl(tmp_path / "jsonl" / "part.jsonl", rows)
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pq" / "part.parquet")
    for folder in ("jsonl", "pq"):
        loaded = chat.load_hub_chat(str(tmp_path / folder), "train", limit=3)
        assert len(loaded) == 3 and loaded[0]["prompt"] == rows[0]["messages"][:1] and loaded[2]["answer"] == "3"


def test_vllm_and_transformers_give_the_same_greedy_answers(vllm_sft):
    """vLLM's CPU build in its child process against transformers' generate, float32, temperature 0."""
    from postrain.generation import VLLMBackend

    prompts = [i["prompt"] for i in chat.generate(48, {"arithmetic": 1.0}, 9, 11)]
    reference = TransformersBackend(str(vllm_sft / "final"), batch_size=16).chat(prompts, 24, temperature=0.0)
    answers = VLLMBackend(str(vllm_sft / "final")).chat(prompts, 24, temperature=0.0)
    assert sum(len(a) for a in reference) > 5 * len(prompts), "the model should answer, not stop at once"
    assert answers == reference


def test_the_preference_step_generates_its_pairs_with_vllm(vllm_sft, tmp_path):
    import logging

    from infra.recipe import PreferenceCfg
    from infra.steps import StepOutput
    from tasks.postrain import PreferenceStepCfg, preference

    chats = tmp_path / "chats"
    chat.write_jsonl(chats / "train.jsonl", chat.generate(40, {"arithmetic": 1.0}, 9, 12))
    inputs = {name: StepOutput(name, name, path, "") for name, path in (("chats", chats), ("policy", vllm_sft))}
    cfg = PreferenceStepCfg(preference=PreferenceCfg(backend="vllm", prompts=40, max_new_tokens=24))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("smolflow")  # the step's logger outside a flow run
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        stats = preference(cfg, inputs, tmp_path)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    progress = [line for line in lines if line.startswith("vLLM: 40/40 answers")]
    assert len(progress) == 2, "each engine reports its progress in the step's log"  # strong, then weak
    pairs = chat.read_jsonl(tmp_path / "pairs.jsonl")
    assert stats.backend == "vllm" and stats.prompts == 40 and stats.pairs == len(pairs) > 0
    assert all(chat.is_correct(p["chosen"][0]["content"], p["answer"]) for p in pairs)
    assert stats.pairs + sum(stats.dropped.values()) == 40


@pytest.fixture(scope="module")
def sft_model(base, tmp_path_factory) -> Path:
    """The tiny base briefly fine-tuned, with its early copy kept as the weak model."""
    from postrain.sft import run_sft

    out = tmp_path_factory.mktemp("sft")
    cfg = SFTCfg(learning_rate=3e-3, max_steps=30, batch_size=16, save_steps=10, logging_steps=5, weak_checkpoint_step=5, max_length=96)
    result = run_sft(str(base), chat.generate(600, chat_families(), 49, 3), cfg, out, seed=0)
    assert result["loss"][-1][1] < result["loss"][0][1]
    assert (out / "weak" / "config.json").exists() and (out / "final" / "model.safetensors").exists()
    return out


def completion_logps(model_path: Path, pairs: list[dict], side: str) -> list[float]:
    """Log-probability of each pair's SIDE answer after its prompt, under the model at MODEL_PATH."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(model_path), AutoModelForCausalLM.from_pretrained(model_path).eval()
    out = []
    for pair in pairs:
        prefix = tok.apply_chat_template(pair["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tok.apply_chat_template(pair["prompt"] + pair[side], tokenize=True, return_dict=False)
        ids = torch.tensor([full])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(float(logps[len(prefix) - 1 :].sum()))
    return out


@pytest.mark.slow
def test_apo_raises_the_chosen_over_rejected_margin_on_its_pairs(sft_model, tmp_path):
    from postrain.apo import run_apo

    items = chat.generate(24, {"arithmetic": 1.0}, 49, 4)
    pairs = [
        {
            "prompt": i["prompt"],
            "chosen": [{"role": "assistant", "content": i["messages"][1]["content"]}],
            "rejected": [{"role": "assistant", "content": "The answer is 0."}],
        }
        for i in items
    ]
    cfg = APOCfg(learning_rate=1e-3, max_steps=6, batch_size=8, save_steps=3, logging_steps=1, loss_type=["apo_zero", "sft"])
    result = run_apo(str(sft_model / "final"), pairs, cfg, tmp_path, seed=0)
    assert len(result["loss"]) == 6 and all(math.isfinite(v) for _, v in result["loss"])

    def margin(model_path: Path) -> float:
        chosen, rejected = completion_logps(model_path, pairs, "chosen"), completion_logps(model_path, pairs, "rejected")
        return sum(c - r for c, r in zip(chosen, rejected)) / len(pairs)

    before, after = margin(sft_model / "final"), margin(tmp_path / "final")
    assert after > before + 1.0, f"chosen-over-rejected log-prob margin {before:.2f} -> {after:.2f}"


@pytest.mark.slow
def test_grpo_raises_the_correctness_reward_on_a_task_the_model_can_learn(base, tmp_path):
    """A model taught to answer any question with a random one of 1-4, where 3 is always right: GRPO's correctness
    reward alone (no length term) must move it towards 3."""
    import random

    from postrain.grpo import run_grpo
    from postrain.sft import run_sft

    rng = random.Random(0)
    rows = [
        chat.example(item["prompt"][0]["content"], f"The answer is {rng.randint(1, 4)}.", "3", "arithmetic")
        for item in chat.generate(800, {"arithmetic": 1.0}, 49, 8)
    ]
    sft_cfg = SFTCfg(
        learning_rate=3e-3, max_steps=300, batch_size=16, save_steps=200, logging_steps=40, weak_checkpoint_step=1, max_length=96
    )
    run_sft(str(base), rows, sft_cfg, tmp_path / "guesser", seed=0)
    cfg = GRPOCfg(
        learning_rate=3e-3,
        max_steps=16,
        batch_size=64,
        num_generations=8,
        max_completion_length=12,
        target_length=8,
        reward_weights={"correctness": 1.0},
        save_steps=100,
        logging_steps=1,
        temperature=1.0,
        backend="transformers",
    )
    result = run_grpo(str(tmp_path / "guesser" / "final"), rows[:200], cfg, tmp_path / "grpo", seed=0)
    rewards = [v for _, v in result["reward"]]
    assert len(rewards) == 16 and all(math.isfinite(v) for v in rewards)
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, str(rewards)


@pytest.mark.slow
def test_a_run_killed_after_its_last_checkpoint_does_not_train_past_max_steps(sft_model, tmp_path):
    from postrain.grpo import run_grpo

    items = chat.generate(16, {"arithmetic": 1.0}, 49, 5)
    cfg = GRPOCfg(
        learning_rate=1e-5, max_steps=2, batch_size=8, num_generations=4, max_completion_length=8, save_steps=1, logging_steps=1,
        backend="transformers",
    )  # fmt: skip
    first = run_grpo(str(sft_model / "final"), items, cfg, tmp_path, seed=0)
    (tmp_path / "final" / "model.safetensors").unlink()  # as if killed after checkpoint-2, before the step was committed
    again = run_grpo(str(sft_model / "final"), items, cfg, tmp_path, seed=0)
    assert again["reward"] == first["reward"] and [s for s, _ in again["reward"]] == [1, 2]
    assert not (tmp_path / "checkpoints" / "checkpoint-3").exists()
    final, last = tmp_path / "final" / "model.safetensors", tmp_path / "checkpoints" / "checkpoint-2" / "model.safetensors"
    assert final.read_bytes() == last.read_bytes()


@pytest.mark.slow
def test_length_penalty_shortens_a_rambling_model(base, tmp_path):
    """From a model taught to pad answers with 0-12 filler words, GRPO with the length reward alone shortens them."""
    import random

    from postrain.grpo import run_grpo
    from postrain.sft import run_sft

    rng = random.Random(0)
    rows = []
    for item in chat.generate(800, {"arithmetic": 1.0}, 49, 6):
        filler = " ".join(rng.choice(["so", "well", "then", "indeed", "and"]) for _ in range(rng.randint(0, 12)))
        rows.append(
            chat.example(item["prompt"][0]["content"], f"{item['messages'][1]['content']} {filler}".strip(), item["answer"], "arithmetic")
        )
    sft_cfg = SFTCfg(
        learning_rate=3e-3, max_steps=200, batch_size=16, save_steps=200, logging_steps=50, weak_checkpoint_step=1, max_length=96
    )
    run_sft(str(base), rows, sft_cfg, tmp_path / "rambler", seed=0)
    cfg = GRPOCfg(
        learning_rate=2e-3,
        max_steps=16,
        batch_size=16,
        num_generations=8,
        max_completion_length=64,
        target_length=4,
        reward_weights={"length": 1.0},
        save_steps=100,
        logging_steps=1,
        temperature=1.0,
        backend="transformers",
    )
    result = run_grpo(str(tmp_path / "rambler" / "final"), rows[:200], cfg, tmp_path / "grpo", seed=0)
    lengths = [v for _, v in result["completion_length"]]
    assert sum(lengths[-4:]) / 4 < sum(lengths[:4]) / 4


def launched(nproc: int, zero_stage: int = 0):
    """A trained step's config as the pipeline launches its trainer: postrain/run.py on NPROC ranks of one thread."""
    from infra.recipe import AccelerateCfg, GenerationCfg
    from tasks.postrain import TrainedStepCfg

    launcher = AccelerateCfg(nproc=nproc, zero_stage=zero_stage, threads_per_rank=1)
    return TrainedStepCfg(launcher=launcher, heldout_eval=GenerationCfg(), seed=0)


def launched_sft(out: Path, nproc: int, zero_stage: int = 0, max_steps: int = 12, save_steps: int = 4):
    """The SFT step's trainer as the pipeline launches it: a job for postrain/run.py under `accelerate launch`."""
    data = out.parent / "train.jsonl"
    if not data.exists():
        chat.write_jsonl(data, chat.generate(600, {"arithmetic": 1.0}, 49, 7))
    out.mkdir(parents=True, exist_ok=True)
    sft = SFTCfg(
        learning_rate=3e-3, max_steps=max_steps, batch_size=8, save_steps=save_steps, logging_steps=2, weak_checkpoint_step=2, max_length=96
    )
    return launched(nproc, zero_stage), sft, data


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def post_job(cfg, stage: str, trainer, model: Path, data: Path, out: Path):
    """The job of STAGE's trainer as `tasks.postrain.train` writes it for its ranks (the same arguments), OUT made."""
    from postrain.run import PostJob

    out.mkdir(parents=True, exist_ok=True)
    return PostJob(stage=stage, model=str(model), data=str(data), config=trainer.model_dump(), out=str(out), seed=cfg.seed)


def test_a_grpo_rank_that_rolls_out_with_transformers_never_imports_vllm(tmp_path):
    """TRL's GRPO module imports vLLM whenever it is installed: 6-7 CPU s of a rank's start-up for nothing when the
    rollouts use transformers' generate. The rank's own start (`python -m postrain.run JOB`, run as `__main__`); its
    prompts do not exist, so it stops once its trainer is imported and reads them, and says what it imported."""
    import json
    import subprocess
    import sys

    grpo = GRPOCfg(learning_rate=1e-3, max_steps=2, batch_size=8, num_generations=4, backend="transformers")
    job = post_job(launched(1), "grpo", grpo, tmp_path, tmp_path / "no-prompts.jsonl", tmp_path)
    (tmp_path / "job.json").write_text(job.model_dump_json())
    rank = f"""
import json, runpy, sys
sys.argv = ["postrain.run", {str(tmp_path / "job.json")!r}]
try:
    runpy.run_module("postrain.run", run_name="__main__", alter_sys=True)
except FileNotFoundError as err:
    print(json.dumps({{"stopped": str(err), "modules": sorted(name for name, m in sys.modules.items() if m is not None)}}))
"""
    said = subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True)
    assert said.stdout, said.stderr[-2000:]
    out = json.loads(said.stdout.splitlines()[-1])
    assert "no-prompts.jsonl" in out["stopped"] and "trl.trainer.grpo_trainer" in out["modules"], "the rank imported its trainer"
    assert not [m for m in out["modules"] if m.split(".")[0] == "vllm"]


def in_this_process(cfg, stage: str, trainer, model: Path, data: Path, out: Path) -> dict:
    """The ranks' own function (postrain/run.py `run`) in this process on one rank's threads: the uninterrupted run a
    launched one is compared with, at the same global batch, without another launch (a rank's imports: ~15 CPU s)."""
    import torch

    from postrain.run import run

    job = post_job(cfg, stage, trainer, model, data, out)
    threads, handlers = torch.get_num_threads(), {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    torch.set_num_threads(cfg.launcher.threads_per_rank)
    try:
        return run(job)
    finally:  # the trainer's signal handlers are a rank's, not this test process's
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_two_ranks_train_the_same_sft_curve_as_one_rank_at_the_same_global_batch(base, tmp_path, monkeypatch):
    """DDP (gloo) and DeepSpeed ZeRO-3 on 2 ranks, 4 sequences each, against 1 rank of 8 (the ranks' function in this
    process): the same batches (accelerate shards each global batch across ranks), the loss averaged over the same tokens."""
    from tasks.postrain import train

    extensions = tmp_path / "torch_extensions"  # where DeepSpeed would JIT-compile an op (its shm all-reduce: minutes)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    cfg, sft, data = launched_sft(tmp_path / "1-zero0", 1)
    runs = {(1, 0): in_this_process(cfg, "sft", sft, base, data, tmp_path / "1-zero0")}
    for nproc, zero in [(2, 0), (2, 3)]:
        cfg, sft, data = launched_sft(tmp_path / f"{nproc}-zero{zero}", nproc, zero)
        runs[nproc, zero] = train(cfg, "sft", sft, base, data, tmp_path / f"{nproc}-zero{zero}")
    one = dict(map(tuple, runs[1, 0]["loss"]))
    assert len(one) == 6 and one[12] < one[2]
    checkpoint = "checkpoints/checkpoint-12"
    assert (tmp_path / "2-zero0" / checkpoint / "rng_state_1.pth").exists()  # two ranks did train
    assert len(list((tmp_path / "2-zero3" / checkpoint).glob("global_step12/*optim_states.pt"))) == 2
    reference = weights(tmp_path / "1-zero0" / "final")
    for key in [(2, 0), (2, 3)]:
        # float32 sums in another order (per-rank means all-reduced) differ in the last bits: 1e-5 is far
        # below the 1e-2 a step moves the loss, far above what reordering gives (measured: < 2e-7)
        assert {s: pytest.approx(v, rel=1e-5) for s, v in one.items()} == dict(map(tuple, runs[key]["loss"]))
        final = weights(tmp_path / f"2-zero{key[1]}" / "final")
        assert max((final[k] - reference[k]).abs().max().item() for k in reference) < 1e-4
        assert (tmp_path / f"2-zero{key[1]}" / "weak" / "model.safetensors").exists()
    assert not extensions.exists(), "DeepSpeed compiled an op that training does not use"


def rank_processes() -> dict[int, int]:
    """RANK -> pid of the post-training ranks this test process launched."""
    import psutil

    ranks = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if "postrain.run" in " ".join(proc.cmdline()) and "RANK" in proc.environ():
                ranks[int(proc.environ()["RANK"])] = proc.pid
        except psutil.Error:
            pass
    return ranks


class Cancelled(Exception):
    """What a Prefect cancel raises in the task's thread."""


def cancelled_launch(cfg, job, curve: str) -> tuple[str, list[int]]:
    """Launch JOB as the pipeline does and cancel it as Prefect does (an exception in the task's thread) once CURVE was
    logged twice (steps 2 and 4): what the ranks said, and the checkpoints they left. No rank may outlive the cancel."""
    from infra.launch import accelerate_command, free_port, launch_env, run_streaming

    out = Path(job.out)
    (out / "job.json").write_text(job.model_dump_json())
    command = accelerate_command(cfg.launcher, "postrain.run", [str(out / "job.json")], out / "accelerate.json", free_port(), False)
    lines: list[str] = []

    def cancel_after_two_logs(line: str) -> None:
        lines.append(line)
        if f"'{curve}'" in line and sum(f"'{curve}'" in seen for seen in lines) == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        run_streaming(command, launch_env(cfg.launcher), cancel_after_two_logs, grace_s=120)
    said = "\n".join(lines)
    assert not psutil_children(), f"no rank outlives the cancel:\n{said}"
    return said, sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("checkpoint-*"))


@pytest.mark.slow
def test_a_killed_rank_fails_the_launch_a_cancel_sigterms_the_ranks_and_each_retry_resumes_with_the_losses_of_an_uninterrupted_run(
    base, tmp_path
):
    """Three launches of one 180-step SFT on 2 ranks, against an uninterrupted one. A rank SIGKILLed after the periodic
    checkpoint at step 60 fails the launch, quoting the launcher's report of it; the retry resumes there and is
    cancelled as Prefect cancels (a cancel once SIGKILLed the ranks, losing everything since the last periodic
    checkpoint): its ranks get SIGTERM and checkpoint together at the step they reached; the last retry resumes there.
    A step takes ~5 ms on a fast box, where the ranks ran 16-23 steps between the line that cancels and the SIGTERM: the
    periodic checkpoints are 60 steps apart, so that the kill and the cancel land before the next one."""
    import threading

    from infra.errors import TrainerFailed
    from tasks.postrain import train

    cfg, sft, data = launched_sft(tmp_path / "ref", 2, max_steps=180, save_steps=60)
    reference = dict(map(tuple, in_this_process(cfg, "sft", sft, base, data, tmp_path / "ref")["loss"]))  # 1 rank of 8
    out = tmp_path / "interrupted"
    out.mkdir()
    errors = []
    first = threading.Thread(target=lambda: errors.append(pytest.raises(TrainerFailed, train, cfg, "sft", sft, base, data, out)))
    first.start()
    deadline = time.time() + 300
    while first.is_alive() and not (out / "checkpoints" / "checkpoint-60" / "trainer_state.json").exists():
        assert time.time() < deadline
        time.sleep(0.05)
    ranks = rank_processes()
    assert sorted(ranks) == [0, 1], "the launch ended before a rank could be killed"
    os.kill(ranks[1], signal.SIGKILL)
    first.join(timeout=120)
    assert errors, "the launch did not fail when a rank was killed"  # pytest.raises fails the thread otherwise
    assert "exitcode" in str(errors[0].value).split("Its last lines:")[1], "the error quotes the launcher's report of the rank"
    assert not (out / "result.json").exists() and not (out / "final").exists()

    job = post_job(cfg, "sft", sft, base, data, out)
    said, saved = cancelled_launch(cfg, job, "loss")  # cancelled at its second loss line: step 64 if it resumed at 60
    assert saved[0] == 60 and len(saved) == 2 and 64 <= saved[1] < 120, f"the periodic checkpoint, then the cancel's: {saved}\n{said}"
    assert not (out / "result.json").exists() and not (out / "final").exists()
    assert "stopping: SIGTERM to 2 rank(s) of postrain.run" in said and f"received SIGTERM: checkpoint-{saved[1]} saved" in said, said
    resumed = train(cfg, "sft", sft, base, data, out)
    assert resumed["resumed_from"].endswith(f"checkpoint-{saved[1]}")
    after = {s: loss for s, loss in map(tuple, resumed["loss"]) if s >= saved[1] + 2}  # logged over 2 steps, both resumed
    assert max(after) == 180 and len(after) >= 20
    assert all(after[s] == pytest.approx(reference[s], rel=1e-4) for s in after), {s: (after[s], reference[s]) for s in after}


def psutil_children() -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if "postrain.run" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_grpo_with_vllm_rollouts_records_its_rewards_and_resumes_after_a_kill(vllm_sft, tmp_path, monkeypatch):
    """TRL's colocate mode on vLLM's CPU build, launched as the pipeline does; SIGKILL after checkpoint-4 of 12.
    vLLM's log-probs of its own samples agree with the trainer's only if the engine holds the policy's
    current weights, so after the resume they prove the weights were pushed in again. The engine compiles
    nothing on CPU: vLLM's and torch's compile caches, here the test's own folders, stay empty."""
    import json
    import threading

    import psutil

    from infra.errors import TrainerFailed
    from tasks.postrain import train

    vllm_cache, inductor_cache = tmp_path / "vllm-cache", tmp_path / "inductor-cache"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(vllm_cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
    cfg = launched(1)
    data = tmp_path / "prompts.jsonl"
    chat.write_jsonl(data, chat.generate(200, {"arithmetic": 1.0}, 9, 13))
    grpo = GRPOCfg(
        learning_rate=1e-3, max_steps=12, batch_size=16, num_generations=8, max_completion_length=16, save_steps=4, logging_steps=1,
        target_length=8, backend="vllm",
    )  # fmt: skip
    out = tmp_path / "grpo"
    out.mkdir()
    errors = []
    launch = (train, cfg, "grpo", grpo, vllm_sft / "final", data, out)
    first = threading.Thread(target=lambda: errors.append(pytest.raises(TrainerFailed, *launch)))
    first.start()
    deadline = time.time() + 300
    while first.is_alive() and not (out / "checkpoints" / "checkpoint-4" / "trainer_state.json").exists():
        assert time.time() < deadline
        time.sleep(0.05)
    commands = {p: p.cmdline() for p in psutil.Process().children(recursive=True)}
    trainers = [p for p, command in commands.items() if command[1:3] == ["-m", "postrain.run"]]
    assert len(trainers) == 1, f"the launch ended before its trainer could be killed: {[e.value for e in errors]}"
    assert not [c for c in commands.values() if "accelerate.commands.launch" in c], "a lone rank needs no accelerate launcher"
    trainers[0].kill()
    first.join(timeout=120)
    assert errors and not (out / "final").exists()
    resumed = launch[0](*launch[1:])
    assert int(resumed["resumed_from"].rsplit("-", 1)[1]) >= 4
    rewards = [r for _, r in resumed["reward"]]
    assert [s for s, _ in resumed["reward"]] == list(range(1, 13)) and all(math.isfinite(r) for r in rewards)
    assert sum(rewards[-4:]) > sum(rewards[:4]), rewards
    history = json.loads((out / "checkpoints" / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
    gaps = [row["sampling/sampling_logp_difference/mean"] for row in history if row.get("step", 0) > 4 and "reward" in row]
    assert len(gaps) == 8 and max(gaps) < 0.05, f"vLLM's samples do not come from the trained policy: {gaps}"
    compiled = [*(vllm_cache / "torch_compile_cache").rglob("*.so"), *inductor_cache.rglob("*.so")]
    assert not compiled, f"the engine compiled {len(compiled)} kernels, such as {compiled[0]}"
