"""Benchmark: SFT steps of the tiny recipe with TRL's fused LM head as it is off Triton devices (every
position, in tiles), scoring the labelled (answer) positions only (in tiles), and `cpu_lm_head` (the
labelled positions in one plain projection).

Same model (the tiny recipe's architecture, random weights, a 4,096-token BPE), same chats (the
recipe's families), same 2 threads; the two sides alternate, twice each, each a fresh trainer from
the same weights. Prints seconds per step (the trainer's own runtime over its steps), the final
training loss of each side (equal: the same loss, computed on fewer rows) and the ratios to TRL's.

    .venv/bin/python bench/postrain.py [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402

import postrain.common as common  # noqa: E402
from infra.recipe import load_recipe  # noqa: E402
from model.network import build_model, model_config, save_pretrained  # noqa: E402
from postrain import data as chat  # noqa: E402
from postrain.sft import build_trainer  # noqa: E402
from tasks.curation import tokenizer as bpe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    recipe = load_recipe(REPO / "configs" / "tiny.yaml")
    d = recipe.postrain.data
    rows = chat.generate(4000, dict(d.families), d.max_value, 0, operators=d.operators)
    rng = random.Random(0)
    words = [" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(20)) for _ in range(5000)]
    texts = [m["content"] for row in rows for m in row["messages"]] + words  # words fill the vocabulary
    trl_default = trl_utils._use_triton, trl_utils._ChunkedLogProbFunction
    cfg = recipe.postrain.sft.model_copy(update={"max_steps": args.steps, "save_steps": 10**6, "logging_steps": args.steps})
    runs: dict[str, list[tuple[float, float]]] = {"TRL's head": [], "labelled, tiles": [], "cpu_lm_head": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = bpe.save_hf(bpe.train_bpe(iter(texts), vocab_size=recipe.curate.tokenizer.train.vocab_size, min_frequency=1), root / "base")
        special = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        save_pretrained(build_model(model_config(recipe.model, len(tok), 256, special_ids=special), seed=0), root / "base")
        for i in range(2):
            for side in runs:
                trl_utils._use_triton, trl_utils._ChunkedLogProbFunction = trl_default
                if side == "labelled, tiles":
                    trl_utils._use_triton = lambda device: True  # TRL's compact path; its folds keep their own check
                elif side == "cpu_lm_head":
                    common.cpu_lm_head()
                trainer = build_trainer(str(root / "base"), rows, cfg, root / f"{side}-{i}".replace(" ", "-").replace(",", ""), seed=0)
                out = trainer.train()
                runs[side].append((out.metrics["train_runtime"] / args.steps, out.training_loss))
    print(f"tiny recipe SFT: hidden {recipe.model.hidden_size}, vocab {len(tok)}, batch {cfg.batch_size}, {args.steps} steps, 2 threads")
    print(f"{'':16}{'s/step (each run)':>22}{'train loss':>12}")
    for side, results in runs.items():
        print(f"{side:16}{' '.join(f'{s:.3f}' for s, _ in results):>22}{results[0][1]:12.4f}")
    mean = {side: sum(s for s, _ in results) / len(results) for side, results in runs.items()}
    baseline, *others = runs
    for side in others:
        print(f"ratio (steps/s) {side} / {baseline}: {mean[baseline] / mean[side]:.3f}x")


if __name__ == "__main__":
    main()
