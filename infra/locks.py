"""Lock files that name their holder, so a second launch refuses instead of racing the first.

Prefect can launch a flow run twice (an automation reacting to a crash event that is reported
twice, a user retrying by hand while a worker still runs it). A lock file created with O_EXCL
holds the owner's pid and host; a lock whose process is gone (same host) is taken over, so a
crash never leaves a step locked for good.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import psutil


def take_lock(lock: Path) -> bool:
    """Create LOCK holding our pid and host; False while another live process holds it."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = lock_holder(lock)
            if holder is not None and holder.get("pid") != me["pid"] and holder_alive(holder):
                return False
            lock.unlink(missing_ok=True)  # stale (its process is gone) or our own, from a retried task
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True
    return False


def lock_holder(lock: Path) -> dict[str, Any] | None:
    try:
        return json.loads(lock.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def holder_alive(holder: dict[str, Any]) -> bool:
    """Another host's process cannot be checked from here: it counts as alive."""
    return holder.get("host") != socket.gethostname() or psutil.pid_exists(int(holder.get("pid", -1)))
