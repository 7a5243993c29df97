"""Steps: a name, a typed config, upstream steps and a function; the config it receives is its identity.

As in marin's executor, a step's id hashes exactly what its function is given: its config (less the
fields the schema marks operational, see infra/recipe.py `operational`), the content fingerprints
of its upstream steps' outputs, and of any file outside the run it reads (`watch`). No call site
writes a key by hand, so a key can neither miss a value the step reads nor include one it doesn't:
rerunning an unchanged recipe skips every finished step, and a changed value reruns the steps
that read it and, through the changed fingerprints, what is downstream of them.

One layout: every version of a step lives in a step store as `STORE/NAME-ID`, and `RUN/NAME` is a
link to the version the run uses. A run's store is `RUN/steps`, a folder of its own or a link to a
store shared with other runs (an ablation's, or a project-wide one: `storage.store`); a mirror holds
the same relative names. A version is never moved or deleted when the recipe changes: another id is
another folder, and going back to a recipe links the old one again.

A step builds into `STORE/.partial/NAME-ID` and commits in three parts, each of which a relaunch
finishes instead of building again: (1) when its function returns, the summary is written beside the
folder (`NAME-ID.built.json`); (2) every file is fsynced and recorded with its MD5, and the manifest
written; (3) the folder is renamed to `STORE/NAME-ID`. The build lock's lease is checked right
before the rename: a holder whose lease was taken over never commits.

`decide` is the one decision, made the same way by the build, the dry run (`statuses`) and a
stage's upstream check: cached (in the store), pull (finished on the mirror), resume (a partial
build, or a build whose commit was cut off), run or rerun.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, get_type_hints

from pydantic import BaseModel, SecretStr, ValidationError

from infra.errors import DiskFull, SmolflowError, StepLocked, UpstreamMissing, disk_full
from infra.locks import acquire, describe_holder, holding
from infra.recipe import Recipe, is_operational, load_recipe, parse_recipe, recipe_dump
from infra.storage import (
    Mirror,
    StorageError,
    fingerprint_files,
    fingerprint_listing,
    fsync_dir,
    fsync_tree,
    temporaries,
    write_json_atomic,
)
from infra.summaries import Summary, read_summary

MANIFEST = "manifest.json"
FINAL = "final"  # STEP/final: the HF model a step leaves (`Step.model` labels it)
HF_CONFIG = "config.json"  # an HF model folder's architecture (FINAL/config.json, a checkpoint's hf/config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # an HF tokenizer
RECIPE = "recipe.json"  # the run's frozen recipe
STEPS = "steps"  # RUN/steps: the run's step store, a folder or a link to a shared one
PARTIAL = ".partial"  # STORE/.partial/NAME-ID: builds in progress (RUN/.partial/NAME links to the run's own)
BUILT = ".built.json"  # STORE/.partial/NAME-ID.built.json: the function returned this summary; only the commit is left
BUILDS = "builds.jsonl"  # STORE/builds.jsonl: which run built which version, one line per build
RUNS = "runs"  # MIRROR/runs/RUN/recipe.json: each run's frozen recipe beside the mirrored store
_OWNER_FILE = ".recipe_owner"  # the flow run that froze recipe.json: its retries and relaunches read it as is
# Folders of a step that are neither fingerprinted nor mirrored with it: logs change from run to
# run, and checkpoints are mirrored as they are written (model/checkpoint.py).
CHECKPOINTS = "checkpoints"  # STEP/checkpoints: a trainer's saved states (and on the mirror: NAME-ID/checkpoints)
UNTRACKED_DIRS = ("logs", CHECKPOINTS)
JOB = "job.json"  # STEP/job.json: what the step's launched trainer was asked to do
LAUNCH_LOG = "launch.log"  # STEP/launch.log: every line its trainer's launches said, after their task was gone too
LAUNCH_CONFIG = "accelerate.json"  # STEP/accelerate.json: accelerate's config for a post-training launch
METRICS = "metrics.jsonl"  # STEP/metrics.jsonl: a pretraining trainer's losses, times and throughput, a line a log
PHASE_SUMMARY = "summary.json"  # STEP/summary.json: what a pretraining trainer writes last, once its phase is done
CARD = "README.md"  # STEP/final/README.md: the model card (tasks/card.py)
TRL_ARGS = "training_args.bin"  # STEP/final/training_args.bin: TRL's pickled training arguments
# A build's traces, by file name: how it ran, not what it hands downstream. They hold this machine's paths (the job,
# TRL's arguments) or times (metrics, summaries, the card): left out of the fingerprint, a rebuild that gives the
# same weights and data gives the steps downstream the same ids (a checkout, a store or a run dir elsewhere too).
TRACES = frozenset({MANIFEST, JOB, LAUNCH_LOG, LAUNCH_CONFIG, METRICS, PHASE_SUMMARY, CARD, TRL_ARGS})
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


class NoInputs(TypedDict):
    """The inputs of a step with no upstream steps."""


@dataclass(frozen=True, eq=False)
class Step:
    """One unit of work: `fn(config, inputs, out_dir)` writes the outputs and returns its summary, an
    instance of the infra.summaries model its return type declares (`summary_type`).

    `inputs` maps each name of `deps` to that upstream step's StepOutput. `watch(config)` returns
    content fingerprints of files outside the run the step reads (raw sources, eval sets). `stage`
    is the pipeline stage whose flow builds it; `model` labels a finished HF model in `final/`, and
    `checkpoints` the pretraining phase whose checkpoints are evaluated as they are written. `seed` is
    the recipe key a trained step draws its randomness from: an ablation repeats the step by varying it.
    `reads(config)` names, for an input the step reads only part of, the folders of it read (`data/code/`): that
    input's fingerprint covers those alone (`part_fingerprint`), so a change elsewhere in it keeps the step's id.
    """

    name: str
    stage: str
    fn: Build
    config: BaseModel
    deps: Mapping[str, Step] = field(default_factory=dict)
    watch: Callable[[Any], dict[str, str]] | None = None
    model: str | None = None
    checkpoints: str | None = None
    seed: str | None = None
    reads: Callable[[Any], Mapping[str, tuple[str, ...]]] | None = None

    def fingerprints(self, inputs: Mapping[str, StepOutput | str]) -> dict[str, str]:
        """What the id hashes besides the config: each input's content (an upstream plan id in a plan), the part
        of it named in `reads` where it names one, and the files `watch` names."""
        parts = self.reads(self.config) if self.reads is not None else {}
        fps = {}
        for k, v in inputs.items():
            if isinstance(v, StepOutput):
                v = part_fingerprint(v, parts[k]) if k in parts else v.fingerprint
            fps[k] = v
        if self.watch is not None:
            fps |= {f"file:{k}": v for k, v in self.watch(self.config).items()}
        return fps

    def step_id(self, inputs: Mapping[str, StepOutput | str]) -> str:
        return step_id(self.name, identity(self.config), self.fingerprints(inputs))

    def __post_init__(self) -> None:
        """A function that types its `inputs` (a TypedDict of roles) is wired to exactly those roles: a role missing
        or unknown fails where the graph is built, not when the step runs."""
        hint = self._hints().get("inputs")
        if not hasattr(hint, "__required_keys__"):
            return  # untyped inputs (a test's toy step)
        required, optional, given = set(hint.__required_keys__), set(hint.__optional_keys__), set(self.deps)
        if not required <= given <= required | optional:
            raise ValueError(
                f"step {self.name}: its inputs {sorted(given)} do not match the roles its function takes "
                f"({hint.__name__}: {sorted(required)}, optional {sorted(optional)})"
            )

    def _hints(self) -> dict[str, Any]:
        """The annotations of the step's function (through a partial); none for a step only identified, never built."""
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return get_type_hints(fn) if callable(fn) else {}

    @property
    def summary_type(self) -> type[Summary]:
        """The summary model the function's return type names; an open Summary where it names none."""
        kind = self._hints().get("return")
        return kind if isinstance(kind, type) and issubclass(kind, Summary) else Summary


