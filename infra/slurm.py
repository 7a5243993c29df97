"""Multi-node pretraining on Slurm: a batch script that runs the deepspeed launcher over the allocation.

The job is requeued on preemption or timeout (`--requeue`, plus a USR1 warning five minutes before
the time limit); the requeued run starts the same trainer job, which resumes from its newest
complete checkpoint (local, or pulled from the S3 mirror on a different node).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from infra.recipe import Recipe

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={cpus_per_task}
#SBATCH --partition={partition}
#SBATCH --time={time}
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output={log_dir}/%x-%j.out
set -euo pipefail

# preempted or near the time limit: requeue; the trainer resumes from its newest checkpoint
trap 'echo "requeueing $SLURM_JOB_ID"; scontrol requeue "$SLURM_JOB_ID"' USR1

HOSTFILE={hostfile}
scontrol show hostnames "$SLURM_JOB_NODELIST" | awk '{{print $1" slots={gpus_per_node}"}}' > "$HOSTFILE"
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR OMP_NUM_THREADS={threads}

{launch} &
wait $!
"""


def sbatch_script(recipe: Recipe, stage: str, job_file: Path, nodes: int, gpus_per_node: int, log_dir: Path) -> str:
    """The batch script for one pretraining stage's trainer job on `nodes` x `gpus_per_node` GPUs."""
    p, slurm = recipe.pretrain, recipe.executor.slurm
    hostfile = log_dir / f"hostfile-{stage}-$SLURM_JOB_ID"
    deepspeed = Path(sys.executable).with_name("deepspeed")
    launch = " ".join(
        [
            shlex.quote(str(deepspeed)),
            "--hostfile",
            '"$HOSTFILE"',
            "--num_gpus",
            str(gpus_per_node),
            "--num_nodes",
            str(nodes),
            "--master_addr",
            '"$MASTER_ADDR"',
            "--master_port",
            "29500",
            "--module",
            "model.train",
            shlex.quote(str(job_file)),
        ]
    )
    return TEMPLATE.format(
        job_name=f"smolflow-{recipe.name}-{stage}",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        cpus_per_task=slurm.cpus_per_task,
        partition=slurm.partition,
        time=slurm.time,
        log_dir=log_dir,
        hostfile=hostfile,
        threads=p.launcher.threads_per_rank,
        launch=launch,
    )
