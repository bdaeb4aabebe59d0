"""Listing every file under a folder or an S3 prefix, with its modification time."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import unquote

from spark_jobs.storage.s3 import S3Location, is_s3, s3_client

__all__ = ["StoredFile", "delete", "list_files", "modified_at"]


@dataclass(frozen=True)
class StoredFile:
    #: Relative to the listed root, '/'-separated, decoded.
    path: str
    #: Modification time (S3: LastModified), seconds since the epoch.
    mtime: float
    #: Where it is: a local path, or an ``s3://bucket/key`` URI (not encoded).
    location: str


def list_files(root: str) -> list[StoredFile]:
    """Every file under `root` (a path, ``file://`` URI or ``s3://`` prefix), recursively."""
    if is_s3(root):
        location = S3Location.parse(root)
        prefix = unquote(location.key).rstrip("/") + "/" if location.key else ""
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix)
        return [
            StoredFile(o["Key"][len(prefix):], o["LastModified"].timestamp(), f"s3://{location.bucket}/{o['Key']}")
            for page in pages
            for o in page.get("Contents", [])
        ]
    folder = unquote(root.removeprefix("file://"))
    found = []
    for current, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(current, name)
            try:
                mtime = os.stat(full).st_mtime
            except FileNotFoundError:  # removed while listing
                continue
            found.append(StoredFile(os.path.relpath(full, folder).replace(os.sep, "/"), mtime, full))
    return found


def modified_at(location: str) -> float | None:
    """When the file at `location` (a local path or an ``s3://`` URI) was
    last written, in seconds since the epoch; None if it is not there."""
    if is_s3(location):
        from botocore.exceptions import ClientError

        parsed = S3Location.parse(location)
        try:
            return s3_client().head_object(Bucket=parsed.bucket, Key=parsed.key)["LastModified"].timestamp()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
    try:
        return os.stat(unquote(location.removeprefix("file://"))).st_mtime
    except FileNotFoundError:
        return None


def delete(stored: StoredFile) -> None:
    """Delete a listed file (already gone: nothing to do)."""
    if is_s3(stored.location):
        location = S3Location.parse(stored.location)
        s3_client().delete_object(Bucket=location.bucket, Key=location.key)
        return
    try:
        os.unlink(stored.location)
    except FileNotFoundError:
        pass