@dataclass(frozen=True)
class StepOutput:
    """What a finished step hands downstream: where its outputs are and what they contain."""

    name: str
    step_id: str
    path: Path
    fingerprint: str
    summary: Summary = field(default_factory=Summary)
    cached: bool = False
    seconds: float = 0.0
    lineage: dict[str, str] = field(default_factory=dict)  # every upstream step's name -> step id, upstream first

    @property
    def final(self) -> Path:
        """The HF model the step left, for steps with a `model` label."""
        return self.path / FINAL

    @property
    def checkpoints(self) -> Path:
        """The trainer checkpoints the step left, for steps that train."""
        return self.path / CHECKPOINTS

    @property
    def folder(self) -> str:
        """The version's name in the store and on the mirror: NAME-ID."""
        return folder_name(self.name, self.step_id)


def fingerprint_tree(root: Path, traces: frozenset[str] = TRACES) -> str:
    """Fingerprint of every file under `root` but its TRACES and untracked folders: what it hands downstream."""
    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] not in UNTRACKED_DIRS and path.name not in traces:
            files.append((rel.as_posix(), path))
    return fingerprint_files(files)


def part_fingerprint(output: StepOutput, folders: tuple[str, ...]) -> str:
    """The content of FOLDERS (relative, ending in '/') of a finished step, from its manifest's MD5s: the same bytes
    under the same names give the same digest, whatever else the step holds (no folder: a constant)."""
    files = (read_manifest(output.path) or {}).get("files", {})
    return fingerprint_listing({rel: r["md5"] for rel, r in files.items() if rel.startswith(folders)})


