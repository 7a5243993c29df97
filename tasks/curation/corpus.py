"""The embedded corpus: raw documents built from what every machine has, with no network.

Prose comes from the docstrings and comments of Python's standard library, code from its `.py`
files, math from generated arithmetic and word problems with worked answers. Everything is
deterministic for a given Python installation and seed: files are walked in sorted order and all
randomness comes from one seeded generator. Like real web data it holds junk (one-line docstrings,
generated tables, near-identical codec modules, repeated worksheets) for curation to remove.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gzip
import io
import json
import os
import random
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from infra.errors import Stopped
from infra.procs import STOPPING
from postrain.problems import arithmetic_problem, word_problem

DOMAINS = ("prose", "code", "math")


@dataclass(frozen=True)
class EmbeddedDoc:
    id: str
    text: str
    domain: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def stdlib_files(root: Path, max_bytes: int | None) -> tuple[Path, ...]:
    """Sorted `.py` files of the stdlib, up to `max_bytes` of source. site-packages (installed packages, not the stdlib:
    7x its files here) is never walked, as this runs each time the corpus step's identity is computed; and the walk is
    kept for the process (27 ms each, ~850 times a test suite): an installed stdlib does not change under a running
    process, and a changed file's content still changes the identity (its digest, curate.corpus_files)."""
    found = []
    for folder, dirs, names in os.walk(root):  # like rglob: symlinked folders are listed, not entered
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += (Path(folder, n) for n in names if n.endswith(".py"))
    files = sorted(p for p in found if p.is_file())
    if max_bytes is None:
        return tuple(files)
    kept, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        kept.append(path)
        total += size
    return tuple(kept)


def _read_source(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def docstrings_of(source: str) -> list[str]:
    """Docstrings of the module and every class and function, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    found = (ast.get_docstring(n, clean=True) for n in nodes)
    return [d for d in found if d]


def comment_blocks_of(source: str) -> list[str]:
    """Runs of consecutive comment lines, joined into paragraphs."""
    blocks, current, last_line = [], [], -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            if tok.start[0] != last_line + 1 and current:
                blocks.append(" ".join(current))
                current = []
            if text and not text.startswith("!"):
                current.append(text)
            last_line = tok.start[0]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    if current:
        blocks.append(" ".join(current))
    return [b for b in blocks if b]


def module_docs(root: Path, path: Path) -> list[EmbeddedDoc]:
    """One code document per module, one prose document of its docstrings, one of its comments."""
    source = _read_source(path)
    if source is None or not source.strip():
        return []
    rel = path.relative_to(root).as_posix()
    docs = [EmbeddedDoc(f"code/{rel}", source, "code")]
    if docstrings := docstrings_of(source):
        docs.append(EmbeddedDoc(f"prose/{rel}#doc", "\n\n".join(docstrings), "prose"))
    if comments := comment_blocks_of(source):
        docs.append(EmbeddedDoc(f"prose/{rel}#comments", "\n\n".join(comments), "prose"))
    return docs


def stdlib_docs(root: Path, max_bytes: int | None, workers: int = 1) -> Iterator[EmbeddedDoc]:
    """The documents of every module in file order, parsed by WORKERS processes (parsing and tokenizing 30 MB
    of source in pure Python is most of the corpus's time)."""
    files = stdlib_files(root, max_bytes)
    read = functools.partial(module_docs, root)
    with contextlib.ExitStack() as stack:
        if workers > 1:
            from tasks.curation.pipelines import process_pool  # datatrove's imports, only when a pool is asked for

            found = stack.enter_context(process_pool(workers)).imap(read, files, chunksize=16)
        else:
            found = map(read, files)
        for docs in tqdm(found, total=len(files), desc="stdlib modules", unit="file", mininterval=2, disable=len(files) < 200):
            if STOPPING.is_set():  # a signal while this runs in a thread beside the main one: the pool ends with the stack
                raise Stopped(f"{root}: parsing stopped by a signal")
            yield from docs


def math_problem(rng: random.Random, max_value: int) -> tuple[str, str, int]:
    make = arithmetic_problem if rng.random() < 0.6 else word_problem
    return make(rng, max_value)


def write_jsonl_gz(path: Path, docs: Iterator[EmbeddedDoc]) -> int:
    """Write documents as datatrove-style JSONL (`id`, `text`, `metadata`); returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    # mtime=0 keeps the gzip header, and so the file's fingerprint, deterministic
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for doc in docs:
            line = json.dumps({"id": doc.id, "text": doc.text, "metadata": {"domain": doc.domain}})
            gz.write(line.encode() + b"\n")
            count += 1
    return count


def eval_items(kind: str, n: int, seed: int, max_value: int) -> list[dict]:
    """Held-out math items; the corpus generator never emits their questions.

    Each has the exact `answer` (generative eval) and four `choices` with the index of the right
    one in `label` (cloze and lettered multiple-choice evals): distractors are near misses
    (off by one or ten), the mistakes a model that half-learned arithmetic makes.
    """
    make = arithmetic_problem if kind == "arithmetic" else word_problem
    rng, seen, items = random.Random(f"{kind}-{seed}"), set(), []
    while len(items) < n:
        question, _, answer = make(rng, max_value)
        if question not in seen:
            seen.add(question)
            choices = distractors(rng, answer) + [answer]
            rng.shuffle(choices)
            items.append(
                {"question": question, "answer": str(answer), "choices": [str(c) for c in choices], "label": choices.index(answer)}
            )
    return items


def distractors(rng: random.Random, answer: int, n: int = 3) -> list[int]:
    return [answer + d for d in rng.sample((-10, -2, -1, 1, 2, 10), n)]


def read_eval_questions(paths: list[str]) -> set[str]:
    questions = set()
    for path in paths:
        with open(path) as f:
            questions.update(json.loads(line).get("question", "") for line in f if line.strip())
    return questions


def build_corpus(
    stdlib: Path,
    stdlib_max_bytes: int | None,
    math_problems: int,
    problems_per_doc: int,
    max_value: int,
    seed: int,
    exclude_questions: set[str],
    out: Path,
    shards: int,
    workers: int = 1,
) -> dict[str, int]:
    """Write the embedded corpus as `out/DOMAIN/NNNNN.jsonl.gz` shards; returns documents per domain."""
    by_domain: dict[str, list[EmbeddedDoc]] = {d: [] for d in DOMAINS}
    for doc in stdlib_docs(stdlib, stdlib_max_bytes, workers):
        by_domain[doc.domain].append(doc)
    by_domain["math"] = list(math_docs(math_problems, problems_per_doc, max_value, seed, exclude_questions))
    counts = {}
    for domain, docs in by_domain.items():
        for shard in range(shards):
            write_jsonl_gz(out / domain / f"{shard:05d}.jsonl.gz", iter(docs[shard::shards]))
        counts[domain] = len(docs)
    return counts


def math_docs(n_problems: int, per_doc: int, max_value: int, seed: int, exclude: set[str]) -> Iterator[EmbeddedDoc]:
    """Worksheets of `per_doc` worked problems; a question in `exclude` (the eval sets) is never emitted."""
    rng = random.Random(seed)
    made = 0
    sheet: list[str] = []
    index = 0
    while made < n_problems:
        question, solution, _ = math_problem(rng, max_value)
        if question in exclude:
            continue
        sheet.append(f"Problem: {question}\nSolution: {solution}")
        made += 1
        if len(sheet) == per_doc or made == n_problems:
            yield EmbeddedDoc(f"math/sheet-{index:06d}", "\n\n".join(sheet), "math")
            sheet, index = [], index + 1
