"""Evaluation: lm-eval on real (micro) models, results keyed by content, locks, report card."""

from __future__ import annotations

import base64
import gzip
import io
import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from flows.graph import build_graph
from infra.errors import DiskFull, SmolflowError, StepLocked
from infra.recipe import EvalCfg, load_recipe, parse_recipe
from infra.steps import Step, finished, run_step
from infra.summaries import ChatDataSummary, HeldoutEval, PhaseSummary, Summary, TrainedSummary, outcomes
from model.checkpoint import CheckpointStore, mark_evaluated
from tasks.evaluation import harness
from tasks.evaluation.harness import EvalJob, EvalWorker, kept_worker, prepare_tasks
from tasks.evaluation.plots import inline
from tasks.evaluation.report import build_report, phase_ends
from tasks.evaluation.results import ITEMS, ModelRef, ResultStore, local_fingerprint, models_in_run, scoring_key
from tasks.evaluation.runner import Evaluator
from tests.helpers import REPO, micro_recipe

log = logging.getLogger("test")


def test_generative_tasks_score_the_answers_sign_and_let_a_worked_answer_finish():
    import re

    import yaml
    from lm_eval.api.metrics import exact_match_fn

    task = yaml.safe_load((REPO / "configs/evals/tasks/_generative.yaml").read_text())
    pattern = task["filter_list"][0]["filter"][0]["regex_pattern"]
    options = {k: v for k, v in task["metric_list"][0].items() if k.startswith("ignore")}

    def score(completion: str, target: str) -> float:
        return exact_match_fn(predictions=[re.findall(pattern, completion)[-1]], references=[target], **options)["exact_match"]

    worked = "30 - 42 = -(42 - 30), 42 - 30: 2 - 0 = 2, 4 - 3 = 1. The answer is -12."
    assert score(worked, "-12") == 1 and score(worked.replace("-12.", "12."), "-12") == 0
    held_out = load_recipe(REPO / "configs/tiny.yaml").postrain.heldout_eval.max_new_tokens
    assert task["generation_kwargs"]["max_gen_toks"] >= held_out


def save_micro_model(out: Path, seed: int) -> Path:
    """A random 2-layer SmolLM3 with a BPE trained on the eval questions: tiny, but a real HF folder."""
    from model.network import build_model, model_config, save_pretrained
    from tasks.curation.tokenizer import save_hf, train_bpe

    texts = [json.loads(line)["question"] for line in (REPO / "configs" / "evals" / "arithmetic.jsonl").read_text().splitlines()]
    tokenizer = save_hf(train_bpe(iter(texts * 3), vocab_size=400, min_frequency=2), out)
    recipe = parse_recipe(micro_recipe(), "micro")
    config = model_config(recipe.model, len(tokenizer), 128, special_ids={"eos_token_id": tokenizer.eos_token_id})
    save_pretrained(build_model(config, seed), out)
    return out


@pytest.fixture
def no_idle_child():
    """An evaluation leaves its child idle for the next one in the process (other tests here take it over): a test that
    counts the children it starts starts from none."""
    harness._end_kept()


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("heldout")
    for source in ("prose", "code", "math"):
        (root / source).mkdir()
        with gzip.open(root / source / "00000.jsonl.gz", "wt") as f:
            for i in range(4):
                f.write(json.dumps({"id": f"{source}-{i}", "text": f"What is {i} + {i}? The answer is {2 * i}. " * 5}) + "\n")
    return root


def evaluator(tmp_path: Path, heldout: Path, cfg: EvalCfg) -> Evaluator:
    include = prepare_tasks(cfg.task_dirs, heldout, tmp_path / "tasks")
    return Evaluator(cfg, ResultStore(str(tmp_path / "results")), include, tmp_path / "work", log)


def test_lm_eval_scores_a_model_once_per_content(tmp_path, heldout):
    cfg = EvalCfg(
        checkpoint_tasks=["smol_arithmetic_cf", "smol_arithmetic_mcf", "smol_ppl_math"],
        model_tasks=["smol_arithmetic_gen"],
        limit=6,
        batch_size=8,
    )
    ev = evaluator(tmp_path, heldout, cfg)
    model_dir = save_micro_model(tmp_path / "model", seed=1)
    ref = ModelRef(str(model_dir), local_fingerprint(model_dir), "sft", "model", "sft")

    first = ev.run([ref])
    assert first.evaluated == ["sft"] and not first.failed
    record = ev.store.get(ref.fingerprint)
    metrics = {task: entry["metrics"] for task, entry in record["tasks"].items()}
    assert set(metrics) == {"smol_arithmetic_cf", "smol_arithmetic_mcf", "smol_ppl_math", "smol_arithmetic_gen"}
    assert 0 <= metrics["smol_arithmetic_cf"]["acc"] <= 1 and metrics["smol_ppl_math"]["bits_per_byte"] > 0
    assert 0 <= metrics["smol_arithmetic_gen"]["exact_match/answer"] <= 1
    # a uniform guess over 4 choices; generative and perplexity tasks have no chance level
    assert metrics["smol_arithmetic_cf"]["chance"] == metrics["smol_arithmetic_mcf"]["chance"] == 0.25
    assert "chance" not in metrics["smol_arithmetic_gen"] and "chance" not in metrics["smol_ppl_math"]
    assert all(entry["limit"] == 6 for entry in record["tasks"].values())
    # each item's outcome is kept beside the aggregate, and the aggregate is their ratio of sums
    for task, key in (("smol_arithmetic_cf", "acc"), ("smol_ppl_math", "bits_per_byte"), ("smol_arithmetic_gen", "exact_match/answer")):
        items = record["tasks"][task]["items"]
        assert len(items["id"]) == len(set(items["id"])) and 4 <= len(items["id"]) <= 6, task  # limit 6; 4 held-out math docs
        assert sum(items["num"]) / sum(items["den"]) == pytest.approx(metrics[task][key], rel=1e-4), task

    # the same content at another path is not evaluated again
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(model_dir), str(copy)], check=True)
    again = ev.run([ModelRef(str(copy), local_fingerprint(copy), "sft", "model", "sft")])
    assert again.cached == ["sft"] and again.evaluated == []

    # other weights are another model; a new task is run alone on an evaluated model
    other = save_micro_model(tmp_path / "other", seed=2)
    assert local_fingerprint(other) != ref.fingerprint
    wider = evaluator(tmp_path, heldout, cfg.model_copy(update={"checkpoint_tasks": cfg.checkpoint_tasks + ["smol_word_problems_cf"]}))
    assert wider.task_groups(ref) == [(["smol_word_problems_cf"], False)]


