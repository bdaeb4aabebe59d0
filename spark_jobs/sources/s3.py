"""An S3 prefix as a files source, listed with boto3.

Same offsets and manifests as the local files source (`sources.files`): the
offset is a position in the log of consumed objects, and a file's identity is
its key relative to the prefix. Differences that matter:

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
"""

from __future__ import annotations

import io
from datetime import datetime

from spark_jobs.errors import SourceError
from spark_jobs.sources.files import FilesSource, SourceFile, is_ready
from spark_jobs.storage import S3Location, s3_client


class S3FilesSource(FilesSource):
    """Lists ``s3://bucket/prefix`` recursively and plans batches of whole objects."""

    #: Keys per listing request (S3's maximum).
    page_size = 1000

    def __init__(self, root: str, fmt: str, *, csv_header: bool = True) -> None:
        super().__init__(root.rstrip("/"), fmt, csv_header=csv_header)
        self.location = S3Location.parse(self.root)
        self._client = None

    @property
    def client(self):  # noqa: ANN201 - a boto3 client
        if self._client is None:
            self._client = s3_client()
        return self._client

    def list_files(self, until: datetime | None = None) -> list[SourceFile]:
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
                    found.append(SourceFile(name, f"s3://{self.location.bucket}/{obj['Key']}", obj["Size"], mtime_ms))
        except (BotoCoreError, ClientError) as exc:
            raise SourceError(
                f"cannot list source {self.root}: {exc}. Check the bucket name in source.path, "
                "the endpoint (AWS_ENDPOINT_URL) and that the credentials may s3:ListBucket"
            ) from exc
        found.sort(key=lambda f: (f.mtime_ms, f.name))
        return found

    def _body(self, f: SourceFile) -> bytes:
        return self.client.get_object(Bucket=self.location.bucket, Key=S3Location.parse(f.uri).key)["Body"].read()

    def check_readable(self, f: SourceFile) -> None:
        """As for local files: a Parquet object must have a readable footer before it is planned."""
        if self.format != "parquet":
            return  # listed a moment ago, and S3 objects are never partially visible
        import pyarrow.parquet as pq

        try:
            pq.read_metadata(io.BytesIO(self._body(f)))
        except Exception as exc:
            raise SourceError(
                f"source object {f.name} ({f.uri}) is not a readable Parquet file: "
                f"{str(exc).strip().splitlines()[0][:300]}. Nothing was planned or consumed. Replace it "
                "under the same key, or move it out of the prefix, then run again."
            ) from exc

    def count_records(self, f: SourceFile) -> int:
        body = self._body(f)
        if self.format == "parquet":
            import pyarrow.parquet as pq

            try:
                return pq.ParquetFile(io.BytesIO(body)).metadata.num_rows
            except Exception:  # unreadable: count it as one; the read reports it by name
                return 1
        lines = sum(1 for line in body.splitlines() if line.strip())
        return max(lines - (1 if self.format == "csv" and self.csv_header else 0), 0)
