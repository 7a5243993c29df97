"""Errors a user can act on. Prefect tasks do not retry them: rerunning cannot fix the input."""

import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

FULL_BELOW = 2**20  # bytes: a folder left with less than this after a failed write ran out of room


class SmolflowError(Exception):
    """Base class; its message is meant for the user, so the CLI prints it without a traceback."""

    retryable = False


class DataError(SmolflowError):
    """Input data that cannot be used: the message names the source, file and line."""


class UpstreamMissing(SmolflowError):
    """A stage was asked to run before the step it reads from."""


class StepLocked(SmolflowError):
    """Another live process is building the same step (a double launch): this one stands down."""


class TrainerFailed(SmolflowError):
    """A launched trainer exited non-zero or unfinished: a retry resumes it from its newest checkpoint."""

    retryable = True


class Stopped(SmolflowError):
    """This process was told to stop (a signal): what it ran checkpointed and ended; a relaunch resumes, no retry here."""


class DiskFull(SmolflowError):
    """No room left where a step, a checkpoint or a result is written: the message names the folder and its free space,
    and what was committed before is untouched (every commit is a rename of a finished folder or file)."""


def disk_full(err: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT error behind ERR (itself, or what it was raised from), else None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def full_disk(folders: Iterable[Path], err: BaseException | None = None) -> str | None:
    """`FOLDER: N MiB free` when a write into FOLDERS failed (ERR) for want of room, else None. ERR may say so (ENOSPC
    or EDQUOT, or their text in safetensors' error); torch.save's does not ("unexpected pos"), so the fullest folder
    left with under FULL_BELOW free counts too. A DiskFull already names its folder and free space."""
    if isinstance(err, DiskFull):
        return str(err)
    free = {folder: shutil.disk_usage(folder).free for folder in map(Path, folders) if folder.exists()}
    if not free:
        return None
    folder = min(free, key=free.get)
    said = err is not None and (disk_full(err) is not None or any(os.strerror(e) in str(err) for e in (errno.ENOSPC, errno.EDQUOT)))
    if not said and free[folder] >= FULL_BELOW:
        return None
    return f"{folder}: {free[folder] / 2**20:.1f} MiB free" + (f" ({type(err).__name__}: {err})" if err is not None else "")
