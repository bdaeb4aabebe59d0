"""The connections a pipeline's task uses, resolved by the providers' own hooks.

Nothing here parses a connection by hand: the Spark provider says what
master a ``spark`` connection names and builds the Spark Connect URL of a
``spark_connect`` one (user, token, TLS); the apache-kafka provider's
connection holds librdkafka settings; the amazon provider's hook makes the
boto3 session for an AWS connection. The job (`spark_jobs`) never imports
Airflow: each helper hands it plain values, or puts them in force for a
``with`` block through the job's own hooks for that purpose
(`spark_jobs.sources.kafka.connection_settings`,
`spark_jobs.storage.s3.use_session`).

Every value below may hold a secret (a token, a password, keys); none is
logged, returned to XCom or written to a table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from microbatch_airflow.airflow_spec import airflow_spec

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["DEFAULT_AWS_CONN_ID", "aws_connection", "connections", "kafka_connection", "kafka_settings", "spark_master"]

log = logging.getLogger(__name__)

#: The amazon provider's default connection; when it is not defined, S3 goes
#: through boto3's standard chain as it does outside Airflow.
DEFAULT_AWS_CONN_ID = "aws_default"

#: The Spark provider's connection types (a URI ``spark-connect://`` parses
#: to ``spark_connect``; ``sc://`` is accepted as its short form).
_SPARK = "spark"
_SPARK_CONNECT = ("spark_connect", "sc")


def spark_master(conn_id: str) -> str:
    """The Spark master that the Airflow connection `conn_id` names.

    A ``spark`` connection (the Spark provider's type: host
    ``spark://spark-master`` and port 7077 in the UI, or the URI
    ``spark://spark-master:7077``) names a standalone master; a
    ``spark_connect`` connection names a Spark Connect server, with its
    login as user id, its password as the bearer token and the ``use_ssl``
    extra for TLS. The result may hold the token: log it only through
    `spark_jobs.engine.session.redact_master`.
    """
    from airflow.sdk import BaseHook

    from spark_jobs.core.spec import SPARK_MASTER

    conn = BaseHook.get_connection(conn_id)
    kind = (conn.conn_type or "").lower().replace("-", "_")
    if kind in _SPARK_CONNECT:
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

        master = SparkConnectHook(conn_id).get_connection_url()
    elif kind == _SPARK:
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        # The provider resolves a spark connection's master (from the UI
        # form's host and port, or from a URI) in its spark-submit hook. The
        # job runs in the task's own process rather than through
        # spark-submit, so that resolution is all it takes from the hook.
        master = SparkSubmitHook(conn_id=conn_id)._connection["master"]
    else:
        master = ""
    if not SPARK_MASTER.fullmatch(master):
        raise AirflowFailException(
            f"connection {conn_id!r} (type {conn.conn_type!r}) does not name a Spark master this job can use: "
            "define a 'spark' connection with host spark://<host> and port 7077 (a standalone master), or a "
            "'spark_connect' connection with host <host> and port 15002 (Spark Connect)"
        )
    return master


def kafka_settings(spec: PipelineSpec, conn_id: str | None = None) -> dict[str, Any] | None:
    """librdkafka settings from an Airflow connection of the apache-kafka
    provider (its extra is the settings dict, e.g. ``{"bootstrap.servers":
    "...", "security.protocol": "SASL_SSL", "sasl.password": "..."}``):
    `conn_id`, else the spec's ``airflow.kafka_conn_id``; None for other
    sources or without either. The job applies them over the spec's options
    (`spark_jobs.sources.kafka.connection_settings`)."""
    if spec.source.type != "kafka":
        return None
    conn_id = conn_id or airflow_spec(spec).kafka_conn_id
    if not conn_id:
        return None
    from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook

    conn = KafkaBaseHook.get_connection(conn_id)
    extra = conn.extra_dejson or {}
    if not isinstance(extra, dict):
        raise AirflowFailException(f"connection {conn_id!r}: its extra must be a JSON object of librdkafka settings")
    return extra


def kafka_connection(spec: PipelineSpec, conn_id: str | None = None) -> AbstractContextManager[None]:
    """`kafka_settings` in force for the `with` block (for the job's and the
    sensor's Kafka clients alike; nothing outside the block sees them)."""
    from spark_jobs.sources.kafka import connection_settings

    return connection_settings(kafka_settings(spec, conn_id))


def aws_connection(spec: PipelineSpec, conn_id: str | None = None) -> AbstractContextManager[None]:
    """For a pipeline that touches S3: the amazon provider's session for an
    AWS connection, in force for the `with` block (listing, reads, delta-rs
    commits, and Spark's executors through their fetch tasks).

    The connection is `conn_id`, else the spec's ``airflow.aws_conn_id``,
    else ``aws_default``. When ``aws_default`` is not defined, boto3's
    standard chain applies, as outside Airflow; a connection named on
    purpose must exist. Without S3 nothing changes.
    """
    if not _touches_s3(spec):
        return nullcontext()
    conn_id = conn_id or airflow_spec(spec).aws_conn_id or DEFAULT_AWS_CONN_ID
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    from spark_jobs.storage.s3 import use_session

    try:
        BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        if conn_id != DEFAULT_AWS_CONN_ID:
            raise AirflowFailException(
                f"AWS connection {conn_id!r} is not defined: create it (Admin > Connections, type Amazon Web "
                f"Services), or leave aws_conn_id unset to use {DEFAULT_AWS_CONN_ID!r} or boto3's standard chain"
            ) from None
        log.info("no %r connection: S3 credentials come from boto3's standard chain", conn_id)
        return nullcontext()
    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    return use_session(hook.get_session(region_name=hook.region_name), hook.conn_config.get_service_endpoint_url("s3"))


@contextmanager
def connections(spec: PipelineSpec, *, kafka_conn_id: str | None = None, aws_conn_id: str | None = None) -> Iterator[None]:
    """Every connection `spec` needs, in force for a `with` block (None: the
    spec's `airflow:` block, then the providers' defaults)."""
    with kafka_connection(spec, kafka_conn_id), aws_connection(spec, aws_conn_id):
        yield


def _touches_s3(spec: PipelineSpec) -> bool:
    from spark_jobs.storage.s3 import is_s3

    paths = [spec.state_path, spec.checkpoint_path, spec.archive_path]
    if spec.source.type != "kafka":
        paths.append(spec.source_path)
    return any(path and is_s3(path) for path in paths)