def folder_name(name: str, sid: str) -> str:
    return f"{name}-{sid}"


def folder_step_id(folder: Path) -> str | None:
    """The step id a step folder's name carries (`NAME-ID`, through any link: `RUN/NAME`, `RUN/.partial/NAME`)."""
    name = Path(folder).resolve().name
    sid = name.rpartition("-")[2]
    return sid if len(sid) == 20 and all(c in "0123456789abcdef" for c in sid) else None


def read_manifest(step_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((step_dir / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _output(manifest: dict[str, Any], path: Path, cached: bool, step: Step | None = None) -> StepOutput:
    """A finished version's output; its summary read with the model its manifest names (a manifest from
    before schemas: the model STEP declares, if known)."""
    raw, schema = manifest.get("summary", {}), manifest.get("summary_schema")
    if schema is None and step is not None:
        schema = step.summary_type.schema_name()
    return StepOutput(
        name=manifest["name"],
        step_id=manifest["step_id"],
        path=path,
        fingerprint=manifest["fingerprint"],
        summary=read_summary(raw, schema, str(path / MANIFEST)),
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


def store_of(run_dir: Path) -> Path:
    """A run's step store: RUN/steps (a folder, or a link to a shared store)."""
    return Path(run_dir) / STEPS


def version(run_dir: Path, name: str, sid: str) -> Path:
    """Where version SID of step NAME lives, finished, in the run's store."""
    return store_of(run_dir) / folder_name(name, sid)


def finished(run_dir: Path, step: Step) -> StepOutput | None:
    """The version of STEP the run links to, if finished (for reports and discovery)."""
    manifest = read_manifest(Path(run_dir) / step.name)
    return _output(manifest, Path(run_dir) / step.name, cached=True, step=step) if manifest else None


# --- the decision ----------------------------------------------------------------------------


@dataclass
class Status:
    """What building a step would do now, and why: cached, pull, resume, run or rerun."""

    step: Step
    state: str
    reason: str = ""
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)  # config keys changed against the version the run links
    output: StepOutput | None = None  # cached or pull: its outputs (pull: as the mirror's manifest records them)
    step_id: str | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)  # what the id hashes besides the config

    def why(self) -> str:
        """The reason in a line: `reason`, else the config keys that changed."""
        return self.reason or ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in self.changes) or "its config changed"


def decide(run_dir: Path, step: Step, fingerprints: Mapping[str, str], mirror: Mirror | None = None, store: Path | None = None) -> Status:
    """The one decision for a step whose inputs have these FINGERPRINTS (`Step.fingerprints`): the build acts on it,
    the dry run and upstream checks print it."""
    fingerprints = dict(fingerprints)
    sid = step_id(step.name, identity(step.config), fingerprints)
    run_dir, folder = Path(run_dir), folder_name(step.name, sid)
    store = Path(store) if store is not None else store_of(run_dir)
    linked = read_manifest(run_dir / step.name)
    changes = changed_keys(linked["config"], identity(step.config)) if linked and linked["step_id"] != sid else []
    found = read_manifest(store / folder)
    if found and found["step_id"] == sid:
        reason = "" if linked and linked["step_id"] == sid else f"in the store {store.resolve()}"
        return Status(step, "cached", reason, [], _output(found, run_dir / step.name, cached=True, step=step), sid, fingerprints)
    partial = store / PARTIAL / folder
    if read_manifest(partial) or (store / PARTIAL / f"{folder}{BUILT}").is_file():
        return Status(step, "resume", "built, its commit was cut off: committing without building again", changes, None, sid, fingerprints)
    if mirror is not None and (found := _on_mirror(mirror, step.name, sid)):
        where, remote = found
        output = _output(remote, run_dir / step.name, cached=True, step=step)
        old = "" if where == folder else f" as {where} (the layout before {folder}: copied there once pulled)"
        return Status(step, "pull", f"finished on {mirror.prefix}{old}", changes, output, sid, fingerprints)
    if partial.is_dir():
        return Status(step, "resume", "a partial build with this identity exists", changes, None, sid, fingerprints)
    inputs_changed = sorted(k for k, v in fingerprints.items() if linked and linked.get("inputs", {}).get(k) != v)
    reason = f"inputs changed: {', '.join(inputs_changed)}" if inputs_changed else ""
    return Status(step, "rerun" if linked else "run", reason, changes, None, sid, fingerprints)


def statuses(run_dir: Path, steps: Iterable[Step], mirror: Mirror | None = None, store: Path | None = None) -> list[Status]:
    """For each step (in DAG order), `decide` on the outputs the steps before it would hand it; a step after
    one that must run first waits for it ("after NAME")."""
    run_dir, out, current = Path(run_dir), [], {}
    for step in steps:
        waiting = [d.name for d in step.deps.values() if current.get(d.name) is None]
        if waiting:
            current[step.name] = None
            linked = read_manifest(run_dir / step.name)
            out.append(Status(step, "rerun" if linked else "run", f"after {', '.join(waiting)}"))
            continue
        fps = step.fingerprints({k: current[d.name] for k, d in step.deps.items()})
        status = decide(run_dir, step, fps, mirror, store)
        current[step.name] = status.output
        out.append(status)
    return out


def out_of_date(run_dir: Path, steps: Iterable[Step]) -> list[Status]:
    """The finished steps the run links whose version is no longer the one its recipe would build (the same
    decision, local store only): after one stage is rerun, the later steps built on what it replaced."""
    return [s for s in statuses(run_dir, steps) if s.state != "cached" and read_manifest(Path(run_dir) / s.step.name)]


def rebuild_command(run_dir: Path) -> str:
    """The command that rebuilds a run's `out_of_date` steps on the recipe the run froze."""
    return f"smolflow run {Path(run_dir) / RECIPE} --run-dir {run_dir}"


def plan_ids(steps: Iterable[Step]) -> dict[str, str]:
    """An id per step from configs alone, upstream plan ids standing in for content fingerprints (in DAG
    order). Steps of two runs with equal plan ids receive the same inputs once built, so they get the
    same step id: an ablation knows before building anything which steps its variants share."""
    ids: dict[str, str] = {}
    for step in steps:
        ids[step.name] = step.step_id({role: ids[d.name] for role, d in step.deps.items()})
    return ids


def require(run_dir: Path, status: Status, needed_by: str) -> None:
    """Raise UpstreamMissing, saying what to run, unless a step another stage reads is cached or can be pulled."""
    if status.state in ("cached", "pull"):
        return
    step = status.step
    if finished(run_dir, step) is None:
        raise UpstreamMissing(
            f"{needed_by} needs the output of step {step.name!r}, which {run_dir} does not have: run the stage that "
            f"produces it first: `smolflow stage {step.stage} RECIPE --run-dir {run_dir}` (or `smolflow run` for the whole pipeline)"
        )
    changed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in status.changes) or status.reason or "its inputs changed"
    raise UpstreamMissing(
        f"{needed_by} needs step {step.name!r}, whose output in {run_dir} is out of date with the recipe ({changed}): "
        f"run `smolflow stage {step.stage} RECIPE --run-dir {run_dir}` first (or `smolflow run`)"
    )


