"""Who reads a Delta table's versions, recorded beside the table.

A downstream pipeline reads an upstream state's versions after the last one
it consumed. The upstream's `maintain` must not VACUUM the files those
versions need, and it cannot see the downstream's ledger (it does not know
where the downstream lives). So, as Kafka keeps its consumer groups'
offsets with the topic, each downstream records its position in the
upstream table's folder, one small JSON file a downstream:

    <table>/_microbatch/consumers/<pipeline>-<12 hex digits of its checkpoint>.json
        {"pipeline": ..., "checkpoint": ..., "table_id": ..., "version": 41, "updated_at": ...}

`version` is the last version the downstream consumed: versions after it are
still to be read. A downstream is its name and its checkpoint (names are not
identities: a staging and a production pipeline of one name keep two files). Delta readers and delta-rs's VACUUM ignore folders whose
name starts with ``_``. A downstream that is gone for good leaves its file
behind, and maintenance then keeps every version after its position: delete
the file to release them (`microbatch maintain` lists the positions it kept).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from urllib.parse import unquote

from spark_jobs.storage.s3 import S3Location, is_s3, read_bytes, s3_client

__all__ = ["CONSUMERS_FOLDER", "JOB_FOLDER", "Consumer", "consumers", "delete_file", "register", "write_json"]

#: The job's own files beside a table's data (Delta and VACUUM ignore `_` folders).
JOB_FOLDER = "_microbatch"
#: Where a table's consumers are recorded, relative to the table's root.
CONSUMERS_FOLDER = f"{JOB_FOLDER}/consumers"


@dataclass(frozen=True)
class Consumer:
    """One downstream's position in an upstream table."""

    pipeline: str
    #: The downstream's checkpoint: where to look for it.
    checkpoint: str
    #: The Delta id of the table the position counts in (a recreated table is another).
    table_id: str | None
    #: The last version consumed (-1: none yet).
    version: int
    updated_at: str = ""


def _root(table: str) -> str:
    return unquote(table.removeprefix("file://")).rstrip("/")


def register(table: str, consumer: Consumer) -> None:
    """Record (or move) `consumer`'s position in `table`."""
    stamped = Consumer(**{**asdict(consumer), "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    which = hashlib.sha256(consumer.checkpoint.encode()).hexdigest()[:12]
    write_json(f"{_root(table)}/{CONSUMERS_FOLDER}/{consumer.pipeline}-{which}.json", asdict(stamped))


def consumers(table: str) -> list[Consumer]:
    """Every consumer recorded in `table`, by pipeline name."""
    folder = f"{_root(table)}/{CONSUMERS_FOLDER}"
    found = []
    for uri in _list(folder):
        if uri.endswith(".json"):
            try:
                found.append(Consumer(**json.loads(read_bytes(uri))))
            except FileNotFoundError:  # deleted while listing
                continue
    return sorted(found, key=lambda c: (c.pipeline, c.checkpoint))


def write_json(uri: str, data: dict) -> None:
    """Write a small JSON file whole: readers see the old or the new one, never a part."""
    body = json.dumps(data, sort_keys=True).encode()
    if is_s3(uri):
        location = S3Location.parse(uri)
        s3_client().put_object(Bucket=location.bucket, Key=location.key, Body=body)
        return
    folder = os.path.dirname(uri)
    os.makedirs(folder, exist_ok=True)
    handle, staged = tempfile.mkstemp(dir=folder, prefix=".writing-")
    with os.fdopen(handle, "wb") as out:
        out.write(body)
    os.replace(staged, uri)


def delete_file(uri: str) -> None:
    """Delete a file or object (already gone: nothing to do)."""
    if is_s3(uri):
        location = S3Location.parse(uri)
        s3_client().delete_object(Bucket=location.bucket, Key=unquote(location.key))
        return
    try:
        os.unlink(unquote(uri.removeprefix("file://")))
    except FileNotFoundError:
        pass


def _list(folder: str) -> list[str]:
    if is_s3(folder):
        location = S3Location.parse(folder)
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=location.key.rstrip("/") + "/")
        return [f"s3://{location.bucket}/{o['Key']}" for page in pages for o in page.get("Contents", [])]
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if not name.startswith(".")]
