"""Build locks: a kernel lock on an open descriptor, plus a fenced lease for hosts that share the folder.

Prefect can launch a flow run twice (a crash event reported twice, a hand retry while a worker
still runs it). `fcntl.flock` belongs to the open descriptor and the kernel drops it when its
holder dies, however it dies: there is no stale lock to judge and no check-then-act race between
two relaunches. Hosts that share a store over a filesystem whose locks are local to each host
cannot see each other's kernel locks, so the holder also keeps a lease in the file: host, pid,
start time, a heartbeat it renews, a random token and an epoch. Another host takes over only once
the heartbeat (or, for a file with no lease written yet, its modification time) is older than the
lease, and raises the epoch. A holder whose lease was taken over notices it (its renewals and
`check()` read the file back) and must not commit; its `release()` leaves the new holder's file alone.

The file is trusted no further than that: it is opened without following links and refused when
another user owns it, and the processes its lease lists are killed on takeover only when they are
ours and carry the lease's token in their environment (LEASE_ENV): a pid and start time alone can
be read by anyone in /proc and planted in a lease.
"""

from __future__ import annotations

import contextvars
import fcntl
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from infra.errors import SmolflowError, StepLocked
from infra.procs import HOST, Proc, stop

LEASE_S = 120.0  # another host takes a lock over once its heartbeat is this old
FIRST_WRITE_S = 10.0  # a holder writes its lease within this of creating the file: an empty file older than it is a dead one's
LEASE_ENV = "SMOLFLOW_LEASE"  # the token of the lease whose holder launched a process
log = logging.getLogger(__name__)


class LockLost(StepLocked):
    """This holder's lease was taken over (its heartbeat stalled past the lease): it must not commit."""

    retryable = True


class Lock:
    """A held lock: the open descriptor, its lease record and the thread renewing it."""

    def __init__(self, path: Path, fd: int, lease_s: float, epoch: int):
        self.path, self.fd, self.lease_s, self.pid = path, fd, lease_s, os.getpid()
        _HELD_FDS.add(fd)
        self.record: dict[str, Any] = {
            **Proc.of().dump(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lease_s": lease_s,
            "epoch": epoch,
            "token": secrets.token_hex(16),
            "children": [],
        }
        self.lost: str | None = None  # why this holder no longer holds the lease
        self._mutex, self._stop = threading.Lock(), threading.Event()
        self._write(first=True)
        self._beat = threading.Thread(target=self._renew, daemon=True, name=f"lease {path.name}")
        self._beat.start()

    def _ours(self) -> bool:
        """Whether PATH is still our file and holds our lease (no takeover since we last wrote it)."""
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(self.fd).st_ino:
                self.lost = f"{self.path} was replaced"
                return False
        except FileNotFoundError:
            self.lost = f"{self.path} was removed"
            return False
        found = _parse(os.pread(self.fd, 1 << 20, 0)) or {}
        if (found.get("token"), found.get("epoch")) != (self.record["token"], self.record["epoch"]):
            self.lost = f"taken over by {describe(found)} (epoch {found.get('epoch')})"
            return False
        return True

    def _write(self, first: bool = False) -> None:
        with self._mutex:
            if self.lost or (not first and not self._ours()):
                return  # never overwrite the lease of whoever took it over
            self.record["heartbeat"] = time.time()
            data = json.dumps(self.record).encode()
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            os.fsync(self.fd)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self._write()
            if self.lost:
                log.error("lock %s: lease lost (%s): this build must not commit", self.path, self.lost)
                return

    def check(self) -> None:
        """Raise LockLost unless this holder still holds the lease (call right before committing)."""
        with self._mutex:
            if self.lost or not self._ours():
                raise LockLost(f"lock {self.path}: {self.lost}; not committing (the new holder builds the step)")

    @property
    def token(self) -> str:
        return self.record["token"]

    def add_child(self, pid: int) -> None:
        """Record a process this holder launched: a later holder kills it if it outlived us."""
        self.record["children"].append(Proc.of(pid).dump())
        self._write()

    def release(self) -> None:
        if os.getpid() != self.pid:
            return  # a fork of the holder: its copy of the descriptor is closed already, the lock is the holder's
        self._stop.set()
        self._beat.join()
        with self._mutex:
            if self.lost is None and self._ours():
                self.path.unlink(missing_ok=True)  # still holding it: a waiter that opened this file sees it unlinked
        _HELD_FDS.discard(self.fd)
        os.close(self.fd)


# The kernel lock belongs to the open file, which a fork shares: a fork of the holder (a pool worker, a forked
# CLI) that outlived it would keep the step locked, under the dead holder's name, until someone found and killed it.
_HELD_FDS: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def holders(path: Path) -> list[psutil.Process]:
    """This user's processes on this host that have PATH open: who really holds its kernel lock, whatever its lease says."""
    try:
        want = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return []
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real != os.getuid():
                continue
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                info = os.stat(f"/proc/{proc.pid}/fd/{fd}")
                if (info.st_dev, info.st_ino) == (want.st_dev, want.st_ino):
                    found.append(proc)
                    break
        except (psutil.Error, OSError):
            continue
    return found


def _open(path: Path) -> tuple[int, bool]:
    """Open PATH as a lock file of ours, never through a link nor another user's file; (fd, whether we created it)."""
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), False
            except FileNotFoundError:
                continue  # released and unlinked between the two opens
            except OSError as err:
                if os.path.islink(path):
                    raise SmolflowError(f"lock {path} is a symbolic link: refusing to open it (remove it if you did not make it)") from None
                raise SmolflowError(f"lock {path}: cannot open it ({err.strerror})") from None
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise SmolflowError(f"lock {path} is owned by uid {info.st_uid}, not by uid {os.getuid()} (this user): refusing to use it")
        return fd, created


