"""Benchmark: the test suite's CPU work, this tree against a baseline commit, one after the other on the same cores.

Each side is a fresh `git clone` of its revision (this working tree's commit, or `--rev`) that runs `make test`'s
own pytest command with this checkout's `.venv`. CPU work is the machine's busy time from /proc/stat (user, nice,
system, irq, softirq over all cores) across the run: it counts what the suite starts outside its own process tree
(Slurm jobs under slurmd, Ray workers, the Prefect server), which getrusage would miss, so keep the box otherwise
idle; the idle box's own busy time over the same span is measured first and printed.
Usage:  .venv/bin/python bench/suite.py [--base 96210ee] [--rev HEAD] [--only base|rev] [--json FILE] [--pytest-args ARGS]
(96210ee: the suite when issue 42 asked for a cut to 0.7x its CPU work.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = (0, 1, 2, 5, 6)  # user nice system irq softirq in /proc/stat's "cpu" line


def busy_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in BUSY) / os.sysconf("SC_CLK_TCK")


def run_suite(rev: str, workers: int, extra: list[str], log: Path | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "clone", "-q", str(REPO), str(tree)], check=True)
        subprocess.run(["git", "-C", str(tree), "checkout", "-q", rev], check=True)
        (tree / ".venv").symlink_to(REPO / ".venv")
        cmd = [str(REPO / ".venv/bin/python"), "-m", "pytest", "-n", str(workers), "--dist", "loadfile",
               "--no-loadscope-reorder", "-q", "-p", "no:cacheprovider", *extra]  # fmt: skip
        cpu0, t0 = busy_s(), time.monotonic()
        # the venv's editable install points at this checkout: the clone's own code goes first, subprocesses too
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        cpu, wall = busy_s() - cpu0, time.monotonic() - t0
    if log:
        log.write_text(proc.stdout + proc.stderr)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    print(f"{rev}: {tail}\n  wall {wall:.0f} s, CPU {cpu:.0f} s ({cpu / wall:.2f} cores busy)", flush=True)
    return {"rev": rev, "commit": subprocess.check_output(["git", "-C", str(REPO), "rev-parse", rev], text=True).strip(),
            "wall_s": wall, "cpu_s": cpu, "result": tail, "rc": proc.returncode}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="96210ee", help="baseline revision")
    ap.add_argument("--rev", default="HEAD", help="revision to measure against it")
    ap.add_argument("--only", choices=["base", "rev"], help="measure one side only")
    ap.add_argument("--workers", type=int, default=(os.cpu_count() or 1) + 1, help="xdist workers, as make test")
    ap.add_argument("--json", type=Path, help="also write the figures here, and each side's pytest output beside it")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments for --rev's side, e.g. '--cpu-durations 30'")
    args = ap.parse_args()
    cpu0 = busy_s()
    time.sleep(30)
    idle = (busy_s() - cpu0) / 30
    print(f"{os.cpu_count()} cores; idle box busy {idle:.3f} cores (measured over 30 s)", flush=True)
    logs = {name: args.json.with_suffix(f".{name}.log") if args.json else None for name in ("base", "rev")}
    extra = {"base": [], "rev": args.pytest_args.split()}
    sides = {name: run_suite(rev, args.workers, extra[name], logs[name]) for name, rev in (("base", args.base), ("rev", args.rev))
             if args.only in (None, name)}  # fmt: skip
    if len(sides) == 2:
        b, r = sides["base"], sides["rev"]
        print(f"{args.rev} / {args.base}: CPU {r['cpu_s'] / b['cpu_s']:.2f}x, wall {r['wall_s'] / b['wall_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"cores": os.cpu_count(), "idle_cores_busy": idle, **sides}, indent=1) + "\n")
    sys.exit(max(s["rc"] for s in sides.values()))


if __name__ == "__main__":
    main()
