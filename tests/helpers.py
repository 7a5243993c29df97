"""Helpers for tests: the micro recipe (configs/micro.yaml) with changes, and small files."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import psutil
import yaml

from infra.steps import BUILDS, Step

REPO = Path(__file__).resolve().parents[1]


def micro_recipe(**changes) -> dict:
    """configs/micro.yaml as data; `changes` maps dotted keys (list items by index) to values."""
    data = yaml.safe_load((REPO / "configs" / "micro.yaml").read_text())
    for key, value in changes.items():
        node = data
        *path, last = key.split(".")
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[last] = value
    return data


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def losses(out: Path) -> dict[int, float]:
    """A pretraining phase's loss at each logged step (its metrics.jsonl); after a resume a step may be logged twice,
    and the last one counts."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def built_folders(store: Path) -> list[str]:
    """The folders built in STORE (`name-<hash>`), in the order they were built (its builds log: one line per build)."""
    return [json.loads(line)["folder"] for line in (store / BUILDS).read_text().splitlines()]


def built(store: Path) -> list[str]:
    """The steps built in STORE, by name, in the order they were built."""
    return [folder.rsplit("-", 1)[0] for folder in built_folders(store)]


def stand_in(step: Step) -> Step:
    """STEP with a function that writes one small file: its identity, decisions and commit as in a real run, in
    milliseconds."""
    return dataclasses.replace(step, fn=lambda cfg, inputs, out: (out / "out.json").write_text("{}") and {})


def survivors(pids: list[int], timeout_s: float) -> list[int]:
    """The PIDS still running after up to TIMEOUT_S. A process that ends between its listing and this check has not
    survived (`psutil.Process` of it would raise), nor has a zombie: only its parent's wait is left."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def flow_run_logs(flow_run_id) -> list[str]:
    """What a flow run (not its subflows) logged, as the Prefect API holds it: what a user reads in the UI."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # sent in batches by a background worker
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC)
    return [log.message for log in logs]
