"""The pretrain stage's steps: one per pretraining phase, each a launched trainer (model/train.py).

A phase's step folder holds its final HF model, metrics and summary, plus its checkpoints (not
fingerprinted; mirrored as they are written). A failed or killed trainer fails the task; the
retry finds the same partial folder and the trainer resumes from its newest complete checkpoint,
on whatever rank count the launcher now has: the rank count is operational, the global batch is not.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from infra import rayjobs, slurm
from infra.env import thread_count
from infra.errors import SmolflowError
from infra.launch import Tail, before_launch, check_exit, free_port, launch_command, launch_env, run_streaming
from infra.locks import exclusive
from infra.procs import OWNER_ENV, PREEMPTED
from infra.recipe import LauncherCfg, PretrainCfg, Recipe, StorageCfg, Strict, operational
from infra.steps import CHECKPOINTS, JOB, LAUNCH_LOG, PHASE_SUMMARY, StepOutput
from infra.storage import write_json_atomic
from infra.summaries import PhaseSummary
from model.config import Schedule, TrainConfig, TrainJob
from tasks.card import write_card
from tasks.common import run_logger, stage_task, tracking_env, tracking_project
from tasks.curation.mixtures import MixturePhase, windows
from tasks.curation.pipelines import source_data
from tasks.evaluation.plots import table_artifact
from tasks.evaluation.report import pretraining_table, step_metrics

# Checkpoints kept beyond keep_last while the eval follower catches up (tasks/evaluate.py).
HOLD_FOR_EVAL = 4


def mixture_phases(p: PretrainCfg) -> list[MixturePhase]:
    return [MixturePhase(name=ph.name, tokens=ph.tokens, mixture=ph.mixture, seq_len=p.phase_seq_len(ph)) for ph in p.phases]


def train_configs(recipe: Recipe) -> list[TrainConfig]:
    """Every phase's resolved training config: sample counts, steps and the global learning-rate schedule."""
    p, opt = recipe.pretrain, recipe.pretrain.optimizer
    samples = [windows(m) for m in mixture_phases(p)]
    steps = []
    for phase, counts in zip(p.phases, samples, strict=True):
        n = sum(counts.values()) // p.phase_batch(phase)
        if n == 0:
            raise SmolflowError(
                f"pretrain phase {phase.name}: {phase.tokens:,} tokens make no full step of {p.phase_batch(phase)} sequences"
            )
        steps.append(n)
    total = sum(n for n, ph in zip(steps, p.phases) if not ph.long_context)
    floor = opt.lr * opt.min_lr_ratio
    configs, offset = [], 0
    for i, (phase, counts, n) in enumerate(zip(p.phases, samples, steps)):
        constant = (phase.lr or opt.lr * max(opt.min_lr_ratio, 0.1)) if phase.long_context else None
        schedule = Schedule(
            steps=n, offset=offset, total=total, warmup=opt.warmup_steps, decay_start=total - int(total * opt.decay_fraction),
            peak=opt.lr, floor=floor, constant=constant,
        )  # fmt: skip
        configs.append(
            TrainConfig(
                phase=phase.name,
                index=i,
                seed=recipe.seed if p.seed is None else p.seed,
                model=recipe.model,
                samples=counts,
                seq_len=p.phase_seq_len(phase),
                batch_size=p.phase_batch(phase),
                schedule=schedule,
                betas=opt.betas,
                eps=opt.eps,
                weight_decay=opt.weight_decay,
                grad_clip=opt.grad_clip,
                z_loss=opt.z_loss,
                precision=p.precision,
                zero_stage=p.zero_stage,
                spike=p.spike,
                rope_theta=phase.rope_theta,
                yarn_factor=p.yarn_factor if i == len(p.phases) - 1 and phase.long_context else None,
                micro_batch_size=p.phase_micro_batch(phase),
                checkpoint=p.checkpoint,
                threads=p.launcher.threads_per_rank,
                log_every=p.log_every,
                tracking=p.tracking,
                project=tracking_project(recipe.name),
                peak_flops=p.hardware.peak_tflops * 1e12 if p.hardware.peak_tflops else None,
                hold_unevaluated=HOLD_FOR_EVAL if recipe.evaluation.follow and recipe.evaluation.checkpoint_tasks else 0,
            )  # fmt: skip
        )
        if not phase.long_context:
            offset += n
    return configs


