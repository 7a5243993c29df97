"""The datatrove pipelines of the curate stage, one builder per step.

Each builder takes the step's output folder (see infra/steps.py), runs real datatrove pipelines
through the executor the recipe names, and returns the step's summary: documents in and out,
what each filter or dedup stage removed, and per-source counts. Data between steps is
datatrove JSONL under `STEP/data/SOURCE/`; removed documents are kept under `STEP/removed/`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import multiprocess
import numpy as np
from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter
from datatrove.pipeline.dedup import MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupBuckets
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import create_hash_func
from datatrove.utils.text import TextNormConfig, ngrams, simplify_text
from fsspec.compression import register_compression

from infra.errors import DataError, SmolflowError, Stopped
from infra.procs import STOPPING
from infra.rayjobs import connect
from infra.recipe import DecontaminateCfg, DedupCfg, ExecutorCfg, S3Cfg, SourceCfg
from tasks.curation.filters import HeldOutSplit, ShortItemDecontFilter, build_filters
from tasks.curation.readers import list_source_files, make_reader
from tasks.curation.tokenizer import EOS
from tasks.curation.words import SPLIT_WORDS

log = logging.getLogger(__name__)
DATA = "data"
HELDOUT = "heldout"  # tokenize/heldout/SOURCE: documents kept out of training for perplexity evals
DOC_FILES = "*/*.jsonl.gz"


def source_data(source: str) -> str:
    """The folder of one source's token files in the tokenize step (tokenize/data/SOURCE/), as a step's `reads` names it."""
    return f"{DATA}/{source}/"


# --- executors -------------------------------------------------------------------------------


def make_executor(cfg: ExecutorCfg, pipeline: list, logging_dir: Path, tasks: int, job_name: str):
    """datatrove's Local, Slurm or Ray executor for `pipeline`, as the recipe's `executor` says."""
    if cfg.kind == "local":
        _preload_forkserver()
        return LocalExecutor(pipeline, tasks=tasks, workers=min(cfg.workers, tasks), logging_dir=str(logging_dir))
    if cfg.kind == "slurm":
        return SlurmExecutor(
            pipeline,
            tasks=tasks,
            time=cfg.slurm.time,
            partition=cfg.slurm.partition,
            cpus_per_task=cfg.slurm.cpus_per_task,
            mem_per_cpu_gb=cfg.slurm.mem_per_cpu_gb,
            workers=cfg.workers,
            tasks_per_job=tasks_per_job(cfg, tasks),
            job_name=slurm_job_name(job_name, logging_dir),
            # datatrove writes `{mem_per_cpu_gb}G`, which sbatch refuses for a float ("2.0G"): megabytes instead
            sbatch_args={"mem-per-cpu": f"{round(cfg.slurm.mem_per_cpu_gb * 1024)}M", **cfg.slurm.sbatch_args},
            venv_path=os.path.join(sys.prefix, "bin", "activate"),
            logging_dir=str(logging_dir),
        )
    from datatrove.executor import RayPipelineExecutor

    return RayPipelineExecutor(
        pipeline,
        tasks=tasks,
        workers=cfg.workers,
        tasks_per_job=tasks_per_job(cfg, tasks),
        logging_dir=str(logging_dir),
        time=round(cfg.timeout_hours * 3600),  # per job (tasks_per_job shards): Ray's executor runs them to the end itself
    )


def tasks_per_job(cfg: ExecutorCfg, tasks: int) -> int:
    """Shards per Slurm array job or Ray actor. Each job is a fresh process that imports datatrove and this module
    (~2.3 CPU s, bench/jobs.py), more than a micro shard's own work: 'even' starts at most `workers` jobs a pipeline."""
    return math.ceil(tasks / cfg.workers) if cfg.tasks_per_job == "even" else cfg.tasks_per_job


