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


def column_work(a: int, op: str, b: int) -> str:
    """A B worked column by column from the units, carrying as on paper: what a small model can compute one
    digit at a time (writing 47 + 38 = 85 at once needs the carry before the tens digit is written).

    '47 + 38: 7 + 8 = 15, 4 + 3 + 1 = 8' ; '34 - 5: 14 - 5 = 9, 2 - 0 = 2' ; '24 * 11: 4 * 11 = 44, 2 * 11 + 4 = 26'
    """
    if op == "-" and a < b:
        return f"{a} - {b} = -({b} - {a}), {column_work(b, op, a)}"
    top, bottom = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(len(top) if op == "*" else max(len(top), len(bottom))):
        x = int(top[i]) if i < len(top) else 0
        if op == "*":
            value = x * b + carry
            steps.append(f"{x} * {b}" + (f" + {carry}" if carry else "") + f" = {value}")
            carry = value // 10
        elif op == "+":
            y = int(bottom[i]) if i < len(bottom) else 0
            value = x + y + carry
            steps.append(f"{x} + {y}" + (f" + {carry}" if carry else "") + f" = {value}")
            carry = value // 10
        else:
            y, x = (int(bottom[i]) if i < len(bottom) else 0), x - carry
            carry = int(x < y)
            steps.append(f"{x + 10 * carry} - {y} = {x + 10 * carry - y}")
    return f"{a} {op} {b}: " + ", ".join(steps)


def arithmetic_problem(rng: random.Random, max_value: int, operators: str = "+-*") -> tuple[str, str, int]:
    """A two-operand problem, its worked solution and the integer answer."""
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    op = rng.choice(operators)
    if op == "*":
        b = rng.randint(0, 12)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    return question, f"{column_work(a, op, b)}. The answer is {answer}.", answer


def word_problem(rng: random.Random, max_value: int) -> tuple[str, str, int]:
    name, other = rng.sample(_NAMES, 2)
    item, items = rng.choice(_ITEMS)
    a, b = rng.randint(2, max_value), rng.randint(1, max_value)
    if rng.random() < 0.5:
        question = f"{name} has {a} {items}. {other} gives {name} {b} more {items}. How many {items} does {name} have now?"
        answer = a + b
        work = f"{name} starts with {a} {items} and gets {b} more, so {column_work(a, '+', b)}."
    else:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {items} and gives {b} of them to {other}. How many {items} does {name} have left?"
        answer = a - b
        work = f"{name} starts with {a} {items} and gives away {b}, so {column_work(a, '-', b)}."
    unit = item if answer == 1 else items
    return question, f"{work} The answer is {answer} {unit}.", answer