def test_a_model_is_scored_again_on_held_out_data_that_changed_and_on_nothing_else(tmp_path, heldout):
    """A model reused as it is (a swarm proxy that left out the source whose data changed) keeps its scores, but
    its score on held-out documents that changed is measured again: a task's result key holds its data's content."""
    cfg = EvalCfg(checkpoint_tasks=["smol_arithmetic_cf", "smol_ppl_code", "smol_ppl_math"], limit=4)
    ev = evaluator(tmp_path / "a", heldout, cfg)
    ref = ModelRef("m", "fp", "phase1/step00000005", "checkpoint", "phase1")
    ev.store.put(ref, {t: {"acc": 0.5} for t in cfg.checkpoint_tasks}, ev.keys, 4, 1.0)
    assert ev.task_groups(ref) == []

    def scored_on(docs: Path, name: str) -> Evaluator:
        return Evaluator(cfg, ev.store, prepare_tasks(cfg.task_dirs, docs, tmp_path / name), tmp_path / "work", log)

    moved = tmp_path / "moved"  # the same documents in another run's store
    shutil.copytree(heldout, moved)
    assert scored_on(moved, "b").task_groups(ref) == []
    with gzip.open(moved / "math" / "00000.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "math-9", "text": "What is 9 + 9? The answer is 18. " * 5}) + "\n")
    assert scored_on(moved, "c").task_groups(ref) == [(["smol_ppl_math"], False)]


def test_scoring_a_model_starts_no_machine_report_processes(tmp_path, heldout, monkeypatch):
    """lm-eval ran `pip list`, `cmake --version` and `lsb_release` for every model it scored (0.4-2.2 s of CPU each)."""
    from tasks.evaluation.harness import run_tasks

    started = []
    popen = subprocess.Popen.__init__
    monkeypatch.setattr(subprocess.Popen, "__init__", lambda self, args, *a, **kw: started.append(str(args)) or popen(self, args, *a, **kw))
    include = prepare_tasks(EvalCfg().task_dirs, heldout, tmp_path / "tasks")
    scores = run_tasks(save_micro_model(tmp_path / "model", seed=1), ["smol_arithmetic_cf"], include, EvalCfg(limit=2), chat=False)
    assert 0 <= scores["smol_arithmetic_cf"]["acc"] <= 1
    assert not [args for args in started if "pip" in args or "cmake" in args or "lsb_release" in args], started


def test_generative_scores_are_the_same_with_the_vllm_and_the_transformers_backends(tmp_path, heldout, vllm_sft):
    """lm-eval through vLLM's CPU build and through transformers, temperature 0, the chat template applied."""
    scores = {}
    for backend in ("hf", "vllm"):
        cfg = EvalCfg(model_tasks=["smol_arithmetic_gen", "smol_word_problems_gen"], limit=60, batch_size=16, backend=backend)
        ev = evaluator(tmp_path / backend, heldout, cfg)
        final = vllm_sft / "final"
        assert ev.run([ModelRef(str(final), local_fingerprint(final), "sft", "model", "sft")]).evaluated == ["sft"]
        record = ev.store.get(local_fingerprint(final))["tasks"]
        scores[backend] = {task: entry["metrics"]["exact_match/answer"] for task, entry in record.items()}
    assert scores["vllm"] == scores["hf"] and scores["hf"]["smol_arithmetic_gen"] > 0, scores


@pytest.mark.usefixtures("no_idle_child")
def test_models_pending_at_once_are_scored_in_one_child_and_a_failing_one_is_reported_not_dropped(tmp_path, heldout, monkeypatch):
    children = []
    real = EvalWorker.run
    monkeypatch.setattr(EvalWorker, "run", lambda self, jobs, abandon=None: children.append(jobs) or real(self, jobs, abandon))
    cfg = EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], model_tasks=["smol_arithmetic_gen"], limit=2)
    ev = evaluator(tmp_path, heldout, cfg)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    good = save_micro_model(tmp_path / "good", seed=3)
    summary = ev.run(
        [
            ModelRef(str(broken), local_fingerprint(broken), "phase1/step00000005", "checkpoint", "phase1", 5, 1280),
            ModelRef(str(good), local_fingerprint(good), "sft", "model", "sft"),
        ]
    )
    # one batch for the checkpoint's tasks and the finished model's base and chat tasks
    assert [len(jobs) for jobs in children] == [3] and ev.worker.launches == 1
    assert list(summary.failed) == ["phase1/step00000005"] and str(broken) in summary.failed["phase1/step00000005"]
    assert summary.evaluated == ["sft"]
    assert set(ev.store.get(local_fingerprint(good))["tasks"]) == {"smol_arithmetic_cf", "smol_arithmetic_gen"}
    assert ev.store.get(local_fingerprint(broken)) is None


