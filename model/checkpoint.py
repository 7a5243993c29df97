"""Checkpoints that are never half-written, verified before older ones go, and mirrored to S3.

DeepSpeed's `save_checkpoint` writes its `latest` file on rank 0 without waiting for the other
ranks and not atomically, so a rank killed mid-save can leave `latest` naming a checkpoint without
its optimizer shard. Here every rank saves into `ROOT/.tmp/TAG` with `save_latest=False`; after a
barrier rank 0 adds the HF export and a `checkpoint.json` listing every file and its size, fsyncs,
renames the folder to `ROOT/TAG`, and only then points `ROOT/latest.json` at it. Older
checkpoints are deleted only once a newer one is complete (and, with a mirror, uploaded).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
from pathlib import Path
from typing import Any

from infra.storage import Mirror, fsync_dir, write_json_atomic

MARKER = "checkpoint.json"
LATEST = "latest.json"
EVALUATED = ".evaluated"  # ROOT/.evaluated/TAG: TAG was scored (see mark_evaluated)
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
    evaluator that falls behind the trainer still scores every checkpoint.
    """
    checkpoint = Path(checkpoint)
    (checkpoint.parent / EVALUATED).mkdir(exist_ok=True)
    (checkpoint.parent / EVALUATED / checkpoint.name).touch()


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    return int(re.fullmatch(r"step(\d+)", tag).group(1))


def fsync_tree(root: Path) -> dict[str, int]:
    """fsync every file under `root` (and the folders), returning relative path -> size."""
    sizes = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[path.relative_to(root).as_posix()] = path.stat().st_size
    for folder in sorted({p.parent for p in root.rglob("*")} | {root}):
        fsync_dir(folder)
    return sizes


def is_complete(folder: Path) -> bool:
    """A checkpoint folder is complete when its marker lists exactly the files it holds, sizes included."""
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return False
    return all((folder / rel).is_file() and (folder / rel).stat().st_size == size for rel, size in listed.items())


class CheckpointStore:
    """The checkpoints of one training stage under `root`; rank 0 manages files, all ranks save shards."""

    def __init__(self, root: Path, keep_last: int, mirror: Mirror | None = None, remote_name: str = "", hold_unevaluated: int = 0):
        self.root = Path(root)
        self.keep_last = keep_last
        self.hold_unevaluated = hold_unevaluated
        self.mirror = mirror
        self.remote_name = remote_name
        self.root.mkdir(parents=True, exist_ok=True)
        self._uploaded: set[str] = set()
        self._failed: set[str] = set()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._uploader = threading.Thread(target=self._upload_loop, daemon=True) if mirror else None
        if self._uploader:
            self._uploader.start()

    # --- finding the newest complete checkpoint -------------------------------------------

    def local_tags(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("step*") if p.is_dir() and is_complete(p))

    def latest(self) -> str | None:
        """Newest complete checkpoint, local or (if newer, or the only one) pulled back from the mirror."""
        local = self.local_tags()
        newest = local[-1] if local else None
        if self.mirror is not None:
            remote = self.remote_tags()
            if remote and (newest is None or step_of(remote[-1]) > step_of(newest)):
                newest = remote[-1]
                if newest not in local:
                    log.info("checkpoint %s is not on this machine: pulling it from %s", newest, self.mirror.prefix)
                    target = self.root / ".tmp" / newest
                    shutil.rmtree(target, ignore_errors=True)
                    self.mirror.pull(f"{self.remote_name}/{newest}", target, MARKER)
                    if not is_complete(target):
                        raise RuntimeError(f"checkpoint {newest} pulled from the mirror is incomplete")
                    os.replace(target, self.root / newest)
                    self._uploaded.add(newest)
        return newest

    def remote_tags(self) -> list[str]:
        fs, root = self.mirror.fs, f"{self.mirror.remote(self.remote_name)}"
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.startswith("step") and self.mirror.read_marker(f"{self.remote_name}/{n}", MARKER))

    # --- saving -----------------------------------------------------------------------------

    def tmp_dir(self) -> Path:
        return self.root / ".tmp"

    def commit(self, tag: str, step: int, extra: dict[str, Any]) -> None:
        """Rank 0, after every rank saved into tmp_dir()/TAG: verify, publish, then prune."""
        staged = self.tmp_dir() / tag
        sizes = fsync_tree(staged)
        write_json_atomic(staged / MARKER, {"tag": tag, "step": step, "files": sizes, **extra})
        final = self.root / tag
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
        fsync_dir(self.root)
        write_json_atomic(self.root / LATEST, {"tag": tag, "step": step})
        if self.mirror is not None:
            self._queue.put(tag)
        self.prune()

    def prune(self) -> None:
        """Delete checkpoints beyond the newest `keep_last`, except those not yet uploaded, and (up to
        `hold_unevaluated` of them) those the evaluator has not scored yet (it marks them in EVALUATED/)."""
        held = 0
        for tag in reversed(self.local_tags()[: -self.keep_last]):
            if self.mirror is not None and tag not in self._uploaded:
                continue  # never delete the only copy: it goes once its upload is verified
            if held < self.hold_unevaluated and not (self.root / EVALUATED / tag).exists():
                held += 1
                continue
            shutil.rmtree(self.root / tag, ignore_errors=True)
            (self.root / EVALUATED / tag).unlink(missing_ok=True)

    # --- mirroring --------------------------------------------------------------------------

    def _upload_loop(self) -> None:
        while (tag := self._queue.get()) is not None:
            try:
                if (self.root / tag).exists():
                    self.mirror.push(self.root / tag, f"{self.remote_name}/{tag}", MARKER)
                    self._uploaded.add(tag)
                    self._failed.discard(tag)
                    log.info("checkpoint %s mirrored to %s", tag, self.mirror.prefix)
            except Exception as err:  # an outage: keep the local copy, try again with the next save
                self._failed.add(tag)
                log.warning("checkpoint %s: upload failed (%s); the local copy is kept and retried", tag, err)
            finally:
                self._queue.task_done()

    def retry_failed(self) -> None:
        for tag in sorted(self._failed):
            self._queue.put(tag)

    def close(self) -> list[str]:
        """Wait for queued uploads; returns the checkpoints whose upload still failed."""
        if self._uploader is None:
            return []
        self.retry_failed()
        self._queue.join()
        self._queue.put(None)
        self._uploader.join()
        self.prune()
        return sorted(self._failed)