def _preload_forkserver() -> None:
    """Have the forkserver that starts datatrove's local workers import the pipeline steps once.

    Each worker otherwise imports datatrove and this module itself (~3 s on 2 quiet cores, ~6 s busy),
    and a curate run starts a pool per pipeline: with the imports in the forkserver, which lives as long
    as this process, a pool starts in ~0.2 s. No effect once the forkserver is running.
    """
    multiprocess.get_context("forkserver").set_forkserver_preload(["__main__", __name__])


STOP_POLL_S = 0.5


class LocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor, stopped when this process is STOPPING (a signal; Prefect raises only in the main
    thread, and an ablation runs its runs in threads beside it): no rank starts after it, and a rank running in a pool
    worker is interrupted once the stop file appears (the worker raises Stopped, which ends the pool). Ranks already
    completed stay so: a rerun runs only the others. With one worker, ranks run in this thread: it stops between them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_file = os.path.join(self.logging_dir.path, f".stop-{uuid.uuid4().hex}")  # pool workers see no event

    def run(self):
        done = threading.Event()

        def watch() -> None:
            while not done.wait(STOP_POLL_S):
                if STOPPING.is_set():
                    Path(self.stop_file).touch()
                    return

        threading.Thread(target=watch, daemon=True, name="datatrove-stop").start()
        try:
            return super().run()
        except Exception as err:
            if STOPPING.is_set():
                raise Stopped(f"{self.logging_dir.path}: stopped by a signal; its completed ranks are kept") from err
            raise
        finally:
            done.set()
            Path(self.stop_file).unlink(missing_ok=True)

    def _launch_run_for_rank(self, rank: int, ranks_q, completed=None, completed_lock=None):
        if STOPPING.is_set() or os.path.exists(self.stop_file):
            raise Stopped(f"rank {rank} not started: stopping")
        with _interrupted_by(self.stop_file):
            return super()._launch_run_for_rank(rank, ranks_q, completed, completed_lock)


@contextmanager
def _interrupted_by(stop_file: str):
    """In a pool worker's main thread: raise Stopped there once STOP_FILE exists (a signal to itself, whose handler
    raises between two bytecodes), so the pool hands the error back instead of finishing the rank."""
    if threading.current_thread() is not threading.main_thread() or multiprocess.parent_process() is None:
        yield
        return
    done = threading.Event()

    def stop(*_: Any) -> None:
        raise Stopped("stopping: this rank is interrupted")

    def watch() -> None:
        while not done.wait(STOP_POLL_S):
            if os.path.exists(stop_file):
                os.kill(os.getpid(), signal.SIGUSR1)
                return

    before = signal.signal(signal.SIGUSR1, stop)
    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGUSR1, before)


def process_pool(workers: int):
    """A pool of WORKERS processes started by the forkserver datatrove's local workers come from: one
    server per process, its imports paid once (a forkserver, not fork: a flow's process runs threads)."""
    _preload_forkserver()
    return multiprocess.get_context("forkserver").Pool(workers)


class SlurmExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor without its stats-merge job: the task sums the per-task stats itself (read_stats),
    and a merge job would cost each pipeline a scheduling round and write into the step after it is committed."""

    def launch_merge_stats(self):
        pass


def slurm_job_name(job_name: str, logging_dir: Path) -> str:
    """Unique per pipeline folder, so two runs' `filter-web` jobs are never waited for (or cancelled) as one."""
    return f"smolflow-{job_name}-{hashlib.sha256(str(logging_dir.resolve()).encode()).hexdigest()[:8]}"


class ClusterTimeout(SmolflowError):
    """A cluster pipeline ran past its time budget; a retry reruns only its incomplete tasks."""

    retryable = True


class ClusterJobFailed(SmolflowError):
    """A cluster pipeline's jobs ended with tasks incomplete (a rank failed, a node died); a retry reruns only those."""

    retryable = True