# --- building --------------------------------------------------------------------------------

WAIT_LOG_S = 60.0  # how often a run waiting for another builder says who holds the step


class SummaryMismatch(SmolflowError):
    """A step function returned something its declared summary model does not accept (a code error: no retry)."""


def _checked(step: Step, returned: Any) -> Summary:
    kind = step.summary_type
    try:
        return kind.model_validate(returned)
    except ValidationError as err:
        raise SummaryMismatch(f"step {step.name}: its summary does not match {kind.schema_name()}: {err}") from None


def run_step(
    run_dir: Path, step: Step, inputs: Mapping[str, StepOutput], mirror: Mirror | None = None, wait_s: float = 86400.0
) -> StepOutput:
    """The step's outputs: linked from the store, pulled from the mirror, or built (resumed) here, as `decide` says.

    Runs that share a store build a step with the same identity once: a run that finds it being built
    by another process waits for it, saying who holds it every minute, and gives up after WAIT_S."""
    run_dir = Path(run_dir)
    return obtain(run_dir, decide(run_dir, step, step.fingerprints(inputs), mirror), mirror, inputs, wait_s)


def obtain(
    run_dir: Path, status: Status, mirror: Mirror | None, inputs: Mapping[str, StepOutput] | None = None, wait_s: float = 86400.0
) -> StepOutput:
    """Act on a decision: link a cached version, or take the step's lock and pull, commit or build it
    (INPUTS are needed only to build), then link it from the run."""
    step, sid = status.step, status.step_id
    store, folder = store_of(run_dir), folder_name(step.name, status.step_id)
    store.mkdir(parents=True, exist_ok=True)
    if status.state == "cached":
        log.info("step %s: finished earlier (step id %s), skipping", step.name, sid)
        (store / PARTIAL / f"{folder}{BUILT}").unlink(missing_ok=True)  # left by a kill right after its commit
        if mirror is not None:
            _push_missing(mirror, store / folder, folder, sid)
        output = status.output
    else:
        with _thread_lock(store / folder):
            output = _wait_and_build(run_dir, store, folder, status, mirror, inputs, wait_s)
        if not output.cached:
            _log_build(store, folder, run_dir, output.seconds)
    _link(run_dir / step.name, Path(STEPS) / folder)
    return dataclasses.replace(output, path=run_dir / step.name)


