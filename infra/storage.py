"""Filesystems for local, s3:// and hf:// paths, and mirroring finished folders to S3.

Credentials come from the recipe (as secrets) or the standard AWS_* variables; they are passed
to s3fs and never formatted into a message or a log line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from infra.errors import SmolflowError
from infra.recipe import S3Cfg

log = logging.getLogger(__name__)
T = TypeVar("T")


class CorruptFile(SmolflowError):
    """A file no longer matches the size and MD5 recorded when it was written: retrying cannot fix it."""


class StorageError(SmolflowError):
    """Remote storage unreachable or inconsistent after retries; a later task retry may succeed."""

    retryable = True


def storage_options(url: str, s3: S3Cfg | None) -> dict[str, Any]:
    return (s3 or S3Cfg()).storage_options() if url.startswith("s3://") else {}


def filesystem(url: str, s3: S3Cfg | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the path inside it for a local, s3:// or hf:// URL."""
    return url_to_fs(url, **storage_options(url, s3))


def datafolder(url: str, s3: S3Cfg | None = None):
    """A datatrove DataFolder for `url` with the recipe's S3 settings."""
    from datatrove.io import get_datafolder

    options = storage_options(url, s3)
    return get_datafolder((url, options) if options else url)


def describe_endpoint(s3: S3Cfg | None) -> str:
    return (s3 and s3.endpoint_url) or "the default AWS endpoint"


def with_retries(what: str, fn: Callable[[], T], attempts: int = 4, backoff_s: float = 1.0) -> T:
    """Run `fn`, retrying transient storage failures with exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except (FileNotFoundError, SmolflowError):
            raise
        except Exception as err:  # s3fs surfaces outages as OSError, botocore and aiohttp errors alike
            if attempt == attempts:
                raise StorageError(f"{what}: failed after {attempts} attempts: {type(err).__name__}: {err}") from None
            log.warning("%s: attempt %d failed (%s); retrying", what, attempt, type(err).__name__)
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old file or the whole new one, never a part."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    """Write TEXT so that readers see the old file or the whole new one, never a part. The temporary is this
    write's own (`temporaries`): two writers of one file (a run's follower and a stage's evaluation) never share it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def temporaries(root: Path) -> list[Path]:
    """What writes under ROOT cut off by a kill left: `write_text_atomic`'s `.NAME.<8 hex>.tmp`, and the `.NAME.tmp` of
    earlier versions (the glob needs a name between the dots: a checkpoint store's `.tmp` folder is no match)."""
    return [path for path in root.rglob(".*.tmp") if path.is_file()]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, skip_dirs: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """fsync every file under ROOT (then its folders) and return each file's record: relative path ->
    size and MD5. Written into a manifest or marker before it, the record is what uploads, downloads
    and remote listings are checked against (S3's ETag is no MD5 for a multipart upload)."""
    records = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] not in skip_dirs:
            digest = hashlib.md5()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                os.fsync(f.fileno())
            records[rel.as_posix()] = {"size": path.stat().st_size, "md5": digest.hexdigest()}
    for folder in sorted({p.parent for p in root.rglob("*")} | {root}):
        fsync_dir(folder)
    return records


def s3_etag(path: Path, part_size: int) -> tuple[str, str]:
    """(MD5, the ETag S3 gives the file uploaded by s3fs in parts of PART_SIZE): one pass over the file."""
    whole, parts = hashlib.md5(), []
    with open(path, "rb") as f:
        while chunk := f.read(part_size):
            whole.update(chunk)
            parts.append(hashlib.md5(chunk).digest())
    if path.stat().st_size < 2 * part_size:  # s3fs sends this in one request: the ETag is the MD5
        return whole.hexdigest(), whole.hexdigest()
    return whole.hexdigest(), f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


_known: dict[tuple, str] = {}  # (algorithm, path, inode, size, mtime, ctime) -> digest, for known_digest
KNOWN_MAX = 200_000  # entries before the memo starts afresh (a long-lived process that hashes many trees)
RACY_NS = 2 * 10**9  # a file changed this recently may change again within one tick of the file clock