def run_pipeline(cfg: ExecutorCfg, pipeline: list, logging_dir: Path, tasks: int, job_name: str) -> list[dict]:
    """Run to completion (cluster jobs are polled; interrupted, they are cancelled) and return the per-step counters."""
    executor = make_executor(cfg, pipeline, logging_dir, tasks, job_name)
    log.info("%s: %d task(s) on the %s executor", job_name, tasks, cfg.kind)
    if cfg.kind == "local":
        executor.run()
        return read_stats(logging_dir)
    if cfg.kind == "ray":
        connect(cfg.ray_address)
        try:
            executor.run()
        except BaseException:  # cancelled, interrupted: the tasks this driver owns die when it leaves the cluster
            import ray

            ray.shutdown()
            raise
        if left := executor.get_incomplete_ranks():
            raise ClusterJobFailed(
                f"{job_name}: its Ray tasks ended with {len(left)} of {tasks} tasks incomplete (ranks {left[:10]}); "
                f"a retry runs only those. Rank {left[0]}:\n{_rank_log_tail(logging_dir, left[0])}"
            )
        return read_stats(logging_dir)
    if stale := _slurm_jobs(executor.job_name):
        # the step's lock is ours, so jobs of this name are an earlier attempt's whose flow process was killed (no
        # `except` ran): cancelled before submitting, else a rank runs in two jobs at once, both writing its shard
        log.warning("%s: cancelling jobs %s of an earlier attempt before submitting", job_name, [j[0] for j in stale])
        _scancel(executor.job_name)
    try:
        executor.run()
        _wait_for_slurm(executor, cfg, logging_dir, tasks, job_name)
    except BaseException:
        _scancel(executor.job_name)
        raise
    return read_stats(logging_dir)


def _slurm_jobs(name: str) -> list[tuple[str, str, str]]:
    """(id, state, reason) of each queued or running job called `name`."""
    out = subprocess.run(
        ["squeue", "--me", "--noheader", f"--name={name}", "--format=%i|%T|%r"], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise ClusterJobFailed(f"squeue failed: {out.stderr.strip()[-500:]}")
    return [tuple(line.split("|")) for line in out.stdout.split()]


def _scancel(name: str, wait_s: float = 120) -> None:
    """Cancel the jobs called `name` and wait until they left the queue (none still writing into the step)."""
    subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)
    deadline = time.time() + wait_s
    while (jobs := _slurm_jobs(name)) and time.time() < deadline:
        time.sleep(1)
    if jobs:
        log.warning("%s: jobs %s still in the queue %.0f s after scancel", name, [j[0] for j in jobs], wait_s)


def _wait_for_slurm(executor, cfg: ExecutorCfg, logging_dir: Path, tasks: int, job_name: str) -> None:
    """Until every task is complete and the jobs have left the queue.

    A job whose dependency can never be met counts as gone; jobs gone with tasks incomplete fail the
    task with the first incomplete rank's log tail. The tasks' completion files are listed every second
    (one folder on the shared disk), the queue (squeue, a call on slurmctld) backs off from 1 s to 10 s and
    is asked at once when the files say all are done: polling only the queue with that back-off found
    a 5 s job done ~8 s late, each pipeline of a curation waiting on it.
    """
    deadline, delay, ask_at = time.time() + cfg.timeout_hours * 3600, 1.0, 0.0
    while True:
        left = executor.get_incomplete_ranks()
        if left and time.time() < ask_at:
            time.sleep(1)
            continue
        jobs = _slurm_jobs(executor.job_name)
        alive = [j for j in jobs if j[2] != "DependencyNeverSatisfied"]
        if not alive:
            if jobs:
                _scancel(executor.job_name)
            if not left:
                return
            raise ClusterJobFailed(
                f"{job_name}: its Slurm jobs ended with {len(left)} of {tasks} tasks incomplete (ranks {left[:10]}); "
                f"a retry runs only those. Rank {left[0]}:\n{_rank_log_tail(logging_dir, left[0], _slurm_outputs(executor, left[0]))}"
            )
        if time.time() > deadline:
            raise ClusterTimeout(
                f"{job_name}: {len(left)} of {tasks} tasks still incomplete after {cfg.timeout_hours:g} h (executor.timeout_hours); "
                f"their logs are in {logging_dir / 'logs'}; a retry runs only the incomplete ones"
            )
        log.info("%s: waiting for %d of %d tasks (jobs %s)", job_name, len(left), tasks, ", ".join(f"{i} {s}" for i, s, _ in jobs))
        ask_at, delay = time.time() + delay, min(delay * 2, 10)
        time.sleep(1)


