"""Delta deletion vectors and log entries, written by the job itself.

delta-rs 1.6.6 reads deletion vectors and writes after them, but cannot
write one: its write transactions take add and remove actions without them,
and no ``cdc`` action either. `spark_jobs.core.merge_on_read` needs both in
one commit, so this module writes what Delta's protocol specifies
(PROTOCOL.md, "Deletion Vectors"; "Deletion Vector Format"):

* a **deletion vector** is the set of a data file's row indexes that are
  deleted, serialized as a ``RoaringBitmapArray`` in the "portable" format
  (magic number, a count of 32-bit bitmaps, each with its high half as a
  key; the 32-bit bitmaps in Roaring's portable format, array and bitmap
  containers), stored in a file of the table's folder
  (``deletion_vector_<uuid>.bin``: a version byte, then each vector as its
  size, its bytes and their CRC-32) and named in the ``add`` action by a
  descriptor (storage type ``u``, the UUID in Z85, offset, size,
  cardinality);
* a **log entry** is written once, at the version it names, or not at all
  (`commit`: `storage.files.create`, hard-linked into place locally, put
  with ``If-None-Match`` on S3: as delta-rs commits on each).

What is read back: the snapshot's files and their descriptors from the log
(`active_files`: the newest checkpoint and the entries after it; delta-rs
does not expose descriptors), and the rows a vector deletes from its file
(`deleted_in`: only the files asked for, as row indexes; delta-rs's
`DeltaTable.deletion_vectors` gives every file's as a mask of all its rows,
which costs with the state, not the batch). Both formats are read whole:
Roaring's array, bitmap and run containers, as other writers make them.
"""

from __future__ import annotations

import json
import struct
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow.parquet as pq
from deltalake import DeltaTable

from spark_jobs.core.delta_io import version_actions
from spark_jobs.storage.files import create, reader, write_bytes
from spark_jobs.storage.listing import list_files
from spark_jobs.storage.s3 import is_s3, read_bytes

__all__ = [
    "FEATURE", "active_files", "carries_vectors", "commit", "deleted_in", "has_deletion_vectors", "is_vector_file",
    "table_root", "vector_file", "vector_files", "vector_location", "vector_rows", "write_vectors",
]

#: The table feature (reader and writer) a table with deletion vectors declares.
FEATURE = "deletionVectors"
#: A `RoaringBitmapArray`'s magic number (little-endian), Delta's protocol.
_MAGIC = 1681511377
#: Roaring's portable format without run containers.
_COOKIE = 12346
#: The largest cardinality Roaring keeps in an array container.
_ARRAY_MAX = 4096
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def has_deletion_vectors(table: DeltaTable) -> bool:
    """Whether the table declares the feature (its files may carry vectors:
    their rows must be read through delta-rs's `QueryBuilder` or Spark,
    never straight from the Parquet files)."""
    return FEATURE in (table.protocol().reader_features or [])


def table_root(table: DeltaTable) -> str:
    """The table's folder, as the job's own reads and writes name it: a
    local path, or ``s3://bucket/prefix``; not percent-encoded."""
    uri = table.table_uri.rstrip("/")
    return unquote(uri) if is_s3(uri) else unquote(urlparse(uri).path).rstrip("/")


def carries_vectors(table: DeltaTable) -> bool:
    """Whether any file of the snapshot has a deletion vector (its rows
    must not be read straight from its Parquet file). From the log, no data read."""
    if not has_deletion_vectors(table):
        return False
    return any(add.get("deletionVector") for add in active_files(table_root(table), table.version()).values())


