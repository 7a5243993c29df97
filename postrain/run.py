"""One TRL stage on the ranks `accelerate launch` started: `python -m postrain.run JOB.json`.

tasks/postrain.py writes the job and launches this on `postrain.launcher.nproc` ranks; every rank
trains, and rank 0 writes `result.json` beside the job once `final` is saved: without it the
launch did not finish, and a retry resumes from the newest complete checkpoint. SIGTERM or SIGUSR1
makes the ranks save a checkpoint and exit with PREEMPTED (postrain/common.py `stop_on_signal`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.env import skip_deepspeed_shm_build, skip_unused_imports
from infra.launch import mark_disk_full
from infra.procs import PREEMPTED, die_with_parent, exit_without_teardown, watch_owner
from infra.recipe import PostrainCfg, TrainerCfg
from infra.storage import write_json_atomic
from postrain.common import Stopped, tracking_args
from postrain.data import read_jsonl

RESULT = "result.json"


class PostJob(BaseModel):
    stage: str  # a trainer's section of the recipe (`PostrainCfg.trainer_types`)
    model: str  # the HF model to start from
    data: str  # JSONL: chat examples (sft, grpo) or preference pairs (apo)
    config: dict[str, Any]  # the stage's trainer config (SFTCfg, APOCfg, GRPOCfg)
    out: str
    seed: int
    tracking: str | None = None  # the trackio project the trainer logs its curves to (None: metrics only in result.json)

    def trainer_cfg(self) -> TrainerCfg:
        return PostrainCfg.trainer_types()[self.stage].model_validate(self.config)


def load_cpu_index_locations() -> None:
    """Let torch.load map storages onto `cpu:N`.

    accelerate gives each CPU rank the device `cpu:0`, and transformers resumes a multi-rank run with
    `torch.load(optimizer.pt, map_location=args.device)`, which torch 2.13 refuses ("don't know how to
    restore data location ... cpu:0"): a CPU storage needs no moving, so it is returned as it is.
    """
    import torch

    torch.serialization.register_package(
        5, lambda obj: None, lambda obj, location: obj if location.startswith("cpu:") and obj.device.type == "cpu" else None
    )


def run(job: PostJob) -> dict[str, Any]:
    """The job's trainer from the registry (infra/recipe.py `PostrainCfg.trainer_types`). Only its module is
    imported: TRL's GRPO module loads vLLM, 5-7 s more on every SFT or APO rank."""
    cfg = job.trainer_cfg()
    module, function = cfg.trainer.split(":")
    trainer = getattr(importlib.import_module(module), function)
    tracking = tracking_args(job.tracking, job.stage)
    return trainer(job.model, read_jsonl(Path(job.data)), cfg, Path(job.out), job.seed, tracking)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train one post-training stage (a job file written by smolflow) on this rank.")
    parser.add_argument("job", type=Path, help="the step's job.json")
    args = parser.parse_args()
    job = PostJob.model_validate_json(args.job.read_text())
    skip_unused_imports(*job.trainer_cfg().unused_modules())  # this module imports no transformers; the trainer's, in `run`, does
    die_with_parent()
    watch_owner()
    load_cpu_index_locations()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # `accelerate launch` with a DeepSpeed config
        skip_deepspeed_shm_build()
    try:
        result = run(job)
    except Stopped as stopped:  # signalled: a checkpoint is saved, every rank stopped at the same step
        print(stopped, flush=True)
        result = None
    except Exception as err:  # a full disk is said beside the exit, for the task to end without a retry
        mark_disk_full(err, Path(job.out), [Path(job.out)])
        raise
    from accelerate import PartialState

    state = PartialState()
    if state.is_main_process and result is not None:
        write_json_atomic(Path(job.out) / RESULT, result)
    # every rank leaves the process group together: a rank exiting with gloo's threads still up aborts
    # ("terminate called without an active exception"), and the launcher reports the whole launch failed
    state.wait_for_everyone()
    state.destroy_process_group()
    if result is None:
        sys.exit(PREEMPTED)


if __name__ == "__main__":
    exit_without_teardown(main)