def _rank_log_tail(logging_dir: Path, rank: int, job_outputs: Sequence[Path] = (), lines: int = 20) -> str:
    """The end of a rank's datatrove log, else of the output of the Slurm job that ran it (where a crash before logging shows)."""
    for path in [logging_dir / "logs" / f"task_{rank:05d}.log", *job_outputs]:
        if path.exists() and path.stat().st_size:
            return f"{path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return f"(no log under {logging_dir})"


def _slurm_outputs(executor: SlurmPipelineExecutor, rank: int) -> list[Path]:
    """The Slurm output of the array job that ran RANK in the last launch, newest first. datatrove numbers a launch's
    jobs by position in its ranks_to_run.json, `tasks_per_job` positions a job, not by rank: with several ranks a job,
    or on a retry (which launches only the incomplete ranks), job RANK's output is another rank's."""
    launched = Path(executor.logging_dir.path, "ranks_to_run.json")
    listed = json.loads(launched.read_text()) if launched.exists() else []
    if rank not in listed:
        return []
    index = listed.index(rank) // executor.tasks_per_job
    if executor.max_array_size != -1:  # a longer launch is split into arrays of this many jobs, each numbered from 0
        index %= executor.max_array_size
    return sorted(Path(executor.slurm_logs_folder).glob(f"*_{index}.out"), key=lambda p: p.stat().st_mtime, reverse=True)


def read_stats(logging_dir: Path) -> list[dict]:
    """Counters per pipeline step, summed over every task's stats file (resumed tasks included)."""
    merged: list[dict] = []
    for path in sorted((logging_dir / "stats").glob("*.json")):
        for i, step in enumerate(json.loads(path.read_text())):
            if i == len(merged):
                merged.append({"name": step["name"], "counters": Counter()})
            for key, value in step["stats"].items():
                merged[i]["counters"][key] += value["total"] if isinstance(value, dict) else value
    return [{"name": s["name"], "counters": dict(s["counters"])} for s in merged]


def count_docs(data_dir: Path) -> dict[str, int]:
    """Documents per source in a step's `data/SOURCE/*.jsonl.gz` files."""
    counts: dict[str, int] = {}
    for source_dir in sorted(p for p in data_dir.iterdir() if p.is_dir()) if data_dir.exists() else []:
        counts[source_dir.name] = count_source_docs(source_dir)
    return counts


def count_source_docs(source_dir: Path) -> int:
    """Documents in one source's `*.jsonl.gz` files."""
    return sum(_count_lines(f) for f in source_dir.glob("*.jsonl.gz"))


def _count_lines(path: Path) -> int:
    with gzip.open(path, "rb") as f:
        return sum(1 for _ in f)


GZIP6 = "gzip6"
# mtime=0: gzip stamps the time of writing in each file's header, so two builds of the same documents had other
# bytes, and each build gave the steps downstream new ids
register_compression(GZIP6, lambda f, mode="rb", **kw: gzip.GzipFile(fileobj=f, mode=mode, compresslevel=6, mtime=0, **kw), [], force=True)


