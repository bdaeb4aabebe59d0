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

An orchestrator may supply the boto3 session instead of the chain
(`use_session`): in Airflow, the amazon provider's AWS connection. This
module never imports Airflow; it takes whatever session it is given. The
credentials are then read from the session at each use, so refreshable ones
(an assumed role) stay fresh through a long run, and Spark's executors get
them with their fetch tasks, since they cannot see the connection.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

from spark_jobs.errors import SourceError

__all__ = [
    "S3_SCHEME",
    "S3Location",
    "client_settings",
    "delta_storage_options",
    "endpoint_url",
    "exists",
    "is_s3",
    "read_bytes",
    "region",
    "reset",
    "s3_client",
    "spark_read_options",
    "use_session",
]

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


@dataclass(frozen=True, eq=False)
class _Supplied:
    """A boto3 session handed in by the orchestrator, with its endpoint."""

    session: Any
    endpoint_url: str | None


#: A context variable, not a global: the Airflow console serves several
#: pipelines (and connections) from threads of one process at once.
_SUPPLIED: ContextVar[_Supplied | None] = ContextVar("microbatch_s3_session", default=None)


@contextmanager
def use_session(session: Any, endpoint: str | None = None) -> Iterator[None]:
    """Within the block, S3 access uses `session` (a ``boto3.Session``) instead
    of boto3's standard chain, and `endpoint` if given (else the usual
    ``AWS_ENDPOINT_URL``/profile setting, or AWS itself)."""
    token = _SUPPLIED.set(_Supplied(session, endpoint))
    try:
        yield
    finally:
        _SUPPLIED.reset(token)


def _boto_session():  # noqa: ANN202 - boto3 is imported lazily
    supplied = _SUPPLIED.get()
    if supplied is not None:
        return supplied.session
    return _chain_session()


def _chain_session():  # noqa: ANN202 - boto3 is imported lazily
    # A new one each time: boto3 sessions are not safe to share across threads.
    import boto3

    return boto3.Session()


def endpoint_url() -> str | None:
    """The S3 endpoint configured for this process, or None for AWS itself."""
    supplied = _SUPPLIED.get()
    if supplied is not None and supplied.endpoint_url:
        return supplied.endpoint_url
    configured = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if configured:
        return configured
    scoped = _boto_session()._session.get_scoped_config()
    services = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
    return services.get("endpoint_url") or scoped.get("endpoint_url")


def region() -> str:
    return _boto_session().region_name or "us-east-1"


def s3_client() -> Any:
    """A boto3 S3 client from the standard chain (endpoint and region included).

    One per session and environment, reused: making one loads botocore's
    service model anew (0.1-0.25 s here), which a loop of small reads (a
    Delta log's entries, a file read in ranges) paid at each call. Clients
    are safe to share across threads (sessions are not); keyed by the
    process too, since a forked child must not share its parent's sockets."""
    environment = tuple(os.environ.get(name) for name in _CLIENT_ENVIRONMENT)
    return _client(_SUPPLIED.get(), os.getpid(), environment, _config_files_changed())


#: The settings boto3's standard chain reads from the environment: a client made under others is not reused.
_CLIENT_ENVIRONMENT = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def _config_files_changed() -> tuple[float | None, ...]:
    """When boto3's config and credentials files were last written (keys
    rotated in them make a new client, as a new session would read them)."""
    names = (
        os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config",
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
    )
    found = []
    for name in names:
        try:
            found.append(os.stat(os.path.expanduser(name)).st_mtime)
        except OSError:
            found.append(None)
    return tuple(found)


@lru_cache(maxsize=16)
def _client(supplied: _Supplied | None, pid: int, environment: tuple[str | None, ...], files: tuple[float | None, ...]) -> Any:
    # (`pid`, `environment` and `files` are only part of the key.) Read in `supplied`'s context, as `s3_client` was called.
    return _boto_session().client("s3", endpoint_url=endpoint_url(), region_name=region())