def known_digest(path: Path, algorithm: str = "sha256") -> str:
    """`file_digest`, read again only when the file's stat changed. Identities are recomputed on every plan, status
    check and build (the stdlib corpus alone is 30 MB of source); a write or a utime always moves ctime, and a file
    changed within RACY_NS is hashed every time, as git treats a "racily clean" entry. For fingerprints, never for
    verifying bytes against a record (a corrupted sector keeps its stat)."""
    st = path.stat()
    key = (algorithm, str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if (digest := _known.get(key)) is None:
        digest = file_digest(path, algorithm)
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
            if len(_known) >= KNOWN_MAX:
                _known.clear()
            _known[key] = digest
    return digest


def fingerprint_files(files: Iterable[tuple[str, Path]]) -> str:
    """Content fingerprint of (name, file) pairs: names and bytes, not paths or times."""
    digest = hashlib.sha256()
    for rel, path in sorted(files):
        digest.update(f"{rel}\0{known_digest(path)}\n".encode())
    return digest.hexdigest()[:20]


def fingerprint_listing(files: Mapping[str, str]) -> str:
    """relative path -> MD5 of every file of a folder (a model, a step's part) -> one hex digest: computed from a
    manifest or a remote listing as well as from the files."""
    payload = json.dumps(sorted(files.items()), separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def fingerprint_url(url: str, glob: str, s3: S3Cfg | None = None) -> str:
    """Fingerprint of the files a source reads: their bytes when local, size and ETag when remote.

    A path string alone is no fingerprint: the same path with new files behind it must rerun.
    """
    fs, root = filesystem(url, s3)
    if isinstance(fs, LocalFileSystem):
        base = Path(root)
        files = [base] if base.is_file() else sorted(p for p in base.glob(glob) if p.is_file())
        return fingerprint_files((p.name if p == base else p.relative_to(base).as_posix(), p) for p in files)
    listing = with_retries(f"list {url}", lambda: fs.find(root, detail=True))
    digest = hashlib.sha256()
    for key, info in sorted(listing.items()):
        etag = info.get("ETag") or info.get("etag") or info.get("blob_id") or info.get("mtime", "")
        digest.update(f"{key}\0{info.get('size')}\0{etag}\n".encode())
    return digest.hexdigest()[:20]


def download_folder(url: str, local_dir: Path, s3: S3Cfg | None = None) -> Path:
    """Copy every file under URL into LOCAL_DIR (files already there are kept), each verified by size."""
    fs, root = filesystem(url, s3)
    for key, info in with_retries(f"list {url}", lambda: fs.find(root, detail=True)).items():
        dest = inside(local_dir, key[len(root) + 1 :])
        if not dest.exists():
            with_retries(f"download {key}", lambda key=key, dest=dest, info=info: get_verified(fs, key, dest, info.get("size")))
    return local_dir


def inside(folder: Path, rel: str) -> Path:
    """FOLDER/REL, refusing a remote key that would land outside FOLDER (`../`, an absolute path)."""
    target = (folder / rel).resolve()
    if not rel or not target.is_relative_to(folder.resolve()):
        raise StorageError(f"refusing remote key {rel!r}: it would be written outside {folder}")
    return folder / rel


def verified_files(root: Path, records: Mapping[str, Mapping[str, Any]], prefix: str) -> list[Path]:
    """The files under ROOT, each checked against its RECORDS entry (PREFIX + its relative path; fsync_tree's size
    and MD5), before they leave the machine: a link, a file the records do not list, or one they list that is
    missing or changed is refused by name."""
    files, problems, found = [], [], []
    for folder, dirs, names in os.walk(root):  # never into a linked folder
        found += [Path(folder) / name for name in dirs + names if (Path(folder) / name).is_symlink() or name in names]
    for path in sorted(found):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            problems.append(f"{rel} is a link")
        else:
            want = records.get(prefix + rel)
            if want is None or want["size"] != path.stat().st_size or want.get("md5") != file_digest(path, "md5"):
                problems.append(f"{rel} {'is not in the manifest' if want is None else 'differs from the manifest'}")
            files.append(path)
    listed = {key.removeprefix(prefix) for key in records if key.startswith(prefix)}
    problems += [f"{rel} is missing" for rel in sorted(listed - {p.relative_to(root).as_posix() for p in files})]
    if problems:
        raise SmolflowError(f"{root}: does not match its manifest: {'; '.join(problems[:5])}" + (" ..." if len(problems) > 5 else ""))
    return files


def get_verified(fs, key: str, dest: Path, size: int | None, md5: str | None = None) -> None:
    """Download KEY to a temporary name beside DEST and rename it once its size (and MD5) match:
    a half-downloaded file is never kept under its real name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.download")
    fs.get_file(key, str(tmp))
    if (size is not None and tmp.stat().st_size != size) or (md5 is not None and file_digest(tmp, "md5") != md5):
        tmp.unlink()
        raise OSError(f"download of {key} does not match its record (size or MD5)")
    os.replace(tmp, dest)


class Mirror:
    """Copies finished folders to `prefix/NAME/` and back, the folder's marker file last.

    A remote folder counts as complete only once its marker is there, and the marker is uploaded
    only after every other file's size and MD5 were checked against the local copy; so an upload
    cut off halfway is never mistaken for a finished one.
    """

    def __init__(self, prefix: str, s3: S3Cfg | None = None, attempts: int = 4, backoff_s: float = 1.0):
        self.prefix = prefix.rstrip("/")
        self.s3 = s3
        self.part_size = (s3 or S3Cfg()).part_size
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.fs, self.root = filesystem(self.prefix, s3)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return with_retries(f"{what} ({describe_endpoint(self.s3)})", fn, self.attempts, self.backoff_s)

    def remote(self, name: str) -> str:
        return f"{self.root}/{name}"

    def push(self, local_dir: Path, name: str, marker: str, skip_dirs: tuple[str, ...] = ()) -> None:
        """Upload LOCAL_DIR's files, each checked against the record in its marker, then the marker."""
        remote = self.remote(name)
        record = json.loads((local_dir / marker).read_text()).get("files", {})
        files = sorted(
            p for p in local_dir.rglob("*") if p.is_file() and p.name != marker and p.relative_to(local_dir).parts[0] not in skip_dirs
        )
        for path in files:
            rel = path.relative_to(local_dir).as_posix()
            target = f"{remote}/{rel}"
            self._retry(f"upload {target}", lambda path=path, target=target, rel=rel: self._put_verified(path, target, record.get(rel)))
        self._retry(f"upload {remote}/{marker}", lambda: self._put_verified(local_dir / marker, f"{remote}/{marker}"))
        self.fs.invalidate_cache()

    def put_file(self, path: Path, name: str) -> None:
        """Upload one file (verified) to `prefix/NAME`."""
        target = self.remote(name)
        self._retry(f"upload {target}", lambda: self._put_verified(path, target))

    def _put_verified(self, path: Path, target: str, record: dict[str, Any] | None = None) -> None:
        md5, etag = s3_etag(path, self.part_size)
        if record is not None and (record.get("md5") != md5 or record.get("size") != path.stat().st_size):
            raise CorruptFile(f"{path} no longer matches the size and MD5 recorded when it was written: not uploading it")
        self.fs.put_file(str(path), target, chunksize=self.part_size)
        self.fs.invalidate_cache(target)
        info = self.fs.info(target)
        if info.get("size") != path.stat().st_size:
            raise OSError(f"size mismatch after upload of {target}")
        remote_etag = str(info.get("ETag", "")).strip('"')
        if remote_etag and remote_etag != etag:
            raise OSError(f"checksum mismatch after upload of {target} (ETag {remote_etag}, expected {etag})")

    def read_marker(self, name: str, marker: str) -> dict[str, Any] | None:
        path = f"{self.remote(name)}/{marker}"

        def read() -> dict[str, Any] | None:
            try:
                with self.fs.open(path, "rb") as f:
                    return json.loads(f.read())
            except FileNotFoundError:
                return None

        return self._retry(f"read {path}", read)

    def pull(self, name: str, local_dir: Path, marker: str) -> dict[str, Any]:
        """Download a finished folder: the files its marker records (each verified, never half-kept), then the
        marker; returns the marker."""
        remote = self.remote(name)
        found = self.read_marker(name, marker)
        if found is None:
            raise StorageError(f"{remote} has no {marker}: not a finished folder")
        listing = self._retry(f"list {remote}", lambda: self.fs.find(remote, detail=True))
        sizes = {key[len(remote) + 1 :]: info.get("size") for key, info in listing.items()}
        record = found.get("files") or {rel: {"size": size} for rel, size in sizes.items() if rel != marker}
        for rel, want in sorted(record.items()):
            want = want if isinstance(want, dict) else {"size": want}
            if sizes.get(rel) != want["size"]:
                raise StorageError(f"{remote}/{rel}: {'missing' if rel not in sizes else 'wrong size'} on the mirror")
            target = inside(local_dir, rel)
            self._retry(
                f"download {remote}/{rel}",
                lambda rel=rel, target=target, want=want: get_verified(self.fs, f"{remote}/{rel}", target, want["size"], want.get("md5")),
            )
        write_json_atomic(inside(local_dir, marker), found)
        return found