def test_a_final_model_with_its_last_checkpoints_weights_takes_its_scores(tmp_path, heldout, monkeypatch):
    """A phase's final export and its last checkpoint differ only in the model card and `use_cache`: the final takes
    the checkpoint's plain scores instead of being scored again, and only its chat tasks run."""
    children = []
    real = EvalWorker.run
    monkeypatch.setattr(EvalWorker, "run", lambda self, jobs, abandon=None: children.append(jobs) or real(self, jobs, abandon))
    cfg = EvalCfg(checkpoint_tasks=["smol_arithmetic_cf", "smol_ppl_math"], model_tasks=["smol_arithmetic_gen"], limit=2)
    ev = evaluator(tmp_path, heldout, cfg)
    checkpoint = save_micro_model(tmp_path / "checkpoint", seed=1)
    final = tmp_path / "final"
    subprocess.run(["cp", "-r", str(checkpoint), str(final)], check=True)
    (final / "README.md").write_text("# a model card\n")
    config = json.loads((final / "config.json").read_text())
    (final / "config.json").write_text(json.dumps(config | {"use_cache": not config["use_cache"]}))

    def ref(folder: Path, label: str, kind: str) -> ModelRef:
        return ModelRef(str(folder), local_fingerprint(folder), label, kind, "phase1", scores_as=scoring_key(folder))

    refs = [ref(checkpoint, "phase1/step00000005", "checkpoint"), ref(final, "base", "model")]
    assert refs[0].fingerprint != refs[1].fingerprint and refs[0].scores_as == refs[1].scores_as
    summary = ev.run(refs)
    assert summary.evaluated == ["phase1/step00000005", "base"] and not summary.failed
    assert [[(job.tasks, job.chat) for job in jobs] for jobs in children] == [
        [(["smol_arithmetic_cf", "smol_ppl_math"], False)],
        [(["smol_arithmetic_gen"], True)],
    ], "the final's plain tasks were not run again"
    theirs, ours = ev.store.get(refs[0].fingerprint)["tasks"], ev.store.get(refs[1].fingerprint)["tasks"]
    assert set(ours) == {"smol_arithmetic_cf", "smol_ppl_math", "smol_arithmetic_gen"}
    assert all(ours[t] == theirs[t] for t in theirs), "the same entries, per-item outcomes included"
    # a config key a score depends on (the long-context phase's YaRN settings) makes another scoring key
    (final / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    assert scoring_key(final) != refs[0].scores_as


def test_a_child_that_replies_other_than_done_and_lives_on_is_killed_not_waited_for(tmp_path, monkeypatch):
    """The parent waited on such a child with no timeout."""
    from tasks.evaluation import harness

    monkeypatch.setattr(harness, "REPLY_GRACE_S", 1)
    worker = EvalWorker(EvalCfg(), tmp_path / "logs")
    talker = "import sys, time; sys.stdin.readline(); print('oops', flush=True); time.sleep(120)"
    started = time.time()
    worker.proc = subprocess.Popen([sys.executable, "-c", talker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    worker.log = tmp_path / "child.log"
    worker.log.write_text("")
    [result] = worker.run([EvalJob(model="m", tasks=["t"], chat=False, out=str(tmp_path / "out.json"), include=str(tmp_path))])
    assert "killed after replying b'oops" in result["error"] and time.time() - started < 30
    assert worker.proc is None, "the child is gone"


def test_the_follower_rides_out_a_storage_outage_and_gives_up_on_one_that_outlasts_training(tmp_path, heldout):
    """A failed listing of the mirror once ended the eval follower for the rest of the run."""
    from infra.storage import StorageError
    from tasks.evaluation.runner import MIRROR_ROUNDS

    ev = evaluator(tmp_path, heldout, EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], poll_seconds=0.01))
    stop, scans = threading.Event(), []

    def flaky():  # two failed listings, then the mirror answers and training ends
        scans.append(1)
        if len(scans) <= 2:
            raise StorageError("list s3://m/runs: failed after 4 attempts: EndpointConnectionError")
        stop.set()
        return []

    summary = ev.follow(flaky, stop)
    assert len(scans) == 4 and not summary.failed  # the round that set stop, then the final round

    def down():
        raise StorageError("list s3://m/runs: failed after 4 attempts: EndpointConnectionError")

    summary = ev.follow(down, stop)  # training is over and the outage goes on: it ends, saying so
    assert f"{MIRROR_ROUNDS} rounds failed" in summary.failed["(storage)"]


@pytest.mark.usefixtures("no_idle_child")
def test_the_follower_scores_successive_batches_in_one_child_and_a_dead_child_is_replaced(tmp_path, heldout):
    """The child's imports (~11 s of CPU) are paid once per follower, not once per batch of checkpoints beside the trainer."""
    ev = evaluator(tmp_path, heldout, EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], limit=4, poll_seconds=0.5))
    folders = [save_micro_model(tmp_path / f"step{i}", seed=10 + i) for i in (1, 2)]
    refs = [ModelRef(str(f), local_fingerprint(f), f"phase1/step{i:08d}", "checkpoint", "phase1", i) for i, f in enumerate(folders, 1)]
    stop, scans = threading.Event(), []

    def discover():  # the second checkpoint appears once the first was scored; training ends with it
        scans.append(len(scans))
        if len(scans) == 2:
            stop.set()
        return refs[: len(scans)]

    summary = ev.follow(discover, stop)
    assert summary.evaluated == [r.label for r in refs] and not summary.failed
    assert ev.worker.launches == 1 and ev.worker.proc.poll() is None, "one child for both batches, kept for the stage's evals"
    assert kept_worker(ev.cfg.model_copy(update={"threads": 2}), ev.work_dir) is ev.worker, "which take it with every core"
    ev.worker.close()
    assert not list(ev.work_dir.glob("eval-child-*.log")), "a child that ended cleanly leaves no log"

    job = [EvalJob(str(folders[0]), ["smol_arithmetic_cf"], False, str(tmp_path / "again.json"), str(ev.include))]
    with ev.worker as worker:
        threading.Timer(3.0, lambda: worker.proc.kill()).start()  # mid-batch: the child's imports alone take longer
        [died] = worker.run(job)
        assert "exit -9" in died["error"], died
        [kept] = ev.work_dir.glob("eval-child-*.log")
        assert str(kept) in died["error"], "the dead child's output is kept and named"
        [scored] = worker.run(job)
    first = ev.store.get(refs[0].fingerprint)["tasks"]["smol_arithmetic_cf"]["metrics"]
    assert worker.launches == 3 and scored["metrics"]["smol_arithmetic_cf"]["acc"] == first["acc"]


