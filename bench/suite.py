"""Benchmark: the test suite's CPU work, this tree against a baseline commit, one after the other on the same cores.

Each side is a fresh `git clone` of its revision (this working tree's commit, or `--rev`) that runs `make test`'s
own pytest command with this checkout's `.venv`. CPU work is the machine's busy time from /proc/stat (user, nice,
system, irq, softirq over all cores) across the run: it counts what the suite starts outside its own process tree
(Slurm jobs under slurmd, Ray workers, the Prefect server), which getrusage would miss, so keep the box otherwise
idle; the idle box's own busy time over the same span is measured first and printed. Each side's CPU is also
split by kind of process (trainer ranks, eval children, Prefect servers, Ray workers...): every process is sampled
once a second and keeps its last CPU reading, so a process shorter than a second, and a process's last second, are
missed; the table says how much of the busy time it explains, and lists the commands of the unnamed kinds
("other") that used the most, which is where to look next.
With `--profile RAW` (one side only) the side runs under `py-spy record --subprocesses` (20 samples a second, raw
stacks to RAW) and each kind's samples are split into module imports (a stack inside `_find_and_load`) and the rest,
with the packages whose imports cost the most. py-spy counts a thread busy unless it sees it wait, so an event loop's
threads (Prefect's server and clients) sample more seconds than they use CPU: read the import share, not the seconds.
py-spy's own CPU counts in the profiled side's busy time, which is then not comparable with an unprofiled side.
`--summarise RAW` prints that split for a RAW already recorded.
With `--record` each side measured goes into docs/results.jsonl and docs/results.md's suite table (bench/record.py).
Usage:  .venv/bin/python bench/suite.py [--base 96210ee] [--rev HEAD] [--only base|rev] [--json FILE] [--pytest-args ARGS]
                                        [--profile RAW] [--summarise RAW] [--record]
(96210ee: the suite when issue 42 asked for a cut to 0.7x its CPU work.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import record  # noqa: E402

BUSY = (0, 1, 2, 5, 6)  # user nice system irq softirq in /proc/stat's "cpu" line


def busy_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in BUSY) / os.sysconf("SC_CLK_TCK")


# kind of process -> what its command line matches; the first match wins, so launchers come before their ranks
KINDS = [
    (
        "launcher (torchrun, accelerate, deepspeed, srun, tether)",
        r"torch\.distributed\.run|accelerate\.commands|deepspeed|\bsrun\b|infra\.procs",
    ),
    ("pretraining rank", r"-m model\.train"),
    ("post-training rank", r"-m postrain\.run"),
    ("vLLM generation", r"postrain\.generation|vllm"),
    ("eval child", r"tasks\.evaluation\.harness"),
    ("Prefect server", r"prefect server start|uvicorn"),
    ("Prefect flow run (deployments)", r"prefect\.engine|prefect worker"),
    ("Ray (head, workers)", r"/ray/|raylet|gcs_server"),
    ("datatrove (forkserver, pickled pipelines)", r"forkserver|launch_pickled_pipeline|resource_tracker"),
    ("CLI (smolflow ...)", r"bin/smolflow|-m flows\.cli"),
    ("pytest workers (flows run in-process)", r"sys\.stdin\.readline|bin/pytest|-m pytest"),
    ("Slurm daemons", r"slurm|munged"),
]


class Census:
    """CPU seconds by kind of process, from a sample of every process each second (see the module doc)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, float], tuple[str, float]] = {}
        self.commands: dict[tuple[int, float], str] = {}  # of the kinds OTHER only: what to look at next
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            for p in psutil.process_iter(["cmdline", "create_time"]):
                try:
                    key = (p.pid, p.info["create_time"])
                    if key in self.seen:
                        kind = self.seen[key][0]
                    else:
                        command = " ".join(p.info["cmdline"] or [])
                        kind = kind_of(command)
                        if kind in OTHER:
                            self.commands[key] = command
                    t = p.cpu_times()
                    self.seen[key] = (kind, t.user + t.system)
                except psutil.Error:
                    continue

    def __enter__(self) -> Census:
        self.before = {(p.pid, p.info["create_time"]) for p in psutil.process_iter(["create_time"])}
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def by_kind(self) -> dict[str, dict[str, float]]:
        """kind -> processes and their CPU seconds, of the processes started while the census ran."""
        out: dict[str, dict[str, float]] = {}
        for key, (kind, cpu) in self.seen.items():
            if key in self.before:
                continue
            row = out.setdefault(kind, {"processes": 0, "cpu_s": 0.0})
            row["processes"] += 1
            row["cpu_s"] += cpu
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"]))

    def others(self, top: int = 8) -> list[tuple[str, int, float]]:
        """The command lines of OTHER kinds that used the most CPU (digits as N, so that runs of one program add up)."""
        rows: dict[str, list[float]] = {}
        for key, command in self.commands.items():
            if key not in self.before:
                row = rows.setdefault(re.sub(r"\d+", "N", command)[:120], [0, 0.0])
                row[0] += 1
                row[1] += self.seen[key][1]
        return sorted(((c, int(n), cpu) for c, (n, cpu) in rows.items()), key=lambda r: -r[2])[:top]


