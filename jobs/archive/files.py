"""Parquet files of archived tables and their manifest: the only module that imports
pyarrow, the `archive` extra, at its first use (without it the module imports, and any
use of pyarrow raises jobs.extras.MissingExtra naming the extra).

A table leaves PostgreSQL as `COPY … (FORMAT csv)` (fast, streamed to a scratch file)
and becomes one Parquet file whose columns keep the table's types: bigint → int64,
integer → int32, smallint → int16, boolean → bool, double precision → float64, text and
varchar → string, jsonb → string (the JSON text PostgreSQL prints, so it parses back to
the same jsonb), timestamptz → timestamp[us, UTC] (±infinity as the int64 extremes),
date → date32, an array → string (as PostgreSQL prints it: {1,2}, which COPY parses
back). Each field carries its PostgreSQL type in its metadata, so a restore
needs nothing but the file. Files are written under a temporary name, fsynced and
renamed, and the directory fsynced: a file under its final name is whole.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from jobs import extras

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq
else:  # imported at first use: the admin imports this module in every API process (D373)
    pa = extras.Lazy("pyarrow", "archive")
    pc = extras.Lazy("pyarrow.compute", "archive")
    pacsv = extras.Lazy("pyarrow.csv", "archive")
    pq = extras.Lazy("pyarrow.parquet", "archive")

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
# ±infinity of a timestamptz column, as microseconds since the epoch.
INFINITY = 2**63 - 1
_BLOCK = 64 << 20  # a CSV block holds whole rows: room for the largest JSON value
_EPOCH_US = "(extract(epoch from {c}) * 1000000)::bigint"


@functools.cache
def _arrow_types() -> dict[str, pa.DataType]:
    """PostgreSQL type (format_type) → Arrow type as stored in the file."""
    return {
        "bigint": pa.int64(),
        "integer": pa.int32(),
        "smallint": pa.int16(),
        "boolean": pa.bool_(),
        "double precision": pa.float64(),
        "real": pa.float32(),
        "text": pa.string(),
        "jsonb": pa.string(),
        "json": pa.string(),
        "uuid": pa.string(),
        "timestamp with time zone": pa.timestamp("us", tz="UTC"),
        "date": pa.date32(),
    }


class ArchiveError(Exception):
    """An archive file or manifest is not what it should be."""


@dataclass(frozen=True)
class Column:
    name: str
    pg_type: str  # as format_type() prints it

    @property
    def base_type(self) -> str:
        return "text" if self.pg_type.startswith("character varying") else self.pg_type

    @property
    def arrow_type(self) -> pa.DataType:
        if self.base_type.endswith("[]"):  # an array as PostgreSQL prints it: {1,2}
            return pa.string()
        try:
            return _arrow_types()[self.base_type]
        except KeyError:
            raise ArchiveError(
                f"column {self.name} has type {self.pg_type}, which the archive does not map"
            ) from None

    def select_expression(self) -> str:
        """The column as COPY should print it for the CSV reader."""
        c = f'"{self.name}"'
        if self.base_type == "timestamp with time zone":
            return (
                f"CASE WHEN {c} = 'infinity' THEN {INFINITY} "
                f"WHEN {c} = '-infinity' THEN {-INFINITY} ELSE {_EPOCH_US.format(c=c)} END"
            )
        if self.base_type in ("jsonb", "json", "uuid"):
            return f"{c}::text"
        return c

    def csv_type(self) -> pa.DataType:
        if self.base_type == "timestamp with time zone":
            return pa.int64()
        return self.arrow_type


def select_list(columns: list[Column]) -> str:
    return ", ".join(c.select_expression() for c in columns)


def arrow_schema(columns: list[Column], table: str) -> pa.Schema:
    fields = [pa.field(c.name, c.arrow_type, metadata={"pg_type": c.pg_type}) for c in columns]
    return pa.schema(fields, metadata={"table": table, "schema_version": str(SCHEMA_VERSION)})


def columns_of(schema: pa.Schema) -> list[Column]:
    return [Column(f.name, f.metadata[b"pg_type"].decode()) for f in schema]


# --- writing --------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    file: str  # name inside the period's directory
    rows: int
    bytes: int
    sha256: str

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}


def write_table(
    directory: Path,
    name: str,
    columns: list[Column],
    table: str,
    copy_to: Callable[[BinaryIO], None],
) -> Written:
    """`copy_to(f)` writes the rows as PostgreSQL CSV into f; they become `name`.parquet
    in `directory`, atomically. The scratch CSV is removed either way."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{name}.parquet"
    tmp = directory / f".{name}.parquet.tmp"
    scratch = directory / f".{name}.csv.tmp"
    schema = arrow_schema(columns, table)
    rows = 0
    try:
        with open(scratch, "wb") as f:
            copy_to(f)
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for batch in _csv_batches(scratch, columns):
                writer.write_batch(_to_schema(batch, schema))
                rows += batch.num_rows
        _fsync(tmp)
        os.replace(tmp, final)
        _fsync(directory)  # the rename itself
    finally:
        for p in (scratch, tmp):
            p.unlink(missing_ok=True)
    return Written(final.name, rows, final.stat().st_size, sha256_of(final))