def final_context(configs: list[TrainConfig]) -> tuple[int, str]:
    """The context of the pretrained model the phases export, and why: the first phase's sequence length, or the last
    long-context phase's, times the YaRN factor the last phase writes (model/train.py builds the configs so)."""
    trained = next((c for c in reversed(configs) if c.long_context), configs[0])
    factor = configs[-1].yarn_factor or 1
    why = f"the sequence length of {trained.phase}" + (f" x YaRN {factor:g}" if factor != 1 else "")
    return int(trained.seq_len * factor), f"{why}; {configs[-1].phase} is the last phase trained"


class PhaseStepCfg(Strict):
    train: TrainConfig
    launcher: LauncherCfg = operational(LauncherCfg())
    storage: StorageCfg = operational(StorageCfg())


def phase_reads(cfg: PhaseStepCfg, sources: list[str]) -> dict[str, tuple[str, ...]]:
    """A phase that draws on some of the curated SOURCES reads only their token files (`TrainJob.sources`), and of
    the mixtures step nothing (its config carries the counts; the step is its gate): a change in another source's
    data keeps its id and model, so a swarm proxy that left that source out is reused. A phase that draws on every
    source keeps the whole outputs' fingerprints."""
    drawn = list(cfg.train.samples)
    if set(drawn) >= set(sources):
        return {}
    return {"tokens": tuple(source_data(s) for s in drawn), "budget": ()}


def trainer_env(storage: StorageCfg, run_dir: Path) -> dict[str, str]:
    """Credentials reach the trainer through its environment, never through the job file."""
    env = tracking_env(run_dir)
    if storage.s3.key is not None:
        env["AWS_ACCESS_KEY_ID"] = storage.s3.key.get_secret_value()
    if storage.s3.secret is not None:
        env["AWS_SECRET_ACCESS_KEY"] = storage.s3.secret.get_secret_value()
    return env


PEAK = "peak_flops.json"


