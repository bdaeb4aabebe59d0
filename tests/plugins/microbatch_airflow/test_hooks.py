"""The connections a task uses, resolved by the providers' hooks
(`microbatch_airflow.hooks`): Spark masters, and S3 through an AWS connection.

The AWS test runs a real batch in a new `airflow dags test` process against
moto's S3 server on loopback, with no AWS settings in the environment at all:
everything it reaches S3 with comes from the connection.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from spark_jobs.demo.clickstream import write_wave
from tests.conftest import ROOT, TEST_AWS_KEY_ID, TEST_AWS_SECRET, assert_exact, oracle_spec_dict, upload_folder
from tests.plugins.conftest import BIN


@pytest.mark.parametrize(
    ("uri", "master"),
    [
        ("spark://spark-master:7077", "spark://spark-master:7077"),
        # As the UI's Spark form saves it: the scheme in the host field.
        ('{"conn_type": "spark", "host": "spark://spark-master", "port": 7077}', "spark://spark-master:7077"),
        ("spark-connect://spark-connect:15002", "sc://spark-connect:15002/"),
        ("sc://spark-connect", "sc://spark-connect/"),
    ],
)
def test_spark_connection_names_the_master(monkeypatch, uri, master):
    from microbatch_airflow.hooks import spark_master

    monkeypatch.setenv("AIRFLOW_CONN_MB_ENGINE", uri)
    assert spark_master("mb_engine") == master


def test_a_spark_connect_connection_carries_user_token_and_tls_and_logs_hide_the_token(monkeypatch):
    """The provider's Spark Connect hook builds the URL; pyspark reads the
    same user, token and TLS back from it; our log form hides the token."""
    from pyspark.sql.connect.client import DefaultChannelBuilder

    from microbatch_airflow.hooks import spark_master
    from spark_jobs.core.spec import SPARK_MASTER
    from spark_jobs.engine.session import redact_master

    monkeypatch.setenv(
        "AIRFLOW_CONN_MB_CONNECT",
        '{"conn_type": "spark_connect", "host": "connect.example", "port": 443, "login": "alice",'
        ' "password": "s3cr3t+tok=en", "extra": {"use_ssl": true}}',
    )
    master = spark_master("mb_connect")
    assert SPARK_MASTER.fullmatch(master)
    channel = DefaultChannelBuilder(master)
    assert (channel.endpoint, channel.userId, channel.token, channel.secure) == (
        "connect.example:443", "alice", "s3cr3t+tok=en", True,
    )
    shown = redact_master(master)
    assert "s3cr3t" not in shown and "token=***" in shown and "user_id=alice" in shown


def test_a_connection_that_is_not_spark_fails_the_task_with_what_to_do(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from microbatch_airflow.hooks import spark_master

    monkeypatch.setenv("AIRFLOW_CONN_MB_DB", "postgres://user:secret-pw@db:5432/x")
    with pytest.raises(AirflowFailException, match="'spark_connect' connection with host") as info:
        spark_master("mb_db")
    assert "secret-pw" not in str(info.value)


def _s3_pipeline(tmp_path, bucket: str) -> tuple:
    base = oracle_spec_dict()
    spec = oracle_spec_dict(
        **{
            "name": "clicks_s3_conn",
            "source": {**base["source"], "path": f"s3://{bucket}/landing/clicks"},
            "state": {**base["state"], "path": f"s3://{bucket}/lake/state"},
            "checkpoint": f"s3://{bucket}/lake/_checkpoints/clicks",
            # The refused run fails once, not three times 10 s apart: its
            # retries would meet the same missing connection.
            "airflow": {"retries": 0},
        }
    )
    folder = tmp_path / "pipelines"
    folder.mkdir()
    path = folder / "clicks_s3_conn.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, tmp_path / "mirror"


def _dags_test(spec_path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "airflow"), "dags", "test", "clicks_s3_conn"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**env, "MICROBATCH_PIPELINES_DIR": str(spec_path.parent), "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO"},
    )


def test_s3_credentials_and_endpoint_come_from_the_aws_connection(tmp_path, bucket, s3_endpoint, airflow_db):
    """No AWS variable, profile or endpoint in the task's environment: only
    ``aws_default``. The batch lists, reads on Spark's executors and commits
    with it, and neither the secret nor the key reaches the task's output or
    XCom. Without the connection the same run fails, naming what to set."""
    from spark_jobs.core.delta_io import open_table, read_all
    from spark_jobs.core.spec import load_spec
    from spark_jobs.storage.s3 import s3_client

    spec_path, mirror = _s3_pipeline(tmp_path, bucket)
    write_wave(mirror, 0, files=2, records_per_file=200, users=30, bad_every=50)
    upload_folder(mirror, f"s3://{bucket}/landing/clicks")

    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    bare.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true")
    refused = _dags_test(spec_path, bare)
    assert refused.returncode != 0 or "failed" in refused.stdout.lower()
    assert "no AWS credentials found for S3" in refused.stdout + refused.stderr
    assert "aws_conn_id" in refused.stdout + refused.stderr

    connection = {
        "conn_type": "aws",
        "login": TEST_AWS_KEY_ID,
        "password": TEST_AWS_SECRET,
        "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }
    done = _dags_test(spec_path, {**bare, "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(connection)})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "clicks_s3_conn batch 1 (epoch 0) committed: 2 inputs, 400 records read (8 of them quarantined)" in output
    assert TEST_AWS_SECRET not in output and TEST_AWS_KEY_ID not in output

    assert_exact(spec_path, mirror=mirror)
    spec = load_spec(spec_path)
    for table in (spec.ledger_path, spec.state_path, spec.quarantine_path):
        text = read_all(open_table(table)).to_pandas().to_json()
        assert TEST_AWS_SECRET not in text
    keys = [o["Key"] for o in s3_client().list_objects_v2(Bucket=bucket, Prefix="lake/")["Contents"]]
    assert any(k.startswith("lake/state/_delta_log/") for k in keys)


def test_a_named_aws_connection_that_does_not_exist_fails_before_any_read(tmp_path, spec_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from microbatch_airflow.hooks import aws_connection
    from spark_jobs.core.spec import load_spec

    s3_spec, _ = _s3_pipeline(tmp_path, "some-bucket")
    with pytest.raises(AirflowFailException, match="AWS connection 'mb_missing' is not defined: create it"):
        aws_connection(load_spec(s3_spec), "mb_missing")
    # A local pipeline needs no AWS connection at all.
    with aws_connection(load_spec(spec_path), "mb_missing"):
        pass
