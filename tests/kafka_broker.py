"""A real Apache Kafka broker on loopback for the tests: one KRaft node, broker and controller.

librdkafka's mock cluster (tests/kafka_cluster.py) speaks the protocol but is
not Kafka: it has no topic ids that change when a topic is deleted and made
again, no log retention or segment deletion, no real log directories. This
module runs the real broker (``kafka.Kafka``) from the JARs that
``python jars/fetch.py kafka`` put in its cache during set-up; it never
downloads anything itself, so a test run stays offline and fails loudly if
set-up was skipped.

    with KafkaBroker.start(tmp_path) as broker:
        AdminClient({"bootstrap.servers": broker.bootstrap})...

``python -m tests.kafka_broker`` starts one in a temporary folder, prints
``BOOTSTRAP host:port`` and stops it when its stdin closes (as
tests/kafka_cluster.py does), for a test that wants it in another process.

The JVM runs in its own process group and is killed with it (SIGKILL: the
data is thrown away with the folder, and a graceful shutdown only costs time).
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from spark_jobs.jar_cache import complete_dir

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 60.0
HEAP = "-Xmx512m"
DATA = "kafka-data"  # the broker's log.dirs, under its work folder


class KafkaJarsMissing(RuntimeError):
    """The broker's JARs were never fetched: set-up (``python jars/fetch.py kafka``) must run first."""


def jar_dir() -> Path:
    """The complete folder of the broker's JARs, or KafkaJarsMissing; never downloads (tests run offline)."""
    folder = complete_dir("kafka")
    if folder is None:
        raise KafkaJarsMissing(
            "the Kafka broker JARs are not fetched; run the test set-up (`make test`) "
            "or `python jars/fetch.py kafka` once (it downloads them with Maven)"
        )
    return folder


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, all held open at once so the kernel cannot hand out one twice."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cluster_id() -> str:
    """A random cluster id as Kafka writes one (22 characters of URL-safe base64).

    One that starts with ``-`` is drawn again, as Kafka's own ``Uuid.randomUuid``
    does: the storage tool's argument parser would take it for an option.
    """
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def server_properties(broker_port: int, controller_port: int, log_dir: Path) -> str:
    """A one-node KRaft cluster on 127.0.0.1 with test-sized settings.

    Kafka 4.x has no ZooKeeper mode. The quorum is a dynamic one of one voter
    (``controller.quorum.bootstrap.servers`` with ``format --standalone``,
    what Kafka 4's own config/server.properties and quickstart do);
    ``controller.quorum.voters`` must then be absent. Internal topics get one
    replica and one partition (a consumer group or a transaction otherwise
    waits for 50 partitions to be made). Segments are small (1 MiB, the
    least Kafka 4 accepts) and retention is checked every second, from the
    start, so retention tests take seconds.
    """
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        "default.replication.factor": "1",
        "auto.create.topics.enable": "true",
        "delete.topic.enable": "true",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "log.segment.bytes": str(1024 * 1024),
        "log.retention.check.interval.ms": "1000",
        "log.initial.task.delay.ms": "0",
        "num.network.threads": "2",
        "num.io.threads": "2",
        "num.recovery.threads.per.data.dir": "1",
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def java_command(jars: Path, main_class: str, *args: str) -> list[str]:
    """``java`` with the cached JARs on the class path, a small heap and warnings-only logs on stdout."""
    return [
        "java",
        HEAP,
        "-XX:+UseSerialGC",  # one test node: fewer GC threads, less memory than G1
        "-XX:TieredStopAtLevel=1",  # C1 only: starts in about half the time; a test broker needs no peak speed
        "-Djava.awt.headless=true",
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
        "-Dorg.slf4j.simpleLogger.logFile=System.out",
        "-Dorg.slf4j.simpleLogger.showDateTime=true",
        "-cp",
        f"{jars}/*",
        main_class,
        *args,
    ]


