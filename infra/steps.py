"""Steps: units of work that declare their inputs and own one folder of the run dir.

A step's identity is a hash of its name, its config and the content fingerprints of its inputs
(as marin's executor steps do), so rerunning an unchanged recipe skips finished steps, and a
changed parameter reruns that step and, through the changed fingerprints, everything downstream.

A step builds into `RUN/.partial/NAME`, and is committed by writing `manifest.json` there and
renaming the folder into place: a step folder without a manifest, or whose manifest names
another step id, is never taken as finished. A killed build is resumed in place when its
partial folder belongs to the same step id (datatrove skips its finished shards).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.errors import StepLocked, UpstreamMissing
from infra.locks import lock_holder, take_lock
from infra.recipe import Recipe, load_recipe, recipe_dump
from infra.storage import Mirror, fingerprint_files

MANIFEST = "manifest.json"
_STEP_ID_FILE = ".step_id"
# Folders of a step that are neither fingerprinted nor mirrored with it: logs change from run to
# run, and checkpoints are mirrored as they are written (model/checkpoint.py).
UNTRACKED_DIRS = ("logs", "checkpoints")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What a finished step hands downstream: where its outputs are and what they contain."""

    name: str
    step_id: str
    path: Path
    fingerprint: str
    summary: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def step_id(name: str, config: Any, inputs: Mapping[str, str]) -> str:
    payload = _canonical({"name": name, "config": config, "inputs": dict(sorted(inputs.items()))})
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def fingerprint_tree(root: Path, skip_dirs: tuple[str, ...] = UNTRACKED_DIRS) -> str:
    """Fingerprint of every file under `root` except the manifest and untracked folders."""
    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] not in skip_dirs and path.name not in (MANIFEST, _STEP_ID_FILE):
            files.append((rel.as_posix(), path))
    return fingerprint_files(files)


