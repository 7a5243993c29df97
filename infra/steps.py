"""Steps: a name, a typed config, upstream steps and a function; the config it receives is its identity.

As in marin's executor, a step's id hashes exactly what its function is given: its config (less the
fields the schema marks operational, see infra/recipe.py `operational`), the content fingerprints
of its upstream steps' outputs, and of any file outside the run it reads (`watch`). No call site
writes a key by hand, so a key can neither miss a value the step reads nor include one it doesn't:
rerunning an unchanged recipe skips every finished step, and a changed value reruns the steps
that read it and, through the changed fingerprints, what is downstream of them.

A step builds into `RUN/.partial/NAME` and is committed by writing `manifest.json` there and
renaming the folder to `RUN/NAME`: a folder without a manifest, or whose manifest names another
step id, is never taken as finished. A killed build resumes in place when its partial folder has
the same id. Work is never deleted on an identity change: a finished or partial version with
another id is moved to `RUN/.previous/NAME-ID` (logged, listed by the dry run), and restored
from there if the recipe goes back to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from infra.errors import SmolflowError, StepLocked, UpstreamMissing
from infra.locks import acquire, describe, holder, holding
from infra.recipe import Recipe, is_operational, load_recipe, parse_recipe, recipe_dump
from infra.storage import Mirror, StorageError, fingerprint_files, fsync_dir, fsync_tree, write_json_atomic

MANIFEST = "manifest.json"
RECIPE = "recipe.json"  # the run's frozen recipe
PREVIOUS = ".previous"  # RUN/.previous/NAME-ID[.partial]: versions moved aside when a step's identity changed
_STEP_ID_FILE = ".step_id"
STORE = ".store"  # RUN/.store: a link to the step store the run shares with others (an ablation's runs)
_OWNER_FILE = ".recipe_owner"  # the flow run that froze recipe.json: its retries and relaunches read it as is
# Folders of a step that are neither fingerprinted nor mirrored with it: logs change from run to
# run, and checkpoints are mirrored as they are written (model/checkpoint.py).
UNTRACKED_DIRS = ("logs", "checkpoints")
log = logging.getLogger(__name__)


# --- identity --------------------------------------------------------------------------------


def identity(value: Any) -> Any:
    """The part of a config that defines what a step produces: every field but the operational ones."""
    if isinstance(value, BaseModel):
        return {name: identity(getattr(value, name)) for name, f in type(value).model_fields.items() if not is_operational(f)}
    if isinstance(value, Mapping):
        return {str(k): identity(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [identity(v) for v in value]
    if isinstance(value, SecretStr):
        raise TypeError("a secret is part of a step's identity: mark its field operational")
    if isinstance(value, Path):
        return str(value)
    return value


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def step_id(name: str, config: Any, inputs: Mapping[str, str]) -> str:
    payload = _canonical({"name": name, "config": config, "inputs": dict(sorted(inputs.items()))})
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ between two nested dicts (lists index as `.0`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += changed_keys(old.get(key, "<unset>"), new.get(key, "<unset>"), f"{prefix}{key}.")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new)) for c in changed_keys(a, b, f"{prefix}{i}.")]
    return [] if old == new else [(prefix.rstrip("."), old, new)]


# --- the spec --------------------------------------------------------------------------------

Build = Callable[[Any, Mapping[str, "StepOutput"], Path], dict[str, Any]]


@dataclass(frozen=True, eq=False)
class Step:
    """One unit of work: `fn(config, inputs, out_dir)` writes the outputs and returns a JSON-able summary.

    `inputs` maps each name of `deps` to that upstream step's StepOutput. `watch(config)` returns
    content fingerprints of files outside the run the step reads (raw sources, eval sets). `stage`
    is the pipeline stage whose flow builds it; `model` labels a finished HF model in `final/`, and
    `checkpoints` the pretraining phase whose checkpoints are evaluated as they are written.
    """

    name: str
    stage: str
    fn: Build
    config: BaseModel
    deps: Mapping[str, Step] = field(default_factory=dict)
    watch: Callable[[Any], dict[str, str]] | None = None
    model: str | None = None
    checkpoints: str | None = None

    def fingerprints(self, inputs: Mapping[str, StepOutput | str]) -> dict[str, str]:
        fps = {k: v.fingerprint if isinstance(v, StepOutput) else v for k, v in inputs.items()}
        if self.watch is not None:
            fps |= {f"file:{k}": v for k, v in self.watch(self.config).items()}
        return fps

    def step_id(self, inputs: Mapping[str, StepOutput | str]) -> str:
        return step_id(self.name, identity(self.config), self.fingerprints(inputs))


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
    lineage: dict[str, str] = field(default_factory=dict)  # every upstream step's name -> step id, upstream first


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
        lineage=dict(manifest.get("lineage", [])),
    )


def lineage(inputs: Mapping[str, StepOutput]) -> dict[str, str]:
    """The upstream steps of a step with these inputs, by name (read from the inputs, never recomputed)."""
    out: dict[str, str] = {}
    for upstream in inputs.values():
        if isinstance(upstream, StepOutput):
            out |= upstream.lineage | {upstream.name: upstream.step_id}
    return out


def finished(run_dir: Path, name: str) -> StepOutput | None:
    """The finished step of that name in the run dir, whatever its id (for reports and discovery)."""
    manifest = read_manifest(Path(run_dir) / name)
    return _output(manifest, Path(run_dir) / name, cached=True) if manifest else None


# --- building --------------------------------------------------------------------------------


def run_step(
    run_dir: Path, step: Step, inputs: Mapping[str, StepOutput], mirror: Mirror | None = None, store: Path | None = None
) -> StepOutput:
    """Return the step's outputs, building them only when no finished copy with this identity exists.

    With a `store` (shared by the runs of an ablation), the step lives in `STORE/NAME-ID` and the run
    dir links to it, so runs whose step has the same identity build it once; a run that finds it being
    built by another waits for it instead of standing down.
    """
    run_dir = Path(run_dir)
    fingerprints = step.fingerprints(inputs)
    sid = step_id(step.name, identity(step.config), fingerprints)
    if store is None:
        return _locked(run_dir, step.name, step, sid, fingerprints, inputs, mirror)
    folder = f"{step.name}-{sid}"
    with _store_lock(store / folder):
        _link(run_dir, run_dir / ".partial" / step.name, store / ".partial" / folder)  # the eval follower sees its checkpoints
        waited = 0
        while True:
            try:
                output = _locked(Path(store), folder, step, sid, fingerprints, inputs, mirror)
                break
            except StepLocked as err:
                if waited % 300 == 0:
                    log.info("%s; waiting for it", err)
                time.sleep(5)
                waited += 5
        (run_dir / ".partial" / step.name).unlink(missing_ok=True)
        if not output.cached:
            _log_build(store, folder, run_dir, output.seconds)
    _link(run_dir, run_dir / step.name, store / folder)
    return dataclasses.replace(output, path=run_dir / step.name)


BUILDS = "builds.jsonl"  # STORE/builds.jsonl: which run built which store folder, one line per build


def _log_build(store: Path, folder: str, run_dir: Path, seconds: float) -> None:
    line = json.dumps({"folder": folder, "run": run_dir.name, "seconds": seconds, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    with open(Path(store) / BUILDS, "a") as f:  # one short O_APPEND write: lines of concurrent builders never mix
        f.write(line + "\n")


_STORE_LOCKS: dict[Path, threading.Lock] = {}


def _store_lock(folder: Path) -> threading.Lock:
    """One builder per store folder among the threads of this process (the lock file covers processes)."""
    return _STORE_LOCKS.setdefault(folder.resolve(), threading.Lock())


def _link(run_dir: Path, link: Path, target: Path) -> None:
    """Point LINK at TARGET (relative, replaced atomically); a real folder there is set aside, never deleted."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        _set_aside(run_dir, link, link.name)
    tmp = link.with_name(f".{link.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(target, link.parent))
    os.replace(tmp, link)


def _locked(root: Path, folder: str, step: Step, sid: str, fingerprints: dict[str, str], inputs, mirror: Mirror | None) -> StepOutput:
    final = root / folder
    manifest = read_manifest(final)
    if manifest and manifest.get("step_id") == sid:
        log.info("step %s: finished earlier (step id %s), skipping", step.name, sid)
        if mirror is not None:
            _push_missing(mirror, final, folder, sid)
        return _output(manifest, final, cached=True)
    path = root / ".partial" / f"{folder}.lock"
    lock = acquire(path)
    if lock is None:
        raise StepLocked(
            f"step {step.name} is being built by {describe(holder(path))}; not starting a second builder "
            f"(the lock is freed when that process exits, or, from another host, when its lease expires)"
        )
    try:
        with holding(lock):
            return _build(root, folder, step, sid, fingerprints, inputs, mirror)
    finally:
        lock.release()


def _build(root: Path, folder: str, step: Step, sid: str, fingerprints: dict[str, str], inputs, mirror: Mirror | None) -> StepOutput:
    """Build into ROOT/.partial/FOLDER and commit to ROOT/FOLDER (FOLDER: the step's name, or NAME-ID in a store)."""
    name = step.name
    final, partial = root / folder, root / ".partial" / folder
    if (manifest := read_manifest(final)) and manifest.get("step_id") == sid:  # finished while we waited for the lock
        return _output(manifest, final, cached=True)
    kept = _previous(root, folder, sid)
    if (manifest := read_manifest(kept)) and manifest.get("step_id") == sid:
        log.info("step %s: restoring the finished version %s kept in %s", name, sid, kept)
        _commit(root, kept, final)
        return _output(manifest, final, cached=True)
    if mirror is not None and (remote := _remote_manifest(mirror, folder)) and remote.get("step_id") == sid:
        log.info("step %s: pulling the finished copy from %s", name, mirror.prefix)
        _set_aside(root, partial, folder)
        mirror.pull(folder, partial, MANIFEST)
        if fingerprint_tree(partial) == remote["fingerprint"]:
            _commit(root, partial, final)
            return _output(remote, final, cached=True)
        log.warning("step %s: the copy on %s does not match its manifest's fingerprint: building it here", name, mirror.prefix)
        _set_aside(root, partial, folder)
    if partial.exists() and _read_text(partial / _STEP_ID_FILE) != sid:
        _set_aside(root, partial, folder)
    if not partial.exists() and _previous(root, folder, sid, ".partial").exists():
        log.info("step %s: resuming the partial build %s kept in %s", name, sid, PREVIOUS)
        os.replace(_previous(root, folder, sid, ".partial"), partial)
    partial.mkdir(parents=True, exist_ok=True)
    (partial / _STEP_ID_FILE).write_text(sid)

    started = time.time()
    summary = step.fn(step.config, inputs, partial)
    seconds = round(time.time() - started, 3)
    manifest = {
        "name": name,
        "step_id": sid,
        "config": identity(step.config),
        "inputs": fingerprints,
        "lineage": list(lineage(inputs).items()),  # pairs: JSON objects are written with sorted keys
        "fingerprint": fingerprint_tree(partial),
        "summary": summary,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": seconds,
        "host": {"name": socket.gethostname(), "python": platform.python_version(), "platform": platform.platform()},
    }
    (partial / _STEP_ID_FILE).unlink()
    manifest["files"] = fsync_tree(partial, skip_dirs=UNTRACKED_DIRS)  # on disk before the manifest says finished
    write_json_atomic(partial / MANIFEST, manifest)
    _commit(root, partial, final)
    if mirror is not None:
        mirror.push(final, folder, MANIFEST, skip_dirs=UNTRACKED_DIRS)
    log.info("step %s: built in %.1f s", name, seconds)
    return _output(manifest, final, cached=False)


def _remote_manifest(mirror: Mirror, folder: str) -> dict[str, Any] | None:
    try:
        return mirror.read_marker(folder, MANIFEST)
    except StorageError as err:  # an outage: the step can still be built here
        log.warning("step %s: cannot look for a finished copy on %s (%s): building it here", folder, mirror.prefix, err)
        return None


def _push_missing(mirror: Mirror, final: Path, folder: str, sid: str) -> None:
    """A finished step whose push failed after its commit (an outage) is pushed when next found finished."""
    try:
        remote = mirror.read_marker(folder, MANIFEST)
        if remote is None or remote.get("step_id") != sid:
            log.info("step %s: not on the mirror %s yet: pushing it", folder, mirror.prefix)
            mirror.push(final, folder, MANIFEST, skip_dirs=UNTRACKED_DIRS)
    except StorageError as err:
        log.warning("step %s: still not on the mirror (%s); the next run tries again", folder, err)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _previous(run_dir: Path, name: str, sid: str, suffix: str = "") -> Path:
    return run_dir / PREVIOUS / f"{name}-{sid}{suffix}"


def _set_aside(run_dir: Path, folder: Path, name: str) -> None:
    """Move a finished or partial version of NAME with another identity to RUN/.previous (never delete it)."""
    if not folder.exists():
        return
    manifest = read_manifest(folder)
    sid = manifest["step_id"] if manifest else _read_text(folder / _STEP_ID_FILE) or "unknown"
    target = _previous(run_dir, name, sid, "" if manifest else ".partial")
    if target.exists():  # the same version kept earlier: add this copy beside it
        target = target.with_name(f"{target.name}.{int(time.time())}")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, target)
    log.warning(
        "step %s: its %s version %s no longer matches the recipe; kept at %s", name, "finished" if manifest else "partial", sid, target
    )


