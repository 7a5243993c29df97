"""Checkpoints that are never half-written, verified before older ones go, and mirrored to S3.

DeepSpeed's `save_checkpoint` writes its `latest` file on rank 0 without waiting for the other
ranks and not atomically, so a rank killed mid-save can leave `latest` naming a checkpoint without
its optimizer shard. Here every rank saves into `ROOT/.tmp/TAG` with `save_latest=False`; after a
barrier rank 0 adds the HF export and a `checkpoint.json` listing every file and its size, fsyncs,
renames the folder to `ROOT/TAG`, and only then points `ROOT/latest.json` at it. Older
checkpoints are deleted only once a newer one is complete (and, with a mirror, uploaded).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from infra.errors import DiskFull, SmolflowError
from infra.storage import CorruptFile, Mirror, StorageError, file_digest, fsync_dir, fsync_tree, with_retries, write_json_atomic

MARKER = "checkpoint.json"
LATEST = "latest.json"
EVALUATED = ".evaluated"  # ROOT/.evaluated/TAG: TAG was scored (see mark_evaluated)
EVAL_WAIT_S = 600.0  # how long a save on a full disk waits for the evaluator to score the checkpoints held for it
log = logging.getLogger(__name__)


def weights_only_engine(engine) -> None:
    """Make DeepSpeed load checkpoint files with `torch.load(weights_only=True)`: tensors and plain
    containers only, never arbitrary pickled objects (its own engine loads with weights_only=False)."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if not isinstance(engine.checkpoint_engine, TorchCheckpointEngine):
        raise TypeError(f"expected DeepSpeed's torch checkpoint engine, got {type(engine.checkpoint_engine).__name__}")

    def load(path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = load


def mark_evaluated(checkpoint: Path) -> None:
    """The evaluator's side of the store's protocol: ROOT/TAG was scored, so `prune` may delete it now.

    Until then the store holds up to `hold_unevaluated` checkpoints past `keep_last`, so an
    evaluator that falls behind the trainer still scores every checkpoint. A checkpoint gone from
    where it was scored was pruned, or its step was committed (renamed), after which its store
    prunes nothing more: there is nothing left to hold back, so that is not an error.
    """
    checkpoint = Path(checkpoint)
    try:
        (checkpoint.parent / EVALUATED).mkdir(exist_ok=True)
        (checkpoint.parent / EVALUATED / checkpoint.name).touch()
    except FileNotFoundError:
        log.info("checkpoint %s moved or was pruned while it was scored: nothing to mark", checkpoint)


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    return int(re.fullmatch(r"step(\d+)", tag).group(1))


def is_complete(folder: Path) -> bool:
    """A checkpoint folder is complete when its marker lists exactly the files it holds, sizes included."""
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return False
    return all((folder / rel).is_file() and (folder / rel).stat().st_size == _size(rec) for rel, rec in listed.items())


def _size(record: dict[str, Any] | int) -> int:
    return record["size"] if isinstance(record, dict) else record  # markers before MD5s were recorded: sizes only


def verify(folder: Path) -> None:
    """Check every file's MD5 against the marker this project wrote; raise CorruptFile naming the first that differs.
    Run before anything that unpickles the checkpoint without `weights_only` (DeepSpeed's universal conversion)."""
    listed = json.loads((folder / MARKER).read_text())["files"]
    for rel, record in sorted(listed.items()):
        if not isinstance(record, dict) or file_digest(folder / rel, "md5") != record["md5"]:
            raise CorruptFile(f"{folder / rel} does not match the MD5 recorded when checkpoint {folder.name} was written")


def checkpoint_bytes(folder: Path) -> int:
    return sum(_size(r) for r in json.loads((folder / MARKER).read_text())["files"].values())


class CheckpointStore:
    """The checkpoints of one training stage under `root`; rank 0 manages files, all ranks save shards.

    With a mirror, a background thread uploads each committed checkpoint and retries failed uploads
    with backoff until they succeed; a checkpoint is pruned only once uploaded. During a long outage
    at most `max_unmirrored` checkpoints wait on disk: the next save fails loudly, naming the mirror,
    instead of filling the disk days into a stage.
    """

    def __init__(
        self,
        root: Path,
        keep_last: int,
        mirror: Mirror | None = None,
        remote_name: str = "",
        hold_unevaluated: int = 0,
        max_unmirrored: int = 4,
        retry_s: tuple[float, float] = (5.0, 300.0),
    ):
        self.root = Path(root)
        self.keep_last = keep_last
        self.hold_unevaluated = hold_unevaluated
        self.max_unmirrored = max_unmirrored
        self.mirror = mirror
        self.remote_name = remote_name
        self.root.mkdir(parents=True, exist_ok=True)
        self._uploaded: set[str] = set()
        self._failed: dict[str, str] = {}  # tag -> last error
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._retry_s = retry_s
        self._uploader = threading.Thread(target=self._upload_loop, daemon=True) if mirror else None
        if self._uploader:
            self._uploader.start()

    # --- finding the newest complete checkpoint -------------------------------------------

    def local_tags(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("step*") if p.is_dir() and is_complete(p))

    def latest(self) -> str | None:
        """Newest complete checkpoint, local or (if newer, or the only one) pulled back from the mirror.
        Local checkpoints the mirror lacks (an upload cut off by a crash or an outage) are queued again."""
        local = self.local_tags()
        newest = local[-1] if local else None
        if self.mirror is None:
            return newest
        try:
            remote = self.remote_tags()
        except StorageError as err:
            log.warning("checkpoints: cannot list %s (%s); resuming from local checkpoints, uploads retried", self.mirror.prefix, err)
            remote = []
        self._uploaded |= set(remote)
        for tag in local:
            if tag not in self._uploaded:
                self._queue.put(tag)
        if remote and (newest is None or step_of(remote[-1]) > step_of(newest)):
            newest = remote[-1]
            log.info("checkpoint %s is not on this machine: pulling it from %s", newest, self.mirror.prefix)
            target = self.root / ".tmp" / newest
            shutil.rmtree(target, ignore_errors=True)
            self.mirror.pull(f"{self.remote_name}/{newest}", target, MARKER)
            if not is_complete(target):
                raise StorageError(f"checkpoint {newest} pulled from {self.mirror.prefix} is incomplete")
            os.replace(target, self.root / newest)
            self._drop_staging()
        return newest

    def remote_tags(self) -> list[str]:
        fs, root = self.mirror.fs, f"{self.mirror.remote(self.remote_name)}"

        def names() -> list[str]:
            try:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True)]
            except FileNotFoundError:
                return []

        listed = with_retries(f"list {root}", names, self.mirror.attempts, self.mirror.backoff_s)
        return sorted(n for n in listed if n.startswith("step") and self.mirror.read_marker(f"{self.remote_name}/{n}", MARKER))

    # --- saving -----------------------------------------------------------------------------

    def tmp_dir(self) -> Path:
        return self.root / ".tmp"

    def clear_staging(self) -> None:
        """Rank 0, on start: saves a killed run left half-written in .tmp (never complete, recomputable)."""
        if self.tmp_dir().exists():
            log.info("checkpoints: clearing the unfinished saves in %s", self.tmp_dir())
            shutil.rmtree(self.tmp_dir())

    def _drop_staging(self) -> None:
        """After a checkpoint left tmp_dir() for its place: remove the folder when nothing else is staged in it, so that
        a finished run's checkpoints hold checkpoints only (the next save makes it again)."""
        with contextlib.suppress(OSError):
            self.tmp_dir().rmdir()

    def make_room(self, estimate: int) -> None:
        """Rank 0, before a save: fail early when checkpoints wait on an unreachable mirror, prune so the
        next checkpoint fits (the newest is always kept, and those held for the evaluator, for up to EVAL_WAIT_S
        while it scores them), or fail naming the folder and the space needed: a rerun with room scores the held."""
        waiting = [t for t in self.local_tags() if self.mirror is not None and t not in self._uploaded]
        if len(waiting) >= self.max_unmirrored:
            errors = "; ".join(sorted(set(self._failed.values()))) or "uploads still queued"
            raise MirrorBehind(
                f"{len(waiting)} checkpoints ({', '.join(waiting)}) are not on {self.mirror.prefix} yet ({errors}): stopping "
                f"before the disk fills; they are kept and uploaded when the mirror is back (a retry resumes from {waiting[-1]})"
            )
        tags = self.local_tags()
        need = 1.1 * max([checkpoint_bytes(self.root / t) for t in tags[-1:]] or [estimate])
        deadline = time.monotonic() + EVAL_WAIT_S
        while shutil.disk_usage(self.root).free < need:
            self.prune(keep=1)  # those the evaluator has yet to score stay: their scores are the run's evidence
            if shutil.disk_usage(self.root).free >= need or not self.unscored() or time.monotonic() > deadline:
                break
            time.sleep(1.0)  # the evaluator may score one in a moment, and then it goes
        if (free := shutil.disk_usage(self.root).free) < need:
            held = f"; {', '.join(self.unscored())} wait for the evaluator to score them" if self.unscored() else ""
            raise DiskFull(
                f"{self.root}: {free / 2**20:.1f} MiB free, the next checkpoint needs about {need / 2**20:.1f} MiB "
                f"(kept: {', '.join(self.local_tags()) or 'none'}{held}); free space there or move checkpoints to a larger disk"
            )

    def unscored(self) -> list[str]:
        """The checkpoints before the newest that `prune` holds for an evaluator that has not scored them yet."""
        if not self.hold_unevaluated:
            return []
        return [t for t in self.local_tags()[:-1] if not (self.root / EVALUATED / t).exists()]

    def commit(self, tag: str, step: int, extra: dict[str, Any]) -> None:
        """Rank 0, after every rank saved into tmp_dir()/TAG: record, publish, then prune."""
        staged = self.tmp_dir() / tag
        files = fsync_tree(staged)
        write_json_atomic(staged / MARKER, {"tag": tag, "step": step, "files": files, **extra})
        final = self.root / tag
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
        self._drop_staging()
        fsync_dir(self.root)
        write_json_atomic(self.root / LATEST, {"tag": tag, "step": step})
        if self.mirror is not None:
            self._queue.put(tag)
        self.prune()

    def prune(self, keep: int | None = None, hold: int | None = None) -> None:
        """Delete checkpoints beyond the newest `keep_last`, except those not yet uploaded, and (up to
        `hold_unevaluated` of them) those the evaluator has not scored yet (it marks them in EVALUATED/)."""
        keep = self.keep_last if keep is None else keep
        hold = self.hold_unevaluated if hold is None else hold
        held = 0
        for tag in reversed(self.local_tags()[:-keep]):
            if self.mirror is not None and tag not in self._uploaded:
                continue  # never delete the only copy: it goes once its upload is verified
            unscored = not (self.root / EVALUATED / tag).exists()
            if held < hold and unscored:
                held += 1
                continue
            if unscored and self.hold_unevaluated:  # an evaluator follows this run: its scores of TAG will be missing
                log.warning("checkpoint %s deleted before the evaluator scored it (%s: no room to hold it)", tag, self.root)
            shutil.rmtree(self.root / tag, ignore_errors=True)
            (self.root / EVALUATED / tag).unlink(missing_ok=True)

    # --- mirroring --------------------------------------------------------------------------

    def _upload_loop(self) -> None:
        wait = self._retry_s[0]
        while True:
            try:
                tag = self._queue.get(timeout=wait if self._failed else None)
            except queue.Empty:  # failed uploads are retried on their own, with growing pauses
                for failed in sorted(self._failed):
                    self._queue.put(failed)
                wait = min(wait * 2, self._retry_s[1])
                continue
            if tag is None:
                self._queue.task_done()
                return
            try:
                if tag not in self._uploaded and (self.root / tag).exists():
                    self.mirror.push(self.root / tag, f"{self.remote_name}/{tag}", MARKER)
                    self._uploaded.add(tag)
                    log.info("checkpoint %s mirrored to %s", tag, self.mirror.prefix)
                self._failed.pop(tag, None)
                wait = self._retry_s[0] if not self._failed else wait
            except Exception as err:  # an outage: keep the local copy and try again
                self._failed[tag] = f"{type(err).__name__}: {err}"
                log.warning("checkpoint %s: upload failed (%s); the local copy is kept and retried", tag, err)
            finally:
                self._queue.task_done()

    def unmirrored(self) -> list[str]:
        return sorted(self._failed)

    def close(self, wait_s: float = 0.0, drain_s: float = 60.0) -> list[str]:
        """Wait for queued uploads up to max(WAIT_S, DRAIN_S), and for failing ones to go through up to WAIT_S; the
        checkpoints the mirror still lacks (a later store's `latest()` queues them again). Never longer: a mirror
        that hangs (an S3 blackhole) once kept rank 0 here while the other ranks sat in a barrier; the uploader is
        a daemon thread, left behind past the deadline."""
        if self._uploader is None:
            return []
        started = time.time()
        drained, deadline = started + max(wait_s, drain_s), started + wait_s
        while self._queue.unfinished_tasks and time.time() < drained:
            time.sleep(0.05)
        while self._failed and not self._queue.unfinished_tasks and time.time() < deadline:
            for tag in sorted(self._failed):  # retry failed ones now, not after the upload loop's growing pause
                self._queue.put(tag)
            while self._queue.unfinished_tasks and time.time() < deadline:
                time.sleep(0.05)
            if self._failed:
                time.sleep(min(self._retry_s[0], max(0.0, deadline - time.time())))
        lacking = sorted({*self._failed, *(t for t in self.local_tags() if t not in self._uploaded)})
        self._queue.put(None)
        self._uploader.join(timeout=max(0.5, max(drained, deadline) - time.time()))
        if not self._uploader.is_alive():
            self.prune()
        return lacking


class MirrorBehind(SmolflowError):
    """Too many checkpoints wait for an unreachable mirror; the task retries once it may be back."""

    retryable = True