OTHER = ("other Python", "other programs")


def kind_of(cmd: str) -> str:
    if not cmd:
        return "kernel threads"
    return next((kind for kind, rx in KINDS if re.search(rx, cmd)), "other Python" if "python" in cmd else "other programs")


def print_kinds(kinds: dict[str, dict[str, float]], cpu: float) -> None:
    counted = sum(row["cpu_s"] for row in kinds.values())
    print(f"  by kind of process ({counted:.0f} CPU s sampled, {counted / cpu:.0%} of the busy time):")
    for kind, row in kinds.items():
        n = int(row["processes"])
        print(f"  {row['cpu_s']:8.0f} s {row['cpu_s'] / counted:6.1%} {n:5d} processes {row['cpu_s'] / n:6.1f} s each  {kind}")


PROFILE_HZ = 20
IMPORT_FRAME = "_find_and_load"
OURS = ("infra/", "model/", "postrain/", "tasks/", "flows/", "tests/", "bench/", "<")
HARNESS = {"xdist", "execnet", "_pytest", "pytest", "pluggy"}  # what imports the test modules: not what they cost


def profiled(cmd: list[str], raw: Path) -> list[str]:
    """CMD under py-spy, its child processes too, without pausing them (--nonblocking) to sample."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        sys.exit(f"--profile: no {spy}; py-spy comes with the `cluster` extra (ray[default]) that `make setup` installs")
    return [str(spy), "record", "--subprocesses", "--nonblocking", "--rate", str(PROFILE_HZ), "-f", "raw", "-o", str(raw), "--", *cmd]


PROCESS = re.compile(r'process \d+:"(.*?)";')  # py-spy's process frames; a command line may hold ";" itself
MODULE = re.compile(r"<module> \((.*?):\d+\)")


def import_split(raw: Path) -> dict[str, dict]:
    """kind -> sampled seconds, those inside module imports, and the packages imported (the outermost installed package
    of an import stack), from py-spy's raw stacks: `process PID:"CMD";...;process PID:"CMD";frame;...;frame COUNT`."""
    out: dict[str, dict] = {}
    for line in stacks(raw):
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        procs = PROCESS.findall(stack)
        frames = PROCESS.sub("", stack).split(";")
        kind = kind_of(procs[-1]) if procs and procs[-1] else "command line not read (exited first)"
        row = out.setdefault(kind, {"sampled_s": 0.0, "import_s": 0.0, "packages": {}})
        seconds = int(count) / PROFILE_HZ
        row["sampled_s"] += seconds
        if any(IMPORT_FRAME in f for f in frames):
            row["import_s"] += seconds
            package = imported_package(frames)
            row["packages"][package] = row["packages"].get(package, 0.0) + seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["sampled_s"]))


def stacks(raw: Path):
    """RAW's lines one at a time: a whole suite's stacks run to ~150 MB."""
    with open(raw) as f:
        for line in f:
            yield line.rstrip("\n")


def imported_package(frames: list[str]) -> str:
    """The first module of an installed package on the stack: not ours, not the standard library, not a script."""
    for m in (m.group(1) for f in frames if (m := MODULE.match(f))):
        top = m.split("/")[0].removesuffix(".py")
        if "/" in m and not m.startswith(OURS) and top not in sys.stdlib_module_names and top not in HARNESS:
            return top
    return "smolflow or the standard library"


def print_imports(split: dict[str, dict]) -> None:
    total = sum(r["sampled_s"] for r in split.values())
    imports = sum(r["import_s"] for r in split.values())
    print(f"  py-spy: {total:.0f} s sampled, {imports:.0f} s ({imports / total:.0%}) importing modules; by kind of process:")
    for kind, row in split.items():
        top = sorted(row["packages"].items(), key=lambda kv: -kv[1])[:4]
        share = row["import_s"] / row["sampled_s"]
        print(f"  {row['sampled_s']:8.0f} s, {share:4.0%} imports  {kind}: " + ", ".join(f"{p} {s:.0f} s" for p, s in top))


