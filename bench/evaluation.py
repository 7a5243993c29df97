"""A finished model's evals four ways, side by side on the same cores: its base and chat task groups in
two one-thread children (a child per batch: how the checkpoint follower scored each batch before its child
lived for the whole stage), in one child as two batches (the follower now), in one child as one batch, and
in one child with every core (what a stage's own evals do). Prints each time and its ratio to the first.

    .venv/bin/python bench/evaluation.py RUN_DIR [MODEL_DIR] [--repeats 2]

RUN_DIR is a finished run (its frozen recipe and held-out documents); MODEL_DIR defaults to its SFT model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.graph import build_graph  # noqa: E402
from infra.env import cores  # noqa: E402
from infra.steps import FINAL, RECIPE, frozen_recipe  # noqa: E402
from tasks.evaluation.harness import EvalJob, EvalWorker, prepare_tasks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("model", nargs="?", help="HF model folder (default: RUN_DIR's SFT model)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    recipe = frozen_recipe(json.loads((args.run_dir / RECIPE).read_text()), str(args.run_dir / RECIPE))
    graph = build_graph(recipe)
    model = args.model or str(args.run_dir / graph.ladder[0].name / FINAL)
    cfg = recipe.evaluation
    work = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    include = prepare_tasks(cfg.task_dirs, Path(graph.models.heldout_dir(args.run_dir)), work / "tasks")
    groups = ((cfg.checkpoint_tasks, False), (cfg.model_tasks, True))
    jobs = [EvalJob(model, tasks, chat, str(work / f"{chat}.json"), str(include), cfg.threads) for tasks, chat in groups]
    every_core = cfg.model_copy(update={"threads": cores()})
    on_every_core = [replace(job, threads=cores()) for job in jobs]

    def batches(cfg, *batches):  # one child for these batches of jobs
        with EvalWorker(cfg, work) as worker:
            for batch in batches:
                worker.run(batch)

    for _ in range(args.repeats):
        times = []
        for label, run in (
            ("two 1-thread children", lambda: [batches(cfg, [job]) for job in jobs]),
            ("one child, two batches", lambda: batches(cfg, *[[job] for job in jobs])),
            ("one child, one batch", lambda: batches(cfg, jobs)),
            (f"one child, {cores()} threads", lambda: batches(every_core, on_every_core)),
        ):
            started = time.time()
            run()
            times.append((label, time.time() - started))
        print(" | ".join(f"{label} {t:.1f} s ({times[0][1] / t:.2f}x)" for label, t in times), flush=True)


if __name__ == "__main__":
    main()
