"""Benchmark: a pipeline of small shards on Slurm and Ray, one job a shard (`executor.tasks_per_job: 1`, datatrove's
default) against `even` (at most `workers` jobs a pipeline), the two alternating on the same cores.

Each job is a new process that imports datatrove and tasks.curation (a Slurm array job, a Ray actor); a micro
recipe's shard takes milliseconds, so the jobs' starts are the pipeline's cost. The bench starts a Slurm cluster and
a Ray head of its own (state in a temporary folder; Slurm needs root), runs SHARDS shards that pass no documents (the
micro recipe's minhash-buckets stage: 14 shards of milliseconds) with 2 workers, and prints each setting's median
wall and busy CPU (/proc/stat: it counts the jobs slurmd and Ray start, so keep the box otherwise idle) and the ratio.

    .venv/bin/python bench/jobs.py [--rounds 3] [--shards 14] [--engines slurm ray]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)  # a Slurm job runs in the submitting folder and imports tasks.curation from it

from bench.suite import busy_s  # noqa: E402
from flows.cluster import Ray, Slurm, free_port_pair  # noqa: E402
from infra.launch import free_port  # noqa: E402
from infra.recipe import ExecutorCfg  # noqa: E402
from tasks.curation import pipelines  # noqa: E402


def no_docs(docs, rank: int = 0, world_size: int = 1):
    yield from docs or []


def executor(kind: str, per_job: int | str) -> ExecutorCfg:
    return ExecutorCfg(kind=kind, workers=2, tasks_per_job=per_job, slurm={"mem_per_cpu_gb": 0.5})


def one_run(cfg: ExecutorCfg, shards: int, work: Path) -> tuple[float, float]:
    logs = Path(tempfile.mkdtemp(dir=work))
    cpu, wall = busy_s(), time.perf_counter()
    pipelines.run_pipeline(cfg, [no_docs], logs, shards, "bench-jobs")
    return time.perf_counter() - wall, busy_s() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs of each setting, alternating (default 3)")
    ap.add_argument("--shards", type=int, default=14, help="shards of the pipeline (default 14, the minhash buckets)")
    ap.add_argument("--engines", nargs="+", choices=["slurm", "ray"], default=["slurm", "ray"])
    args = ap.parse_args()
    from loguru import logger  # datatrove's: a line per rank and pipeline, and a warning each about the local disk

    logger.remove()
    logger.add(sys.stderr, level="ERROR")
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
        work = Path(tmp)
        clusters = {"slurm": Slurm(state=work / "slurm", port=free_port_pair()), "ray": Ray(state=work / "ray", port=free_port())}
        for kind in args.engines:
            cluster = clusters[kind]
            if kind == "slurm":
                cluster.start(timeout_s=180)
                os.environ["SLURM_CONF"] = str(cluster.conf)
            else:
                cluster.start()
                os.environ.update(cluster.env())
            runs: dict[int | str, list[tuple[float, float]]] = {1: [], "even": []}
            try:
                for _ in range(args.rounds):
                    for per_job, times in runs.items():
                        times.append(one_run(executor(kind, per_job), args.shards, work))
            finally:
                if kind == "ray":
                    import ray

                    ray.shutdown()
                cluster.stop()
            print(f"{kind}: {args.shards} shards, 2 workers, median of {args.rounds} alternating runs each")
            medians = {per_job: [statistics.median(x) for x in zip(*times)] for per_job, times in runs.items()}
            for per_job, (wall, cpu) in medians.items():
                jobs = math.ceil(args.shards / pipelines.tasks_per_job(executor(kind, per_job), args.shards))
                print(f"  tasks_per_job {per_job!s:4}: {wall:6.1f} s wall, {cpu:6.1f} busy CPU s ({jobs} jobs)")
            (wall1, cpu1), (walle, cpue) = medians.values()
            print(f"  even / 1:           {walle / wall1:6.2f}x wall, {cpue / cpu1:6.2f}x CPU")


if __name__ == "__main__":
    main()