def run_suite(rev: str, workers: int, extra: list[str], log: Path | None, raw: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "clone", "-q", str(REPO), str(tree)], check=True)
        subprocess.run(["git", "-C", str(tree), "checkout", "-q", rev], check=True)
        (tree / ".venv").symlink_to(REPO / ".venv")
        cmd = [str(REPO / ".venv/bin/python"), "-m", "pytest", "-n", str(workers), "--dist", "loadfile",
               "--no-loadscope-reorder", "-q", "-p", "no:cacheprovider", *extra]  # fmt: skip
        if raw:
            cmd = profiled(cmd, raw)
        cpu0, t0 = busy_s(), time.monotonic()
        # the venv's editable install points at this checkout: the clone's own code goes first, subprocesses too
        env = {**os.environ, "PYTHONPATH": str(tree)}
        with Census() as census:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        cpu, wall = busy_s() - cpu0, time.monotonic() - t0
    if log:
        log.write_text(proc.stdout + proc.stderr)
    said = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", line)]
    tail = said[-1] if said else proc.stdout.strip()[-500:] or proc.stderr[-500:]
    print(f"{rev}: {tail}\n  wall {wall:.0f} s, CPU {cpu:.0f} s ({cpu / wall:.2f} cores busy)", flush=True)
    kinds = census.by_kind()
    print_kinds(kinds, cpu)
    print("  most CPU among the other processes:")
    for command, n, cpu_s in census.others():
        print(f"  {cpu_s:8.0f} s {n:5d} processes  {command}")
    imports = import_split(raw) if raw else None
    if imports:
        print_imports(imports)
    return {"rev": rev, "commit": subprocess.check_output(["git", "-C", str(REPO), "rev-parse", rev], text=True).strip(),
            "wall_s": wall, "cpu_s": cpu, "result": tail, "rc": proc.returncode, "by_kind": kinds, "imports": imports}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="96210ee", help="baseline revision")
    ap.add_argument("--rev", default="HEAD", help="revision to measure against it")
    ap.add_argument("--only", choices=["base", "rev"], help="measure one side only")
    ap.add_argument("--workers", type=int, default=(os.cpu_count() or 1) + 1, help="xdist workers, as make test")
    ap.add_argument("--json", type=Path, help="also write the figures here, and each side's pytest output beside it")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments for --rev's side, e.g. '--cpu-durations 30'")
    ap.add_argument("--profile", type=Path, metavar="RAW", help="profile the measured side with py-spy (needs --only)")
    ap.add_argument("--summarise", type=Path, metavar="RAW", help="only print the import split of a recorded profile")
    ap.add_argument("--record", action="store_true", help="add each side to docs/results.jsonl and docs/results.md")
    args = ap.parse_args()
    if args.summarise:
        print_imports(import_split(args.summarise))
        return
    if args.profile and not args.only:
        ap.error("--profile measures one side only (py-spy's CPU counts in its busy time): add --only base or --only rev")
    if args.profile and args.record:
        ap.error("--record takes unprofiled sides only (py-spy's CPU counts in a profiled side's busy time)")
    cpu0 = busy_s()
    time.sleep(30)
    idle = (busy_s() - cpu0) / 30
    print(f"{os.cpu_count()} cores; idle box busy {idle:.3f} cores (measured over 30 s)", flush=True)
    logs = {name: args.json.with_suffix(f".{name}.log") if args.json else None for name in ("base", "rev")}
    extra = {"base": [], "rev": args.pytest_args.split()}
    revs = {"base": args.base, "rev": args.rev}
    sides = {name: run_suite(rev, args.workers, extra[name], logs[name], args.profile) for name, rev in revs.items()
             if args.only in (None, name)}  # fmt: skip
    if len(sides) == 2:
        b, r = sides["base"], sides["rev"]
        print(f"{args.rev} / {args.base}: CPU {r['cpu_s'] / b['cpu_s']:.2f}x, wall {r['wall_s'] / b['wall_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"cores": os.cpu_count(), "idle_cores_busy": idle, **sides}, indent=1) + "\n")
    for side in sides.values() if args.record else ():
        record.append(record.suite_record(side, time.strftime("%Y-%m-%d", time.gmtime())))
    sys.exit(max(s["rc"] for s in sides.values()))


if __name__ == "__main__":
    main()
