"""Curation steps on planted data, through real datatrove executors (no Prefect)."""

from __future__ import annotations

import gzip
import json
import random
import shutil

import numpy as np
import pytest

from infra.recipe import RecipeError, parse_recipe
from infra.steps import fingerprint_tree
from tasks.curation import pipelines, tokenizer
from tasks.curation.mixtures import MixtureError, resolve_mixtures, split_budget
from tasks.pretrain import mixture_phases
from tests.helpers import REPO, micro_recipe, survivors, write_jsonl

WORDS = [f"w{i}" + "abcdefghij"[i % 10] * (i % 4 + 1) for i in range(3000)]


def unique_doc(rng: random.Random, n_words: int = 200) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def shingles(text: str, n: int = 5) -> set:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def web_recipe(path, **changes):
    data = micro_recipe(**changes)
    data["sources"] = [{"name": "web", "domain": "web", "format": "jsonl", "path": str(path)}]
    data["curate"]["filters"] = {"web": {}}
    for stage in data["pretrain"]["phases"]:
        stage["mixture"] = {"web": 1.0}
    return parse_recipe(data, "test recipe")


def read_ids(folder) -> list[str]:
    ids = []
    for path in sorted(folder.rglob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            ids += [json.loads(line)["id"] for line in f]
    return ids


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """40 unique documents, 6 exact copies, 8 near copies (Jaccard >= 0.9), 3 with a long eval item inside,
    3 with a short one, 2 with a short one's operator changed."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("planted")
    uniques = [unique_doc(rng) for _ in range(40)]
    records = [{"id": f"u{i}", "text": t} for i, t in enumerate(uniques)]
    records += [{"id": f"exact{i}", "text": uniques[i]} for i in range(6)]
    near = []
    for i in range(8):
        words = uniques[10 + i].split()
        words[rng.randrange(len(words))] = "changed"
        near.append(" ".join(words))
        assert jaccard(near[-1], uniques[10 + i]) >= 0.9
    records += [{"id": f"near{i}", "text": t} for i, t in enumerate(near)]
    evals = [json.loads(line) for line in (REPO / "configs/evals/word_problems.jsonl").read_text().splitlines()]
    records += [
        {"id": f"leak{i}", "text": unique_doc(rng, 60) + " " + evals[i * 7]["question"] + " " + unique_doc(rng, 60)} for i in range(3)
    ]
    # arithmetic items are 4 words, too short for the 14-gram index: 3 planted whole, 2 with another operator
    sums = [json.loads(line)["question"] for line in (REPO / "configs/evals/arithmetic.jsonl").read_text().splitlines()]
    products = [q for q in sums if " * " in q]
    others = [q.replace(" * ", " - ") for q in products if q.replace(" * ", " - ") not in sums][:2]
    records += [{"id": f"short{i}", "text": unique_doc(rng, 60) + " " + products[i] + " " + unique_doc(rng, 60)} for i in range(3)]
    records += [{"id": f"other{i}", "text": unique_doc(rng, 60) + " " + q + " " + unique_doc(rng, 60)} for i, q in enumerate(others)]
    rng.shuffle(records)
    write_jsonl(root / "raw" / "part0.jsonl", records[: len(records) // 2])
    write_jsonl(root / "raw" / "part1.jsonl", records[len(records) // 2 :])
    recipe = web_recipe(root / "raw")
    ex = recipe.executor
    steps = {name: root / name for name in ("ingest", "filter", "dedup", "decont")}
    pipelines.ingest(recipe.sources, {"web": str(root / "raw")}, ex, recipe.storage.s3, False, steps["ingest"])
    pipelines.filter_docs({"web": {}}, ex, steps["ingest"], steps["filter"])
    summary = pipelines.dedup(recipe.curate.dedup, ex, steps["filter"], steps["dedup"])
    decont = pipelines.decontaminate(recipe.curate.decontaminate, ex, steps["dedup"], steps["decont"])
    return {"recipe": recipe, "root": root, "steps": steps, "dedup": summary, "decont": decont, "records": records}


def test_exact_and_near_duplicates_are_removed(planted):
    kept = set(read_ids(planted["steps"]["dedup"] / "data"))
    dups = {r["id"] for r in planted["records"] if r["id"].startswith(("exact", "near"))}
    uniques = {r["id"] for r in planted["records"] if r["id"].startswith("u")}
    # of each duplicate pair exactly one copy survives, and no unique document is lost
    assert uniques <= kept | {f"u{i}" for i in range(6)} | {f"u{10 + i}" for i in range(8)}
    for i in range(6):
        assert len({f"u{i}", f"exact{i}"} & kept) == 1
    for i in range(8):
        assert len({f"u{10 + i}", f"near{i}"} & kept) == 1
    assert len(kept & (uniques | dups)) == 40
    assert planted["dedup"]["removed"] == {"exact": 6, "minhash": 8}
    stages = ["exact-signatures", "exact-find", "exact-filter"]
    stages += ["minhash-signatures", "minhash-buckets", "minhash-cluster", "minhash-filter"]
    assert list(planted["dedup"]["seconds"]) == stages  # each stage timed, in the order it ran
    assert all(s > 0 for s in planted["dedup"]["seconds"].values())


def test_planted_eval_items_are_removed(planted):
    """Long items by their 14-grams; items shorter than that by their exact words, symbols kept."""
    kept = read_ids(planted["steps"]["decont"] / "data")
    assert not [i for i in kept if i.startswith(("leak", "short"))]
    assert planted["decont"]["hits"] == {"word_problems": 3, "arithmetic": 3}
    assert planted["decont"]["hits_short"] == {"arithmetic": 3}
    assert planted["decont"]["indexed_ngrams"]["arithmetic"] == {"items": 300, "ngrams": 0, "short_items": 300}
    assert sorted(i for i in kept if i.startswith("other")) == ["other0", "other1"]  # "68 - 8" is not "68 * 8"
    assert len(kept) == 42


def test_curated_files_are_the_same_bytes_wherever_and_whenever_they_are_built(planted, tmp_path):
    """A step's id hashes its inputs' bytes. Documents carried the absolute path they were read from (datatrove's
    `file_path`), gzip headers the time of writing and token files the tokenizer's path: each run dir, checkout and
    rebuild gave the steps from `filter` on ids of their own, so no store could share them."""
    recipe = planted["recipe"]
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(planted["root"] / "raw", elsewhere / "raw")
    ingested = elsewhere / "ingest"
    pipelines.ingest(recipe.sources, {"web": str(elsewhere / "raw")}, recipe.executor, recipe.storage.s3, False, ingested)
    pipelines.filter_docs({"web": {}}, recipe.executor, ingested, elsewhere / "filter")
    for step in ("ingest", "filter"):
        assert fingerprint_tree(elsewhere / step) == fingerprint_tree(planted["steps"][step]), step
    with gzip.open(next((ingested / "data").rglob("*.jsonl.gz")), "rt") as f:
        assert json.loads(f.readline())["metadata"]["file"] in {"part0.jsonl", "part1.jsonl"}  # provenance, relative
    texts = tokenizer.sample_texts([planted["steps"]["decont"] / "data" / "web"], 10**9)
    tok = tokenizer.train_bpe(texts, vocab_size=400, min_frequency=2)
    tokenized = []
    for where in ("here", "there"):
        tokenizer.save_hf(tok, tmp_path / where / "tok")
        c = recipe.curate
        args = ["web"], recipe.executor, recipe.seed, c.heldout_fraction, planted["steps"]["decont"]
        pipelines.tokenize(*args, tmp_path / where / "tok" / "tokenizer.json", tmp_path / where / "tokenized")
        tokenized.append(fingerprint_tree(tmp_path / where / "tokenized"))
    assert tokenized[0] == tokenized[1]


def test_tokenized_data_reads_back_to_the_same_text(planted, tmp_path):
    recipe, decont = planted["recipe"], planted["steps"]["decont"]
    texts = tokenizer.sample_texts([decont / "data" / "web"], 10**9)
    tokenizer.save_hf(tokenizer.train_bpe(texts, vocab_size=400, min_frequency=2), tmp_path / "tok")
    c = recipe.curate
    summary = pipelines.tokenize(
        ["web"], recipe.executor, recipe.seed, c.heldout_fraction, decont, tmp_path / "tok" / "tokenizer.json", tmp_path / "tokenized"
    )
    from transformers import AutoTokenizer  # here, not at the top: every xdist worker imports every test module (3.4 CPU s)

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ds = next((tmp_path / "tokenized" / "data" / "web").glob("*.ds"))
    tokens = np.fromfile(ds, dtype=np.uint16)
    ends = np.fromfile(str(ds) + ".index", dtype=np.uint64)
    decoded = {tok.decode(tokens[a:b].tolist()) for a, b in zip([0, *ends[:-1]], ends)}
    originals = set()
    for path in (decont / "data" / "web").glob("*.jsonl.gz"):
        with gzip.open(path, "rt") as f:
            originals |= {json.loads(line)["text"] + tokenizer.EOS for line in f}
    heldout = set()
    for path in (tmp_path / "tokenized" / "heldout" / "web").glob("*.jsonl.gz"):
        with gzip.open(path, "rt") as f:
            heldout |= {json.loads(line)["text"] + tokenizer.EOS for line in f}
    # every document is either trained on or held out for perplexity evals, never both, never neither
    assert heldout and not decoded & heldout and decoded | heldout == originals
    assert summary["sources"]["web"] == {"tokens": len(tokens), "docs": len(ends), "heldout_docs": len(heldout)}


def test_chat_template_marks_assistant_turns_with_trailing_newline(tmp_path):
    bpe = tokenizer.train_bpe(iter(["hello there, how are you? fine thanks"] * 50), vocab_size=300, min_frequency=1)
    tok = tokenizer.save_hf(bpe, tmp_path)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    out = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    marked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert marked == "hello<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "".join(tok.convert_ids_to_tokens(tok("1234")["input_ids"])) == "1234"
    assert len(tok("1234")["input_ids"]) == 4  # digits split one per token


def test_mixture_counts_match_weights():
    counts = split_budget(1001, {"a": 0.5, "b": 0.3, "c": 0.2})
    assert sum(counts.values()) == 1001 and counts == {"a": 501, "b": 300, "c": 200}
    recipe = parse_recipe(micro_recipe(), "micro")
    manifest = resolve_mixtures(mixture_phases(recipe.pretrain), 4, {"prose": 10_000, "code": 10_000, "math": 10_000})
    for stage, cfg in zip(manifest["phases"], recipe.pretrain.phases):
        drawn = {k: v["tokens"] for k, v in stage["sources"].items()}
        assert sum(drawn.values()) == cfg.tokens
        for source, weight in cfg.mixture.items():
            assert abs(drawn[source] - weight * cfg.tokens) <= 1


def test_repeating_a_small_source_warns_then_fails():
    recipe = parse_recipe(micro_recipe(**{"pretrain.phases.0.tokens": 2000}), "micro")
    # math draws 200 + 600 + 800 + 200 tokens over the four phases
    phases, epochs = mixture_phases(recipe.pretrain), recipe.pretrain.max_epochs
    manifest = resolve_mixtures(phases, epochs, {"prose": 10_000, "code": 10_000, "math": 600})
    assert manifest["warnings"] == [
        "phase2: math repeated 1.33x so far (800 of 600 tokens)",
        "phase3: math repeated 2.67x so far (1,600 of 600 tokens)",
        "long_context: math repeated 3.00x so far (1,800 of 600 tokens)",
    ]
    with pytest.raises(MixtureError, match=r"phases\[2\] \(phase3\): source 'math' would be repeated 4.6 times"):
        resolve_mixtures(phases, epochs, {"prose": 10_000, "code": 10_000, "math": 350})


def test_executor_construction_for_clusters(tmp_path):
    from datatrove.executor import RayPipelineExecutor, SlurmPipelineExecutor

    recipe = parse_recipe(
        micro_recipe(executor={"kind": "slurm", "tasks": 64, "workers": 8, "slurm": {"partition": "hopper-cpu", "time": "02:00:00"}}), "m"
    )
    ex = pipelines.make_executor(recipe.executor, [], tmp_path / "logs", 64, "filter-web")
    assert isinstance(ex, SlurmPipelineExecutor)
    name = pipelines.slurm_job_name("filter-web", tmp_path / "logs")
    assert (ex.tasks, ex.partition, ex.time, ex.job_name) == (64, "hopper-cpu", "02:00:00", name)
    assert ex.venv_path.endswith("bin/activate")
    assert ex.tasks_per_job == 1, "datatrove's default: one array job a shard"
    recipe = parse_recipe(micro_recipe(executor={"kind": "ray", "tasks": 16, "workers": 4, "tasks_per_job": 3}), "m")
    ray = pipelines.make_executor(recipe.executor, [], tmp_path / "ray-logs", 16, "dedup")
    assert isinstance(ray, RayPipelineExecutor) and (ray.tasks, ray.workers, ray.tasks_per_job) == (16, 4, 3)
    # 'even': each of `workers` jobs runs its share, whatever a pipeline's shards (minhash buckets: 14)
    even = parse_recipe(micro_recipe(executor={"kind": "slurm", "tasks": 2, "workers": 4, "tasks_per_job": "even"}), "m").executor
    assert [pipelines.tasks_per_job(even, n) for n in (2, 4, 14)] == [1, 1, 4]
    with pytest.raises(RecipeError, match="executor.tasks_per_job"):
        parse_recipe(micro_recipe(executor={"tasks_per_job": 0}), "m")


def test_a_failed_ranks_slurm_output_is_that_of_the_job_that_ran_it_in_the_last_launch(tmp_path):
    """datatrove numbers a launch's array jobs by position in its ranks_to_run.json, tasks_per_job ranks a job: job
    RANK's output was another rank's, or an earlier launch's (the error's log tail was `*_RANK.out`)."""
    ex = parse_recipe(micro_recipe(executor={"kind": "slurm", "tasks": 8, "workers": 4, "tasks_per_job": 2}), "m").executor
    logs = tmp_path / "logs"
    executor = pipelines.make_executor(ex, [], logs, 8, "filter-web")
    (logs / "slurm_logs").mkdir(parents=True)
    for job, ranks in ((100, [0, 1, 2, 3, 4, 5, 6, 7]), (200, [1, 5, 6])):  # a launch, then the retry of 3 ranks
        (logs / "ranks_to_run.json").write_text(json.dumps(ranks))
        for index in range(len(ranks) // 2 + len(ranks) % 2):
            (logs / "slurm_logs" / f"{job}_{index}.out").write_text(f"job {job}: ranks {ranks[2 * index : 2 * index + 2]}\n")

    def tail(rank: int) -> str:
        return pipelines._rank_log_tail(logs, rank, pipelines._slurm_outputs(executor, rank))

    assert [tail(rank).splitlines()[-1] for rank in (1, 5, 6)] == ["job 200: ranks [1, 5]"] * 2 + ["job 200: ranks [6]"]
    assert tail(2) == f"(no log under {logs})", "rank 2 was not launched last time: no job's output is its own"
    (logs / "logs").mkdir()
    (logs / "logs" / "task_00005.log").write_text("rank 5 logged this\n")
    assert tail(5).endswith("rank 5 logged this"), "its own log first"


def test_minhash_signatures_hash_the_same_shingles_as_datatrove():
    """The faster signature step (no diacritics pass on ASCII text) must find exactly datatrove's shingles."""
    import numpy as np
    from datatrove.pipeline.dedup import MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.text import TextNormConfig

    from tasks.curation.words import SPLIT_WORDS

    cfg = MinhashConfig(n_grams=5, norm_config=TextNormConfig(norm_numbers=False))
    theirs, ours = (cls("unused", config=cfg, language=SPLIT_WORDS) for cls in (MinhashDedupSignature, pipelines.Signatures))
    texts = ["Plain ASCII, with punctuation; and 42 numbers in it (here).", "Déjà vu: a naïve café résumé — with accents, ñ and ü."]
    texts += ["one two", (REPO / "README.md").read_text()[:5000]]
    for text in texts:
        assert np.array_equal(theirs.get_shingles(text), ours.get_shingles(text)), text[:40]
    assert len(ours.get_shingles(texts[1])) > 0 and len(ours.get_shingles(texts[2])) == 0