def building_step_id(out: Path) -> str:
    """Inside a build: the id of the step being built (e.g. to name what it mirrors)."""
    return (out / _STEP_ID_FILE).read_text()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(step_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((step_dir / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _output(manifest: dict[str, Any], path: Path, cached: bool) -> StepOutput:
    return StepOutput(
        name=manifest["name"],
        step_id=manifest["step_id"],
        path=path,
        fingerprint=manifest["fingerprint"],
        summary=manifest.get("summary", {}),
        cached=cached,
        seconds=manifest.get("seconds", 0.0),
    )


def load_step(run_dir: Path, name: str, needed_by: str) -> StepOutput:
    """A finished step of an earlier run, for a stage run on its own; says what to run if missing."""
    manifest = read_manifest(Path(run_dir) / name)
    if manifest is None:
        raise UpstreamMissing(
            f"{needed_by} needs the output of step {name!r}, which {run_dir} does not have: "
            f"run the stage that produces it first: `smolflow stage {producing_stage(name)} RECIPE --run-dir {run_dir}` "
            f"(or `smolflow run` for the whole pipeline)"
        )
    return _output(manifest, Path(run_dir) / name, cached=True)


def producing_stage(step: str) -> str:
    """The stage (flows/pipeline.py) whose flow builds `step`."""
    if step.startswith("pretrain_"):
        return "pretrain"
    return {"chat_data": "sft"}.get(step, step if step in ("sft", "preference", "apo", "grpo") else "curate")


def run_step(
    run_dir: Path,
    name: str,
    config: Any,
    inputs: Mapping[str, StepOutput | str],
    build: Callable[[Path], dict[str, Any]],
    mirror: Mirror | None = None,
) -> StepOutput:
    """Return the step's outputs, building them only when no finished copy with this identity exists.

    `inputs` maps an input's name to an upstream StepOutput or to a content fingerprint;
    `build(out_dir)` writes the outputs into `out_dir` and returns a JSON-able summary.
    """
    run_dir = Path(run_dir)
    fingerprints = {k: v.fingerprint if isinstance(v, StepOutput) else v for k, v in inputs.items()}
    sid = step_id(name, config, fingerprints)
    final = run_dir / name

    manifest = read_manifest(final)
    if manifest and manifest.get("step_id") == sid:
        log.info("step %s: finished earlier (step id %s), skipping", name, sid)
        return _output(manifest, final, cached=True)

    lock = run_dir / ".partial" / f"{name}.lock"
    if not take_lock(lock):
        holder = lock_holder(lock) or {}
        raise StepLocked(
            f"step {name} is being built by pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}; "
            f"not starting a second builder (delete {lock} if that process is gone)"
        )
    try:
        return _build(run_dir, name, sid, config, fingerprints, build, mirror)
    finally:
        lock.unlink(missing_ok=True)


def _build(run_dir: Path, name: str, sid: str, config: Any, fingerprints: dict[str, str], build, mirror: Mirror | None) -> StepOutput:
    final, partial = run_dir / name, run_dir / ".partial" / name
    if (manifest := read_manifest(final)) and manifest.get("step_id") == sid:  # finished while we waited for the lock
        return _output(manifest, final, cached=True)
    if mirror is not None and (remote := mirror.read_marker(name, MANIFEST)) and remote.get("step_id") == sid:
        log.info("step %s: pulling the finished copy from %s", name, mirror.prefix)
        shutil.rmtree(partial, ignore_errors=True)
        mirror.pull(name, partial, MANIFEST)
        _commit(partial, final)
        return _output(remote, final, cached=True)
    if partial.exists() and _read_text(partial / _STEP_ID_FILE) != sid:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    (partial / _STEP_ID_FILE).write_text(sid)

    started = time.time()
    summary = build(partial)
    seconds = round(time.time() - started, 3)
    manifest = {
        "name": name,
        "step_id": sid,
        "config": config,
        "inputs": fingerprints,
        "fingerprint": fingerprint_tree(partial),
        "summary": summary,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": seconds,
        "host": {"python": platform.python_version(), "platform": platform.platform()},
    }
    (partial / _STEP_ID_FILE).unlink()
    write_json_atomic(partial / MANIFEST, manifest)
    _commit(partial, final)
    if mirror is not None:
        mirror.push(final, name, MANIFEST, skip_dirs=UNTRACKED_DIRS)
    log.info("step %s: built in %.1f s", name, seconds)
    return _output(manifest, final, cached=False)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _commit(partial: Path, final: Path) -> None:
    """Swap the finished partial folder into place; the old copy is removed only afterwards."""
    trash = final.parent / ".partial" / f"{final.name}.old"
    shutil.rmtree(trash, ignore_errors=True)
    if final.exists():
        os.replace(final, trash)
    os.replace(partial, final)
    fsync_dir(final.parent)
    shutil.rmtree(trash, ignore_errors=True)


@dataclass(frozen=True)
class RunContext:
    """One run of a recipe: the validated recipe, its run dir, and where finished steps are mirrored."""

    recipe: Recipe
    run_dir: Path
    mirror: Mirror | None

    @classmethod
    def load(cls, recipe_path: str, run_dir: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunContext:
        recipe = load_recipe(recipe_path, overrides)
        root = Path(run_dir) if run_dir else Path("runs") / recipe.name
        root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(root / "recipe.json", recipe_dump(recipe))
        mirror = Mirror(recipe.storage.mirror, recipe.storage.s3) if recipe.storage.mirror else None
        return cls(recipe=recipe, run_dir=root, mirror=mirror)

    def step(self, name: str, config: Any, inputs: Mapping[str, StepOutput | str], build: Callable[[Path], dict[str, Any]]) -> StepOutput:
        return run_step(self.run_dir, name, config, inputs, build, self.mirror)

    def load_step(self, name: str, needed_by: str) -> StepOutput:
        return load_step(self.run_dir, name, needed_by)
