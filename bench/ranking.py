"""Benchmark: does an ablation decide at its proxy scale as it would at the full one? (the playbook's ranking
consistency across scale)

It runs an ablation file twice: as shipped (default: configs/ablations/math_weight.yaml, at a quarter of the tiny
recipe's pretraining tokens) and with its shared `pretrain.phases.N.tokens` overrides removed (the tiny recipe's
full tokens), each in its own run dir, curation shared through the project's store. Then, for every metric both
reports compare, it asks whether the variants' order (the sign of the difference from the baseline) and the verdict
agree between the two scales, and prints the fraction of pairwise decisions that agree.
Usage:  .venv/bin/python bench/ranking.py [--ablation FILE] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def full_scale(path: Path, folder: Path) -> Path:
    """The ablation file without its shared token overrides (its base recipe resolved from the original's folder)."""
    spec = yaml.safe_load(path.read_text())
    spec["set"] = [s for s in spec.get("set", []) if not (s.startswith("pretrain.phases.") and ".tokens=" in s)]
    spec["base"] = str((path.parent / spec["base"]).resolve())
    spec["name"] = f"{spec['name']}_full"
    spec["description"] = f"{spec.get('description', '')} (run at the full tokens by bench/ranking.py)"
    out = folder / path.name
    folder.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def ablate(path: Path, run_dir: Path) -> tuple[float, list[dict]]:
    """Run (or find built) the ablation; its wall seconds and the comparison rows of its report."""
    started = time.time()
    subprocess.run([str(Path(sys.executable).parent / "smolflow"), "ablate", str(path), "--run-dir", str(run_dir)], check=True, cwd=REPO)
    rows = json.loads((run_dir / "report" / "ablation.json").read_text())["rows"]
    return time.time() - started, [r for r in rows if "diff" in r]


def decided(verdict: str) -> str:
    """better / worse / none: what a user would do with the variant."""
    word = verdict.split(" ")[0]
    return word if word in ("better", "worse") else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ablation", default=str(REPO / "configs" / "ablations" / "math_weight.yaml"))
    parser.add_argument("--run-dir", default="runs/ablations/ranking", help="holds proxy/ and full/")
    args = parser.parse_args()
    root, path = Path(args.run_dir), Path(args.ablation).resolve()
    proxy_s, proxy = ablate(path, root / "proxy")
    full_s, full = ablate(full_scale(path, root), root / "full")
    at_full = {(r["model"], r["task"], r["metric"], r["variant"]): r for r in full}
    print(f"{path.name}: proxy scale {proxy_s:,.0f} s, full scale {full_s:,.0f} s on this machine (0 s: already built)")
    print(f"{'metric':46}{'proxy diff':>12}{'full diff':>12}  {'order':8}{'proxy verdict':>16}{'full verdict':>16}")
    orders, same_order, same_decision, n = 0, 0, 0, 0
    for r in proxy:
        f = at_full.get((r["model"], r["task"], r["metric"], r["variant"]))
        if f is None:
            continue
        n += 1
        signs = (_sign(r["diff"]), _sign(f["diff"]))
        order = "tie" if 0 in signs else "agrees" if signs[0] == signs[1] else "flips"  # a tie orders nothing
        orders += order != "tie"
        same_order += order == "agrees"
        same_decision += decided(r["verdict"]) == decided(f["verdict"])
        what = f"{r['variant']}: {r['model']} {r['task']} {r['metric']}"
        print(f"{what[:46]:46}{r['diff']:>+12.4f}{f['diff']:>+12.4f}  {order:8}{decided(r['verdict']):>16}{decided(f['verdict']):>16}")
    if n:
        print(f"pairwise orders that agree across scale: {same_order}/{orders} (the other {n - orders} metrics tie at one scale)")
        print(f"decisions (better / worse / none) that agree: {same_decision}/{n} ({same_decision / n:.0%})")


def _sign(diff: float) -> int:
    return (diff > 0) - (diff < 0)


if __name__ == "__main__":
    main()
