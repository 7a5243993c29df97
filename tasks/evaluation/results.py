"""Which models a run holds, and their evaluation results keyed by content.

A model is any HF folder worth scoring: every complete pretraining checkpoint (`hf/` inside it,
committed or still in the stage's partial folder) and every finished model (the pretrained base,
SFT, APO, GRPO). Its fingerprint hashes the folder's files (name + MD5), so a result is reused
wherever the same weights turn up again (a checkpoint pulled back from S3, a rerun that moved the
folder) and recomputed only when the content changes. MD5 because S3 reports it as the ETag of a
plain upload: a mirrored checkpoint is fingerprinted from its listing, without downloading it.

Results live in `evals/results/FP.json` (run dir) or `PREFIX/evals/FP.json` (S3), one task's
metrics at a time, so adding a task to the recipe evaluates only that task. A lock file per
fingerprint keeps two overlapping evaluation runs from scoring the same model at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.errors import DiskFull, disk_full
from infra.locks import acquire
from infra.recipe import EvalCfg, S3Cfg
from infra.steps import CARD, CHECKPOINTS, FINAL, HF_CONFIG, MANIFEST, Step, folder_step_id, identity, read_manifest, step_id
from infra.storage import filesystem, fingerprint_listing, known_digest, with_retries, write_json_atomic
from model.checkpoint import MARKER, is_complete

log = logging.getLogger(__name__)
ITEMS = "items"  # a task's per-item outcomes in a result record (infra.summaries.outcomes)
MAIN_METRIC = ("acc", "exact_match/answer", "bits_per_byte")  # the number a task is summed up by, in this order


def eval_key(cfg: EvalCfg) -> str:
    """What a task's score depends on besides the model: the evaluation config's identity (item limit,
    context, backend...), less the task lists (each task's result is kept on its own) and the
    operational fields (threads, niceness, batch size, polling), which change no score."""
    config = {k: v for k, v in identity(cfg).items() if k not in ("checkpoint_tasks", "model_tasks")}
    return step_id("eval", config, {})


def main_metric(metrics: dict[str, float]) -> tuple[str, float] | None:
    key = next((k for k in MAIN_METRIC if k in metrics), None)
    return (key, metrics[key]) if key else None


def stderr_of(metrics: dict[str, float], key: str) -> float | None:
    """The standard error lm-eval reported for metric KEY ('acc' -> 'acc_stderr', 'a/b' -> 'a_stderr/b')."""
    name, _, flt = key.partition("/")
    return metrics.get(f"{name}_stderr" + (f"/{flt}" if flt else ""))


@dataclass(frozen=True)
class ModelRef:
    """One model folder to evaluate and its place in the run (for plots: stage, step, tokens)."""

    path: str  # local folder or remote URL of the HF files
    fingerprint: str
    label: str  # "phase1/step00000200", "base", "sft", ...
    kind: str  # "checkpoint" (pretraining) or "model" (finished: also gets the chat tasks)
    stage: str  # the pretraining phase of a checkpoint, the label of a model
    step: int | None = None
    tokens: int | None = None
    step_id: str | None = None  # the id of the step that made it: runs sharing a result store tell theirs apart
    scores_as: str | None = None  # `scoring_key`: equal for folders that score the same (a phase's final, its last checkpoint)

    def info(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "label": self.label,
            "kind": self.kind,
            "stage": self.stage,
            "step": self.step,
            "tokens": self.tokens,
            "step_id": self.step_id,
        }


UNSCORED_CONFIG = ("use_cache",)  # config keys no score depends on (older code saved checkpoints' hf/ without the cache)


def _listing(folder: Path) -> dict[str, str]:
    """relative path -> MD5 of every file of a local model folder (a file whose stat is unchanged is not read again).
    A folder renamed mid-listing lists short without an error (pathlib's glob skips what vanished),
    so an empty listing raises FileNotFoundError instead of fingerprinting nothing."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{folder}: no files (moved, or not a model folder)")
    return {p.relative_to(folder).as_posix(): known_digest(p, "md5") for p in files}


def local_fingerprint(folder: Path) -> str:
    """Content fingerprint of a local model folder: its results' key."""
    return fingerprint_listing(_listing(folder))


def scoring_key(folder: Path) -> str:
    """What a local model folder's scores depend on: every file but the model card, and the config less the keys
    no score reads. A phase's final model and its last checkpoint share it: the scores of one are the other's."""
    listing = _listing(folder)
    files = {rel: md5 for rel, md5 in listing.items() if rel not in (CARD, HF_CONFIG)}
    if HF_CONFIG in listing:
        config = {k: v for k, v in json.loads((folder / HF_CONFIG).read_text()).items() if k not in UNSCORED_CONFIG}
        files[HF_CONFIG] = hashlib.md5(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return fingerprint_listing(files)


def models_in_run(run_dir: Path, steps: list[Step]) -> list[ModelRef]:
    """Every complete checkpoint and finished model the run's steps hold, in training order
    (`Step.checkpoints` and `Step.model` say which steps hold which)."""
    run_dir, models = Path(run_dir), []
    for step in steps:
        if step.checkpoints is None:
            continue
        for root in (run_dir / step.name, run_dir / ".partial" / step.name):
            sid = made_by(root)
            for folder in sorted((root / CHECKPOINTS).glob("step*")):
                try:
                    if not ((folder / "hf").is_dir() and is_complete(folder)):
                        continue
                    marker = json.loads((folder / MARKER).read_text())
                    fingerprint, scores_as = local_fingerprint(folder / "hf"), scoring_key(folder / "hf")
                except FileNotFoundError:
                    continue  # its step was committed (renamed) or the checkpoint pruned mid-read: the next scan finds it where it is
                models.append(
                    ModelRef(
                        path=str(folder / "hf"),
                        fingerprint=fingerprint,
                        label=f"{step.checkpoints}/{folder.name}",
                        kind="checkpoint",
                        stage=step.checkpoints,
                        step=marker.get("step"),
                        tokens=marker.get("tokens"),
                        step_id=sid,
                        scores_as=scores_as,
                    )
                )
    for step in steps:
        folder = run_dir / step.name / FINAL
        if step.model and (run_dir / step.name / MANIFEST).is_file() and folder.is_dir():
            fingerprint, scores_as = local_fingerprint(folder), scoring_key(folder)
            models.append(
                ModelRef(str(folder), fingerprint, step.model, "model", step.model, step_id=made_by(folder.parent), scores_as=scores_as)
            )
    return distinct(models)  # a checkpoint seen mid-rename (partial and committed) counts once


def distinct(models: list[ModelRef]) -> list[ModelRef]:
    """Each model content once, the first place it was found: the same files in two folders are one model to score."""
    unique: dict[str, ModelRef] = {}
    for m in models:
        unique.setdefault(m.fingerprint, m)
    return list(unique.values())


def made_by(step_dir: Path) -> str | None:
    """The id of the step a finished or partial step folder holds."""
    manifest = read_manifest(step_dir)
    return manifest["step_id"] if manifest else folder_step_id(step_dir) if os.path.lexists(step_dir) else None


def models_in_prefix(prefix: str, s3: S3Cfg | None, steps: list[Step]) -> tuple[list[ModelRef], dict[str, str]]:
    """Every checkpoint and finished model mirrored under an s3:// (or any fsspec) prefix, fingerprinted from
    the file records (size, MD5) of its marker or manifest, checked against the listing. Returns the models and
    the folders that could not be fingerprinted, with the reason (logged, never dropped silently)."""
    fs, root = filesystem(prefix, s3)
    found = []
    for step in steps:
        if step.checkpoints is None:
            continue
        markers = with_retries(f"list {prefix}", lambda step=step: layouts(fs, root, step.name, f"{CHECKPOINTS}/step*/{MARKER}"))
        for marker_path in sorted(markers):
            folder = marker_path.rsplit("/", 1)[0]
            marker = _read_json(fs, marker_path)
            found.append((folder, "hf", f"{step.checkpoints}/{folder.rsplit('/', 1)[-1]}", "checkpoint", step.checkpoints, marker))
    for step in [s for s in steps if s.model]:  # every version the mirror holds (an ablation's runs share one mirror)
        for path in sorted(with_retries(f"list {prefix}", lambda step=step: layouts(fs, root, step.name, MANIFEST))):
            if (manifest := _read_json(fs, path)) is not None and manifest.get("name") == step.name:
                found.append((path.rsplit("/", 1)[0], FINAL, step.model, "model", step.model, manifest))
    models, skipped = [], {}
    for folder, sub, label, kind, stage, record in found:
        fingerprint, problem = remote_fingerprint(fs, folder, sub, record.get("files", {}))
        if problem:
            skipped[f"{folder}/{sub}"] = problem
            log.warning("not evaluating %s/%s: %s", folder, sub, problem)
            continue
        url = f"s3://{folder}/{sub}" if prefix.startswith("s3://") else f"{folder}/{sub}"
        models.append(ModelRef(url, fingerprint, label, kind, stage, record.get("step"), record.get("tokens"), record.get("step_id")))
    return distinct(models), skipped  # an old layout's folder and its copy under NAME-ID are one model


def layouts(fs, root: str, name: str, inside: str) -> list[str]:
    """Paths matching INSIDE in every version of step NAME on a mirror: ROOT/NAME-ID/..., and ROOT/NAME/... where a
    mirror written before that layout holds one."""
    return [*fs.glob(f"{root}/{name}-*/{inside}"), *fs.glob(f"{root}/{name}/{inside}")]


def _read_json(fs, path: str) -> dict[str, Any] | None:
    try:
        return json.loads(with_retries(f"read {path}", lambda: fs.cat_file(path)))
    except FileNotFoundError:
        return None


def remote_fingerprint(fs, folder: str, sub: str, files: dict[str, Any]) -> tuple[str, str | None]:
    """local_fingerprint of FOLDER/SUB from the MD5s its marker recorded, once the listing's sizes match them;
    (fingerprint, None) or ("", why not)."""
    record = {rel[len(sub) + 1 :]: r for rel, r in files.items() if rel.startswith(f"{sub}/")}
    if not record or not all(isinstance(r, dict) and "md5" in r for r in record.values()):
        return "", "its marker records no MD5s (written by an older smolflow): download it to evaluate it"
    try:
        listing = with_retries(f"list {folder}/{sub}", lambda: fs.find(f"{folder}/{sub}", detail=True))
    except FileNotFoundError:
        listing = {}
    sizes = {key[len(folder) + len(sub) + 2 :]: info.get("size") for key, info in listing.items()}
    wrong = sorted(rel for rel, r in record.items() if sizes.get(rel) != r["size"])
    if wrong:
        return "", f"{len(wrong)} file(s) missing or of another size than recorded ({', '.join(wrong[:3])})"
    return fingerprint_listing({rel: r["md5"] for rel, r in record.items()}), None


def _merged(fingerprint: str, objects: list[dict[str, Any]], keys: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """One model's record from its objects: every task, the seconds of all its evaluations, the time of the last.
    A task scored under several keys (two item limits, two versions of its held-out data) has an object for each:
    the record holds the newest under KEYS[task] when there is one, else the newest of all."""
    if not objects:
        return None
    objects = sorted(objects, key=lambda r: r.get("evaluated_at", ""))
    record = {"fingerprint": fingerprint, "model": objects[-1].get("model", {}), "tasks": {}}
    wanted = keys or {}
    for o in objects:
        for task, entry in o["tasks"].items():
            kept = record["tasks"].get(task)
            if kept is None or entry.get("key") == wanted.get(task) or kept.get("key") != wanted.get(task):
                record["tasks"][task] = entry
    record["seconds"] = round(sum(o.get("seconds", 0.0) for o in objects), 2)
    record["evaluated_at"] = objects[-1].get("evaluated_at")
    return record


RESULTS = Path("evals") / "results"  # a run's result store (an ablation's and a swarm's runs link theirs to a shared one)
KEYS = Path("evals") / "keys.json"  # task -> the key the run's evaluations score it under (`keep_keys`)


def run_results(run_dir: Path) -> ResultStore:
    """The run's result store, reading each task's result under the key the run's last evaluation scored it under:
    a store shared with other runs, or a run that went back to an earlier item limit, holds other keys too, and the
    newest of them need not be this run's."""
    path = run_dir / KEYS
    return ResultStore(str(run_dir / RESULTS), keys=json.loads(path.read_text()) if path.is_file() else None)


def keep_keys(run_dir: Path, keys: Mapping[str, str]) -> None:
    """Record the keys an evaluation of the run scores under, for `run_results` (the follower and a stage's evaluation
    may record at once: each write has its own temporary)."""
    path = run_dir / KEYS
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, dict(keys))


class ResultStore:
    """Evaluation results per model fingerprint, in a local folder or under an fsspec URL: one object per result
    (`FP.TASK.KEY.json`, a record holding that one task under one key), written whole and never read back to be
    rewritten, so two hosts scoring one model in the same bucket cannot drop each other's tasks. A model's record is
    the merge of its objects (and of `FP.TASK.json` and `FP.json`, which earlier versions wrote, still read)."""

    def __init__(self, url: str, s3: S3Cfg | None = None, lock_dir: Path | None = None, keys: Mapping[str, str] | None = None):
        """KEYS (task -> key): the results `get` and `all` read where a task has several (`_merged`)."""
        self.url, self.keys = url.rstrip("/"), keys
        self.fs, self.root = filesystem(self.url, s3)
        self.lock_dir = Path(lock_dir or (Path(url) / ".locks" if "://" not in url else Path(".smolflow") / "eval-locks"))

    def _list(self, pattern: str) -> list[str]:
        """A fresh listing: s3fs caches listings, and another host's objects would not be in this host's cache."""
        self.fs.invalidate_cache(self.root)
        return self.fs.glob(f"{self.root}/{pattern}")

    def _read(self, paths: list[str]) -> dict[str, list[dict[str, Any]]]:
        """fingerprint (the part of the name before its first dot) -> the objects read."""
        out: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(paths):  # FP.json (earlier versions' whole record) sorts before FP.TASK.json
            try:
                with self.fs.open(path, "rb") as f:
                    out.setdefault(Path(path).name.split(".")[0], []).append(json.loads(f.read()))
            except FileNotFoundError:
                continue
        return out

    def get(self, fingerprint: str, keys: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """The model's record; each task's result under KEYS (task -> key; the store's own by default) where one is
        stored (`_merged`)."""
        objects = self._read(self._list(f"{fingerprint}*.json"))  # FP.json, FP.TASK(.KEY).json; another FP is dropped by name
        return _merged(fingerprint, objects.get(fingerprint, []), self.keys if keys is None else keys)

    def pending(self, model: ModelRef, tasks: list[str], keys: Mapping[str, str]) -> list[str]:
        """Tasks this model has no result for under their KEYS (task -> `eval_key`, and the task's data where it has some)."""
        done = (self.get(model.fingerprint, keys) or {}).get("tasks", {})
        return [t for t in tasks if t not in done or done[t].get("key") != keys[t]]

    def put(
        self, model: ModelRef, metrics: dict[str, dict[str, float]], keys: Mapping[str, str], limit: int | None, seconds: float
    ) -> dict[str, Any]:
        """One object per task and key (its item outcomes, when kept, beside its metrics; SECONDS shared among them):
        a result under another key is kept beside it, not replaced. Returns the model's record as it now reads."""
        self.fs.makedirs(self.root, exist_ok=True)
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for task, m in metrics.items():
            entry = {"key": keys[task], "limit": limit, "metrics": {k: v for k, v in m.items() if k != ITEMS}}
            entry |= {ITEMS: m[ITEMS]} if ITEMS in m else {}
            record = {"fingerprint": model.fingerprint, "model": model.info(), "tasks": {task: entry}}
            name = f"{model.fingerprint}.{task}.{keys[task]}.json"
            self._write(name, record | {"seconds": round(seconds / len(metrics), 2), "evaluated_at": at})
        return self.get(model.fingerprint, keys) or {}

    def _write(self, name: str, record: dict[str, Any]) -> None:
        tmp = f"{self.root}/.{name}.{uuid.uuid4().hex[:8]}.tmp"  # two hosts writing one result never share a temporary
        try:
            with self.fs.open(tmp, "w") as f:
                json.dump(record, f, sort_keys=True, separators=(",", ":"))  # compact: item outcomes run to thousands of numbers
        except OSError as err:
            if disk_full(err) is None:
                raise
            Path(tmp).unlink(missing_ok=True)  # ENOSPC comes from a local disk
            free = shutil.disk_usage(self.root).free
            raise DiskFull(
                f"evaluation results: no space left writing {tmp} ({free / 2**20:.1f} MiB free there); the model's results "
                "stored before are untouched: free space and rerun (`smolflow eval` scores only what has none)"
            ) from err
        self.fs.mv(tmp, f"{self.root}/{name}")

    def files(self, fingerprint: str) -> list[str]:
        """The names of a model's objects (a run's mirror copies them)."""
        return sorted(Path(p).name for p in self._list(f"{fingerprint}.*.json"))

    def all(self) -> list[dict[str, Any]]:
        """Every model's record, each task's result under the store's keys where one is stored."""
        objects = self._read(self._list("*.json"))
        return [r for fp in sorted(objects) if (r := _merged(fp, objects[fp], self.keys))]

    @contextmanager
    def claim(self, fingerprint: str) -> Iterator[bool]:
        """Yields True when this process may evaluate the model; False while another live process is."""
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        lock = acquire(self.lock_dir / f"{fingerprint}.lock")
        try:
            yield lock is not None
        finally:
            if lock is not None:
                lock.release()
