"""The demo's wall time and where it goes: runs `smolflow run RECIPE` into a fresh run dir (or reads a
finished one with --read) and prints, per step of the pipeline graph, when it started after launch and
how long it built (from its manifest), per stage the span from its first step's start to its last
step's end, and the time outside every step (start-ups, imports, Prefect round trips).

    .venv/bin/python bench/demo.py [configs/tiny.yaml] [--run-dir runs/demo-bench] [--read] [--record]

With --record the figures and the run's ladder go into docs/results.jsonl and docs/results.md's demo table
(bench/record.py), under the commit of the git checkout that holds the run dir (a fresh clone's `make demo`:
`bench/demo.py --read --run-dir CLONE/runs/tiny --record`).

Run it on an otherwise idle machine: the figure the demo promises (issue 13: ≤ 15 min on 2 cores)
is wall time with nothing else running. With --read the launch is the first step's start.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import record  # noqa: E402
from flows.graph import STAGES, build_graph  # noqa: E402
from infra.recipe import load_recipe  # noqa: E402
from infra.steps import MANIFEST  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def started_at(manifest: dict) -> float:
    return datetime.strptime(manifest["started"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="configs/tiny.yaml")
    parser.add_argument("--run-dir", default="runs/demo-bench", help="a fresh run dir (deleted first unless --read)")
    parser.add_argument("--read", action="store_true", help="report on a finished run dir instead of running")
    parser.add_argument("--record", action="store_true", help="add the figures to docs/results.jsonl and docs/results.md")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    launched = wall = None
    if not args.read:
        shutil.rmtree(run_dir, ignore_errors=True)
        launched = time.time()
        # a store of its own, not the project's shared one: every step is built and timed
        cmd = [sys.executable, "-m", "flows.cli", "run", args.recipe, "--run-dir", str(run_dir), "--set", "storage.store=null"]
        code = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL).returncode
        wall = time.time() - launched
        if code != 0:
            sys.exit(f"error: `{' '.join(cmd)}` exited {code}; see {run_dir}/logs")

    graph = build_graph(load_recipe(args.recipe))
    rows = []
    for step in graph.steps:
        path = run_dir / step.name / MANIFEST
        if path.exists():
            m = json.loads(path.read_text())
            rows.append((step.stage, step.name, started_at(m), m["seconds"]))
    if not rows:
        sys.exit(f"error: no finished step in {run_dir}")
    launched = launched or min(r[2] for r in rows)
    end = max(r[2] + r[3] for r in rows)
    wall = wall or end - launched
    print(f"{'step':<28}{'stage':<12}{'starts at':>10}{'builds':>10}")
    for stage, name, start, seconds in rows:
        print(f"{name:<28}{stage:<12}{start - launched:>9.0f}s{seconds:>9.0f}s")
    print(f"\n{'stage':<12}{'span':>9}{'share':>8}")
    spans = {}
    for stage in STAGES:
        steps = [(r[2], r[2] + r[3]) for r in rows if r[0] == stage]
        if steps:
            spans[stage] = max(e for _, e in steps) - min(s for s, _ in steps)
            print(f"{stage:<12}{spans[stage]:>8.0f}s{spans[stage] / wall:>8.1%}")
    covered, edge = 0.0, launched  # the union of step intervals: steps of a stage may overlap
    for start, stop in sorted((r[2], r[2] + r[3]) for r in rows):
        covered += max(0.0, stop - max(start, edge))
        edge = max(edge, stop)
    outside = wall - covered
    print(f"\nwall {wall:.0f}s ({wall / 60:.1f} min); inside steps {covered:.0f}s; outside steps {outside:.0f}s ({outside / wall:.1%})")
    if args.record:
        commit = subprocess.run(["git", "-C", str(run_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
        if commit.returncode:
            sys.exit(f"error: --record names the commit of the checkout that holds {run_dir}, and it is in none")
        status = ["git", "-C", str(run_dir), "status", "--porcelain", "--untracked-files=no"]
        edited = subprocess.run(status, capture_output=True, text=True)
        if edited.stdout.strip():  # the code that ran is not the commit's: a row under that commit would misname it
            sys.exit(f"error: --record names a commit, and the checkout that holds {run_dir} has edits to it:\n{edited.stdout}")
        ladder = run_dir / "reports" / "postrain.json"
        rungs = {r["model"]: r["accuracy"] for r in json.loads(ladder.read_text())["ladder"]} if ladder.exists() else {}
        date = datetime.fromtimestamp(launched, UTC).strftime("%Y-%m-%d")
        figures = {"wall_s": round(wall), "stages_s": {s: round(v) for s, v in spans.items()}, "ladder": rungs}
        record.append({"what": "demo", "date": date, "commit": commit.stdout.strip(), **figures})


if __name__ == "__main__":
    main()
