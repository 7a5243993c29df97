"""Benchmark: are the ablation verdicts right? Null ablations (variants identical but for the seed) must give few
"better"/"worse" verdicts, a planted effect must be found in most repeats, and the paired test must need fewer items
than the unpaired one.

It runs one ablation of the tiny recipe at a proxy scale (`--scale` of its pretraining tokens; curation comes from
the project's store): the recipe's mixtures, and a planted change (`--planted no_math`: no math in any phase, a large
effect; `math25`: 25% math in phase 1 instead of 10%, a small one), each with `--seeds` seeds (`pretrain.seed`:
weights and batch order), scored on held-out math bits per byte and arithmetic cloze. From the
base models' per-item outcomes, judged as `smolflow ablate` judges (tasks/evaluation/stats.py):
- nulls: every pair of seeds of one variant, the noise floor measured on that variant's other seeds, and (a one-seed
  ablation's floor) on the first seed's own last 4 checkpoints (none, so no floor, in a run of fewer than 8);
- power: every (recipe, no math) pair of seeds, the floor from the recipe's other seeds, and from its own checkpoints;
(each run's last checkpoint, the base model's weights)
- items: on each planted pair, the fewest held-out items (random subsets, doubling) at which the paired interval
  excludes 0, and the same for the unpaired interval;
- the ablation itself: all seeds against all, and the noise floor 2, 3, 5 or 8 seeds per variant would give.
Usage:  .venv/bin/python bench/verdicts.py [--seeds 5] [--scale 0.1] [--planted no_math|math25] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from flows.graph import build_graph  # noqa: E402
from flows.pipeline import source_recipe  # noqa: E402
from infra.recipe import load_recipe  # noqa: E402
from tasks.evaluation.compare import checkpoint_floors  # noqa: E402
from tasks.evaluation.report import eval_records  # noqa: E402
from tasks.evaluation.stats import Items, items_of, noise_floor, paired, verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = {"smol_ppl_math": True, "smol_arithmetic_cf": False}  # task -> lower is better


def planted_change(name: str) -> list[str]:
    """The planted variant's overrides: no math in any phase, or phase 1's math raised from 10% to 25%."""
    phases = load_recipe(REPO / "configs" / "tiny.yaml").pretrain.phases
    if name == "math25":
        return ["pretrain.phases.0.mixture={prose: 0.375, code: 0.375, math: 0.25}"]
    out = []
    for i, p in enumerate(phases):
        rest = {k: w for k, w in p.mixture.items() if k != "math"}
        out.append(f"pretrain.phases.{i}.mixture={{{', '.join(f'{k}: {w / sum(rest.values()):.4f}' for k, w in rest.items())}}}")
    return out


def ablation_file(folder: Path, seeds: int, scale: float, planted: str) -> Path:
    recipe = load_recipe(REPO / "configs" / "tiny.yaml")
    shared = [f"pretrain.phases.{i}.tokens={int(p.tokens * scale)}" for i, p in enumerate(recipe.pretrain.phases)]
    shared += [f"evaluation.checkpoint_tasks=[{', '.join(TASKS)}]", "evaluation.model_tasks=[]"]
    spec = {
        "name": f"verdicts_{planted}",
        "base": str(REPO / "configs" / "tiny.yaml"),
        "description": f"null ablations and a planted effect ({planted}), for bench/verdicts.py",
        "until": "pretrain",
        "seeds": seeds,
        "seed_key": "pretrain.seed",  # curation stays shared
        "set": shared,
        "variants": [{"name": "recipe", "set": []}, {"name": planted, "set": planted_change(planted)}],
    }
    path = folder / "verdicts.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@dataclass
class Seed:
    items: dict[str, Items]  # task -> the item outcomes of the run's pretrained model (its last checkpoint)
    own_floor: dict[str, float | None]  # task -> the noise floor from its own last checkpoints (one-seed ablations)


def read_seed(run_dir: Path) -> Seed:
    records = eval_records(run_dir, build_graph(source_recipe(str(run_dir), None)).steps)
    scored = [r for r in records if r["model"]["kind"] == "checkpoint" and all(t in r["tasks"] for t in TASKS)]
    last = max(scored, key=lambda r: r["model"]["tokens"])
    floors = {task: f for (_, task, _), f in checkpoint_floors(records, ["base"]).items()}
    return Seed({task: items_of(last["tasks"][task].get("items")) for task in TASKS}, {task: floors.get(task) for task in TASKS})


def score(items: Items) -> float:
    return sum(n for n, _ in items.values()) / sum(d for _, d in items.values())


def judge(base: Items, other: Items, floor: float | None, lower: bool) -> str:
    """One seed against one seed, as an ablation with one seed per variant would judge, over FLOOR."""
    p = paired([base], [other])
    return verdict(p.diff, p.ci95, floor, lower, p.mcnemar_p)


def seeds_floor(floor_from: list[Items]) -> float | None:
    """The floor that other seeds of the baseline measure."""
    return noise_floor([score(i) for i in floor_from], 1, 1)


def fewest_items(base: Items, other: Items, which: str, rng: np.random.Generator) -> int | None:
    """The fewest items (doubling from 10, random subsets) at which that interval excludes 0 in 4 of 5 draws."""
    ids = sorted(set(base) & set(other))
    n = 10
    while n <= len(ids):
        hits = 0
        for _ in range(5):
            subset = set(rng.choice(ids, n, replace=False))
            p = paired([{i: base[i] for i in subset}], [{i: other[i] for i in subset}])
            low, high = p.ci95 if which == "paired" else p.unpaired_ci95
            hits += not (low <= 0 <= high)
        if hits >= 4:
            return n
        n *= 2
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.1, help="share of the tiny recipe's pretraining tokens")
    parser.add_argument("--planted", choices=("no_math", "math25"), default="no_math")
    parser.add_argument("--run-dir", help="default: runs/ablations/verdicts_PLANTED")
    args = parser.parse_args()
    root = Path(args.run_dir or f"runs/ablations/verdicts_{args.planted}")
    root.mkdir(parents=True, exist_ok=True)
    path = ablation_file(root, args.seeds, args.scale, args.planted)
    variants = ("recipe", args.planted)
    started = time.time()
    subprocess.run([str(Path(sys.executable).parent / "smolflow"), "ablate", str(path), "--run-dir", str(root)], check=True, cwd=REPO)
    seconds = time.time() - started
    seeds = {v: [read_seed(root / (f"{v}-seed{s}" if args.seeds > 1 else v)) for s in range(args.seeds)] for v in variants}
    runs = {v: [seed.items for seed in seeds[v]] for v in variants}
    rng = np.random.default_rng(0)
    expected = "worse" if args.planted == "no_math" else "better"  # on math: less math is worse, more is better
    print(f"ablation: 2 variants x {args.seeds} seeds at {args.scale:g} of the tiny recipe's tokens, {seconds:,.0f} s on this machine")
    print(f"{'task':22}{'floor from':>20}{'null verdicts':>16}{'planted found':>16}{'items: paired':>16}{'unpaired':>10}")
    for task, lower in TASKS.items():
        for floor_from in ("other seeds", "own checkpoints"):
            nulls = []
            for v in variants:
                for a, b in itertools.combinations(range(args.seeds), 2):
                    others = [runs[v][s][task] for s in range(args.seeds) if s not in (a, b)]
                    floor = seeds_floor(others) if floor_from == "other seeds" else seeds[v][a].own_floor[task]
                    nulls.append(judge(runs[v][a][task], runs[v][b][task], floor, lower))
            false = sum(v.split(" ")[0] in ("better", "worse") for v in nulls)
            planted = []
            for a, b in itertools.product(range(args.seeds), repeat=2):
                others = [runs[variants[0]][s][task] for s in range(args.seeds) if s != a]
                floor = seeds_floor(others) if floor_from == "other seeds" else seeds[variants[0]][a].own_floor[task]
                planted.append(judge(runs[variants[0]][a][task], runs[variants[1]][b][task], floor, lower))
            found = sum(v.startswith(expected) for v in planted)
            items = ""
            if floor_from == "other seeds":
                pairs = [(runs[variants[0]][s][task], runs[variants[1]][s][task]) for s in range(args.seeds)]
                need = {w: [fewest_items(a, b, w, rng) for a, b in pairs] for w in ("paired", "unpaired")}
                median = {w: (f"{int(np.median([n for n in ns if n]))}" if any(ns) else "never") for w, ns in need.items()}
                items = f"{median['paired']:>16}{median['unpaired']:>10}"
            print(
                f"{task:22}{floor_from:>20}{f'{false}/{len(nulls)} ({false / len(nulls):.0%})':>16}"
                f"{f'{found}/{len(planted)} ({found / len(planted):.0%})':>16}{items}"
            )
    own = {t: [f for v in variants for seed in seeds[v] if (f := seed.own_floor[t]) is not None] for t in TASKS}
    runs_n = sum(len(seeds[v]) for v in variants)
    said = [f"{t} in {len(f)} of {runs_n} runs" + (f" (median {np.median(f):.4f})" if f else "") for t, f in own.items()]
    # compare.checkpoint_floors gives none where a run has fewer than 8 checkpoints (still learning across them)
    print("one seed's floor from its last 4 checkpoints: " + ", ".join(said))
    n = args.seeds
    for task, lower in TASKS.items():  # the ablation itself: every seed of each variant, as `smolflow ablate` judges it
        p = paired([r[task] for r in runs[variants[0]]], [r[task] for r in runs[variants[1]]])
        floor = noise_floor([score(r[task]) for r in runs[variants[0]]], n, n)
        floors = ", ".join(f"{k} seeds {noise_floor([score(r[task]) for r in runs[variants[0]]], k, k):.4f}" for k in (2, 3, 5, 8))
        print(
            f"{task}: {n} seeds vs {n}: {p.diff:+.4f} [{p.ci95[0]:+.4f}, {p.ci95[1]:+.4f}], noise floor {floor:.4f}: "
            f"{verdict(p.diff, p.ci95, floor, lower, p.mcnemar_p)} (floor with k seeds per variant: {floors})"
        )
    means = {v: {t: np.mean([score(r[t]) for r in runs[v]]) for t in TASKS} for v in variants}
    print("means: " + "; ".join(f"{v}: " + ", ".join(f"{t} {m:.4f}" for t, m in means[v].items()) for v in variants))
    print("items: median over seed pairs of the fewest items at which the interval excludes 0 in 4 of 5 random subsets")


if __name__ == "__main__":
    main()