class Writer(JsonlWriter):
    """datatrove's JSONL writer at gzip level 6 with no time stamp: its plain "gzip" goes through fsspec's GzipFile at
    level 9, 3x the CPU of level 6 for files ~1% smaller. The files are ordinary `.jsonl.gz`; being a class of this
    module, it registers the compression in every process that unpickles it (local, Slurm or Ray workers)."""

    def __init__(self, folder: str, output_filename: str):
        super().__init__(folder, output_filename=output_filename, compression=GZIP6)


def _writer(folder: Path, by_source: bool = True, suffix: str = "") -> Writer:
    """SUFFIX tells apart the files of two writers sharing a folder (they would write the same names)."""
    name = f"${{rank}}{suffix}.jsonl.gz"
    return Writer(str(folder), f"${{source}}/{name}" if by_source else name)


def _reader(folder: Path, glob: str = "*.jsonl.gz") -> JsonlReader:
    """Reads a step's own documents without adding their path (readers.py `get_document_from_dict` says why)."""
    return JsonlReader(str(folder), glob_pattern=glob, add_file_path=False)


def _tasks_for(cfg: ExecutorCfg, n_files: int) -> int:
    return max(1, min(cfg.tasks, n_files))


# --- steps -----------------------------------------------------------------------------------


def ingest(
    sources: list[SourceCfg], source_paths: dict[str, str], executor: ExecutorCfg, s3: S3Cfg, strict: bool, out: Path
) -> dict[str, Any]:
    """Read every raw source into uniform JSONL tagged with its source and domain."""
    summary: dict[str, Any] = {"sources": {}}
    for source in sources:
        folder, glob, files = list_source_files(source, source_paths[source.name], s3)
        errors_dir = out / "errors" / source.name
        reader = make_reader(source, folder, glob, s3, errors_dir, strict)
        stats = run_pipeline(
            executor,
            [reader, _writer(out / DATA)],
            out / "logs" / source.name,
            _tasks_for(executor, len(files)),
            f"ingest-{source.name}",
        )
        docs = count_source_docs(out / DATA / source.name)
        malformed = stats[0]["counters"].get("malformed", 0) if stats else 0
        summary["sources"][source.name] = {
            "files": len(files),
            "docs": docs,
            "malformed": malformed,
            "errors": read_errors(errors_dir, 5),
        }
        if docs == 0:
            raise DataError(
                f"source {source.name!r} ({source_paths[source.name]}): no usable documents "
                f"in {len(files)} file(s); {malformed} malformed record(s), first: "
                f"{read_errors(errors_dir, 3)}"
            )
    return summary


def read_errors(errors_dir: Path, limit: int) -> list[dict]:
    errors: list[dict] = []
    for path in sorted(errors_dir.glob("*.jsonl")) if errors_dir.exists() else []:
        with open(path) as f:
            errors.extend(json.loads(line) for line in f)
    return errors[:limit]


def filter_docs(filters: dict[str, dict[str, dict[str, Any]]], executor: ExecutorCfg, ingested: Path, out: Path) -> dict[str, Any]:
    """Each source (`filters`: source -> filter -> parameters) through its filters; removed documents are kept per filter."""
    summary: dict[str, Any] = {"sources": {}}
    for source, params in filters.items():
        in_dir = ingested / DATA / source
        pipeline = [
            _reader(in_dir),
            *build_filters(params, lambda name, s=source: _writer(out / "removed" / s / name, by_source=False)),
            _writer(out / DATA),
        ]
        n_files = len(list(in_dir.glob("*.jsonl.gz")))
        stats = run_pipeline(executor, pipeline, out / "logs" / source, _tasks_for(executor, n_files), f"filter-{source}")
        docs_in = stats[0]["counters"].get("documents", 0)
        removed = {
            name: {
                "total": step["counters"].get("dropped", 0),
                "reasons": {k.removeprefix("dropped_"): v for k, v in step["counters"].items() if k.startswith("dropped_")},
            }
            for name, step in zip(params, stats[1 : 1 + len(params)])
        }
        summary["sources"][source] = {"docs_in": docs_in, "docs_out": count_source_docs(out / DATA / source), "removed": removed}
    return summary


