"""Evaluate models that have no results yet: once over a list, or following a trainer's checkpoints.

Pretraining checkpoints get the recipe's `checkpoint_tasks` (cloze, lettered MC, perplexity);
finished models get those plus `model_tasks` with the chat template applied (generative math).
A model whose evaluation fails is reported, never dropped: the follower goes on with the others
and the run's evaluation step retries it and fails the step if it still fails.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from infra.env import cores, thread_count
from infra.errors import Stopped
from infra.procs import STOPPING
from infra.recipe import EvalCfg, S3Cfg
from infra.steps import HF_CONFIG
from infra.storage import Mirror, StorageError, download_folder
from model.checkpoint import mark_evaluated
from tasks.evaluation.harness import ABANDONED, EvalFailed, EvalJob, keep_worker, kept_worker, task_data, tasks_without_data
from tasks.evaluation.results import ITEMS, RESULTS, ModelRef, ResultStore, eval_key, main_metric


@dataclass
class EvalSummary:
    evaluated: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)  # another process was evaluating it
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"{len(self.evaluated)} evaluated, {len(self.cached)} already had results, {len(self.busy)} left to a concurrent run, "
            f"{len(self.failed)} failed ({self.seconds:.0f} s)"
        )


def result_keys(cfg: EvalCfg, include: Path) -> dict[str, str]:
    """task -> the key its result is kept under: the evaluation config's identity (`eval_key`) and, for a task that
    reads local data (held-out documents), that data's content. A model reused as it is (a swarm proxy that left a
    changed source out) is scored again on held-out data that changed, and on nothing else."""
    base = eval_key(cfg)
    return {t: f"{base}.{d}" if d else base for t, d in task_data(include, cfg.checkpoint_tasks + cfg.model_tasks).items()}


class Evaluator:
    def __init__(
        self,
        cfg: EvalCfg,
        store: ResultStore,
        include: Path,
        work_dir: Path,
        log: logging.Logger | logging.LoggerAdapter,
        mirror: Mirror | None = None,
        s3: S3Cfg | None = None,
        alone: bool = False,
    ):
        """`alone`: nothing else of the run is running (a stage's own evals), so the jobs take every core (`cfg.threads`
        is the count beside a trainer). The child is an idle one left by an earlier evaluation in this process if one
        serves this config (`kept_worker`), and is left to the next one in turn."""
        self.cfg = cfg.model_copy(update={"threads": cores()}) if alone else cfg
        self.store, self.include, self.work_dir, self.log = store, include, Path(work_dir), log
        self.mirror, self.s3, self.keys = mirror, s3, result_keys(cfg, include)
        self.abandon: threading.Event | None = None  # `follow`'s: set, nothing new is scored and a running child is stopped
        self.scored: dict[str, str] = {}  # scoring key -> fingerprint of a model scored under it (its scores are its twins')
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # started at its first batch; run and follow leave it to the next evaluation, or end it when interrupted
        self.worker = kept_worker(self.cfg, self.work_dir)
        self.no_data = tasks_without_data(include, cfg.checkpoint_tasks + cfg.model_tasks)
        for task, reason in self.no_data.items():
            log.warning("eval task %s is skipped: %s", task, reason)

    def task_groups(self, model: ModelRef) -> list[tuple[list[str], bool]]:
        """(pending tasks, chat template?) for this model; tasks without data are left out (and were warned about)."""
        groups = [(self.cfg.checkpoint_tasks, False)] + ([(self.cfg.model_tasks, True)] if model.kind == "model" else [])
        groups = [([t for t in tasks if t not in self.no_data], chat) for tasks, chat in groups]
        return [(pending, chat) for tasks, chat in groups if (pending := self.store.pending(model, tasks, self.keys))]

    def evaluate(self, models: list[ModelRef], summary: EvalSummary) -> set[str]:
        """Score each model on its pending tasks, in one batch of the child; returns the fingerprints of
        those that failed (or moved away mid-evaluation). A model that scores as one already scored (a phase's
        final and its last checkpoint: `scoring_key`) takes that one's scores instead of being scored again."""
        failed: set[str] = set()
        twins: list[ModelRef] = []  # scoring as a model of this batch: theirs are copied once it is scored
        with ExitStack() as claims:
            batch = []  # (model, its jobs)
            keys = set()
            for model in models:
                if not (groups := self.task_groups(model)):
                    summary.cached.append(model.label)
                    self._scored(model)
                elif model.scores_as and model.scores_as in keys:
                    twins.append(model)
                elif not claims.enter_context(self.store.claim(model.fingerprint)):
                    self.log.info("eval %s: another run is evaluating it, skipping", model.label)
                    summary.busy.append(model.label)
                elif (groups := self._copied(model, groups, summary)) and (jobs := self._jobs(model, groups, summary, failed)):
                    batch.append((model, jobs))
                    keys.add(model.scores_as)
            results = iter(self.worker.run([job for _, jobs in batch for job in jobs], self._abandoned) if batch else [])
            for model, jobs in batch:
                scored = [next(results) for _ in jobs]
                try:
                    if errors := [done["error"] for done in scored if "error" in done]:
                        raise EvalFailed(errors[0])
                    for done in scored:
                        record = self.store.put(model, done["metrics"], self.keys, self.cfg.limit, done["seconds"])
                except (EvalFailed, OSError) as err:
                    self._failed(model, str(err), summary, failed)
                    continue
                self._done(model, record, summary)
        return failed | (self.evaluate(twins, summary) if twins else set())

    def _abandoned(self) -> bool:
        """Scoring stops at once when this process is STOPPING (a signal), or a follower's flow failed or was stopped."""
        return STOPPING.is_set() or (self.abandon is not None and self.abandon.is_set())

    def _scored(self, model: ModelRef) -> None:
        if model.scores_as:
            self.scored.setdefault(model.scores_as, model.fingerprint)

    def _copied(self, model: ModelRef, groups: list[tuple[list[str], bool]], summary: EvalSummary) -> list[tuple[list[str], bool]]:
        """Copy into MODEL's record the pending plain (no chat template) tasks a model with its scoring key was
        scored on under this evaluation's key; returns the groups still pending."""
        twin = self.scored.get(model.scores_as) if model.scores_as else None
        record = self.store.get(twin, self.keys) if twin and twin != model.fingerprint else None
        have = {t: e for t, e in (record or {"tasks": {}})["tasks"].items() if e.get("key") == self.keys.get(t)}
        tasks = [t for pending, chat in groups if not chat for t in pending if t in have]
        if not tasks:
            return groups
        metrics = {t: have[t]["metrics"] | ({ITEMS: have[t][ITEMS]} if ITEMS in have[t] else {}) for t in tasks}
        done = self.store.put(model, metrics, self.keys, have[tasks[0]].get("limit"), 0.0)
        self.log.info(
            "eval %s: scores as %s (same weights and config): its %d task(s) copied", model.label, record["model"]["label"], len(tasks)
        )
        left = [([t for t in pending if t not in tasks], chat) for pending, chat in groups]
        if not (left := [(pending, chat) for pending, chat in left if pending]):
            self._done(model, done, summary)
        return left

    def _jobs(self, model: ModelRef, groups: list[tuple[list[str], bool]], summary: EvalSummary, failed: set[str]) -> list[EvalJob]:
        try:
            folder = self._local_copy(model)
        except OSError as err:
            self._failed(model, str(err), summary, failed)
            return []
        out, threads = self.work_dir / model.fingerprint, thread_count(self.cfg.threads)
        return [
            EvalJob(folder, tasks, chat, f"{out}-{'chat' if chat else 'base'}.json", str(self.include), threads) for tasks, chat in groups
        ]

    def _failed(self, model: ModelRef, error: str, summary: EvalSummary, failed: set[str]) -> None:
        failed.add(model.fingerprint)
        if error.startswith(ABANDONED):
            self.log.info("eval %s: %s", model.label, ABANDONED)
            return
        if "://" not in model.path and not Path(model.path).exists():
            # its step was committed (renamed) or the checkpoint pruned: the next scan finds it where it is now
            self.log.info("eval %s: moved while being evaluated; it is picked up at its new place", model.label)
            return
        self.log.warning("eval %s failed: %s", model.label, error)
        summary.failed[model.label] = error

    def _done(self, model: ModelRef, record: dict, summary: EvalSummary) -> None:
        self._scored(model)
        self._mark_evaluated(model)
        if self.mirror is not None:
            for name in self.store.files(model.fingerprint):
                self.mirror.put_file(Path(self.store.root) / name, f"{RESULTS.as_posix()}/{name}")
        summary.evaluated.append(model.label)
        self.log.info("eval %s (%s): %s", model.label, _tokens(model), headline(record))

    def run(self, models: list[ModelRef]) -> EvalSummary:
        summary, started = EvalSummary(), time.time()
        try:
            self.evaluate(models, summary)
            if STOPPING.is_set():  # what it left unscored is a relaunch's: not a finished evaluation
                raise Stopped("evaluation: this process is stopping; the models not yet scored are left to a relaunch")
        except BaseException:
            self.worker.close(now=True)
            raise
        keep_worker(self.worker)
        summary.seconds = time.time() - started
        return summary

    def follow(
        self, discover: Callable[[], list[ModelRef]], stop: threading.Event, abandon: threading.Event | None = None, max_failures: int = 2
    ) -> EvalSummary:
        """Evaluate new checkpoints as `discover` finds them, until `stop` is set and nothing is left that this
        process can score: a model another process is scoring is waited for (one poll at a time, never in a
        busy loop) while training runs, and left to that process (counted as busy) once `stop` is set. Once
        ABANDON is set (the flow failed or is being stopped) nothing new is scored and a running child is killed."""
        summary, started, failures, outage = EvalSummary(), time.time(), {}, 0
        self.abandon = abandon or threading.Event()
        try:
            while not self._abandoned():
                finishing = stop.is_set()
                busy = len(summary.busy)
                try:
                    todo = []
                    for m in discover():
                        if not self.task_groups(m):
                            self._scored(m)  # scored before (another process, an earlier attempt): a twin to copy from
                        elif failures.get(m.fingerprint, 0) < max_failures:
                            todo.append(m)
                    for fingerprint in self.evaluate(todo, summary):
                        failures[fingerprint] = failures.get(fingerprint, 0) + 1
                except StorageError as err:  # the mirror or the S3 result store: an outage the next round may not see
                    outage += 1
                    if finishing and outage >= MIRROR_ROUNDS:
                        summary.failed["(storage)"] = f"{outage} rounds failed, the last: {err}"
                        break
                    self.log.warning("eval follower: storage failed (%s); trying again in %.0f s", err, self.cfg.poll_seconds)
                    stop.wait(self.cfg.poll_seconds)
                    continue
                outage = 0
                progressed = len(todo) > len(summary.busy) - busy  # some model was not left to another process
                if finishing and not progressed:
                    break
                if not progressed:
                    stop.wait(self.cfg.poll_seconds)
        except BaseException:
            self.worker.close(now=True)
            raise
        if self._abandoned():  # its flow is failing or stopping: nothing is left to score in this process
            self.worker.close()
        else:  # to the stage's evaluation after training, or the next run's
            keep_worker(self.worker)
        summary.busy = sorted(set(summary.busy) - set(summary.evaluated))
        summary.failed = {k: v for k, v in summary.failed.items() if k not in summary.evaluated}
        summary.seconds = time.time() - started
        return summary

    def _local_copy(self, model: ModelRef) -> str:
        """A remote model is downloaded once into the work dir (by fingerprint)."""
        if "://" not in model.path:
            return model.path
        target = self.work_dir / "models" / model.fingerprint
        if not (target / HF_CONFIG).is_file():
            staging = target.with_name(f".{target.name}")
            shutil.rmtree(staging, ignore_errors=True)
            download_folder(model.path, staging, self.s3)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        return str(target)

    @staticmethod
    def _mark_evaluated(model: ModelRef) -> None:
        """Tell the trainer's checkpoint store (model/checkpoint.py) it may prune this checkpoint now."""
        if model.kind == "checkpoint" and "://" not in model.path:
            mark_evaluated(Path(model.path).parent)


MIRROR_ROUNDS = 5  # once training is over, the follower gives up after this many rounds in a row failed by storage


def headline(record: dict) -> str:
    """One line of the main number of each task."""
    parts = []
    for task, entry in sorted(record["tasks"].items()):
        if main := main_metric(entry["metrics"]):
            parts.append(f"{task.removeprefix('smol_')} {main[0].split('/')[0]} {main[1]:.3f}")
    return ", ".join(parts)


def _tokens(model: ModelRef) -> str:
    return f"{model.tokens:,} tokens" if model.tokens else model.kind
