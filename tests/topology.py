"""The docker stack's topology, run natively on loopback.

There is no Docker engine on these machines, so `docker/docker-compose.yml`
is never brought up here. Its topology is run instead: each long-running
service of the compose file is started as the same software, natively, on a
free loopback port (`NATIVE` says how), and its one-shot services are steps
of `Topology.start` (migrating Airflow's database, creating the bucket).

What the services share is read from the compose file itself, with each
``host:port`` of a service swapped for its loopback address (`loopback`):
the Airflow components' connections and S3 settings, the Spark Connect
server's settings from its command, the example pipelines of
`docker/pipelines/` as they are. So the live test (tests/test_topology.py)
runs the compose file's wiring, not a copy of it that could drift.

What cannot be the same: the images themselves (the processes run from this
virtualenv and pyspark's own Spark), MinIO (moto's S3 server stands in),
container paths and the interpreter name (`NOT_PORTABLE`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.kafka_broker import KafkaBroker
from tests.plugins.live_airflow import LiveAirflow
from tests.spark_servers import SparkServer, start_cluster, start_connect

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "docker-compose.yml"
PIPELINES = ROOT / "docker" / "pipelines"

#: How each long-running service of the compose file runs here.
NATIVE = {
    "postgres": "PostgreSQL from Debian's packages, in a temporary folder (dev/postgres.py)",
    "airflow-apiserver": "airflow api-server",
    "airflow-scheduler": "airflow scheduler (LocalExecutor: tasks, so Spark drivers, run under it)",
    "airflow-dag-processor": "airflow dag-processor",
    "airflow-triggerer": "airflow triggerer",
    "spark-master": "pyspark's bin/spark-class ...deploy.master.Master",
    "spark-worker": "pyspark's bin/spark-class ...deploy.worker.Worker",
    "spark-connect": "pyspark's bin/spark-submit spark_jobs/engine/connect_server.py, with the compose command's settings",
    "minio": "moto's S3 server (tests/moto_server.py)",
    "kafka": "the Kafka broker of jars/kafka/pom.xml, one KRaft node (tests/kafka_broker.py)",
    # The `celery` profile: not started by this test, which runs the default
    # profile; tests/plugins/test_airflow_celery.py runs it live.
    "redis": "the celery profile: Redis from Debian's packages (dev/redis.py)",
    "airflow-worker-1": "the celery profile: airflow celery worker (LiveAirflow(executor='celery'))",
    "airflow-worker-2": "the celery profile: airflow celery worker (LiveAirflow(executor='celery'))",
}
#: One-shot services: steps of `Topology.start`.
ONE_SHOT = {
    "airflow-init": "airflow db migrate and the passwords file (LiveAirflow.start)",
    "minio-init": "the bucket `microbatch`",
}
#: Settings of the Airflow services that name a place inside the images.
NOT_PORTABLE = {
    "MICROBATCH_PIPELINES_DIR": "a container path: the test's own folder holds copies of docker/pipelines",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": "a container path: the harness writes its own file",
    "PYSPARK_PYTHON": "the images' interpreter name: executors run this virtualenv's Python",
    "SPARK_LOCAL_HOSTNAME": "the scheduler container's name: drivers bind to loopback here",
    "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "a fixed port (8974), which another Airflow on this host may hold",
}
BUCKET = "microbatch"


def compose() -> dict[str, Any]:
    """The compose file as written (anchors and merge keys resolved by YAML)."""
    return yaml.safe_load(COMPOSE.read_text())


def loopback(value: str, hosts: dict[str, str]) -> str:
    """`value` with each compose ``service:port`` replaced by its loopback address."""
    for service, address in hosts.items():
        value = re.sub(rf"(?<![\w.-]){re.escape(service)}(?![\w.-])", address, value)
    return value


def airflow_settings(stack: dict[str, Any], hosts: dict[str, str]) -> dict[str, str]:
    """The Airflow services' literal settings (not `.env` secrets, which the
    live harness sets itself), on loopback."""
    env = stack["services"]["airflow-scheduler"]["environment"]
    return {
        key: loopback(str(value), hosts)
        for key, value in env.items()
        if "${" not in str(value) and key not in NOT_PORTABLE
    }


def connect_settings(stack: dict[str, Any], hosts: dict[str, str]) -> dict[str, str]:
    """The `--conf` settings of the compose Connect server's command, on
    loopback, without its address (the native server binds a free port)."""
    command = stack["services"]["spark-connect"]["command"]
    pairs = [command[i + 1] for i, arg in enumerate(command) if arg == "--conf"]
    settings = dict(pair.split("=", 1) for pair in pairs)
    for own in ("spark.driver.host", "spark.connect.grpc.binding.port"):
        settings.pop(own)
    return {key: loopback(value, hosts) for key, value in settings.items()}


def _host_port(url: str) -> str:
    return re.sub(r"^\w[\w+.-]*://", "", url).rstrip("/")


@dataclass
class Topology:
    """The stack's services running natively; `start`, then `stop` (safe after a failed start)."""

    work: Path
    pipelines: Path = field(init=False)
    hosts: dict[str, str] = field(default_factory=dict)
    airflow: LiveAirflow | None = None
    broker: KafkaBroker | None = None
    spark: list[SparkServer] = field(default_factory=list)
    connect_url: str = ""
    s3_endpoint: str = ""
    _moto: subprocess.Popen[str] | None = None

    def __post_init__(self) -> None:
        self.pipelines = self.work / "pipelines"

    def start(self) -> Topology:
        stack = compose()
        assert set(stack["services"]) == set(NATIVE) | set(ONE_SHOT), (
            "docker/docker-compose.yml and tests/topology.py list different services: "
            f"{sorted(set(stack['services']) ^ (set(NATIVE) | set(ONE_SHOT)))}; say in NATIVE how a new one runs here"
        )
        try:
            self._start(stack)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, stack: dict[str, Any]) -> None:
        self._start_s3()
        self.broker = KafkaBroker.start(self.work / "kafka")
        # The Spark services get the S3 settings, as in the compose file:
        # executors and the Connect server read S3 with the standard chain.
        s3_env = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
        s3_env.update(AWS_ENDPOINT_URL=self.s3_endpoint, AWS_ALLOW_HTTP="true")
        worker = stack["services"]["spark-worker"]["command"]
        cores, memory = (worker[worker.index(flag) + 1] for flag in ("--cores", "--memory"))
        cluster, master = start_cluster(self.work / "cluster", cores=int(cores), memory=memory, env=s3_env)
        self.spark.append(cluster)
        self.hosts.update({
            "minio:9000": _host_port(self.s3_endpoint),
            "kafka:9092": self.broker.bootstrap,
            "spark-master:7077": _host_port(master),
        })
        connect, self.connect_url = start_connect(
            self.work / "connect", master=master, conf=connect_settings(stack, self.hosts), env=s3_env
        )
        self.spark.append(connect)
        self.hosts["spark-connect:15002"] = _host_port(self.connect_url)
        self.pipelines.mkdir(parents=True)
        for spec in sorted(PIPELINES.glob("*.yaml")):
            shutil.copy(spec, self.pipelines / spec.name)
        self.airflow = LiveAirflow(self.work / "airflow", self.pipelines)
        self.hosts["airflow-apiserver:8080"] = f"127.0.0.1:{self.airflow.port}"
        self.airflow.env.update(airflow_settings(stack, self.hosts))
        # The specs name the compose broker (`kafka:9092`); the job's
        # documented override points them at this one.
        self.airflow.env["MICROBATCH_KAFKA_BOOTSTRAP_SERVERS"] = self.broker.bootstrap
        # SPARK_LOCAL_HOSTNAME's counterpart: a task's driver is reached by
        # the cluster's executors on loopback.
        self.airflow.env["SPARK_LOCAL_IP"] = "127.0.0.1"
        self.airflow.start()

    def _start_s3(self) -> None:
        import boto3

        self._moto = subprocess.Popen(
            [sys.executable, "-m", "tests.moto_server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        line = self._moto.stdout.readline()
        assert line.startswith("PORT "), f"moto server did not start: {line!r}"
        self.s3_endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        # minio-init's step.
        boto3.client("s3", endpoint_url=self.s3_endpoint).create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.airflow is not None:
            self.airflow.stop()
        for server in self.spark:
            server.stop()
        if self.broker is not None:
            self.broker.stop()
        if self._moto is not None:
            self._moto.stdin.close()
            self._moto.wait(30)

    def tail(self) -> str:
        """The servers' logs, ends only: what a failure message shows beside Airflow's own."""
        parts = [server.tail() for server in self.spark]
        if self.broker is not None:
            parts.append(self.broker.tail())
        return "\n".join(parts)