def _wait_and_build(run_dir: Path, store: Path, folder: str, status: Status, mirror, inputs, wait_s: float) -> StepOutput:
    path, started, said = store / PARTIAL / f"{folder}.lock", time.time(), 0.0
    while True:
        lock = acquire(path)
        if lock is not None:
            break
        waited = time.time() - started
        if waited >= wait_s:
            who = describe_holder(path)
            raise StepLocked(
                f"step {status.step.name} is being built by {who}; gave up waiting after {waited:.0f} s "
                f"(storage.wait_for_builder_s; the lock is freed when that process exits, or, from another host, when its lease expires)"
            )
        if waited >= said:
            log.info("step %s is being built by %s; waiting for it (%.0f s so far)", status.step.name, describe_holder(path), waited)
            said += WAIT_LOG_S
        time.sleep(max(0.05, min(5.0, WAIT_LOG_S, wait_s - waited)))
    building = run_dir / PARTIAL / status.step.name  # the eval follower and the user see the build through it
    try:
        _link(building, Path("..") / STEPS / PARTIAL / folder)
        with holding(lock):
            output = _build(store, folder, status, mirror, inputs, lock)
        building.unlink()  # kept while the build is unfinished: it points at what a relaunch resumes
        return output
    finally:
        lock.release()


def _build(store: Path, folder: str, status: Status, mirror: Mirror | None, inputs, lock) -> StepOutput:
    """Under the step's lock: pull, finish a cut-off commit, or build into STORE/.partial/FOLDER; then commit."""
    step, sid = status.step, status.step_id
    final, partial, built = store / folder, store / PARTIAL / folder, store / PARTIAL / f"{folder}{BUILT}"
    if (manifest := read_manifest(final)) and manifest.get("step_id") == sid:  # finished while we waited for the lock
        built.unlink(missing_ok=True)
        return _output(manifest, final, cached=True, step=step)
    if (manifest := read_manifest(partial)) is None and not built.is_file() and mirror is not None:
        if found := _on_mirror(mirror, step.name, sid):
            where, remote = found
            pulled = store / PARTIAL / f"{folder}.pull"  # a download, not work: an earlier attempt's is replaced
            shutil.rmtree(pulled, ignore_errors=True)
            log.info("step %s: pulling the finished copy from %s/%s", step.name, mirror.prefix, where)
            mirror.pull(where, pulled, MANIFEST)
            # a manifest written before traces were left out fingerprinted them too
            if remote["fingerprint"] in (fingerprint_tree(pulled), fingerprint_tree(pulled, frozenset({MANIFEST}))):
                lock.check()
                _commit(pulled, final)
                if where != folder:  # the mirror's old layout: the copy goes where this layout reads it (the old one stays)
                    _push_missing(mirror, final, folder, sid)
                return _output(remote, final, cached=True, step=step)
            shutil.rmtree(pulled)
            log.warning("step %s: the copy on %s does not match its manifest's fingerprint: building it here", step.name, mirror.prefix)
    try:
        manifest = _built(step, sid, status, inputs, partial, built, manifest)
        lock.check()  # a holder whose lease was taken over never commits
        _commit(partial, final)  # (3)
    except Exception as err:
        if (full := disk_full(err)) is None:
            raise
        free = shutil.disk_usage(partial if partial.is_dir() else store).free
        raise DiskFull(
            f"step {step.name}: no space left writing {full.filename or partial} ({free / 2**20:.1f} MiB free there); its "
            f"partial build stays in {partial}, nothing committed was touched: free space (or move storage.store) and rerun"
        ) from err
    built.unlink(missing_ok=True)
    if mirror is not None:
        mirror.push(final, folder, MANIFEST, skip_dirs=UNTRACKED_DIRS)
    log.info("step %s: built in %.1f s", step.name, manifest.get("seconds", 0.0))
    return _output(manifest, final, cached=False, step=step)


