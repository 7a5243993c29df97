"""Benchmark: the CPU a `smolflow` command spends before it runs a flow (a check, a plan, a dry run, a refusal), this
tree's commit against a baseline, the two alternating on the same cores.

Each side is a fresh `git clone` of its revision run with this checkout's `.venv` (its code first on PYTHONPATH, as
bench/suite.py does); each command runs REPEAT times a side, and the median of its process's user + system CPU
(getrusage of the child) is printed with the ratio. The commands read configs/micro.yaml and an empty run dir, so
none runs a flow: what they cost is imports and checks, which a user pays on every call.
Usage:  .venv/bin/python bench/cli.py [--base 8126451] [--rev HEAD] [--repeat 5]
(8126451: the stop before the graph, the dry run and the refusals stopped importing Prefect.)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {  # label -> arguments; RUN is an empty run dir
    "validate": ["validate", "configs/micro.yaml"],
    "plan": ["plan", "configs/micro.yaml"],
    "run --dry-run": ["run", "configs/micro.yaml", "--run-dir", "RUN", "--dry-run"],
    "stage sft (refused: no upstream)": ["stage", "sft", "configs/micro.yaml", "--run-dir", "RUN"],
    "stage nonsense (refused)": ["stage", "nonsense", "configs/micro.yaml"],
    "eval of a mistyped run dir (refused)": ["eval", "RUN"],
}


def cpu_of(tree: Path, args: list[str], run_dir: Path) -> float:
    """User + system CPU seconds of one `smolflow ARGS` from TREE (its exit status is the command's to give)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [str(REPO / ".venv/bin/python"), "-m", "flows.cli", *[str(run_dir) if a == "RUN" else a for a in args]]
    subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="8126451", help="baseline revision")
    ap.add_argument("--rev", default="HEAD", help="revision to measure against it")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each command on each side")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-bench-") as tmp:
        trees = {}
        for rev in (args.base, args.rev):
            trees[rev] = Path(tmp) / rev.replace("/", "_")
            subprocess.run(["git", "clone", "-q", str(REPO), str(trees[rev])], check=True)
            subprocess.run(["git", "-C", str(trees[rev]), "checkout", "-q", rev], check=True)
        run_dir = Path(tmp) / "empty-run"
        print(f"{os.cpu_count()} cores; median CPU s of {args.repeat} runs a side, the sides alternating")
        print(f"{'command':<40}{args.base:>10}{args.rev:>10}{'ratio':>8}")
        for label, cmd in COMMANDS.items():
            seen: dict[str, list[float]] = {rev: [] for rev in trees}
            for _ in range(args.repeat):
                for rev, tree in trees.items():
                    seen[rev].append(cpu_of(tree, cmd, run_dir))
            base, rev = (statistics.median(seen[r]) for r in trees)
            print(f"{label:<40}{base:>9.2f}s{rev:>9.2f}s{rev / base:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
