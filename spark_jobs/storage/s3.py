"""Where tables and source files live: local folders or S3.

S3 settings come from the standard AWS configuration chain, through boto3,
and never from a spec: credentials from the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``), a
profile (``AWS_PROFILE``, ``~/.aws/credentials``), SSO or an instance/task
role; the endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` or the
profile's ``endpoint_url`` (MinIO, moto, other S3-compatible servers); the
region from ``AWS_REGION`` / the profile. A spec names only ``s3://bucket/prefix``
locations, so the same spec runs against MinIO in development and AWS in
production, and holds nothing secret.

delta-rs does not use boto3, so the resolved values are handed to it as
storage options. Two settings matter for correctness:

* ``conditional_put = etag``: each Delta commit writes
  ``_delta_log/<version>.json`` with ``If-None-Match: *``, so when two runs
  race for the same table version, S3 itself lets exactly one create it and
  the other gets a conflict (then our fences decide, as on a local disk).
  AWS S3 supports conditional writes since 2024-08, as do MinIO, R2 and
  moto; delta-rs 1.x defaults to this, and we set it explicitly so that a
  changed default can never silently turn it off.
* ``AWS_S3_ALLOW_UNSAFE_RENAME`` is passed as ``false``: delta-rs would
  otherwise also take it from the environment, and ``true`` allows the
  last-writer-wins rename that loses commits under concurrency.

The options dict holds credentials: it is passed to delta-rs and nowhere
else, never logged, and never stored in a table or commit metadata.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

from spark_jobs.errors import SourceError

__all__ = ["S3_SCHEME", "S3Location", "delta_storage_options", "endpoint_url", "exists", "is_s3", "read_bytes", "region", "reset", "s3_client"]

S3_SCHEME = "s3://"


def is_s3(location: str) -> bool:
    return location.startswith(S3_SCHEME) or location.startswith("s3a://")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # no leading slash; "" for the bucket root

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        rest = uri.split("://", 1)[1]
        bucket, _, key = rest.partition("/")
        return cls(bucket, key)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def _boto_session():  # noqa: ANN202 - boto3 is imported lazily
    import boto3

    return boto3.Session()


def endpoint_url() -> str | None:
    """The S3 endpoint configured for this process, or None for AWS itself."""
    configured = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if configured:
        return configured
    scoped = _boto_session()._session.get_scoped_config()
    services = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
    return services.get("endpoint_url") or scoped.get("endpoint_url")


def region() -> str:
    return _boto_session().region_name or "us-east-1"


def s3_client() -> Any:
    """A boto3 S3 client from the standard chain (endpoint and region included)."""
    return _boto_session().client("s3", endpoint_url=endpoint_url(), region_name=region())


def delta_storage_options(location: str) -> dict[str, str] | None:
    """Storage options for delta-rs to open the table at `location` (None: local)."""
    if not is_s3(location):
        return None
    return dict(_s3_options())


@lru_cache(maxsize=1)
def _s3_options() -> tuple[tuple[str, str], ...]:
    # Resolved once per process: a run is short (minutes), well inside the
    # lifetime of role or SSO credentials, and resolving costs a round trip
    # for instance roles.
    credentials = _boto_session().get_credentials()
    if credentials is None:
        raise SourceError(
            "no AWS credentials found for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "an AWS_PROFILE, or run with an instance/task role (boto3's standard chain)"
        )
    frozen = credentials.get_frozen_credentials()
    options = {
        "AWS_ACCESS_KEY_ID": frozen.access_key,
        "AWS_SECRET_ACCESS_KEY": frozen.secret_key,
        "AWS_REGION": region(),
        "conditional_put": "etag",
        "AWS_S3_ALLOW_UNSAFE_RENAME": "false",
    }
    if frozen.token:
        options["AWS_SESSION_TOKEN"] = frozen.token
    endpoint = endpoint_url()
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            options["AWS_ALLOW_HTTP"] = "true"
    return tuple(sorted(options.items()))


def reset() -> None:
    """Forget resolved credentials (tests switch servers within one process)."""
    _s3_options.cache_clear()


def exists(uri: str) -> bool:
    """Whether a file (a path or ``file://`` URI, percent-encoded as delta-rs
    lists them) or an ``s3://`` object exists."""
    if not is_s3(uri):
        return os.path.exists(unquote(uri.removeprefix("file://")))
    location = S3Location.parse(uri)
    try:
        s3_client().head_object(Bucket=location.bucket, Key=unquote(location.key))
    except Exception as exc:
        # Only "not found" means missing: throttling or a credentials error
        # must not pass for a deleted file (a lost version, an unrestorable batch).
        status = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if status in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def read_bytes(uri: str) -> bytes:
    """A whole file (a path, ``file://`` URI or ``s3://`` object); FileNotFoundError if missing."""
    if not is_s3(uri):
        with open(unquote(uri.removeprefix("file://")), "rb") as handle:
            return handle.read()
    location = S3Location.parse(uri)
    client = s3_client()
    try:
        return client.get_object(Bucket=location.bucket, Key=unquote(location.key))["Body"].read()
    except client.exceptions.NoSuchKey as exc:
        raise FileNotFoundError(uri) from exc