def _slow_rank(data, rank: int, world_size: int, folder: str):
    """A pipeline step that says it started (its pid, in FOLDER), then works for a minute. (FOLDER is an argument:
    the pool's workers come from a forkserver that an earlier test may have started, with that test's environment.)"""
    import os
    import time
    from pathlib import Path

    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)
    return data


def test_a_stopping_process_interrupts_its_local_curation_workers_and_keeps_completed_ranks(tmp_path):
    """A signal reaches an ablation's curation thread only as STOPPING: the pool's ranks in flight are interrupted,
    no further rank starts, and nothing is marked complete that did not finish."""
    import functools
    import threading
    import time

    from infra.errors import Stopped
    from infra.procs import STOPPING
    from infra.recipe import ExecutorCfg

    slow = functools.partial(_slow_rank, folder=str(tmp_path))
    executor = pipelines.make_executor(ExecutorCfg(kind="local", workers=2), [slow], tmp_path / "logs", 4, "slow")
    raised: list[BaseException] = []
    thread = threading.Thread(target=lambda: raised.extend(_raises(executor.run)))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2, "two ranks run at once"
        STOPPING.set()
        thread.join(20)
        assert not thread.is_alive(), "the executor returned within seconds, not after its ranks' minute"
        assert len(raised) == 1 and isinstance(raised[0], Stopped)
        assert sorted(p.name for p in tmp_path.glob("*.pid")) == sorted(f"{r}.pid" for r in range(2)), "no third rank started"
        assert not any(executor.is_rank_completed(r) for r in range(4))
        assert not survivors(pids, 5), "workers ended"
    finally:
        STOPPING.clear()
        thread.join(70)


def _raises(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return [err]
    return []