def store_peak_flops(store: Path, threads: int, phase: str) -> float:
    """The MFU denominator of a CPU run without `pretrain.hardware.peak_tflops`: one fp32 matmul probe per host and
    thread count, kept in STORE/peak_flops.json with how it was taken and reused by every phase and run whose steps
    live there (reruns, an ablation's variants, a swarm's proxies). So it is taken before the first of their trainers
    starts, one probe at a time: a probe beside a trainer or checkpoint evaluations reads low and inflates MFU
    (measured: 79% for an honest 31%), as a swarm's later proxies did when each run took its own."""
    path, key, host = store / PEAK, str(threads), socket.gethostname()
    with exclusive(store / f".{PEAK}.lock"):
        probes = json.loads(path.read_text()) if path.is_file() else {}
        if key not in probes.get(host, {}):
            import torch

            from model.plan import measure_peak_flops

            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                flops = measure_peak_flops()
            finally:
                torch.set_num_threads(before)
            method = f"fp32 matmul 1024x1024, best of 5 probes over 1.5 s, {threads} thread(s), before {phase}'s trainer started"
            probes.setdefault(host, {})[key] = {
                "flops_per_rank": flops,
                "method": method,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            write_json_atomic(path, probes)
            run_logger().info("peak for MFU: %.1f GFLOP/s per rank (%s), kept in %s", flops / 1e9, method, path)
    return probes[host][key]["flops_per_rank"]


class PhaseData(TypedDict):
    tokens: StepOutput  # tokenize
    bpe: StepOutput  # tokenizer
    budget: StepOutput  # mixtures: the data holds what the phase draws


class PhaseInputs(PhaseData, total=False):
    previous: StepOutput  # the phase before, for every phase but the first


def train_phase(cfg: PhaseStepCfg, inputs: PhaseInputs, out: Path) -> PhaseSummary:
    """Launch the trainer on the phase's job (its roles: PhaseInputs)."""
    t, previous, log = cfg.train, inputs.get("previous"), run_logger()
    run_dir = inputs["tokens"].path.parent  # inputs are linked from the run: RUN/NAME
    init_from = init_remote = None
    if previous is not None:
        init_from = str(previous.final if t.long_context else previous.checkpoints)
        init_remote = f"{previous.folder}/{CHECKPOINTS}"
    import torch

    # a Slurm job or Ray task probes on its own node, a GPU trainer its own device in the phase's precision
    if t.peak_flops is None and cfg.launcher.kind not in ("slurm", "ray") and not torch.cuda.is_available():
        store = inputs["tokens"].path.resolve().parent  # where the links lead: STORE/NAME-ID
        t = t.model_copy(update={"peak_flops": store_peak_flops(store, thread_count(cfg.launcher.threads_per_rank), t.phase)})
    job = TrainJob(
        config=t,
        sources={name: str(inputs["tokens"].path / source_data(name)) for name in t.samples},  # what phase_reads names
        tokenizer_dir=str(inputs["bpe"].path),
        out_dir=str(out),
        checkpoint_dir=str(out / CHECKPOINTS),
        init_from=init_from,
        init_remote=init_remote,
        remote_name=f"{out.name}/{CHECKPOINTS}",  # the mirror holds the store's relative names: NAME-ID/checkpoints
        mirror=cfg.storage.mirror,
        s3_endpoint=cfg.storage.s3.endpoint_url,
        s3_region=cfg.storage.s3.region,
    )
    job_path = out / JOB
    job_path.write_text(job.model_dump_json(indent=2))
    before_launch(out)  # not the summary: a Slurm job an earlier attempt submitted may have written it already
    launcher = cfg.launcher
    if launcher.kind == "ray":  # on the worker: one process, or torchrun's ranks
        launcher = launcher.model_copy(update={"kind": "python" if launcher.nproc == 1 else "torchrun"})
    env = launch_env(launcher, trainer_env(cfg.storage, run_dir))
    tail = Tail(log.info)  # the local trainer's last lines, for the error (a job's own log holds the rest)
    if cfg.launcher.kind == "slurm":
        code = run_slurm_job(cfg.launcher, out, job_path, env, t.phase)
    else:
        command = launch_command(launcher, "model.train", [str(job_path)], port=free_port())
        log.info("pretrain %s: %s%s", t.phase, " ".join(command), " (a Ray task)" if cfg.launcher.kind == "ray" else "")
        code = (
            run_ray_task(cfg.launcher, out, command, env)
            if cfg.launcher.kind == "ray"
            else run_streaming(command, env, tail, grace_s=cfg.launcher.stop_grace_s, log=out / LAUNCH_LOG)
        )
    summary = out / PHASE_SUMMARY  # written last, by rank 0, once the phase is done
    check_exit(f"pretrain {t.phase}", code, out, [Path(job.checkpoint_dir), out], summary, tail)
    result = PhaseSummary.model_validate_json(summary.read_text())
    write_card(out, cfg, result, inputs)
    return result


def run_slurm_job(
    launcher: LauncherCfg, out: Path, job_path: Path, env: dict[str, str], phase: str, on_line: Callable[[str], None] | None = None
) -> int | None:
    """Submit the phase's batch job, or follow the one a previous attempt of this step submitted; its exit code."""
    log, name, job_log = run_logger(), slurm.job_name(out), out / "slurm.log"
    job = slurm.find(name)
    if job is None:
        script = out / "job.sbatch"
        script.write_text(slurm.batch_script(launcher, name, job_log, "model.train", [str(job_path)], out))
        job = slurm.submit(script, {k: v for k, v in env.items() if k != OWNER_ENV})  # the job outlives this task
        log.info("pretrain %s: submitted Slurm job %s (%s)", phase, job, script)
    else:
        log.info("pretrain %s: following Slurm job %s, submitted by an earlier attempt", phase, job)
    end = slurm.follow(job, job_log, on_line or log.info, pending_s=launcher.slurm.pending_hours * 3600)
    if end.name != "COMPLETED":
        log.warning("pretrain %s: Slurm job %s ended %s (exit code %s)", phase, job, end.name, end.exit_code)
    return PREEMPTED if end.name in ("TIMEOUT", "PREEMPTED", "NODE_FAIL") else end.exit_code


def run_ray_task(launcher: LauncherCfg, out: Path, command: list[str], env: dict[str, str]) -> int:
    """The launch command as a Ray task on the cluster, its output in OUT/ray.log and this task's log; its exit code."""
    rayjobs.connect(launcher.ray_address)
    cpus = launcher.nproc * thread_count(launcher.threads_per_rank)
    return rayjobs.run_task(command, env, out / "ray.log", cpus, out.name, run_logger().info, launcher.stop_grace_s)


@stage_task("pretrain-report", retries=1)
def report(run_dir: Path, name: str, phases: list[StepOutput]) -> Path:
    rows = [
        {
            "phase": s.summary.phase,
            "steps": s.summary.steps,
            "tokens": s.summary.tokens,
            "seq_len": s.summary.seq_len,
            "final_loss": round(s.summary.final_loss, 4),
            "seconds": s.seconds,
            "cached": s.cached,
        }
        for s in phases
    ]
    per_phase = {s.summary.phase: step_metrics(run_dir, s.name) for s in phases}
    lines = ["# Pretraining", "", *pretraining_table(per_phase)]
    path = run_dir / "reports" / "pretrain.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + f"\n\nFinal model: `{phases[-1].final}`\n")
    table_artifact(rows, key=f"{name}-pretrain".replace("_", "-"), description="Pretraining phases")
    run_logger().info("pretrain report: %s", path.resolve())
    return path
