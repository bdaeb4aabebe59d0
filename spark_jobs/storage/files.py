"""One file of a table's folder, local or on S3: read in ranges, written whole, created once.

The job writes some Delta files itself rather than through delta-rs
(`spark_jobs.core.merge_on_read`: deletion vectors, data and change files,
and the log entry that commits them). These are the few operations it
needs, the same on a local folder and on an S3 prefix:

* `reader`: a file-like object Parquet reads in ranges (its footer, then
  the row groups it asks for), not the whole object fetched first: a
  state's files are tens of MB each, and a batch reads their row groups
  on several threads at once;
* `write_bytes`: a whole file, replaced if there;
* `create`: a file written only if none is at its name (`FileExistsError`
  otherwise), whole or not at all: a hard link of a file written aside on
  a local disk, a put with ``If-None-Match: *`` on S3 (as delta-rs's
  ``conditional_put`` commits its log entries there).
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any
from urllib.parse import unquote

from spark_jobs.storage.s3 import S3Location, is_s3, s3_client

__all__ = ["create", "reader", "write_bytes"]


def reader(location: str) -> Any:
    """A readable, seekable file at `location` (a path, ``file://`` URI or
    ``s3://`` object, not percent-encoded) for `pyarrow.parquet.ParquetFile`."""
    if is_s3(location):
        return _S3Reader(location)
    return open(_local(location), "rb")  # noqa: SIM115 - the ParquetFile's to close


def write_bytes(location: str, data: bytes) -> None:
    """`data` as the whole file at `location` (its folder made when missing)."""
    if is_s3(location):
        target = S3Location.parse(location)
        s3_client().put_object(Bucket=target.bucket, Key=target.key, Body=data)
        return
    path = _local(location)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def create(location: str, data: bytes) -> None:
    """`data` as the file at `location` if none is there, else `FileExistsError`.

    A reader never sees part of it: written aside and hard-linked into place
    locally (a link fails if the name exists); put with ``If-None-Match: *``
    on S3, which fails with 412 if an object is there. A put S3 carried out
    but answered with an error is retried by boto3 and then fails with 412
    too: the caller must tell its own file from another's by its content
    (`merge_on_read`'s commits carry the batch's commit token, which step 4
    looks for)."""
    if is_s3(location):
        from botocore.exceptions import ClientError

        target = S3Location.parse(location)
        try:
            s3_client().put_object(Bucket=target.bucket, Key=target.key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise FileExistsError(location) from exc
            raise
        return
    path = _local(location)
    aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(aside, "wb") as handle:
        handle.write(data)
    try:
        os.link(aside, path)
    finally:
        os.unlink(aside)


def _local(location: str) -> str:
    return unquote(location.removeprefix("file://"))


class _S3Reader(io.RawIOBase):
    """An S3 object read in ranges (a GET with ``Range`` per read), with one
    client: what Parquet reads of a file is its footer and the column chunks
    of the row groups it is asked for."""

    def __init__(self, location: str) -> None:
        super().__init__()
        self._where = S3Location.parse(location)
        self._client = s3_client()
        self._size = self._client.head_object(Bucket=self._where.bucket, Key=self._where.key)["ContentLength"]
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._at + size)
        if end <= self._at:
            return b""
        body = self._client.get_object(Bucket=self._where.bucket, Key=self._where.key, Range=f"bytes={self._at}-{end - 1}")
        data = body["Body"].read()
        self._at += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)
