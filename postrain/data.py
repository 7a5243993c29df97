"""Chat data for post-training: generated offline for the tiny recipe, from the hub for the real one.

Every example has `prompt` (the user turn), `messages` (prompt + assistant answer, for SFT) and
`answer` (the verifiable final answer, for accuracy, preference filtering and GRPO rewards).
Prompts are deduplicated with datasketch's MinHashLSH and decontaminated against the eval sets.
"""

from __future__ import annotations

import builtins
import json
import keyword
import random
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from infra.recipe import Family
from postrain.problems import arithmetic_problem, word_problem

if TYPE_CHECKING:  # datasketch (1.2 s of imports) is loaded by the post-training stage only, not by every flow process
    from datasketch import MinHash

ANSWER = re.compile(r"answer is\s+(-?[\w']+)", re.IGNORECASE)
WORDS = sorted({w.lower() for w in dir(builtins) + keyword.kwlist if w.isalpha() and 3 <= len(w) <= 10})


def _arithmetic(rng: random.Random, max_value: int, operators: str) -> tuple[str, str, str]:
    question, solution, answer = arithmetic_problem(rng, max_value, operators)
    return question, solution, str(answer)


def _word_problem(rng: random.Random, max_value: int, _: str) -> tuple[str, str, str]:
    question, solution, answer = word_problem(rng, max_value)
    return question, solution, str(answer)


def _reverse(rng: random.Random, *_: object) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word '{word}'.", f"'{word}' backwards is '{word[::-1]}'. The answer is {word[::-1]}.", word[::-1]


def _count_letters(rng: random.Random, *_: object) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    return (
        f"How many letters are in the word '{word}'?",
        f"The word '{word}' has {len(word)} letters. The answer is {len(word)}.",
        str(len(word)),
    )


FAMILIES: dict[str, Callable[[random.Random, int, str], tuple[str, str, str]]] = {
    "arithmetic": _arithmetic,
    "word_problem": _word_problem,
    "reverse_word": _reverse,
    "count_letters": _count_letters,
}
assert set(FAMILIES) == set(get_args(Family)), "infra/recipe.py Family lists the families generated here"


def example(question: str, solution: str, answer: str, family: str) -> dict[str, Any]:
    user = {"role": "user", "content": question}
    return {"prompt": [user], "messages": [user, {"role": "assistant", "content": solution}], "answer": answer, "family": family}


def generate(n: int, families: dict[str, float], max_value: int, seed: int, operators: str = "+-*") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    names, weights = list(families), list(families.values())
    out = []
    for _ in range(n):
        family = rng.choices(names, weights)[0]
        out.append(example(*FAMILIES[family](rng, max_value, operators), family))
    return out


def mixture_shortfalls(counts: dict[str, int], families: dict[str, float], least: float = 0.8) -> list[str]:
    """A line per generated family whose share of the generated chats (COUNTS by family; hub chats aside) is
    under `least` x the recipe's share.

    Deduplication thins a family whose problem space is small (arithmetic up to 49 has 5,000 distinct
    questions): the training mix then drifts from the recipe without an error, and with it what SFT learns.
    """
    total, asked = sum(counts.get(f, 0) for f in families), sum(families.values())
    return [
        f"{family}: {counts.get(family, 0) / total:.0%} of the training chats, the recipe asks {weight / asked:.0%} "
        "(deduplication ran out of distinct problems: raise max_value or lower generated)"
        for family, weight in families.items()
        if total and counts.get(family, 0) / total < least * weight / asked
    ]


def plant_sign_slips(items: list[dict[str, Any]], share: float, seed: int) -> int:
    """Drop the minus sign from the final answer of `share` of the negative answers' solutions; return how many.

    Distilled SFT data carries its teacher's systematic mistakes, which SFT copies and only a verifier can
    catch. The tiny recipe plants one such flaw so the demo shows what GRPO's correctness reward undoes;
    `answer` keeps the true value, so the preference filter and the reward still check against it.
    """
    rng, planted = random.Random(seed), 0
    for item in items:
        if item["family"] in FAMILIES and item["answer"].startswith("-") and rng.random() < share:
            last = item["messages"][-1]
            last["content"] = last["content"].replace(f"The answer is {item['answer']}.", f"The answer is {item['answer'][1:]}.")
            planted += 1
    return planted


def sign_slips_note(count: int) -> str:
    """What a reader of a card or report must know about the planted flaw, in one wording for both."""
    return (
        f"The SFT data was flawed on purpose: its solutions drop the minus sign of {count:,} negative answers "
        "(`postrain.data.sign_slips`), a teacher's systematic mistake that SFT copies and a verifier's reward can undo. "
        "The held-out answers and the references the preference filter and GRPO check against keep their sign."
    )


def extract_answer(text: str) -> str | None:
    """The final answer of a completion ('... The answer is X.'), or None when it gives none."""
    found = ANSWER.findall(text)
    return found[-1].strip("'.").lower() if found else None


def is_correct(completion: str, answer: str) -> bool:
    return extract_answer(completion) == answer.lower()


def _minhash(text: str, num_perm: int = 64) -> MinHash:
    from datasketch import MinHash

    m = MinHash(num_perm=num_perm, seed=1)
    text = " ".join(text.lower().split())
    m.update_batch([text[i : i + 4].encode() for i in range(max(1, len(text) - 3))])
    return m


def dedup_and_decontaminate(
    items: Iterable[dict[str, Any]], eval_questions: Iterable[str], threshold: float
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Drop prompts near-identical (MinHash Jaccard >= threshold) to an eval question or an earlier prompt."""
    from datasketch import MinHashLSH

    evals = MinHashLSH(threshold=threshold, num_perm=64)
    for i, question in enumerate(eval_questions):
        evals.insert(f"eval{i}", _minhash(question))
    seen = MinHashLSH(threshold=threshold, num_perm=64)
    kept, counts = [], {"duplicates": 0, "contaminated": 0}
    for i, item in enumerate(items):
        m = _minhash(item["prompt"][0]["content"])
        if evals.query(m):
            counts["contaminated"] += 1
        elif seen.query(m):
            counts["duplicates"] += 1
        else:
            seen.insert(str(i), m)
            kept.append(item)
    return kept, counts


def load_hub_chat(path: str, split: str, limit: int | None) -> list[dict[str, Any]]:
    """Conversational data from the hub (e.g. SmolTalk-style `messages` columns) or a local copy of it.

    `path` is anything `datasets.load_dataset` reads: a hub id, or a local folder/file of JSON or
    Parquet (the tests use local files; offline, a hub id fails with the hub's own error).
    """
    from datasets import load_dataset

    local = Path(path)
    if local.exists():
        files = [str(p) for p in sorted(local.rglob("*")) if p.suffix in (".json", ".jsonl", ".parquet")] if local.is_dir() else [path]
        kind = "parquet" if files[0].endswith(".parquet") else "json"
        ds = load_dataset(kind, data_files=files, split="train")
    else:
        ds = load_dataset(path, split=split)
    rows = []
    for row in ds.select(range(min(limit, len(ds)))) if limit else ds:
        messages = row["messages"]
        last = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        rows.append({"prompt": messages[:-1], "messages": messages, "answer": extract_answer(last) or "", "family": "hub"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