def passthrough(previous: Path, out: Path) -> dict[str, Any]:
    """A disabled step: the previous step's documents, copied unchanged."""
    shutil.copytree(previous / DATA, out / DATA)
    return {"docs_out": count_docs(out / DATA)}


def _text_of(doc) -> str:
    return doc.text


class Signatures(MinhashDedupSignature):
    """datatrove's MinHash signatures, the same shingles found faster: its text simplification strips diacritics
    one character at a time in Python (a third of the stage's time), a no-op on ASCII text, skipped there."""

    def get_shingles(self, text: str) -> np.ndarray:
        norm = self.config.norm_config
        if norm.norm_unicode_diacritics and text.isascii():
            norm = replace(norm, norm_unicode_diacritics=False)
        words = self.word_tokenizer.word_tokenize(simplify_text(text, norm))
        n = self.config.n_grams
        grams = (" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
        return np.fromiter((self._hash_func(g) for g in grams), dtype=np.uint64).reshape((-1, 1))


def dedup(cfg: DedupCfg, ex: ExecutorCfg, filtered: Path, out: Path) -> dict[str, Any]:
    """Exact dedup, then MinHash near-dedup (datatrove's four stages), across all sources.

    The summary's `seconds` gives each datatrove stage's wall time: where a dedup's time goes."""
    docs_in = count_docs(filtered / DATA)
    current = filtered / DATA
    removed: dict[str, int] = {}
    seconds: dict[str, float] = {}

    def stage(name: str, tasks: int, *steps) -> list[dict]:
        started = time.perf_counter()
        stats = run_pipeline(ex, list(steps), out / "logs" / name, tasks, f"dedup-{name}")
        seconds[name] = round(time.perf_counter() - started, 2)
        return stats

    def shards() -> int:
        return _tasks_for(ex, len(list(current.glob(DOC_FILES))))

    if cfg.exact:
        exact_cfg = ExactDedupConfig(content_getter=_text_of)
        sigs, dups = out / "work" / "exact_sigs", out / "work" / "exact_dups"
        stage("exact-signatures", shards(), _reader(current, DOC_FILES), ExactDedupSignature(str(sigs), exact_cfg))
        stage("exact-find", 1, ExactFindDedups(str(sigs), str(dups), exact_cfg))
        stats = stage(
            "exact-filter",
            shards(),
            _reader(current, DOC_FILES),
            ExactDedupFilter(str(dups), exact_cfg, exclusion_writer=_writer(out / "removed" / "exact", False)),
            _writer(out / "work" / "exact_out"),
        )
        removed["exact"] = stats[1]["counters"].get("dropped", 0)
        current = out / "work" / "exact_out"

    mh = cfg.minhash
    if mh.enabled:
        mh_cfg = MinhashConfig(
            n_grams=mh.n_grams,
            num_buckets=mh.buckets,
            hashes_per_bucket=mh.hashes_per_bucket,
            norm_config=TextNormConfig(norm_numbers=mh.normalize_numbers),
        )
        work = out / "work"
        stage(
            "minhash-signatures",
            shards(),
            _reader(current, DOC_FILES),
            Signatures(str(work / "mh_sigs"), config=mh_cfg, language=SPLIT_WORDS),
        )
        stage("minhash-buckets", mh.buckets, MinhashDedupBuckets(str(work / "mh_sigs"), str(work / "mh_buckets"), config=mh_cfg))
        stage("minhash-cluster", 1, MinhashDedupCluster(str(work / "mh_buckets"), str(work / "mh_clusters"), config=mh_cfg))
        stats = stage(
            "minhash-filter",
            shards(),
            _reader(current, DOC_FILES),
            MinhashDedupFilter(str(work / "mh_clusters"), exclusion_writer=_writer(out / "removed" / "minhash", False)),
            _writer(out / DATA),
        )
        removed["minhash"] = stats[1]["counters"].get("dropped", 0)
    else:
        shutil.copytree(current, out / DATA)
    shutil.rmtree(out / "work", ignore_errors=True)
    total_in = sum(docs_in.values())
    return {
        "docs_in": total_in,
        "removed": removed,
        "rates": {k: round(v / total_in, 4) if total_in else 0.0 for k, v in removed.items()},
        "docs_out": count_docs(out / DATA),
        "seconds": seconds,
    }


# --- decontamination -------------------------------------------------------------------------

# numbers stay as they are: normalised to 0, every templated math question would match every other
DECONT_NORM = TextNormConfig(norm_numbers=False)


def decont_config(n_grams: int) -> NGramsDecontConfig:
    return NGramsDecontConfig(n_grams=n_grams, norm_config=DECONT_NORM)


def build_decont_index(
    eval_sets: list[str], fields: list[str], n_grams: int, index_dir: Path
) -> tuple[dict[str, dict[str, int]], dict[str, list[str]]]:
    """Hash every n-gram of each eval item's text into `TASK.index.hashes` (datatrove's index format).

    datatrove's own indexer loads eval sets through lighteval; this reads the project's JSONL eval
    sets and normalises, splits and hashes exactly as `NGramsDecontFilter` does, so the filter
    finds them. Items shorter than n words cannot be matched this way: they are returned apart, per
    eval set, for `ShortItemDecontFilter`'s exact check.
    """
    cfg = decont_config(n_grams)
    hash_func = create_hash_func(cfg.hash_config)
    index_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    short: dict[str, list[str]] = {}
    for eval_path in eval_sets:
        task = Path(eval_path).name.split(".")[0]
        hashes: set[int] = set()
        items = n_short = 0
        try:
            lines = Path(eval_path).read_text().splitlines()
        except FileNotFoundError:
            raise DataError(f"curate.decontamination.eval_sets: {eval_path} not found") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{eval_path}:{number}: not valid JSON: {err}") from None
            text = " ".join(str(item[f]) for f in fields if f in item)
            words = SPLIT_WORDS.word_tokenize(simplify_text(text, cfg.norm_config))
            items += 1
            if len(words) < n_grams:
                n_short += 1
                short.setdefault(task, []).append(text)
            hashes.update(hash_func(" ".join(g)) for g in ngrams(words, n_grams))
        np.array(sorted(hashes), dtype=cfg.hash_config.np_descr).tofile(index_dir / f"{task}.index.hashes")
        counts[task] = {"items": items, "ngrams": len(hashes), "short_items": n_short}
    return counts, short


def decontaminate(cfg: DecontaminateCfg, executor: ExecutorCfg, deduped: Path, out: Path) -> dict[str, Any]:
    index_dir = out / "index"
    indexed, short = build_decont_index(cfg.eval_sets, cfg.fields, cfg.n_grams, index_dir)
    n_files = len(list((deduped / DATA).glob(DOC_FILES)))
    stats = run_pipeline(
        executor,
        [
            _reader(deduped / DATA, DOC_FILES),
            NGramsDecontFilter(
                str(index_dir),
                config=decont_config(cfg.n_grams),
                exclusion_writer=_writer(out / "removed", by_source=True),
                language=SPLIT_WORDS,
            ),
            ShortItemDecontFilter(short, exclusion_writer=_writer(out / "removed", suffix="-short")),
            _writer(out / DATA),
        ],
        out / "logs" / "decontamination",
        _tasks_for(executor, n_files),
        "decontamination",
    )
    counters, short_counters = stats[1]["counters"], stats[2]["counters"]
    tasks = [k for k in counters if k.startswith("contaminated_") and not k.startswith("contaminated_tg_")]  # tg_: task groups
    ngram_hits = {k.removeprefix("contaminated_"): counters[k] for k in tasks}
    short_hits = {k.removeprefix("contaminated_short_"): v for k, v in short_counters.items() if k.startswith("contaminated_short_")}
    return {
        "indexed_ngrams": indexed,
        "hits": dict(Counter(ngram_hits) + Counter(short_hits)),
        "hits_short": short_hits,
        "hits_by_source": count_docs(out / "removed"),
        "docs_in": counters.get("total", 0),
        "docs_out": count_docs(out / DATA),
    }


def tokenize(
    sources: list[str], executor: ExecutorCfg, seed: int, heldout_fraction: float, decontaminated: Path, tokenizer_json: Path, out: Path
) -> dict[str, Any]:
    """datatrove's DocumentTokenizer and merger: one shuffled `.ds` token file per source.

    A hashed fraction of each source's documents goes to `heldout/SOURCE/` instead: never trained
    on, it is the text of the per-domain perplexity evals (tasks/evaluation/).
    """
    from datatrove.pipeline.tokens import DocumentTokenizer, DocumentTokenizerMerger

    summary: dict[str, Any] = {"sources": {}}
    for source in sources:
        in_dir = decontaminated / DATA / source
        if not any(in_dir.glob("*.jsonl.gz")):
            log.warning("tokenize: source %s has no documents left after curation", source)
            summary["sources"][source] = {"tokens": 0, "docs": 0}
            continue
        shards = out / "work" / source
        tokenizer = DocumentTokenizer(
            str(shards),
            tokenizer_name_or_path=str(tokenizer_json),
            eos_token=EOS,
            seed=seed,
            local_working_dir=str(out / "work" / f"{source}-tmp"),
        )
        n_files = len(list(in_dir.glob("*.jsonl.gz")))
        heldout = HeldOutSplit(heldout_fraction, exclusion_writer=Writer(str(out / HELDOUT / source), "${rank}.jsonl.gz"))
        run_pipeline(
            executor,
            [_reader(in_dir), heldout, tokenizer],
            out / "logs" / f"{source}-tokenize",
            _tasks_for(executor, n_files),
            f"tokenize-{source}",
        )
        merger = DocumentTokenizerMerger(str(shards), str(out / DATA / source), save_filename=source, seed=seed, progress=False)
        run_pipeline(executor, [merger], out / "logs" / f"{source}-merge", 1, f"merge-{source}")
        _name_tokenizer_only(out / DATA / source)
        summary["sources"][source] = token_counts(out / DATA / source) | {"heldout_docs": count_source_docs(out / HELDOUT / source)}
    shutil.rmtree(out / "work", ignore_errors=True)
    return summary


def _name_tokenizer_only(folder: Path) -> None:
    """datatrove heads each `.ds.metadata` with the tokenizer's path as given (absolute, in the run dir): keep only its
    file name, so the token files' bytes, and the ids of the steps that read them, do not depend on where the run lies."""
    for meta in folder.glob("*.ds.metadata"):
        first, *rest = meta.read_text().split("\n")
        name, size = first.rsplit("|", 1)
        meta.write_text("\n".join([f"{Path(name).name}|{size}", *rest]))


def token_counts(folder: Path) -> dict[str, int]:
    """Tokens and documents in a folder of datatrove `.ds` files, from the files themselves."""
    tokens = docs = 0
    for ds in sorted(folder.glob("*.ds")):
        tokens += ds.stat().st_size // token_size(ds)
        docs += ds.with_name(ds.name + ".index").stat().st_size // 8  # one uint64 end offset per document
    return {"tokens": tokens, "docs": docs}


def token_size(ds_file: Path) -> int:
    """Bytes per token of a `.ds` file, from the `NAME|SIZE` first line of its `.metadata`."""
    first_line = ds_file.with_name(ds_file.name + ".metadata").read_text().splitlines()[0]
    return int(first_line.rsplit("|", 1)[1])