def _commit(run_dir: Path, ready: Path, final: Path) -> None:
    """Move a complete folder into place; a finished version with another id goes to RUN/.previous first."""
    _set_aside(run_dir, final, final.name)
    os.replace(ready, final)
    fsync_dir(final.parent)


def kept_versions(run_dir: Path) -> list[Path]:
    """Versions moved aside by identity changes, for the dry run to list."""
    folder = Path(run_dir) / PREVIOUS
    return sorted(folder.iterdir()) if folder.is_dir() else []


# --- what a run would do ---------------------------------------------------------------------


@dataclass
class Status:
    """What running a step would do now: cached, run, rerun, resume or restore, and why."""

    step: Step
    state: str
    reason: str = ""
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    output: StepOutput | None = None  # where a cached step's outputs are


def statuses(run_dir: Path, steps: Iterable[Step], store: Path | None = None) -> list[Status]:
    """For each step (in DAG order), whether it is cached or would (re)build, with the config keys that changed
    (looking in the run's step store, if it has one or `store` is given)."""
    run_dir, out, current = Path(run_dir), [], {}
    store = store or store_of(run_dir)
    for step in steps:
        manifest = read_manifest(run_dir / step.name)
        changes = changed_keys(manifest["config"], identity(step.config)) if manifest else []
        waiting = [d.name for d in step.deps.values() if current.get(d.name) is None]
        if waiting:
            current[step.name] = None
            state = "rerun" if manifest else "run"
            out.append(Status(step, state, f"after {', '.join(waiting)}", changes))
            continue
        fps = step.fingerprints({k: current[d.name] for k, d in step.deps.items()})
        sid = step_id(step.name, identity(step.config), fps)
        root, folder = (store, f"{step.name}-{sid}") if store else (run_dir, step.name)
        found = read_manifest(root / folder)
        if found and found["step_id"] == sid:
            current[step.name] = _output(found, root / folder, cached=True)
            reason = "" if manifest and manifest["step_id"] == sid else f"in the store {store}"
            out.append(Status(step, "cached", reason, output=current[step.name]))
            continue
        current[step.name] = None
        inputs_changed = sorted(k for k, v in fps.items() if manifest and manifest.get("inputs", {}).get(k) != v)
        reason = f"inputs changed: {', '.join(inputs_changed)}" if inputs_changed else ""
        if read_manifest(_previous(root, folder, sid)):
            out.append(Status(step, "restore", f"kept in {PREVIOUS}", changes))
        elif _read_text(root / ".partial" / folder / _STEP_ID_FILE) == sid or _previous(root, folder, sid, ".partial").exists():
            out.append(Status(step, "resume", "a partial build with this identity exists", changes))
        else:
            out.append(Status(step, "rerun" if manifest else "run", reason, changes))
    return out


