"""Benchmark: the project's near-dedup (datatrove MinHash, 4 stages) vs a datasketch MinHashLSH baseline.

One generated corpus of unique documents plus planted near-duplicates at known Jaccard
similarities; both deduplicate it in the same run, and the figures are printed side by side as
ratios (absolute times on a shared 2-core machine are noise). Usage:

    .venv/bin/python bench/curate.py [--docs 3000] [--words 300]
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasketch import MinHash, MinHashLSH  # noqa: E402
from datatrove.utils.text import TextNormConfig, simplify_text  # noqa: E402

from infra.env import apply_offline_defaults  # noqa: E402
from infra.recipe import load_recipe  # noqa: E402
from tasks.curation import pipelines  # noqa: E402

TARGETS = (0.95, 0.9, 0.85, 0.8, 0.7)


def shingles(text: str, n: int = 5) -> set[str]:
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def near_copy(rng: random.Random, text: str, target: float, vocab: list[str]) -> str:
    """Replace scattered words until the 5-gram Jaccard similarity falls just below `target` + 0.05."""
    words = text.split()
    while True:
        words[rng.randrange(len(words))] = rng.choice(vocab)
        candidate = " ".join(words)
        if jaccard(candidate, text) < target + 0.05:
            return candidate


def make_corpus(n_docs: int, n_words: int, seed: int):
    """Unique Zipfian documents, and for a quarter of them one near copy at each target similarity band."""
    rng = random.Random(seed)
    vocab = [f"t{i}" for i in range(20_000)]
    weights = [1 / (i + 1) for i in range(len(vocab))]
    uniques = [" ".join(rng.choices(vocab, weights, k=n_words)) for _ in range(n_docs)]
    docs = [{"id": f"u{i}", "text": t} for i, t in enumerate(uniques)]
    planted = {}  # dup id -> (original id, measured jaccard)
    for i in range(0, n_docs, 4):
        target = TARGETS[(i // 4) % len(TARGETS)]
        text = near_copy(rng, uniques[i], target, vocab)
        dup_id = f"d{i}"
        docs.append({"id": dup_id, "text": text})
        planted[dup_id] = (f"u{i}", jaccard(text, uniques[i]))
    rng.shuffle(docs)
    return docs, planted


def _signature(args: tuple[str, int, int]):
    text, num_perm, n_grams = args
    words = simplify_text(text, TextNormConfig(norm_numbers=False)).split()
    m = MinHash(num_perm=num_perm, seed=1)
    m.update_batch([" ".join(words[i : i + n_grams]).encode() for i in range(len(words) - n_grams + 1)])
    return m


def datasketch_dedup(docs: list[dict], bands: int, rows: int, n_grams: int, cores: int) -> set[str]:
    """Baseline: MinHash signatures on CORES processes (as many as the project's workers), then an in-memory
    MinHashLSH with the same banding, keeping the first document of each match."""
    with multiprocessing.get_context("fork").Pool(cores) as pool:
        signatures = pool.map(_signature, [(d["text"], bands * rows, n_grams) for d in docs], chunksize=64)
    lsh = MinHashLSH(num_perm=bands * rows, params=(bands, rows))
    removed = set()
    for doc, m in zip(docs, signatures):
        if lsh.query(m):
            removed.add(doc["id"])
        else:
            lsh.insert(doc["id"], m)
    return removed


def project_dedup(docs: list[dict], workdir: Path, tasks: int) -> set[str]:
    raw = workdir / "raw"
    raw.mkdir(parents=True)
    for i, part in enumerate((docs[: len(docs) // 2], docs[len(docs) // 2 :])):
        (raw / f"part{i}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))
    web = f"[{{name: web, domain: web, format: jsonl, path: {raw}}}]"
    phases = [f"pretrain.phases.{i}.mixture={{web: 1.0}}" for i in range(4)]
    overrides = [
        f"sources={web}",
        "curate.filters={web: {}}",
        f"executor.tasks={tasks}",
        f"executor.workers={tasks}",
        "curate.dedup.exact=false",
    ]
    recipe = load_recipe(REPO / "configs" / "micro.yaml", overrides + phases)
    ex = recipe.executor
    pipelines.ingest(recipe.sources, {"web": str(raw)}, ex, recipe.storage.s3, False, workdir / "ingest")
    pipelines.filter_docs({"web": {}}, ex, workdir / "ingest", workdir / "filter")
    start = time.perf_counter()
    summary = pipelines.dedup(recipe.curate.dedup, ex, workdir / "filter", workdir / "dedup")
    seconds = time.perf_counter() - start
    removed = set()
    for path in (workdir / "dedup" / "removed").rglob("*.jsonl.gz"):
        with gzip.open(path, "rt") as f:
            removed |= {json.loads(line)["id"] for line in f}
    return removed, seconds, summary["seconds"]


def scores(removed: set[str], planted: dict) -> dict:
    """Precision over removed documents; recall per similarity band (a pair counts once either copy goes)."""
    caught = {d for d, (orig, _) in planted.items() if d in removed or orig in removed}
    true_removed = {x for x in removed if x in planted or any(x == o for o, _ in planted.values())}
    bands = {}
    for target in TARGETS:
        members = [d for d, (_, j) in planted.items() if target <= j < target + 0.05]
        bands[target] = (sum(d in caught for d in members) / len(members)) if members else float("nan")
    return {"precision": len(true_removed) / len(removed) if removed else 1.0, "recall": len(caught) / len(planted), "bands": bands}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--words", type=int, default=300)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores both sides run on (default: all)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[: args.cores]
    os.sched_setaffinity(0, cores)  # inherited by both sides' worker processes
    args.tasks = len(cores)
    apply_offline_defaults()
    docs, planted = make_corpus(args.docs, args.words, seed=0)
    print(f"corpus: {len(docs)} documents ({args.docs} unique + {len(planted)} planted near copies), {args.words} words each")

    start = time.perf_counter()
    base_removed = datasketch_dedup(docs, bands=14, rows=8, n_grams=5, cores=args.tasks)
    base_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        ours_removed, ours_s, stages = project_dedup(docs, Path(tmp), args.tasks)

    base, ours = scores(base_removed, planted), scores(ours_removed, planted)
    print(f"\n{'':28}{'datasketch LSH':>16}{'smolflow':>12}{'ratio':>8}")
    print(f"{'docs/s':28}{len(docs) / base_s:16,.0f}{len(docs) / ours_s:12,.0f}{base_s / ours_s:8.2f}x")
    print(f"{'precision':28}{base['precision']:16.3f}{ours['precision']:12.3f}")
    print(f"{'recall (all planted)':28}{base['recall']:16.3f}{ours['recall']:12.3f}")
    for target in TARGETS:
        print(f"{f'recall, Jaccard {target:.2f}-{target + 0.05:.2f}':28}{base['bands'][target]:16.3f}{ours['bands'][target]:12.3f}")
    print("\nsmolflow's wall time per datatrove stage: " + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()))
    print(
        f"\nBoth on cores {cores}: smolflow = datatrove MinHash (4 stages, {args.tasks} worker process(es), JSONL in and out); "
        f"baseline = datasketch signatures on {args.tasks} process(es), then MinHashLSH in memory; same 14x8 banding, 5-grams."
    )


if __name__ == "__main__":
    main()