def deleted_in(root: str, adds: Iterable[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The row indexes (sorted, ``uint64``) each file of `adds` (the log's
    add actions) has deleted, by path relative to the table, decoded; files
    without a vector are not listed. Each vector file is read once."""
    carrying = [add for add in adds if add.get("deletionVector")]
    files: dict[str, bytes] = {}
    found = {}
    for add in carrying:
        descriptor = add["deletionVector"]
        location = vector_location(root, descriptor)
        if location is not None and location not in files:
            files[location] = read_bytes(location)
        stored = files.get(location, b"")
        rows = vector_rows(descriptor, lambda start, size: stored[start : start + size])
        if len(rows) != int(descriptor["cardinality"]):
            raise ValueError(f"{root}: the deletion vector of {add['path']} holds {len(rows)} rows, its descriptor says {descriptor['cardinality']}")
        found[unquote(add["path"])] = rows
    return found


def vector_rows(descriptor: dict[str, Any], read: Callable[[int, int], bytes]) -> np.ndarray:
    """The row indexes (sorted, ``uint64``) the vector `descriptor` deletes:
    inline, or read from the file it is stored in (`vector_location`) by
    `read(start, size)`, which gives that file's bytes from `start`.

    Pure, with numpy only: Spark's executors decode the vectors of the files
    they read with it (`spark_files.read_files`), this module pickled by value."""
    if descriptor["storageType"] == "i":
        return _deserialized(_unz85(descriptor["pathOrInlineDv"])[: descriptor["sizeInBytes"]])
    start = int(descriptor.get("offset") or 1)  # (absent: the data after the file's version byte)
    (size,) = struct.unpack(">I", read(start, 4))
    return _deserialized(read(start + 4, size))


def active_files(root: str, version: int) -> dict[str, dict[str, Any]]:
    """The ``add`` action of each file in the snapshot at `version`, by path
    (as the log writes it), read from the log: the newest checkpoint at or
    before `version` and the entries after it.

    A file's identity in the log is its path and its vector: one entry may
    add a file with one vector and remove it with another (delta-rs's
    RESTORE does, adding the old one first), so actions are matched on both."""
    log = f"{root}/_delta_log"
    named = (f.path for f in list_files(log) if "/" not in f.path and f.path.endswith(".checkpoint.parquet"))
    checkpoints = sorted(v for v in (int(name.split(".")[0]) for name in named) if v <= version)
    files: dict[tuple[str, str], dict[str, Any]] = {}
    start = 0
    if checkpoints:
        start = checkpoints[-1] + 1
        with reader(f"{log}/{checkpoints[-1]:020d}.checkpoint.parquet") as source:
            adds = pq.read_table(source, columns=["add"]).column("add")
        for add in adds.to_pylist():
            if add is not None:
                add = _json_add(add)
                files[_identity(add)] = add
    for v in range(start, version + 1):
        actions = version_actions(root, v)
        if actions is None:  # cleaned up, and no checkpoint this side of it: never guess a snapshot
            raise FileNotFoundError(f"{root}: log entry {v} is gone and no checkpoint at or before {version} covers it")
        for action in actions:
            if "remove" in action:
                files.pop(_identity(action["remove"]), None)
        for action in actions:
            if "add" in action:
                files[_identity(action["add"])] = action["add"]
    return {add["path"]: add for add in files.values()}


def _identity(action: dict[str, Any]) -> tuple[str, str]:
    """A file action's identity in the log: its path and its vector's id
    (Delta's ``uniqueId``: storage type, path or inline bytes, ``@offset``)."""
    dv = action.get("deletionVector") or {}
    unique = f"{dv.get('storageType', '')}{dv.get('pathOrInlineDv', '')}" + (f"@{dv['offset']}" if dv.get("offset") is not None else "")
    return action["path"], unique if dv else ""


def _json_add(add: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's add action as its log entry wrote it (maps as objects, no nulls)."""
    out = {k: v for k, v in add.items() if v is not None and k != "stats_parsed"}
    if isinstance(out.get("partitionValues"), list):
        out["partitionValues"] = dict(out["partitionValues"])
    if isinstance(out.get("tags"), list):
        out["tags"] = dict(out["tags"])
    if "deletionVector" in out:
        out["deletionVector"] = {k: v for k, v in out["deletionVector"].items() if v is not None}
    return out


def write_vectors(root: str, vectors: list[np.ndarray]) -> list[dict[str, Any]]:
    """`vectors` (each the sorted deleted row indexes of one file) in one
    new deletion-vector file in the table's folder; their descriptors."""
    uid = uuid.uuid4()
    chunks, descriptors, offset = [b"\x01"], [], 1
    for rows in vectors:
        data = _serialized(rows)
        chunk = struct.pack(">I", len(data)) + data + struct.pack(">I", zlib.crc32(data) & 0xFFFFFFFF)
        descriptors.append(
            {"storageType": "u", "pathOrInlineDv": _z85(uid.bytes), "offset": offset, "sizeInBytes": len(data), "cardinality": len(rows)}
        )
        chunks.append(chunk)
        offset += len(chunk)
    write_bytes(f"{root}/deletion_vector_{uid}.bin", b"".join(chunks))
    return descriptors


def vector_location(root: str, descriptor: dict[str, Any] | None) -> str | None:
    """Where the vector `descriptor` (an action's ``deletionVector``) names
    is stored, a path or ``s3://`` URI; None for none or an inline vector.
    Storage type ``u``: in the table's folder `root`, under an optional
    random prefix (a subfolder), named by the UUID in Z85 (its last 20
    characters); ``p``: an absolute URI."""
    if not descriptor or descriptor.get("storageType") not in ("u", "p"):
        return None
    encoded = descriptor["pathOrInlineDv"]
    if descriptor["storageType"] == "p":
        return unquote(encoded) if is_s3(encoded) else unquote(urlparse(encoded).path)
    prefix, uid = encoded[:-20], uuid.UUID(bytes=_unz85(encoded[-20:]))
    name = f"deletion_vector_{uid}.bin"
    return f"{root}/{prefix}/{name}" if prefix else f"{root}/{name}"


def vector_file(root: str, descriptor: dict[str, Any] | None) -> str | None:
    """The vector file `descriptor` names, relative to the table's folder
    `root`; None for none, an inline vector, or one stored elsewhere."""
    location = vector_location(root, descriptor)
    if location is None or not location.startswith(f"{root.rstrip('/')}/"):
        return None
    return location[len(root.rstrip("/")) + 1 :]


def vector_files(table: DeltaTable) -> list[str]:
    """The vector files (paths or ``s3://`` URIs) the snapshot's files read
    their deleted rows from: what a rewind to it needs besides its data
    files, since `maintain` removes the vector files of versions it does not
    keep (`spark_jobs.core.untracked`)."""
    if not has_deletion_vectors(table):
        return []
    root = table_root(table)
    named = {vector_location(root, add.get("deletionVector")) for add in active_files(root, table.version()).values()}
    return sorted(named - {None})


def is_vector_file(path: str) -> bool:
    """Whether `path` (relative to a table's folder) is named as Delta names deletion-vector files."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith("deletion_vector_") and name.endswith(".bin")


def commit(root: str, version: int, actions: list[dict[str, Any]]) -> None:
    """`actions` as the log entry `version`, or `FileExistsError` if that
    entry exists (another commit took the version); a reader never sees
    half an entry (`storage.files.create`)."""
    entry = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)
    create(f"{root}/_delta_log/{version:020d}.json", entry.encode())


def _serialized(rows: np.ndarray) -> bytes:
    """A `RoaringBitmapArray` of `rows` (sorted, unique, under 2^64)."""
    rows = np.asarray(rows, dtype=np.uint64)
    highs = (rows >> np.uint64(32)).astype(np.uint32)
    keys, starts = np.unique(highs, return_index=True)
    ends = [*starts[1:], len(rows)]
    parts = [struct.pack("<IQ", _MAGIC, len(keys))]
    for key, start, end in zip(keys, starts, ends):
        parts.append(struct.pack("<I", key) + _roaring32((rows[start:end] & np.uint64(0xFFFFFFFF)).astype(np.uint32)))
    return b"".join(parts)


def _roaring32(values: np.ndarray) -> bytes:
    """Roaring's portable serialization of sorted unique 32-bit `values`:
    a header, each container's key and cardinality, their offsets, then
    each container (an array of 16-bit values, or a bitmap of 2^16 bits)."""
    highs, lows = (values >> 16).astype(np.uint16), (values & 0xFFFF).astype(np.uint16)
    keys, starts, counts = np.unique(highs, return_index=True, return_counts=True)
    described = np.empty(2 * len(keys), dtype="<u2")
    described[0::2], described[1::2] = keys, counts - 1
    bodies = []
    for start, count in zip(starts, counts):
        low = lows[start : start + count]
        if count <= _ARRAY_MAX:
            bodies.append(low.astype("<u2").tobytes())
        else:
            bits = np.zeros(1 << 16, dtype=bool)
            bits[low] = True
            bodies.append(np.packbits(bits, bitorder="little").tobytes())
    offset = 8 + 8 * len(keys)
    offsets = []
    for body in bodies:
        offsets.append(offset)
        offset += len(body)
    header = struct.pack("<II", _COOKIE, len(keys))
    return header + described.tobytes() + np.asarray(offsets, dtype="<u4").tobytes() + b"".join(bodies)


def _z85(data: bytes) -> str:
    """Z85 (ZeroMQ's base 85) of `data`, a multiple of 4 bytes long."""
    out = []
    for (word,) in struct.iter_unpack(">I", data):
        chars = []
        for _ in range(5):
            word, digit = divmod(word, 85)
            chars.append(_Z85[digit])
        out.extend(reversed(chars))
    return "".join(out)


def _unz85(text: str) -> bytes:
    """The bytes `text` is the Z85 of (`_z85` undone)."""
    out = []
    for start in range(0, len(text), 5):
        word = 0
        for char in text[start : start + 5]:
            word = word * 85 + _Z85.index(char)
        out.append(struct.pack(">I", word))
    return b"".join(out)


def _deserialized(data: bytes) -> np.ndarray:
    """The row indexes of a serialized `RoaringBitmapArray` (`_serialized` undone), sorted."""
    magic, count = struct.unpack_from("<IQ", data, 0)
    if magic != _MAGIC:
        raise ValueError(f"not a deletion vector (magic number {magic})")
    at, parts = 12, []
    for _ in range(count):
        (key,) = struct.unpack_from("<I", data, at)
        values, at = _roaring32_read(data, at + 4)
        parts.append((np.uint64(key) << np.uint64(32)) | values.astype(np.uint64))
    return np.concatenate(parts) if parts else np.empty(0, np.uint64)


def _roaring32_read(data: bytes, at: int) -> tuple[np.ndarray, int]:
    """Roaring's portable serialization at `at`: its values, sorted, and where it ends.

    The header: a cookie (12346: no run containers, then the container
    count; 12347 in the low half: the count less one in the high half, then
    a bitmap of which containers are runs), each container's key and
    cardinality less one, the containers' offsets (absent with runs and
    under four containers), then the containers: runs (their count, then
    each start and length less one), arrays of 16-bit values, or bitmaps of
    2^16 bits."""
    (cookie,) = struct.unpack_from("<I", data, at)
    at += 4
    if cookie & 0xFFFF == _COOKIE + 1:
        size = (cookie >> 16) + 1
        runs = np.unpackbits(np.frombuffer(data, np.uint8, (size + 7) // 8, at), bitorder="little")[:size].astype(bool)
        at += (size + 7) // 8
    elif cookie == _COOKIE:
        (size,) = struct.unpack_from("<I", data, at)
        at += 4
        runs = np.zeros(size, bool)
    else:
        raise ValueError(f"not a Roaring bitmap (cookie {cookie})")
    described = np.frombuffer(data, "<u2", 2 * size, at).astype(np.uint32)
    at += 4 * size
    if not runs.any() or size >= 4:
        at += 4 * size  # the offsets: the containers are read in order anyway
    parts = []
    for i in range(size):
        high, cardinality = described[2 * i] << np.uint32(16), int(described[2 * i + 1]) + 1
        if runs[i]:
            (n,) = struct.unpack_from("<H", data, at)
            pairs = np.frombuffer(data, "<u2", 2 * n, at + 2).astype(np.uint32).reshape(n, 2)
            at += 2 + 4 * n
            low = np.concatenate([np.arange(s, s + length + 1, dtype=np.uint32) for s, length in pairs]) if n else np.empty(0, np.uint32)
        elif cardinality <= _ARRAY_MAX:
            low = np.frombuffer(data, "<u2", cardinality, at).astype(np.uint32)
            at += 2 * cardinality
        else:
            bits = np.unpackbits(np.frombuffer(data, np.uint8, 8192, at), bitorder="little")
            low = np.flatnonzero(bits).astype(np.uint32)
            at += 8192
        parts.append(high | low)
    return (np.concatenate(parts) if parts else np.empty(0, np.uint32)), at