def delta_storage_options(location: str) -> dict[str, str] | None:
    """Storage options for delta-rs to open the table at `location` (None: local)."""
    if not is_s3(location):
        return None
    supplied = _SUPPLIED.get()
    return {**dict(_s3_settings(supplied)), **_frozen_credentials()}


def client_settings() -> dict[str, Any]:
    """Keyword arguments for Spark's executors to make their S3 clients with.

    Endpoint and region always; credentials only when a session was
    supplied (an Airflow connection): it exists only in the driver's process,
    so its current credentials travel with the fetch tasks, like the
    ``fs.s3a`` keys Spark's own S3 connector takes from the driver's conf.
    Otherwise executors resolve their own through boto3's chain.
    """
    settings: dict[str, Any] = {"endpoint_url": endpoint_url(), "region_name": region()}
    if _SUPPLIED.get() is not None:
        frozen = _frozen_credentials()
        settings["aws_access_key_id"] = frozen["AWS_ACCESS_KEY_ID"]
        settings["aws_secret_access_key"] = frozen["AWS_SECRET_ACCESS_KEY"]
        settings["aws_session_token"] = frozen.get("AWS_SESSION_TOKEN")
    return settings


def spark_read_options() -> dict[str, str]:
    """Spark's own S3 settings (Hadoop's S3A), for sessions that read this
    project's tables with delta-spark: the endpoint and region the job's
    boto3 and delta-rs use, and ``s3://`` locations as the specs write them
    (Hadoop maps only ``s3a://`` to S3A unless told).

    No credentials: S3A takes them from the same standard chain (the
    environment, a profile, an instance role) on the driver and on each
    executor, so no secret enters Spark's configuration, where its UI and
    event logs would show it. The JARs (hadoop-aws and the AWS SDK modules
    S3A uses) come with the delta-spark set, `jars/spark/pom.xml`.
    """
    options = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.s3a.endpoint.region": region(),
    }
    endpoint = endpoint_url()
    if endpoint:
        options["spark.hadoop.fs.s3a.endpoint"] = endpoint
        # MinIO, moto and other servers answer on one host name: the bucket
        # goes in the path, not in a virtual host name they cannot resolve.
        options["spark.hadoop.fs.s3a.path.style.access"] = "true"
    return options


def _frozen_credentials() -> dict[str, str]:
    # Read at each use: refreshable credentials (an assumed role, SSO) renew
    # themselves here when close to expiry, so a long run keeps working.
    frozen = _credentials(_SUPPLIED.get()).get_frozen_credentials()
    options = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        options["AWS_SESSION_TOKEN"] = frozen.token
    return options


@lru_cache(maxsize=8)
def _credentials(supplied: _Supplied | None) -> Any:
    # The credentials object, resolved once per session (for instance roles
    # resolving costs a round trip); its values are read at each use.
    credentials = (supplied.session if supplied else _chain_session()).get_credentials()
    if credentials is None:
        raise SourceError(
            "no AWS credentials found for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "an AWS_PROFILE, or run with an instance/task role (boto3's standard chain); "
            "in Airflow, an AWS connection (aws_conn_id)"
        )
    return credentials


@lru_cache(maxsize=8)
def _s3_settings(supplied: _Supplied | None) -> tuple[tuple[str, str], ...]:
    # Keyed by the supplied session: region and endpoint are read in its context.
    options = {
        "AWS_REGION": region(),
        "conditional_put": "etag",
        "AWS_S3_ALLOW_UNSAFE_RENAME": "false",
    }
    endpoint = endpoint_url()
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            options["AWS_ALLOW_HTTP"] = "true"
    return tuple(sorted(options.items()))


def reset() -> None:
    """Forget resolved credentials (tests switch servers within one process)."""
    _credentials.cache_clear()
    _s3_settings.cache_clear()
    _client.cache_clear()


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