@pytest.mark.usefixtures("no_idle_child")
def test_evaluations_in_one_process_share_one_child_across_stages_runs_and_configs_and_another_priority_ends_it(tmp_path, heldout):
    """SFT, APO, GRPO and the evaluate stage each score their model alone, and so does each run of an ablation or a
    swarm in its thread: one child's imports (~12 s of CPU), not one per stage, run or config (each batch brings its
    own). The child outlives the thread that started it (it dies with its parent thread: the first kept child was
    SIGKILLed when its run's thread ended)."""
    cfg = EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], limit=2)
    folders = [save_micro_model(tmp_path / f"model{i}", seed=20 + i) for i in (1, 2, 3)]
    refs = [ModelRef(str(f), local_fingerprint(f), f"m{i}", "model", f"m{i}") for i, f in enumerate(folders, 1)]
    runs = [tmp_path / "run", tmp_path / "run", tmp_path / "other"]  # two stages of one run, then another run
    workers, evaluated = [], []

    def evaluate(ref: ModelRef, run: Path) -> None:
        include = prepare_tasks(cfg.task_dirs, heldout, run / "tasks")
        ev = Evaluator(cfg, ResultStore(str(run / "results")), include, run / "work", log, alone=True)
        evaluated.extend(ev.run([ref]).evaluated)
        workers.append(ev.worker)

    for ref, run in zip(refs, runs, strict=True):  # one after the other, each in a thread that ends (a swarm's run's)
        thread = threading.Thread(target=evaluate, args=(ref, run))
        thread.start()
        thread.join()
    assert evaluated == [r.label for r in refs]
    assert all(w is workers[0] for w in workers) and workers[0].launches == 1 and workers[0].proc.poll() is None
    record = ResultStore(str(tmp_path / "other" / "results")).get(refs[2].fingerprint)
    assert record["tasks"]["smol_arithmetic_cf"]["metrics"]["acc"] >= 0, "the other run's model, in its own store"
    items = lambda store, ref: store.get(ref.fingerprint)["tasks"]["smol_arithmetic_cf"][ITEMS]["id"]  # noqa: E731
    assert len(items(ResultStore(str(tmp_path / "run" / "results")), refs[0])) == 2
    other, include, store = cfg.model_copy(update={"limit": 3}), tmp_path / "other" / "tasks", ResultStore(str(tmp_path / "x" / "results"))
    elsewhere = Evaluator(other, store, include, tmp_path / "x" / "work", log, alone=True)
    assert elsewhere.worker is workers[0], "an evaluation that scores something else takes the idle child"
    elsewhere.run([refs[0]])
    assert workers[0].launches == 1 and len(items(store, refs[0])) == 3, "and scores as its own config says"
    lower = Evaluator(other.model_copy(update={"nice": 15}), store, include, tmp_path / "y" / "work", log, alone=True)
    assert lower.worker is not workers[0] and workers[0].proc is None, "an evaluation at another priority ends the idle child"