def plan_ids(steps: Iterable[Step]) -> dict[str, str]:
    """An id per step from configs alone, upstream plan ids standing in for content fingerprints (in DAG
    order). Steps of two runs with equal plan ids receive the same inputs once built, so they get the
    same step id: an ablation knows before building anything which steps its variants share."""
    ids: dict[str, str] = {}
    for step in steps:
        ids[step.name] = step.step_id({role: ids[d.name] for role, d in step.deps.items()})
    return ids


def require(run_dir: Path, step: Step, status: Status, needed_by: str) -> StepOutput:
    """A finished upstream step of another stage, current with the recipe (`status`); says what to run if not."""
    if status.state == "cached" and status.output is not None:
        return status.output
    if finished(run_dir, step.name) is None:
        raise UpstreamMissing(
            f"{needed_by} needs the output of step {step.name!r}, which {run_dir} does not have: run the stage that "
            f"produces it first: `smolflow stage {step.stage} RECIPE --run-dir {run_dir}` (or `smolflow run` for the whole pipeline)"
        )
    changed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in status.changes) or status.reason or "its inputs changed"
    raise UpstreamMissing(
        f"{needed_by} needs step {step.name!r}, whose output in {run_dir} is out of date with the recipe ({changed}): "
        f"run `smolflow stage {step.stage} RECIPE --run-dir {run_dir}` first (or `smolflow run`)"
    )


