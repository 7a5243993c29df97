"""What the cluster tests share (tests/test_slurm.py, tests/test_cluster.py; their engines are fixtures of conftest.py):
executors and launchers on the engines, curation compared with local, and the micro swarm."""

from __future__ import annotations

import csv
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from infra.recipe import LauncherCfg, Strict, parse_recipe
from infra.steps import NoInputs
from infra.summaries import Summary
from tasks.curation import pipelines
from tests.helpers import micro_recipe
from tests.test_curation import read_ids


def cluster_executor(kind: str, **changes):
    executor = {"kind": kind, "tasks": 2, "workers": 2, "tasks_per_job": "even", "slurm": {"mem_per_cpu_gb": 0.5}}
    recipe = micro_recipe(executor={**executor, **changes})
    return parse_recipe(recipe, f"{kind} recipe").executor


def slurm_executor(**changes):
    return cluster_executor("slurm", **changes)


def curate_and_compare(ex, local, tmp_path):
    recipe = local["recipe"]
    steps = {name: tmp_path / name for name in ("ingest", "filter", "dedup", "decont")}
    pipelines.ingest(recipe.sources, {"web": str(local["root"] / "raw")}, ex, recipe.storage.s3, False, steps["ingest"])
    pipelines.filter_docs({"web": {}}, ex, steps["ingest"], steps["filter"])
    dedup = pipelines.dedup(recipe.curate.dedup, ex, steps["filter"], steps["dedup"])
    decont = pipelines.decontaminate(recipe.curate.decontaminate, ex, steps["dedup"], steps["decont"])
    for name in steps:
        kept = sorted(read_ids(local["steps"][name] / "data"))
        assert kept and sorted(read_ids(steps[name] / "data")) == kept, f"{name}: {ex.kind} kept other documents than local"
    untimed = {k: v for k, v in local["dedup"].items() if k != "seconds"}  # stage wall times differ by engine
    assert ({k: v for k, v in dedup.items() if k != "seconds"}, decont) == (untimed, local["decont"])
    return steps


def sleep_long(docs, rank: int = 0, world_size: int = 1):
    time.sleep(120)
    yield from docs or []


def fail_on_rank_1(docs, rank: int = 0, world_size: int = 1):
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    yield from docs or []


def record_parent(docs, rank: int = 0, world_size: int = 1, folder: str = ""):
    """Writes the command line of the process that started this shard's process to FOLDER/RANK."""
    Path(folder, str(rank)).write_text(" ".join(psutil.Process(os.getppid()).cmdline()))
    yield from docs or []


def slurm_launcher(**slurm) -> LauncherCfg:
    return LauncherCfg(kind="slurm", nproc=2, threads_per_rank=1, slurm={"time": "10", **slurm})


PROXIES = ["p000", "p001", "p002", "p003"]
# an engine's swarm trains the first two proxies (`concurrency: 2` starts them together) and finds the other two, and
# the curation, in a store seeded from local_swarm's (LocalSwarm.seed): the engine trains two at once and nothing more
TRAINED, SEEDED = PROXIES[:2], PROXIES[2:]


def micro_swarm(tmp_path: Path, engine: dict[str, str] | None = None, store: Path | None = None) -> tuple[Path, list[str]]:
    """The micro swarm file (4 proxies, no validation; steps in STORE, else its own) and the overrides that send its
    proxies to ENGINE."""
    import yaml

    from tests.test_swarm import swarm_file

    targets = {"smol_ppl_code": 1.0, "smol_ppl_prose": 2.0}  # the micro recipe holds out no math documents
    path = swarm_file(tmp_path, store, concurrency=2, bounds={"math": [0.05, 0.5]}, targets=targets, validation=None)
    if engine is None:
        return path, []
    overlay = tmp_path / "engine.yaml"
    overlay.write_text(yaml.safe_dump(engine))
    return path, [f"@{overlay}"]


def scores(root: Path) -> list[dict[str, str]]:
    """The swarm's metrics.csv: each proxy's target and per-task scores, as written."""
    with open(root / "report" / "metrics.csv") as f:
        return list(csv.DictReader(f))


class SwarmStore(Strict):
    store: str


def train_local_swarm(cfg: SwarmStore, inputs: NoInputs, out: Path) -> Summary:
    """The micro swarm run by this process's children, its steps in the session's swarm store (test_swarm.py's swarm
    finds its proxies there); kept here: its scores, and the store folders each proxy's run dir links."""
    from flows.swarm import swarm_flow

    swarm_flow(str(micro_swarm(out, store=Path(cfg.store))[0]), str(out / "sw"))
    (out / "metrics.csv").write_bytes((out / "sw" / "report" / "metrics.csv").read_bytes())
    store = Path(cfg.store).resolve()
    folders = {p: sorted(f.resolve().name for f in (out / "sw" / p).iterdir() if f.resolve().parent == store) for p in PROXIES}
    (out / "folders.json").write_text(json.dumps(folders))
    shutil.rmtree(out / "sw")
    return Summary()


@dataclass(frozen=True)
class LocalSwarm:
    """local_swarm: what its proxies scored, and where their steps are."""

    scores: list[dict[str, str]]
    store: Path
    folders: dict[str, list[str]]  # proxy -> the store folders its run dir links (curation, its mixtures, its pretraining)

    def seed(self, dest: Path, proxies: list[str]) -> Path:
        """A step store at DEST holding copies of the curation and of PROXIES' steps: a swarm over it curates nothing
        and trains only the other proxies."""
        for name in {f for p in proxies for f in self.folders[p]}:
            shutil.copytree(self.store / name, dest / name, symlinks=True)
        return dest


def run_watched(swarm: tuple[Path, list[str]], root: Path, count: Callable[[], int]) -> int:
    """Run the swarm, sampling COUNT (trainers running on the engine) every half second; the most seen at once."""
    from flows.swarm import swarm_flow

    running: list[int] = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            running.append(count())
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        swarm_flow(str(swarm[0]), str(root), swarm[1])
    finally:
        stop.set()
        watcher.join()
    return max(running)