def _built(step: Step, sid: str, status: Status, inputs, partial: Path, built: Path, manifest: dict | None) -> dict:
    """The step built into PARTIAL with its manifest written: (1) the function's record, (2) the files on disk, the
    manifest last; a relaunch after (1) commits without building again."""
    if manifest is None:
        if built.is_file():
            record = json.loads(built.read_text())
            log.info("step %s: its function finished earlier (step id %s): committing it without building again", step.name, sid)
        else:
            if inputs is None:
                raise UpstreamMissing(f"step {step.name} must be built, not only linked: run its stage `smolflow stage {step.stage}`")
            if partial.is_dir():
                log.info("step %s: resuming the partial build %s", step.name, partial)
            partial.mkdir(parents=True, exist_ok=True)
            started = time.time()
            summary = _checked(step, step.fn(step.config, inputs, partial))
            record = {
                "summary": summary.model_dump(mode="json"),
                "summary_schema": summary.schema_name(),
                "inputs": status.fingerprints,
                "lineage": list(lineage(inputs).items()),  # pairs: JSON objects are written with sorted keys
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                "seconds": round(time.time() - started, 3),
            }
            write_json_atomic(built, record)  # (1): from here on a relaunch commits, never builds again
        for cut in temporaries(partial):  # a write cut off (the manifest's, the step's own): no output of the step
            cut.unlink()
        manifest = {
            "name": step.name,
            "step_id": sid,
            "config": identity(step.config),
            **record,
            "fingerprint": fingerprint_tree(partial),
            "host": {"name": socket.gethostname(), "python": platform.python_version(), "platform": platform.platform()},
        }
        manifest["files"] = fsync_tree(partial, skip_dirs=UNTRACKED_DIRS)  # (2): on disk before the manifest says finished
        write_json_atomic(partial / MANIFEST, manifest)
    return manifest


def _commit(ready: Path, final: Path) -> None:
    os.replace(ready, final)
    fsync_dir(final.parent)