# --- one run of a recipe ---------------------------------------------------------------------

_OPENED: dict[Path, Recipe] = {}  # run dir -> recipe read in this process (it may hold secrets recipe.json masks)


@dataclass(frozen=True)
class Run:
    """One run of a recipe: its run dir, the recipe frozen there at creation, and the S3 mirror."""

    recipe: Recipe
    run_dir: Path
    mirror: Mirror | None
    changes: tuple[tuple[str, Any, Any], ...] = ()  # recipe keys changed against the frozen recipe when opened

    @classmethod
    def open(
        cls,
        recipe_path: str | None,
        run_dir: str | None = None,
        overrides: Iterable[str] = (),
        owner: str | None = None,
        freeze: bool = True,
    ) -> Run:
        """The run in RUN_DIR. Without a recipe path, or for a relaunch of the flow run (`owner`) that froze
        it, the frozen recipe; with one, that recipe: a difference from the frozen one is returned in
        `changes` (and logged), and the new recipe frozen in its place when `freeze`."""
        new = load_recipe(recipe_path, list(overrides)) if recipe_path else None
        root = Path(run_dir) if run_dir else Path("runs") / new.name if new else None
        if root is None:
            raise SmolflowError("give a recipe or a run dir holding one (recipe.json)")
        frozen = _read_json(root / RECIPE)
        if frozen is None and new is None:
            raise SmolflowError(f"{root} holds no run (no {RECIPE}): pass the recipe")
        reuse = new is None or (owner is not None and _read_text(root / _OWNER_FILE) == owner)
        if reuse and frozen is not None:
            recipe = _OPENED.get(root.resolve())
            if recipe is None or recipe_dump(recipe) != frozen:
                recipe = frozen_recipe(frozen, str(root / RECIPE))
            return cls._make(recipe, root)
        changes = tuple(changed_keys(frozen, recipe_dump(new))) if frozen is not None else ()
        for key, old, value in changes:
            log.warning("recipe of %s: %s changed: %r -> %r", root, key, old, value)
        if freeze:
            root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(root / RECIPE, recipe_dump(new))
            (root / _OWNER_FILE).write_text(owner or "")
            _OPENED[root.resolve()] = new
        run = cls._make(new, root, changes)
        if freeze and run.mirror is not None:  # the runs of a store share a mirror: each recipe under its run's name
            run.mirror.put_file(root / RECIPE, f"{root.name}/{RECIPE}" if store_of(root) else RECIPE)
        return run

    @classmethod
    def _make(cls, recipe: Recipe, root: Path, changes: tuple = ()) -> Run:
        mirror = Mirror(recipe.storage.mirror, recipe.storage.s3) if recipe.storage.mirror else None
        return cls(recipe=recipe, run_dir=root, mirror=mirror, changes=changes)

    def build(self, step: Step, inputs: Mapping[str, StepOutput]) -> StepOutput:
        return run_step(self.run_dir, step, inputs, self.mirror, store_of(self.run_dir))


def store_of(run_dir: Path) -> Path | None:
    """The step store a run dir shares with others (its `.store` link), if any."""
    link = Path(run_dir) / STORE
    return link if link.is_dir() else None


def frozen_recipe(data: dict[str, Any], source: str) -> Recipe:
    """A recipe.json back as a Recipe; its masked secrets are dropped (credentials come from AWS_*)."""
    data = json.loads(json.dumps(data))
    for secret in ("key", "secret"):
        data.get("storage", {}).get("s3", {}).pop(secret, None)
    return parse_recipe(data, source)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
