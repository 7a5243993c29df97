"""Math problems with worked solutions: the embedded corpus's math documents and the chat data are made of them.

Both the curate stage (tasks/curation/corpus.py) and post-training (postrain/data.py) draw from
these generators, and the eval sets are built from them too, so decontamination has something
real to catch.
"""

from __future__ import annotations

import random

_NAMES = ["Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemi", "Liam"]
_ITEMS = [
    ("apple", "apples"),
    ("book", "books"),
    ("marble", "marbles"),
    ("coin", "coins"),
    ("pencil", "pencils"),
    ("stamp", "stamps"),
    ("shell", "shells"),
    ("card", "cards"),
]


def arithmetic_problem(rng: random.Random, max_value: int) -> tuple[str, str, int]:
    """A two-operand problem, its worked solution and the integer answer."""
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    op = rng.choice("+-*")
    if op == "*":
        b = rng.randint(0, 12)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    return question, f"{a} {op} {b} = {answer}. The answer is {answer}.", answer


def word_problem(rng: random.Random, max_value: int) -> tuple[str, str, int]:
    name, other = rng.sample(_NAMES, 2)
    item, items = rng.choice(_ITEMS)
    a, b = rng.randint(2, max_value), rng.randint(1, max_value)
    if rng.random() < 0.5:
        question = f"{name} has {a} {items}. {other} gives {name} {b} more {items}. How many {items} does {name} have now?"
        answer = a + b
        work = f"{name} starts with {a} {items} and gets {b} more, so {a} + {b} = {answer}."
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {items} and gives {b} of them to {other}. How many {items} does {name} have left?"
        answer = a - b
        work = f"{name} starts with {a} {items} and gives away {b}, so {a} - {b} = {answer}."
    unit = item if answer == 1 else items
    return question, f"{work} The answer is {answer} {unit}.", answer