def _log_build(store: Path, folder: str, run_dir: Path, seconds: float) -> None:
    line = json.dumps({"folder": folder, "run": run_dir.name, "seconds": seconds, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    with open(store / BUILDS, "a") as f:  # one short O_APPEND write: lines of concurrent builders never mix
        f.write(line + "\n")


_THREAD_LOCKS: dict[Path, threading.Lock] = {}


def _thread_lock(folder: Path) -> threading.Lock:
    """One builder per store folder among the threads of this process (the lock file covers processes)."""
    return _THREAD_LOCKS.setdefault(folder.resolve(), threading.Lock())


def _link(link: Path, target: Path) -> None:
    """Point LINK at TARGET (relative to LINK's folder), replaced atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        raise SmolflowError(f"{link} is a folder, not a link to a version in the step store: move it away (nothing was changed)")
    tmp = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}.link")  # one per writer: runs link at once
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _on_mirror(mirror: Mirror, name: str, sid: str) -> tuple[str, dict[str, Any]] | None:
    """(where, manifest) of the mirror's finished copy of step NAME with id SID: under NAME-ID, or, on a mirror
    written before that layout, under NAME, which held the run's current version (its manifest names the id)."""
    try:
        for where in (folder_name(name, sid), name):
            if (remote := mirror.read_marker(where, MANIFEST)) and remote.get("step_id") == sid:
                return where, remote
    except StorageError as err:  # an outage: the step can still be built here
        log.warning("step %s: cannot look for a finished copy on %s (%s): building it here", name, mirror.prefix, err)
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


# --- run dirs of the old layout --------------------------------------------------------------

_OLD_PREVIOUS, _OLD_STORE, _OLD_STEP_ID = ".previous", ".store", ".step_id"


def convert_layout(run_dir: Path) -> list[str]:
    """Move a run dir made by smolflow before the one layout into it, in place, rebuilding nothing: finished
    steps (`RUN/NAME`) and kept versions (`RUN/.previous/NAME-ID`) into the store, partial builds into its
    `.partial/`, an ablation's `.store` link renamed `steps`. Returns what was moved (logged)."""
    run_dir, moved = Path(run_dir), []
    if (run_dir / _OLD_STORE).is_symlink() and not os.path.lexists(run_dir / STEPS):
        os.replace(run_dir / _OLD_STORE, run_dir / STEPS)
        moved.append(f"{_OLD_STORE} -> {STEPS}")
    store = store_of(run_dir)

    def move(src: Path, dst: Path) -> bool:
        if os.path.lexists(dst):
            log.warning("layout: %s is already in the store as %s: left where it is", src, dst)
            return False
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        moved.append(f"{src.relative_to(run_dir)} -> {dst.relative_to(run_dir)}")
        return True

    for entry in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if entry.is_symlink() and (target := os.readlink(entry)).startswith(f"{_OLD_STORE}/"):  # an ablation run's step
            _link(entry, Path(STEPS) / target.removeprefix(f"{_OLD_STORE}/"))
            moved.append(f"{entry.name} -> {STEPS}/{target.removeprefix(f'{_OLD_STORE}/')}")
        elif entry.is_dir() and not entry.is_symlink() and (m := read_manifest(entry)) and m.get("name") == entry.name:
            if move(entry, store / folder_name(entry.name, m["step_id"])):
                _link(entry, Path(STEPS) / folder_name(entry.name, m["step_id"]))
    old = run_dir / _OLD_PREVIOUS
    for entry in sorted(old.iterdir()) if old.is_dir() else []:
        if entry.name.endswith(".partial") and folder_step_id(entry.with_name(entry.name.removesuffix(".partial"))):
            move(entry, store / PARTIAL / entry.name.removesuffix(".partial"))
        elif read_manifest(entry):
            move(entry, store / entry.name)
    partial = run_dir / PARTIAL
    for entry in sorted(partial.iterdir()) if partial.is_dir() else []:
        if entry.is_dir() and not entry.is_symlink() and (sid := _read_text(entry / _OLD_STEP_ID)):
            target = store / PARTIAL / folder_name(entry.name, sid.strip())
            if move(entry, target):
                (target / _OLD_STEP_ID).unlink()  # the folder's name carries its id now
    for folder in (old, partial):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for line in moved:
        log.warning("layout of %s converted: %s", run_dir, line)
    if old.is_dir():
        log.warning("layout: %s still holds versions with no id (an old partial build): kept, never resumed", old)
    return moved


# --- one run of a recipe ---------------------------------------------------------------------

_OPENED: dict[Path, Recipe] = {}  # run dir -> recipe read in this process (it may hold secrets recipe.json masks)
_RECIPE_LOCK = ".recipe.lock"  # held by the process whose flow runs were given the run's recipe, while they run
_HELD: dict[Path, list] = {}  # run dir -> [its recipe lock, how many open runs of this process hold it]


def _hold(root: Path) -> None:
    """One more open run of this process that was given ROOT's recipe. The first takes ROOT's recipe lock: another
    process may not freeze a recipe into ROOT meanwhile, since a pipeline's later stages read the frozen one."""
    key = root.resolve()
    if key in _HELD:
        _HELD[key][1] += 1
        return
    lock = acquire(key / _RECIPE_LOCK)  # absolute: the holder's working directory may change while it runs
    if lock is None:
        raise SmolflowError(
            f"{root} is in use by a run given its recipe ({describe_holder(key / _RECIPE_LOCK)}); its frozen recipe stays: "
            "leave out the recipe to build on it (`smolflow stage NAME --run-dir RUN`), or wait until that run ends"
        )
    _HELD[key] = [lock, 1]


def _release(root: Path) -> None:
    held = _HELD.get(root.resolve())
    if held is not None:
        held[1] -= 1
        if held[1] == 0:
            _HELD.pop(root.resolve())[0].release()


@dataclass(frozen=True)
class Run:
    """One run of a recipe: its run dir, the recipe frozen there at creation, and the S3 mirror."""

    recipe: Recipe
    run_dir: Path
    mirror: Mirror | None
    changes: tuple[tuple[str, Any, Any], ...] = ()  # recipe keys changed against the frozen recipe when opened
    holds: bool = False  # opened with a recipe: holds the run dir's recipe lock until `close`

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
        `changes` (and logged), and the new recipe frozen in its place when `freeze`. Given a recipe and
        FREEZE, the run holds the run dir's recipe lock until `close()`: another process that is given a
        recipe for it meanwhile is refused, naming this one."""
        new = load_recipe(recipe_path, list(overrides)) if recipe_path else None
        root = Path(run_dir) if run_dir else Path("runs") / new.name if new else None
        if root is None:
            raise SmolflowError("give a recipe or a run dir holding one (recipe.json)")
        frozen = _read_json(root / RECIPE)
        if frozen is None and new is None:
            raise SmolflowError(f"{root} holds no run (no {RECIPE}): pass the recipe")
        if root.is_dir():
            convert_layout(root)
        holds = new is not None and freeze
        if holds:
            root.mkdir(parents=True, exist_ok=True)
            _hold(root)
            frozen = _read_json(root / RECIPE)  # as it is now that no other run may change it
        try:
            return cls._opened(root, new, frozen, owner, freeze, holds)
        except BaseException:
            if holds:
                _release(root)
            raise

    @classmethod
    def _opened(cls, root: Path, new: Recipe | None, frozen: dict | None, owner: str | None, freeze: bool, holds: bool) -> Run:
        reuse = new is None or (owner is not None and _read_text(root / _OWNER_FILE) == owner)
        if reuse and frozen is not None:
            recipe = _OPENED.get(root.resolve())
            if recipe is None or recipe_dump(recipe) != frozen:
                recipe = frozen_recipe(frozen, str(root / RECIPE))
            return cls._make(recipe, root, holds=holds)
        changes = tuple(changed_keys(frozen, recipe_dump(new))) if frozen is not None else ()
        for key, old, value in changes:
            log.warning("recipe of %s: %s changed: %r -> %r", root, key, old, value)
        run = cls._make(new, root, changes, prepare=freeze, holds=holds)
        if freeze:
            write_json_atomic(root / RECIPE, recipe_dump(new))
            (root / _OWNER_FILE).write_text(owner or "")
            _OPENED[root.resolve()] = new
            if run.mirror is not None:  # beside the store it mirrors, under the run's name; an outage never holds the run
                threading.Thread(target=run._mirror_recipe, daemon=True, name="mirror recipe.json").start()
        return run

    def _mirror_recipe(self) -> None:
        try:
            self.mirror.put_file(self.run_dir / RECIPE, f"{RUNS}/{self.run_dir.name}/{RECIPE}")
        except StorageError as err:
            log.warning("run %s: %s not mirrored (%s); the run goes on, the next open mirrors it", self.run_dir, RECIPE, err)

    def close(self) -> None:
        """Release the run dir's recipe lock if this run holds it (the last of this process's runs that do)."""
        if self.holds:
            _release(self.run_dir)

    @classmethod
    def _make(cls, recipe: Recipe, root: Path, changes: tuple = (), prepare: bool = True, holds: bool = False) -> Run:
        mirror = Mirror(recipe.storage.mirror, recipe.storage.s3) if recipe.storage.mirror else None
        run = cls(recipe=recipe, run_dir=root, mirror=mirror, changes=changes, holds=holds)
        if prepare:
            run._link_store()
        return run

    @property
    def store(self) -> Path:
        """The step store: the recipe's shared `storage.store`, else the run's own RUN/steps."""
        return Path(self.recipe.storage.store) if self.recipe.storage.store else store_of(self.run_dir)

    def _link_store(self) -> None:
        """Make RUN/steps the run's store: a folder of its own, or a link to the shared store."""
        link = store_of(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.recipe.storage.store is None:
            if not os.path.lexists(link):
                link.mkdir()
            return
        self.store.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.store.resolve(), self.run_dir.resolve())
        if link.is_symlink() and os.readlink(link) == target:
            return
        if os.path.lexists(link) and not link.is_symlink():
            if any(link.iterdir()):
                raise SmolflowError(
                    f"{link} holds step versions of its own and the recipe sets storage.store={self.recipe.storage.store}: "
                    f"move them into {self.store} (or drop the setting for this run dir)"
                )
            link.rmdir()
        if link.is_symlink():
            log.warning("run %s: its step store changes from %s to %s", self.run_dir, os.readlink(link), target)
        tmp = link.with_name(f".{STEPS}.{os.getpid()}.{threading.get_ident()}.link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)

    def statuses(self, steps: Iterable[Step]) -> list[Status]:
        return statuses(self.run_dir, steps, self.mirror, self.store)

    def build(self, step: Step, inputs: Mapping[str, StepOutput]) -> StepOutput:
        return run_step(self.run_dir, step, inputs, self.mirror, self.recipe.storage.wait_for_builder_s)

    def obtain(self, status: Status) -> StepOutput:
        """A cached or pullable upstream step of another stage, linked (pulled) into the run."""
        return obtain(self.run_dir, status, self.mirror, None, self.recipe.storage.wait_for_builder_s)


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