def acquire(path: Path, lease_s: float | None = None) -> Lock | None:
    """Take the lock at PATH, or None while a live holder (this host) or an unexpired lease (any host) has it."""
    lease_s = LEASE_S if lease_s is None else lease_s
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd, created = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # its holder released and unlinked it between our open and our flock: take the new file
    old = None if created else _parse(os.pread(fd, 1 << 20, 0))
    if not created and old is None:  # a file with no readable lease: a holder between its create and its first write?
        old = {"host": "an unknown host (no lease written yet)", "heartbeat": os.fstat(fd).st_mtime, "lease_s": min(lease_s, FIRST_WRITE_S)}
    if old is not None:
        # this host's holder would still hold the kernel lock: we have it, so it is gone; another host's lease must expire
        if old.get("host") != HOST and time.time() - float(old.get("heartbeat", 0)) < float(old.get("lease_s", lease_s)):
            os.close(fd)
            return None
        log.warning("lock %s: taking over from %s (its process is gone or its lease expired)", path, describe(old))
    lock = Lock(path, fd, lease_s, epoch=int((old or {}).get("epoch", 0)) + 1)  # our lease first: stopping leftovers takes a while
    if old is not None:
        _stop_leftovers(path, old)
    return lock


def _stop_leftovers(path: Path, old: dict[str, Any]) -> None:
    """Stop the processes the previous holder launched, when they are ours and carry its lease token: a launched tree
    is given the rest of its grace to checkpoint (its tether stops it since the holder died), then killed."""
    for child in old.get("children", []):
        proc = Proc.load(child).process()
        if proc is None:
            continue
        try:
            ours = proc.uids().real == os.getuid() and proc.environ().get(LEASE_ENV) == old.get("token")
        except psutil.Error:
            ours = False
        if not ours or not old.get("token"):
            log.warning("lock %s: pid %d is listed by the previous holder but does not carry its lease token: left alone", path, proc.pid)
            continue
        log.warning("lock %s: stopping pid %d, left running by the previous holder", path, proc.pid)
        stop([proc])


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


def describe_holder(path: Path) -> str:
    """Who holds the lock at PATH: its lease, and on this host the processes that really have it open where the
    lease's process is not one of them (it died; a process it forked or handed the descriptor to holds it now)."""
    record = holder(path)
    said = describe(record)
    live = [p for p in holders(path) if p.pid != os.getpid()]
    if live and (record or {}).get("pid") not in {p.pid for p in live}:
        procs = []
        for p in live[:3]:
            try:
                procs.append(f"pid {p.pid} ({' '.join(p.cmdline())[:120]})")
            except psutil.Error:
                procs.append(f"pid {p.pid}")
        said += f"; the lock is held open by {', '.join(procs)}: kill it to free the step"
    return said


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        found = json.loads(data)
    except ValueError:
        return None
    return found if isinstance(found, dict) and found else None


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """PATH's kernel lock for a short section that threads and processes of this host take one at a time (a probe),
    waiting for it. The file stays: unlinked, a waiter could lock a file no one else opens any more."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, _ = _open(path)
    _HELD_FDS.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _HELD_FDS.discard(fd)
        os.close(fd)


_HELD: contextvars.ContextVar[Lock | None] = contextvars.ContextVar("held_lock", default=None)


@contextmanager
def holding(lock: Lock) -> Iterator[Lock]:
    """Within this block, processes launched by this thread are recorded in LOCK (`record_child`) and carry its token."""
    token = _HELD.set(lock)
    try:
        yield lock
    finally:
        _HELD.reset(token)


def lease_env() -> dict[str, str]:
    """The environment that marks a launched process as the held lease's (see `_stop_leftovers`)."""
    lock = _HELD.get()
    return {LEASE_ENV: lock.token} if lock is not None else {}


def record_child(pid: int) -> None:
    if (lock := _HELD.get()) is not None:
        lock.add_child(pid)