class KafkaBroker:
    """A running broker+controller JVM; ``bootstrap`` is ``127.0.0.1:port``.

    ``log_dir`` is its one log directory (``<topic>-<partition>/`` folders with
    the segments and ``partition.metadata``), for tests that check what Kafka
    itself wrote; ``log`` is the JVM's output.
    """

    def __init__(self, process: subprocess.Popen, bootstrap: str, workdir: Path, log: Path) -> None:
        self.process = process
        self.bootstrap = bootstrap
        self.workdir = workdir
        self.log_dir = workdir / DATA
        self.log = log

    @classmethod
    def start(cls, workdir: Path, timeout: float = READY_TIMEOUT) -> KafkaBroker:
        """Format the storage, start the JVM and return once it answers metadata requests.

        Free ports are picked, then released for the broker to bind: another
        process can take one in between. That shows as "Address already in
        use" in the log, and the start is tried again with new ports (and a
        fresh storage folder: the quorum's endpoint is written in it).
        """
        jars = jar_dir()
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            try:
                return cls._start_once(jars, workdir, timeout)
            except RuntimeError as error:
                if "Address already in use" not in str(error) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, jars: Path, workdir: Path, timeout: float) -> KafkaBroker:
        broker_port, controller_port = free_ports(2)
        data = workdir / DATA
        shutil.rmtree(data, ignore_errors=True)
        config = workdir / "server.properties"
        config.write_text(server_properties(broker_port, controller_port, data))
        log = workdir / "kafka.log"
        fmt = subprocess.run(
            java_command(jars, "kafka.tools.StorageTool", "format", "--standalone", "-t", cluster_id(), "-c", str(config)),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if fmt.returncode != 0:
            raise RuntimeError(f"kafka storage format failed ({fmt.returncode}):\n{fmt.stdout}{fmt.stderr}")
        process = _run_broker(jars, workdir, log, mode="w")
        broker = cls(process, f"127.0.0.1:{broker_port}", workdir, log)
        try:
            broker._wait_ready(timeout)
        except BaseException:
            broker.stop()
            raise
        return broker

    def _wait_ready(self, timeout: float) -> None:
        """Until the broker lists topics to a real client: the listener is bound and KRaft has a leader."""
        from confluent_kafka.admin import AdminClient

        # librdkafka backs off up to 10 s between refused connections by
        # default; the listener opens a few seconds in, so retry often.
        admin = AdminClient(
            {
                "bootstrap.servers": self.bootstrap,
                "log_level": 0,
                "reconnect.backoff.ms": 50,
                "reconnect.backoff.max.ms": 200,
            }
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kafka broker exited ({self.process.returncode}) while starting\n{self.tail()}")
            try:
                metadata = admin.list_topics(timeout=2)
                if metadata.brokers:
                    return
            except Exception:  # noqa: BLE001 - KafkaException while it starts; retried until the deadline
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kafka broker did not answer metadata within {timeout:.0f} s\n{self.tail()}")

    def restart(self, timeout: float = READY_TIMEOUT) -> None:
        """Kill the JVM (as a crash would) and start it again on the same
        ports and data: its topics and records survive, as on a real host."""
        self.stop()
        self.process = _run_broker(jar_dir(), self.workdir, self.log, mode="a")
        self._wait_ready(timeout)

    def tail(self, chars: int = 4000) -> str:
        """The end of the broker's log, for failure messages."""
        try:
            return f"--- {self.log}\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return f"--- {self.log}: unreadable"

    def stop(self) -> None:
        """Kill the JVM's process group and wait for it; safe to call twice."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(30)

    def __enter__(self) -> KafkaBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run_broker(jars: Path, workdir: Path, log: Path, *, mode: str) -> subprocess.Popen:
    """The broker JVM on `workdir`'s server.properties, its output appended to (or replacing) `log`."""
    with open(log, mode) as handle:
        return subprocess.Popen(
            java_command(jars, "kafka.Kafka", str(workdir / "server.properties")),
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,  # its own process group, killed as one
        )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="microbatch-kafka-") as work, KafkaBroker.start(Path(work)) as broker:
        print(f"BOOTSTRAP {broker.bootstrap}", flush=True)
        sys.stdin.read()  # until the parent closes the pipe or exits


if __name__ == "__main__":
    main()
