"""The embedded corpus is deterministic and never emits an eval question."""

from __future__ import annotations

import gzip
import json
import os

import infra.storage
from infra.storage import fingerprint_files
from tasks.curation import corpus
from tests.helpers import REPO


def build(out, exclude=frozenset(), workers=1):
    return corpus.build_corpus(
        corpus.stdlib_root(), 300_000, 240, 12, 99, seed=7, exclude_questions=set(exclude), out=out, shards=2, workers=workers
    )


def test_corpus_is_deterministic_with_any_number_of_workers(tmp_path):
    counts_a, counts_b = build(tmp_path / "a"), build(tmp_path / "b", workers=2)
    assert counts_a == counts_b and all(counts_a[d] > 0 for d in corpus.DOMAINS)
    files = lambda root: [(p.relative_to(root).as_posix(), p) for p in sorted(root.rglob("*.jsonl.gz"))]  # noqa: E731
    assert fingerprint_files(files(tmp_path / "a")) == fingerprint_files(files(tmp_path / "b"))


def test_the_stdlib_walk_leaves_out_site_packages_and_does_not_enter_linked_folders(tmp_path):
    for rel in ("a.py", "pkg/b.py", "pkg/deep/c.py", "site-packages/x.py", "pkg/site-packages/y.py", "notes.txt", "d.py/e.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "linked").symlink_to(tmp_path / "pkg", target_is_directory=True)
    found = [p.relative_to(tmp_path).as_posix() for p in corpus.stdlib_files(tmp_path, None)]
    assert found == ["a.py", "d.py/e.py", "pkg/b.py", "pkg/deep/c.py"]


def test_a_fingerprint_reads_a_file_again_exactly_when_its_stat_changed(tmp_path, monkeypatch):
    path, reads = tmp_path / "a.txt", []
    path.write_text("one")
    read = infra.storage.file_digest
    monkeypatch.setattr(infra.storage, "file_digest", lambda p, algorithm="sha256": reads.append(p) or read(p, algorithm))
    first = fingerprint_files([("a", path)])
    assert fingerprint_files([("a", path)]) == first and len(reads) == 2, "a file changed within the racy window is read each time"
    monkeypatch.setattr(infra.storage, "RACY_NS", 0)  # as if written long ago
    fingerprint_files([("a", path)])
    assert fingerprint_files([("a", path)]) == first and len(reads) == 3, "an unchanged file is read once"
    before = path.stat()
    path.write_text("two")  # the same size, and its old mtime put back: only ctime tells
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert fingerprint_files([("a", path)]) != first and len(reads) == 4


def test_prose_comes_from_docstrings_and_comments():
    source = 'def f():\n    """Add two numbers and return the sum."""\n    # carry the overflow\n    # into the next digit\n    return 1\n'
    assert corpus.docstrings_of(source) == ["Add two numbers and return the sum."]
    assert corpus.comment_blocks_of(source) == ["carry the overflow into the next digit"]
    assert corpus.docstrings_of("def broken(:\n") == []


def test_generated_math_skips_eval_questions(tmp_path):
    evals = [REPO / "configs" / "evals" / "arithmetic.jsonl", REPO / "configs" / "evals" / "word_problems.jsonl"]
    questions = corpus.read_eval_questions([str(p) for p in evals])
    assert len(questions) == 600
    build(tmp_path, exclude=questions)
    texts = []
    for path in (tmp_path / "math").glob("*.jsonl.gz"):
        with gzip.open(path, "rt") as f:
            texts += [json.loads(line)["text"] for line in f]
    emitted = {line.removeprefix("Problem: ") for t in texts for line in t.splitlines() if line.startswith("Problem: ")}
    assert len(emitted) > 100 and not emitted & questions


def test_shipped_eval_sets_are_reproducible():
    for kind in ("arithmetic", "word_problems"):
        shipped = [json.loads(line) for line in (REPO / "configs" / "evals" / f"{kind}.jsonl").read_text().splitlines()]
        assert shipped == corpus.eval_items(kind, 300, seed=2026, max_value=99)


def test_the_stdlib_is_walked_once_a_process(tmp_path, monkeypatch):
    """Every identity of the corpus step lists the stdlib (27 ms): the listing is kept, not walked again."""
    walks, walk = [], os.walk
    monkeypatch.setattr(os, "walk", lambda root: walks.append(root) or walk(root))
    (tmp_path / "a.py").write_text("x = 1\n")
    assert corpus.stdlib_files(tmp_path, None) == corpus.stdlib_files(tmp_path, None) == (tmp_path / "a.py",)
    assert walks == [tmp_path]
