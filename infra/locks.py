"""Build locks: a kernel lock on an open descriptor, plus a lease for hosts that share the folder.

Prefect can launch a flow run twice (a crash event reported twice, a hand retry while a worker
still runs it). `fcntl.flock` belongs to the open descriptor and the kernel drops it when its
holder dies, however it dies: there is no stale lock to judge and no check-then-act race between
two relaunches. Hosts that share a run dir over a filesystem whose locks are local to each host
(several parallel filesystems) cannot see each other's kernel locks, so the holder also keeps a
lease in the file: its host, pid and start time and a heartbeat it renews while it holds the lock.
Another host takes over only once the heartbeat is older than the lease (host clocks in sync, as on
any cluster). The lease also lists the processes the holder launched (trainers), so that whoever
takes a lock over kills a leftover tree before it builds.
"""

from __future__ import annotations

import contextvars
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infra.procs import HOST, Proc, kill_tree

LEASE_S = 120.0  # another host takes a lock over once its heartbeat is this old
log = logging.getLogger(__name__)


class Lock:
    """A held lock: the open descriptor, its lease record and the thread renewing it."""

    def __init__(self, path: Path, fd: int, lease_s: float):
        self.path, self.fd, self.lease_s = path, fd, lease_s
        self.record: dict[str, Any] = {
            **Proc.of().dump(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lease_s": lease_s,
            "children": [],
        }
        self._mutex, self._stop = threading.Lock(), threading.Event()
        self._write()
        self._beat = threading.Thread(target=self._renew, daemon=True, name=f"lease {path.name}")
        self._beat.start()

    def _write(self) -> None:
        with self._mutex:
            self.record["heartbeat"] = time.time()
            data = json.dumps(self.record).encode()
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            os.fsync(self.fd)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self._write()

    def add_child(self, pid: int) -> None:
        """Record a process this holder launched: a later holder kills it if it outlived us."""
        self.record["children"].append(Proc.of(pid).dump())
        self._write()

    def release(self) -> None:
        self._stop.set()
        self._beat.join()
        self.path.unlink(missing_ok=True)  # still holding it: a waiter that opened this file sees it unlinked
        os.close(self.fd)


def acquire(path: Path, lease_s: float = LEASE_S) -> Lock | None:
    """Take the lock at PATH, or None while a live holder (this host) or an unexpired lease (another) has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # its holder released and unlinked it between our open and our flock: take the new file
    old = _parse(os.pread(fd, 1 << 20, 0))
    if old is not None and old.get("host") != HOST and time.time() - float(old.get("heartbeat", 0)) < float(old.get("lease_s", lease_s)):
        os.close(fd)
        return None
    if old is not None:
        log.warning("lock %s: taking over from %s (its process is gone or its lease expired)", path, describe(old))
        for child in old.get("children", []):
            if (proc := Proc.load(child).process()) is not None:
                log.warning("lock %s: killing pid %d, left running by the previous holder", path, proc.pid)
                kill_tree(proc)
    return Lock(path, fd, lease_s)


def holder(path: Path) -> dict[str, Any] | None:
    try:
        return _parse(path.read_bytes())
    except FileNotFoundError:
        return None


def describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "another process (no lease written yet)"
    age = time.time() - float(record.get("heartbeat", 0))
    return f"pid {record.get('pid')} on {record.get('host')} since {record.get('since')} (heartbeat {age:.0f} s ago)"


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        return json.loads(data) or None
    except ValueError:
        return None


_HELD: contextvars.ContextVar[Lock | None] = contextvars.ContextVar("held_lock", default=None)


@contextmanager
def holding(lock: Lock) -> Iterator[Lock]:
    """Within this block, processes launched by this thread are recorded in LOCK (`record_child`)."""
    token = _HELD.set(lock)
    try:
        yield lock
    finally:
        _HELD.reset(token)


def record_child(pid: int) -> None:
    if (lock := _HELD.get()) is not None:
        lock.add_child(pid)
