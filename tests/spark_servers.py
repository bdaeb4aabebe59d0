"""Real Spark servers on loopback for the engine tests, from pyspark's own jars.

* a standalone cluster: a master and one worker, each a `bin/spark-class`
  JVM in the foreground (what `sbin/start-master.sh` would daemonise);
* a Spark Connect server: the project's (`spark_jobs/engine/connect_server.py`,
  whose sessions share compiled code) under `spark-submit`, in the foreground.

Each runs in its own process group and is killed with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pyspark

from spark_jobs.engine import connect_server
from spark_jobs.engine.session import DELTA_SQL, extra_jars

SPARK_HOME = Path(pyspark.__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_env(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(work / "logs"),
        "SPARK_WORKER_DIR": str(work / "worker"),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }


@dataclass
class SparkServer:
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start(self, args: list[str], env: dict[str, str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(log)
        handle = open(log, "w")  # noqa: SIM115 - lives as long as the process
        self.procs.append(subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True))

    def tail(self) -> str:
        return "\n".join(f"--- {p}\n" + p.read_text()[-3000:] for p in self.logs if p.exists())

    def wait_for(self, check, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what}: a server process exited ({proc.returncode})\n{self.tail()}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{what}: not ready after {timeout} s\n{self.tail()}")

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


def start_cluster(
    work: Path, cores: int = 2, env: dict[str, str] | None = None, memory: str = "2g", workers: int = 1
) -> tuple[SparkServer, str]:
    """A standalone master and `workers` workers of `cores` cores and `memory`
    each (`env`: more of their environment, which executors inherit); returns
    the server and ``spark://127.0.0.1:port``."""
    env = {**spark_env(work), **(env or {})}
    port, ui = free_port(), free_port()
    server = SparkServer()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    server.start(
        [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui)],
        env,
        work / "master.log",
    )
    # Where the master really listens, from its log: a port taken between
    # `free_port` and the bind (another server starting at once) makes Spark
    # bind the next one, and polling the port we chose then asked another
    # server (a Spark UI answering HTML: seen in CI).
    bound: dict[str, int] = {}

    def started() -> bool:
        log = (work / "master.log").read_text(errors="replace") if (work / "master.log").exists() else ""
        rpc = re.search(r"Starting Spark master at spark://[^:]+:(\d+)", log)
        web = re.search(r"MasterWebUI.*started at http://[^:]+:(\d+)", log)
        if rpc and web:
            bound.update(rpc=int(rpc.group(1)), web=int(web.group(1)))
        return bool(bound)

    def alive_workers() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{bound['web']}/json/", timeout=2) as response:
            return int(json.load(response).get("aliveworkers", 0))

    try:
        server.wait_for(started, "spark master")
        master = f"spark://127.0.0.1:{bound['rpc']}"
        server.wait_for(lambda: alive_workers() >= 0, "spark master's UI")
        for n in range(workers):
            folder = work / ("worker" if n == 0 else f"worker-{n}")
            server.start(
                [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", str(cores),
                 "--memory", memory, "--webui-port", str(free_port()), "--work-dir", str(folder), master],
                env,
                work / f"{folder.name}.log",
            )
        server.wait_for(lambda: alive_workers() == workers, "spark workers")
    except BaseException:
        server.stop()  # a fixture that fails to start leaves no JVM behind
        raise
    return server, master


def start_connect(
    work: Path, *, master: str = "local[2]", conf: dict[str, str] | None = None, env: dict[str, str] | None = None
) -> tuple[SparkServer, str]:
    """A Spark Connect server (sessions on `master`, local[2] by default;
    `conf`: more of its settings, `env`: more of its environment); returns
    the server and ``sc://127.0.0.1:port``."""
    settings = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.defaultJavaOptions": connect_server.JVM_OPTIONS,
        # Delta on the server, as the docker image's Connect server has it:
        # a client's `format("delta")` runs there.
        **DELTA_SQL,
        **(conf or {}),
        "spark.connect.grpc.binding.port": str(port := free_port()),
    }
    server = SparkServer()
    server.start(
        [str(SPARK_HOME / "bin" / "spark-submit"), "--master", master,
         "--jars", ",".join(extra_jars()),
         *[arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}")],
         connect_server.__file__],
        {**spark_env(work), **(env or {})},
        work / "connect.log",
    )

    def listening() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    server.wait_for(listening, "spark connect server", timeout=180)
    return server, f"sc://127.0.0.1:{port}"