def _csv_batches(path: Path, columns: list[Column]) -> Iterator[pa.RecordBatch]:
    if path.stat().st_size == 0:
        return
    reader = pacsv.open_csv(
        path,
        read_options=pacsv.ReadOptions(column_names=[c.name for c in columns], block_size=_BLOCK),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types={c.name: c.csv_type() for c in columns},
            # COPY prints NULL unquoted and '' as "": keep them apart.
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
            true_values=["t"],
            false_values=["f"],
        ),
    )
    yield from reader


def _to_schema(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    arrays = [
        pc.cast(batch.column(i), field.type)
        if batch.column(i).type != field.type
        else batch.column(i)
        for i, field in enumerate(schema)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _fsync(path: Path) -> None:
    """A file's bytes, or a directory's entries, on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync(tmp)
    final = directory / MANIFEST
    os.replace(tmp, final)
    _fsync(directory)  # the rename itself
    return final


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ArchiveError(f"{path}: not a manifest ({e})") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArchiveError(
            f"{path}: schema version {manifest.get('schema_version')!r}, "
            f"this code reads {SCHEMA_VERSION}"
        )
    return manifest


# --- verifying and reading ------------------------------------------------------------


def verify(directory: Path, entry: dict[str, Any], expected_rows: int | None = None) -> None:
    """The file is the one the manifest describes: same sha256, same row count (read
    through, page by page), and `expected_rows` when given (the table's count)."""
    path = directory / entry["file"]
    if not path.exists():
        raise ArchiveError(f"{path} is missing")
    digest = sha256_of(path)
    if digest != entry["sha256"]:
        raise ArchiveError(f"{path}: sha256 {digest} is not the manifest's {entry['sha256']}")
    try:
        rows = sum(b.num_rows for b in pq.ParquetFile(path).iter_batches())
    except (OSError, pa.ArrowException) as e:
        raise ArchiveError(f"{path}: unreadable ({e})") from None
    if rows != entry["rows"] or (expected_rows is not None and rows != expected_rows):
        raise ArchiveError(
            f"{path}: {rows} rows; the manifest says {entry['rows']}"
            + ("" if expected_rows is None else f", the table holds {expected_rows}")
        )


def read_rows(path: Path, column: str, value: int) -> list[dict[str, Any]]:
    """The rows whose `column` equals `value`, as Python values with JSON columns
    parsed (row groups whose statistics exclude the value are skipped)."""
    table = pq.read_table(path, filters=[(column, "=", value)])
    names = table.schema.names
    json_columns = [c.name for c in columns_of(table.schema) if c.base_type in ("jsonb", "json")]
    rows = [dict(zip(names, row, strict=True)) for row in _python_rows(table)]
    for row in rows:
        for name in json_columns:
            if row[name] is not None:
                row[name] = json.loads(row[name])
    return rows


def _python_rows(table: pa.Table | pa.RecordBatch) -> list[tuple]:
    columns = [
        _python_column(table.column(i), table.schema.field(i)) for i in range(len(table.schema))
    ]
    return list(zip(*columns, strict=True))


def _python_column(col: Any, field: pa.Field) -> list[Any]:
    """Python values of a column; a timestamp at ±infinity becomes the word
    PostgreSQL reads, since no datetime holds it."""
    if not pa.types.is_timestamp(field.type):
        return col.to_pylist()
    micros = pc.cast(col, pa.int64())
    infinite = pc.fill_null(pc.greater_equal(pc.abs(micros), INFINITY), False)
    if not pc.any(infinite).as_py():
        return col.to_pylist()
    finite = pc.if_else(infinite, pa.scalar(None, field.type), col).to_pylist()
    return [
        ("infinity" if m > 0 else "-infinity") if inf else v
        for v, m, inf in zip(finite, micros.to_pylist(), infinite.to_pylist(), strict=True)
    ]


def csv_chunks(path: Path, batch_size: int = 200_000) -> Iterator[tuple[list[Column], bytes]]:
    """The file back as CSV for `COPY … FROM STDIN (FORMAT csv)`, a batch at a time, with
    the columns it holds: timestamps as their microseconds since the epoch (±infinity
    as stored), JSON as its text, NULL unquoted and every string quoted."""
    f = pq.ParquetFile(path)
    columns = columns_of(f.schema_arrow)
    options = pacsv.WriteOptions(include_header=False)
    for batch in f.iter_batches(batch_size=batch_size):
        arrays = [
            pc.cast(col, pa.int64()) if pa.types.is_timestamp(col.type) else col
            for col in batch.columns
        ]
        out = pa.BufferOutputStream()
        pacsv.write_csv(pa.RecordBatch.from_arrays(arrays, names=batch.schema.names), out, options)
        yield columns, out.getvalue().to_pybytes()