def test_unknown_task_names_the_task_dirs(tmp_path, heldout):
    from infra.errors import SmolflowError
    from tasks.evaluation.harness import run_tasks

    cfg = EvalCfg(checkpoint_tasks=["hellaswagg"])
    include = prepare_tasks(cfg.task_dirs, heldout, tmp_path / "tasks")
    with pytest.raises(SmolflowError, match="unknown lm-eval task"):
        run_tasks(tmp_path, ["hellaswagg"], include, cfg, chat=False)


HOLD = "import sys, time; from pathlib import Path; from infra.locks import acquire; acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"  # noqa: E501


def holding(lock: Path) -> subprocess.Popen:
    """Another process holding LOCK until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claimed_model_is_left_to_the_live_claimant(tmp_path):
    store = ResultStore(str(tmp_path / "results"))
    store.lock_dir.mkdir(parents=True)
    holder = holding(store.lock_dir / "abc.lock")
    try:
        with store.claim("abc") as owned:
            assert owned is False
    finally:
        holder.kill()
        holder.wait()
    with store.claim("abc") as owned:  # its process is gone: the kernel dropped its lock
        assert owned is True
    assert not (store.lock_dir / "abc.lock").exists()


def test_step_lock_refuses_a_second_builder_and_survives_a_dead_one(tmp_path):
    sid = Step("train", "test", None, EvalCfg()).step_id({})
    lock = tmp_path / "steps" / ".partial" / f"train-{sid}.lock"
    lock.parent.mkdir(parents=True)
    holder = holding(lock)
    built = []
    try:
        with pytest.raises(StepLocked, match=f"pid {holder.pid}.*gave up waiting"):
            run_step(tmp_path, Step("train", "test", lambda cfg, inputs, out: built.append(out) or {}, EvalCfg()), {}, wait_s=0.5)
        assert built == []
    finally:
        holder.kill()
        holder.wait()
    out = run_step(tmp_path, Step("train", "test", lambda cfg, inputs, out: built.append(out) or {"ok": True}, EvalCfg()), {})
    assert out.summary.model_dump() == {"ok": True} and len(built) == 1 and not lock.exists()


def test_the_eval_follower_waits_for_a_model_claimed_elsewhere_without_spinning_and_leaves_it_when_stopped(tmp_path, heldout):
    ev = evaluator(tmp_path, heldout, EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], poll_seconds=0.5))
    store = ev.store
    store.lock_dir.mkdir(parents=True)
    model = ModelRef(str(tmp_path), "fp1", "phase1/step00000005", "checkpoint", "phase1")
    holder = holding(store.lock_dir / "fp1.lock")
    scans, stop = [], threading.Event()

    def discover():
        scans.append(time.time())
        return [model]

    try:
        threading.Timer(3.0, stop.set).start()
        started = time.time()
        summary = ev.follow(discover, stop)
    finally:
        holder.kill()
        holder.wait()
    assert time.time() - started < 10, "the follower ends once stopped, leaving the model to its claimant"
    assert summary.busy == [model.label] and summary.evaluated == []
    assert len(scans) <= 3 / 0.5 + 2, f"{len(scans)} scans in 3 s: it spins instead of polling"


def test_prune_holds_checkpoints_until_evaluated_and_says_which_it_deleted_unscored(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=1, hold_unevaluated=2)
    with caplog.at_level("WARNING", logger="model.checkpoint"):
        for step in (1, 2, 3, 4):
            (store.tmp_dir() / f"step{step:08d}").mkdir(parents=True)
            (store.tmp_dir() / f"step{step:08d}" / "w.bin").write_bytes(b"x" * step)
            store.commit(f"step{step:08d}", step, {})
        # newest kept, the two newest unevaluated older ones held, the oldest pruned: its scores will be missing
        assert store.local_tags() == ["step00000002", "step00000003", "step00000004"]
        mark_evaluated(tmp_path / "step00000002")  # what the evaluator calls once it scored a checkpoint
        mark_evaluated(tmp_path / "step00000003")
        store.prune()
    assert store.local_tags() == ["step00000004"]
    assert [r.getMessage().split()[:5] for r in caplog.records] == [["checkpoint", "step00000001", "deleted", "before", "the"]]


def test_a_full_disk_waits_for_the_evaluator_to_score_what_it_holds_and_fails_keeping_it_when_none_comes(small_disk, caplog, monkeypatch):
    """A save on a short disk deletes only scored checkpoints: a checkpoint the evaluator has yet to score goes once it
    is scored (the save waits), and if the evaluator never comes the save fails, keeping it for a rerun to score."""
    import model.checkpoint

    store = CheckpointStore(small_disk(512 * 1024), keep_last=1, hold_unevaluated=2)

    def save(step: int) -> None:
        store.make_room(150 * 1024)
        (store.tmp_dir() / f"step{step:08d}").mkdir(parents=True)
        (store.tmp_dir() / f"step{step:08d}" / "w.bin").write_bytes(b"x" * 150 * 1024)
        store.commit(f"step{step:08d}", step, {})

    with caplog.at_level("WARNING", logger="model.checkpoint"):
        save(1), save(2), save(3)  # the third fits beside the two held ones
        threading.Timer(1.0, mark_evaluated, [store.root / "step00000001"]).start()
        save(4)  # no room until step 1 is scored: waits, then deletes it
        assert store.local_tags() == ["step00000002", "step00000003", "step00000004"] and not caplog.records

        monkeypatch.setattr(model.checkpoint, "EVAL_WAIT_S", 1.5)
        with pytest.raises(DiskFull, match=r"step00000002, step00000003 wait for the evaluator to score them\); free space"):
            store.make_room(150 * 1024)
    assert store.local_tags() == ["step00000002", "step00000003", "step00000004"] and not caplog.records


def fake_checkpoint(stage_dir: Path, step: int) -> Path:
    """A complete checkpoint folder as the store commits it: an HF export and a marker listing it."""
    folder = stage_dir / "checkpoints" / f"step{step:08d}"
    (folder / "hf").mkdir(parents=True)
    (folder / "hf" / "config.json").write_text(json.dumps({"step": step}))
    size = (folder / "hf" / "config.json").stat().st_size
    (folder / "checkpoint.json").write_text(json.dumps({"step": step, "tokens": 256 * step, "files": {"hf/config.json": size}}))
    return folder


def test_a_checkpoint_whose_step_commits_while_it_is_scored_is_found_where_it_went_scoring_stubbed(tmp_path, heldout, monkeypatch):
    """The follower scores checkpoints in the partial folder of the training step; the step's commit renames
    that folder at any moment. Both races are replayed deterministically: the commit during the scoring
    (lm-eval's child is stubbed to do the rename) and during the scan (between the marker check and the read)."""
    import tasks.evaluation.results as results

    graph = build_graph(parse_recipe(micro_recipe(), "micro")).steps
    step = next(s for s in graph if s.checkpoints)
    run = tmp_path / "run"
    partial, final = run / ".partial" / step.name, run / step.name
    fake_checkpoint(partial, 5)
    [model] = models_in_run(run, graph)
    assert model.path.startswith(str(partial))

    def commit_while_scoring(worker, jobs, abandon=None):
        partial.rename(final)
        return [{"metrics": {"smol_arithmetic_cf": {"acc": 0.5}}, "seconds": 0.1} for _ in jobs]

    monkeypatch.setattr(EvalWorker, "run", commit_while_scoring)
    ev = evaluator(tmp_path, heldout, EvalCfg(checkpoint_tasks=["smol_arithmetic_cf"], limit=2))
    summary = ev.run([model])
    assert summary.evaluated == [model.label] and not summary.failed
    [moved] = models_in_run(run, graph)
    assert moved.path.startswith(str(final)) and moved.fingerprint == model.fingerprint
    assert ev.task_groups(moved) == [], "its score is found at the new place, not computed again"

    run = tmp_path / "run2"
    partial, final = run / ".partial" / step.name, run / step.name
    fake_checkpoint(partial, 6)
    real = results.is_complete

    def commit_after_the_check(folder):
        complete = real(folder)
        if partial.exists():
            partial.rename(final)
        return complete

    monkeypatch.setattr(results, "is_complete", commit_after_the_check)
    assert models_in_run(run, graph) == [], "a checkpoint that moves mid-scan is left to the next scan"
    monkeypatch.setattr(results, "is_complete", real)
    assert [m.path for m in models_in_run(run, graph)] == [str(final / "checkpoints" / "step00000006" / "hf")]
    with pytest.raises(FileNotFoundError):
        local_fingerprint(partial / "checkpoints" / "step00000006" / "hf")


def test_report_card_from_a_run_dir(tmp_path):
    recipe = parse_recipe(micro_recipe(), "micro")
    run = tmp_path / "run"
    stage = run / "pretrain_phase1"
    (stage / "checkpoints" / "step00000005" / "hf").mkdir(parents=True)
    (stage / "checkpoints" / "step00000005" / "hf" / "config.json").write_text("{}")
    (stage / "checkpoints" / "step00000005" / "checkpoint.json").write_text(
        json.dumps({"step": 5, "tokens": 1280, "files": {"hf/config.json": 2}})
    )
    speed = {"mfu": 0.2, "peak_flops_per_rank": 5e10}
    (stage / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"phase": "phase1", "tokens": 256 * s, "loss": 6 - s / 10, "tokens_per_s": 900.0, "step_s": 0.3} | speed)
            for s in range(1, 6)
        )
    )

    def manifest(name: str, summary: Summary, seconds: float) -> None:
        (run / name).mkdir(exist_ok=True)
        record = {"name": name, "step_id": name[:3], "fingerprint": name, "seconds": seconds, "config": {}, "inputs": {}}
        record |= {"summary": summary.model_dump(mode="json"), "summary_schema": summary.schema_name()}
        (run / name / "manifest.json").write_text(json.dumps(record))

    def heldout(accuracy: float, tokens: float, by_family: dict[str, float], right: int = 0) -> HeldoutEval:
        kept = outcomes([f"p{i}" for i in range(40)], [float(i < right) for i in range(40)])  # the first RIGHT of 40 prompts
        spread = {"answered": 1.0, "by_family": by_family, "examples": [], "outcomes": kept}
        return HeldoutEval(items=40, accuracy=accuracy, mean_answer_tokens=tokens, **spread)

    phase = {"phase": "phase1", "steps": 5, "tokens": 1280, "seq_len": 256, "final_loss": 5.5, "stopped_early": False}
    manifest("pretrain_phase1", PhaseSummary(**phase, dropped_steps=[], failed_uploads=[], checkpoint_seconds=0.1), 12.0)
    sft_eval = heldout(0.25, 20.0, {"arithmetic": 0.5, "word_problem": 0.0}, right=10)
    manifest("sft", TrainedSummary(eval=sft_eval, eval_before=heldout(0.0, 40.0, {})), 30.0)
    manifest("apo", TrainedSummary(eval=heldout(0.2, 19.0, {"arithmetic": 0.4, "word_problem": 0.0}, right=8)), 9.0)
    counts = {"generated": 100, "contaminated": 0, "duplicates": 0, "train": 90, "heldout": 10, "sign_slips": 7}
    manifest("chat_data", ChatDataSummary(**counts, families={}, mixture_shortfalls=[]), 1.0)
    graph = build_graph(recipe)
    models = models_in_run(run, graph.steps)
    assert [(m.label, m.tokens) for m in models] == [("phase1/step00000005", 1280)]
    store = ResultStore(str(run / "evals" / "results"))
    cf = {"acc": 0.3, "acc_stderr": 0.04, "acc_norm": 0.2, "chance": 0.25}
    scores = {"smol_arithmetic_cf": cf, "smol_ppl_code": {"bits_per_byte": 2.5}}
    store.put(models[0], scores, dict.fromkeys(scores, "k"), 150, 3.0)

    card = build_report(run, recipe.name, graph.steps)
    text = card.path.read_text()
    assert [p.name for p in card.plots] == ["pretrain.png", "evals.png", "postrain.png", "wall_time.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in card.plots)
    assert "| phase1 | 5 | 1,280 | 5.500 | 900 | 0.30 | 20.0% | 50.0 GFLOP/s |" in text  # MFU with the peak it is against
    # what the eval plots draw: the point with its stderr, the chance line, the end of phase1
    cf = next(r for r in card.eval_rows if r["task"] == "smol_arithmetic_cf")
    assert (cf["value"], cf["stderr"], cf["chance"], cf["tokens"]) == (0.3, 0.04, 0.25, 1280)
    assert phase_ends([finished(run, graph.phases[0])]) == [("phase1", 1280)]
    assert "| phase1/step00000005 | 0.300 | 2.500 |" in text
    assert "| sft | 25.0% | arithmetic 50.0%, word_problem 0.0% |  | 20.0 |" in text  # per family, as the card shows it
    # each rung against the one below on the same prompts: 10 of 40 gained is beyond noise, 2 of 10 lost is not
    assert "| 20.0 | +25.0% [+12.5%, +40.0%], McNemar p=0.002: up |" in text
    assert "| 19.0 | -5.0% [-12.5%, +0.0%], McNemar p=0.5: within noise |" in text
    assert "drop the minus sign of 7 negative answers" in text  # a planted teacher flaw is said beside the ladder
    assert "**Held-out accuracy falls: apo is 5.0 points under sft.**" in text  # a rung that costs accuracy is said
    assert "base is" not in text and "sft is" not in text, "only a rung under the one below it"
    assert "**4 of 17 steps finished** (pretrain_phase1, chat_data, sft, apo)" in text
    assert "## Curation" in text and "_not run yet_" in text  # sections without data say so

    # the Prefect artifact carries the plots themselves (the UI serves no run files), reduced, at their size
    inlined = inline(card.markdown, card.path.parent)
    uris = re.findall(r"!\[[^\]]*\]\(data:image/png;base64,([^)]+)\)", inlined)
    assert len(uris) == len(card.plots) and not re.search(r"\]\((?!data:)", inlined), "every plot inside, no link left"
    for uri, plot in zip(uris, card.plots, strict=True):
        with Image.open(io.BytesIO(base64.b64decode(uri))) as sent, Image.open(plot) as kept:
            assert sent.size == kept.size
    assert sum(len(u) for u in uris) < sum(p.stat().st_size for p in card.plots), "smaller as base64 than the files"
    card.plots[0].unlink()
    with pytest.raises(SmolflowError, match="links plots/pretrain.png, which is not there"):
        inline(card.markdown, card.path.parent)

    # SFT rebuilt alone: the APO the run links was trained from the SFT it replaced. Not parent and child: no verdict
    record = json.loads((run / "apo" / "manifest.json").read_text())
    (run / "apo" / "manifest.json").write_text(json.dumps(record | {"lineage": [["sft", "old"]]}))
    text = build_report(run, recipe.name, graph.steps).markdown
    assert "| 19.0 | not compared: trained from another sft (out of date) |" in text and "falls" not in text
    (run / "apo" / "manifest.json").write_text(json.dumps(record | {"lineage": [["sft", "sft"]]}))  # trained from it
    assert "McNemar p=0.5: within noise |" in build_report(run, recipe.name, graph.steps).markdown


def test_a_task_without_documents_is_skipped_with_a_warning(tmp_path, heldout, caplog):
    empty = tmp_path / "heldout"
    (empty / "code").mkdir(parents=True)
    with gzip.open(empty / "code" / "00000.jsonl.gz", "wt"):
        pass  # datatrove leaves an empty shard when no document was set aside
    cfg = EvalCfg(checkpoint_tasks=["smol_arithmetic_cf", "smol_ppl_code"], limit=2)
    with caplog.at_level(logging.WARNING, logger="test"):
        ev = evaluator(tmp_path, empty, cfg)
    assert list(ev.no_data) == ["smol_ppl_code"] and "heldout_fraction" in caplog.text
    ref = ModelRef(str(tmp_path), "fp", "phase1/step00000005", "checkpoint", "phase1")
    assert ev.task_groups(ref) == [(["smol_arithmetic_cf"], False)]


def _checkpoints(scores_by_task: dict[str, list[float]], chance: dict[str, float], run: str = "r") -> list[dict]:
    """Result records of a run's checkpoints at 100, 200, ... tokens."""
    n = len(next(iter(scores_by_task.values())))
    records = []
    for i in range(n):
        tasks = {}
        for task, scores in scores_by_task.items():
            key = "bits_per_byte" if "ppl" in task else "acc"
            tasks[task] = {"metrics": {key: scores[i]} | ({"chance": chance[task]} if task in chance else {})}
        model = {"kind": "checkpoint", "tokens": 100 * (i + 1), "label": f"p/{i}"}
        records.append({"fingerprint": f"{run}{i}", "model": model, "tasks": tasks})
    return records


def test_the_audit_tells_tasks_with_early_signal_from_late_ones_and_from_noise_at_chance():
    import numpy as np

    from tasks.evaluation.audit import audit, audit_table

    rng = np.random.default_rng(0)
    steps = np.arange(1, 9)
    tasks = {
        "early_cf": list(0.25 + 0.05 * steps + rng.normal(0, 0.005, 8)),  # above chance from the second checkpoint
        "late_cf": list(0.25 + np.where(steps > 5, 0.1 * (steps - 5), 0) + rng.normal(0, 0.005, 8)),  # leaves chance at 6 of 8
        "flat_mcf": list(0.25 + rng.normal(0, 0.01, 8)),  # at chance the whole run
        "smol_ppl_code": list(3.0 - 0.2 * steps + rng.normal(0, 0.005, 8)),  # bits per byte: lower is better, no chance level
    }
    chance = {"early_cf": 0.25, "late_cf": 0.25, "flat_mcf": 0.25}
    found = {a.task: a for a in audit([_checkpoints(tasks, chance)])}
    assert found["early_cf"].verdict == "usable early" and found["early_cf"].monotonicity > 0.9
    assert found["late_cf"].verdict == "usable late"
    assert found["flat_mcf"].verdict == "no signal at this scale" and abs(found["flat_mcf"].above_chance) < 2
    assert found["smol_ppl_code"].verdict == "usable early" and found["smol_ppl_code"].snr > 0, "lower bits per byte is better"
    # three seeds: noise is their spread at each checkpoint; a task whose seeds swap order at every checkpoint ranks at random
    runs = []
    for seed in range(3):
        offset = {"early_cf": 0.01 * seed, "late_cf": 0.0, "flat_mcf": 0.0, "smol_ppl_code": 0.0}
        noisy = {t: [v + offset[t] + rng.normal(0, 0.002) for v in s] for t, s in tasks.items()}
        noisy["flat_mcf"] = [0.25 + rng.normal(0, 0.01) for _ in range(8)]
        runs.append(_checkpoints(noisy, chance, run=f"s{seed}"))
    seeded = {a.task: a for a in audit(runs)}
    assert seeded["early_cf"].runs == 3 and seeded["early_cf"].ranking > 0.9, "seed 2 > seed 1 > seed 0 at every checkpoint"
    assert seeded["flat_mcf"].ranking < 0.5 and seeded["flat_mcf"].verdict == "no signal at this scale"
    assert audit([_checkpoints(tasks, chance)] * 2)[0].runs == 1, "runs that share their checkpoints are one run"
    # two variants, one seed each, far apart and each climbing smoothly (math bits per byte with 10% vs 25% math):
    # their gap is the ablation's effect, not noise, and a climb through the last checkpoints is not noise either
    climb = 3.0 - 0.2 * steps
    apart = [_checkpoints({"smol_ppl_math": list(climb + gap + rng.normal(0, 0.005, 8))}, {}, run=r) for r, gap in (("a", 0.0), ("b", 0.4))]
    (math_bpb,) = audit(apart, ["math10", "math25"])
    assert math_bpb.verdict == "usable early" and math_bpb.noise < 0.02, math_bpb
    assert audit(apart)[0].noise > 0.25, "taken as seeds of one variant, the gap counts as noise"
    assert "| flat_mcf | acc | 8 x 1 |" in "\n".join(audit_table(list(found.values())))
    # a few items: rising from 0.25 to a 0.375 that repeats at the last checkpoints is within its standard error
    few = _checkpoints({"few_cf": [0.25, 0.25, 0.375, 0.375, 0.375, 0.375]}, {"few_cf": 0.25})
    for record in few:
        record["tasks"]["few_cf"]["metrics"]["acc_stderr"] = 0.17  # 8 items
    (small,) = audit([few])
    assert small.noise == 0.17 and small.verdict == "no signal at this scale", small
