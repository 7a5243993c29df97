"""Benchmark: processes that train side by side on the same cores, with more threads than cores and with one
thread per core (what `infra.env.cores` enforces: SMOLFLOW_CORES or the affinity mask caps every thread count).

Each process runs the same training steps of the tiny recipe's model (random weights, a 16 x 256 batch, AdamW):
first alone with every core, then as many processes as cores at once with every core each, then the same
processes with one thread each. Prints each process's seconds and the slowest one's ratio to the baseline
(processes at once with every core each).

    .venv/bin/python bench/threads.py [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.env import cores  # noqa: E402


def steps(count: int) -> None:
    """The child: COUNT training steps, then its seconds on stdout."""
    import torch

    from infra.recipe import load_recipe
    from model.network import build_model, model_config
    from model.train import lm_loss

    arch = load_recipe(REPO / "configs" / "tiny.yaml").model
    model = build_model(model_config(arch, 4096, 256), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 4096, (16, 256), generator=torch.Generator().manual_seed(0))
    lm_loss(model(input_ids=batch).logits, batch, 0.0)[0].backward()  # warm-up: allocations outside the timing
    opt.zero_grad()
    started = time.time()
    for _ in range(count):
        lm_loss(model(input_ids=batch).logits, batch, 0.0)[0].backward()
        opt.step()
        opt.zero_grad()
    print(f"{time.time() - started:.2f}")


def side_by_side(processes: int, threads: int, count: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--child", "--steps", str(count)]
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [float(p.communicate()[0].split()[-1]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        steps(args.steps)
        return
    n = cores()
    print(f"{args.steps} steps per process, {n} cores")
    alone = side_by_side(1, n, args.steps)
    crowded = side_by_side(n, n, args.steps)
    shared = side_by_side(n, 1, args.steps)
    print(f"1 process, {n} threads: {alone[0]:.1f} s")
    print(f"{n} processes at once, {n} threads each: {', '.join(f'{t:.1f}' for t in crowded)} s")
    print(f"{n} processes at once, 1 thread each: {', '.join(f'{t:.1f}' for t in shared)} s ({max(crowded) / max(shared):.2f}x)")


if __name__ == "__main__":
    main()
