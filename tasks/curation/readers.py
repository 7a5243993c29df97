"""Readers for raw sources: datatrove readers that never drop a record silently.

datatrove's own readers log a malformed JSON line, a non-UTF-8 file or a record without text as
a warning and move on. Ours count every such record (`malformed` in the step's stats), write it
with its file and line to an errors file for the report, and in strict mode stop the run with
that location instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from datatrove.pipeline.readers.base import BaseDiskReader

from infra.errors import DataError
from infra.recipe import S3Cfg, SourceCfg
from infra.storage import datafolder, describe_endpoint, filesystem, with_retries

DEFAULT_GLOBS = {"jsonl": "**/*.jsonl*", "parquet": "**/*.parquet", "text": "**/*.txt", "embedded": "**/*.jsonl*"}


class CheckedReaderMixin:
    """Counts, records and (in strict mode) raises on records that cannot become documents."""

    def __init__(self, source: SourceCfg, errors_dir: Path, strict: bool, **reader_kwargs: Any):
        super().__init__(**reader_kwargs)
        self.source_name, self.domain = source.name, source.domain
        self.errors_dir, self.strict = str(errors_dir), strict
        self._error_file = None

    def record_error(self, filepath: str, line: int | None, message: str) -> None:
        where = f"{filepath}:{line}" if line is not None else filepath
        if self.strict:
            raise DataError(f"source {self.source_name!r}: {where}: {message} (strict mode; set curate.strict: false to skip and count)")
        self.stat_update("malformed")
        if self._error_file is None:
            Path(self.errors_dir).mkdir(parents=True, exist_ok=True)
            self._error_file = open(Path(self.errors_dir) / f"{self._rank:05d}.jsonl", "w")
        self._error_file.write(json.dumps({"file": filepath, "line": line, "error": message}) + "\n")
        self._error_file.flush()

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        self._rank = rank
        try:
            yield from super().run(data, rank, world_size)
        finally:
            if self._error_file is not None:
                self._error_file.close()
                self._error_file = None

    def get_document_from_dict(self, data: dict, source_file: str, id_in_file: int | str):
        text = data.get(self.text_key)
        line = id_in_file + 1 if isinstance(id_in_file, int) else None
        if not isinstance(text, str):
            found = "missing" if text is None else f"a {type(text).__name__}"
            self.record_error(source_file, line, f"field {self.text_key!r} is {found}, not text (keys: {sorted(data)})")
            return None
        if not text.strip():
            self.record_error(source_file, line, f"field {self.text_key!r} is empty")
            return None
        document = super().get_document_from_dict(data, source_file, id_in_file)
        # the file within the source, not datatrove's absolute `file_path` (its Parquet reader always adds it): a
        # document's bytes, and so the ids of the steps that read it, must not depend on where the source lies
        document.metadata.pop("file_path", None)
        document.metadata.update(source=self.source_name, domain=self.domain, file=source_file)
        return document


class CheckedJsonlReader(CheckedReaderMixin, JsonlReader):
    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
            empty = True
            for index, raw in enumerate(f):
                if not raw.strip():
                    continue
                empty = False
                with self.track_time():
                    try:
                        record = orjson.loads(raw)  # also rejects bytes that are not UTF-8
                    except orjson.JSONDecodeError as err:
                        self.record_error(filepath, index + 1, f"not valid JSON: {err}")
                        continue
                    if not isinstance(record, dict):
                        self.record_error(filepath, index + 1, f"expected a JSON object, got {type(record).__name__}")
                        continue
                    document = self.get_document_from_dict(record, filepath, index)
                if document is not None:
                    yield document
            if empty:
                self.record_error(filepath, None, "empty file")


class TextFilesReader(CheckedReaderMixin, BaseDiskReader):
    """Plain-text files, one document per file, id = the file's path."""

    name = "📄 Text files"

    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            self.record_error(filepath, line, f"not UTF-8 (byte {raw[err.start]:#04x} at offset {err.start})")
            return
        document = self.get_document_from_dict({"text": text, "id": filepath}, filepath, 0)
        if document is not None:
            yield document


class CheckedParquetReader(CheckedReaderMixin, ParquetReader):
    def read_file(self, filepath: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            with self.data_folder.open(filepath, "rb") as f:
                names = pq.ParquetFile(f).schema_arrow.names
        except (pa.ArrowInvalid, OSError) as err:
            self.record_error(filepath, None, f"not a readable Parquet file: {err}")
            return
        for key in (self.text_key, self.id_key):
            if key not in names:
                raise DataError(
                    f"source {self.source_name!r}: {filepath}: no column {key!r} (columns: {names}); set the source's text_key / id_key"
                )
        yield from super().read_file(filepath)


def list_source_files(source: SourceCfg, path: str, s3: S3Cfg | None) -> tuple[str, str, list[str]]:
    """(folder, glob, files) of a source; a missing or empty source is a DataError naming it."""
    fs, inner = filesystem(path, s3)
    where = f"source {source.name!r} ({path})"
    try:
        is_file = with_retries(f"{where}: look up", lambda: fs.isfile(inner))
        exists = is_file or with_retries(f"{where}: look up", lambda: fs.isdir(inner))
    except Exception as err:
        raise DataError(f"{where}: cannot reach storage at {describe_endpoint(s3)}: {err}") from None
    if not exists:
        raise DataError(f"{where}: no such file or folder")
    if is_file:
        folder, glob = path.rsplit("/", 1) if "/" in path else (".", path)
        return folder, glob, [glob]
    glob = source.glob or DEFAULT_GLOBS[source.format]
    try:
        files = sorted(datafolder(path, s3).list_files(glob_pattern=glob))
    except PermissionError as err:
        raise DataError(f"{where}: not readable: {err}") from None
    if not files:
        raise DataError(f"{where}: no files match {glob!r}")
    return path, glob, files


def make_reader(source: SourceCfg, path: str, glob: str, s3: S3Cfg | None, errors_dir: Path, strict: bool):
    cls = {"jsonl": CheckedJsonlReader, "embedded": CheckedJsonlReader, "text": TextFilesReader, "parquet": CheckedParquetReader}[
        source.format
    ]
    return cls(
        source,
        errors_dir,
        strict,
        data_folder=datafolder(path, s3),
        glob_pattern=glob,
        text_key=source.text_key,
        id_key=source.id_key,
        limit=source.limit or -1,
    )
