"""An S3 prefix as the lister of a files source, with boto3.

The files source (`spark_jobs.sources.files`) plans over it exactly as over a
local folder: the offset is a position in the log of consumed objects, and a
file's identity is its key relative to the prefix. Differences that matter:

* Arrival time is the object's ``LastModified`` (when the upload completed),
  so `plan(until=...)` bounds a batch by data interval as on a local disk.
* An object is listed only once its upload has completed: S3 makes a PUT or
  a multipart upload visible atomically, and in-progress multipart uploads
  are not objects. Keys with hidden/temporary names (``_`` or ``.`` segments,
  ``.tmp`` and similar suffixes) are skipped as locally, for writers that
  stage under a temporary key and copy into place.
* "Folder" marker objects (keys ending in ``/``) are not files.

Listing is paginated (``list_objects_v2``, 1000 keys a page) and reads no
object bodies; only the `max_records` cap downloads objects, to count them.

Releasing a consumed object (`after_commit: delete | archive`) takes only
the upload that was consumed: a HEAD checks its size and LastModified, and
the delete is conditional on the ETag the HEAD saw (If-Match), so an upload
under the same key after the listing or the HEAD is left for the next batch.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from spark_jobs.errors import SourceError, first_line
from spark_jobs.sources.files import SourceFile, parquet_row_count, is_ready
from spark_jobs.storage.s3 import S3Location, s3_client

__all__ = ["S3Lister"]

log = logging.getLogger("microbatch")


@dataclass(frozen=True)
class _Version:
    """Which upload of a key a release checked."""

    etag: str
    version_id: str | None


def _code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


class S3Lister:
    """Lists ``s3://bucket/prefix`` recursively."""

    #: Keys per listing request (S3's maximum).
    page_size = 1000

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.location = S3Location.parse(self.root)
        self._client: Any = None

    @property
    def client(self) -> Any:
        """A boto3 S3 client, made on first use."""
        if self._client is None:
            self._client = s3_client()
        return self._client

    def list(self, until: datetime | None) -> list[SourceFile]:
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self.location.key + "/" if self.location.key else ""
        limit_ms = int(until.timestamp() * 1000) if until else None
        found: list[SourceFile] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=prefix, PaginationConfig={"PageSize": self.page_size}
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if not name or name.endswith("/") or not all(is_ready(part) for part in name.split("/")):
                        continue
                    mtime_ms = int(obj["LastModified"].timestamp() * 1000)
                    if limit_ms is not None and mtime_ms >= limit_ms:
                        continue
                    found.append(SourceFile(name, f"s3://{self.location.bucket}/{obj['Key']}", obj["Size"], mtime_ms, obj.get("ETag")))
        except (BotoCoreError, ClientError) as exc:
            raise SourceError(
                f"cannot list source {self.root}: {exc}. Check the bucket name in source.path, "
                "the endpoint (AWS_ENDPOINT_URL) and that the credentials may s3:ListBucket",
                path=self.root,
            ) from exc
        return found

    def open(self, f: SourceFile) -> IO[bytes]:
        body = self.client.get_object(Bucket=self.location.bucket, Key=S3Location.parse(f.uri).key)["Body"].read()
        return io.BytesIO(body)

    def stat(self, f: SourceFile) -> SourceFile | None:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.location.bucket, Key=S3Location.parse(f.uri).key)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise SourceError(f"cannot read source object {f.uri}: {exc}", path=f.uri) from exc
        return SourceFile(f.name, f.uri, head["ContentLength"], int(head["LastModified"].timestamp() * 1000), head.get("ETag"))

    def remove(self, f: SourceFile) -> bool:
        version = self._still(f)
        return version is not None and self._delete(f, version)

    def move(self, f: SourceFile, archive: str) -> bool:
        # S3 has no rename: copy, then delete (a crash in between leaves the
        # object in both places; the next release deletes the source copy).
        # The copy takes the checked version (by version id where the bucket
        # keeps versions, else on condition of its ETag); so does the delete.
        version = self._still(f)
        if version is None:
            return False
        from botocore.exceptions import ClientError

        target = S3Location.parse(archive.rstrip("/") + "/" + f.name)
        source = {"Bucket": self.location.bucket, "Key": S3Location.parse(f.uri).key}
        condition: dict[str, Any] = {"CopySourceIfMatch": version.etag}
        if version.version_id:
            source["VersionId"] = version.version_id
        try:
            self.client.copy_object(Bucket=target.bucket, Key=target.key, CopySource=source, **condition)
        except ClientError as exc:
            if _code(exc) in ("PreconditionFailed", "412"):
                return False
            raise
        return self._delete(f, version)

    def recover(self, consumed: Callable[[SourceFile], bool], archive: str | None) -> int:
        return 0  # a conditional delete holds nothing aside

    def _still(self, f: SourceFile) -> _Version | None:
        """The object's version if it is still the one `f` lists (size and
        LastModified), else None: another upload took its key."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.location.bucket, Key=S3Location.parse(f.uri).key)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        if not f.same_as(SourceFile(f.name, f.uri, head["ContentLength"], int(head["LastModified"].timestamp() * 1000), head.get("ETag"))):
            return None
        version_id = head.get("VersionId")
        return _Version(head["ETag"], version_id if version_id not in (None, "null") else None)

    def _delete(self, f: SourceFile, version: _Version) -> bool:
        """Delete the object only if it is still the checked upload: S3's
        conditional delete (If-Match on the ETag) fails with 412 when an
        upload landed after the check. Not by version id: in a versioned
        bucket that would bring the version before it back into the listing.
        An upload of the very same bytes has the same ETag (a single-part
        upload's is its MD5) and goes as the checked one would have; in a
        versioned bucket it stays as a noncurrent version."""
        from botocore.exceptions import ClientError

        key = S3Location.parse(f.uri).key
        try:
            self.client.delete_object(Bucket=self.location.bucket, Key=key, IfMatch=version.etag)
        except ClientError as exc:
            if _code(exc) in ("PreconditionFailed", "412"):
                return False
            if _code(exc) not in ("NotImplemented", "InvalidArgument"):
                raise
            # A store without conditional deletes: the check above is all there is.
            log.warning("%s does not take conditional deletes (If-Match); deleting %s after a check by size and time", self.root, f.uri)
            self.client.delete_object(Bucket=self.location.bucket, Key=key)
        return True

    def check_readable(self, f: SourceFile, fmt: str) -> None:
        """As for local files: a Parquet object must have a readable footer before it is planned."""
        if fmt != "parquet":
            return  # listed a moment ago, and S3 objects are never partially visible
        try:
            with self.open(f) as handle:
                parquet_row_count(handle)
        except Exception as exc:
            raise SourceError(
                f"source object {f.name} ({f.uri}) is not a readable Parquet file: {first_line(exc)}. "
                "Nothing was planned or consumed. Replace it under the same key, or move it out of "
                "the prefix, then run again.",
                path=f.uri,
            ) from exc
