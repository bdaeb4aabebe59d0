"""The local driver JVM: launched by this process, now or ahead of need.

pyspark starts its driver JVM inside ``SparkSession.builder.getOrCreate()``,
when the first session is asked for. A run in a new process (the CLI, an
Airflow task) knows much earlier that it will most likely need one, and the
JVM's boot is the longest single wait of such a run. `DriverLaunch` starts it
as soon as the run knows its configuration, on a thread, so that it boots
while Python imports the Delta and Arrow libraries, reconciles the tables and
plans the batch; the session then attaches to it (`gateway`). A run that finds
nothing new stops it (`cancel`), which costs such a run about a fifth of a
CPU-second, mostly on the other core (figures in docs/benchmarks.md).

The launch is pyspark's own (`pyspark.java_gateway.launch_gateway`: spark-submit
with ``pyspark-shell``, whose JVM writes its py4j port and secret to a file
we name), done here so that this process holds the child and can stop it,
and so that:

* the JVM's standard output and error are a relay pipe from its first line
  (`spark_jobs.engine.jvm_output`), never this process's own streams;
* `spark-submit`'s launcher JVM gets its class archive through the child's
  environment only (`jvm_cache.launcher_java_options`);
* the wait for the port file polls every 10 ms, not every 100.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from typing import TYPE_CHECKING, BinaryIO

from spark_jobs.engine.jvm_cache import LAUNCHER_ENV, launcher_java_options
from spark_jobs.engine.jvm_output import relay_pipe

if TYPE_CHECKING:
    from py4j.java_gateway import JavaGateway

__all__ = ["DriverExitedError", "DriverLaunch", "EarlyDriver"]

log = logging.getLogger("microbatch")

#: How often the launch looks for the JVM's port file.
_POLL_S = 0.01

#: The JVM classes pyspark's own launch imports into the gateway's view.
_JAVA_IMPORTS = (
    "org.apache.spark.SparkConf",
    "org.apache.spark.api.java.*",
    "org.apache.spark.api.python.*",
    "org.apache.spark.ml.python.*",
    "org.apache.spark.mllib.api.python.*",
    "org.apache.spark.resource.*",
    "org.apache.spark.sql.Encoders",
    "org.apache.spark.sql.OnSuccessCall",
    "org.apache.spark.sql.functions",
    "org.apache.spark.sql.classic.*",
    "org.apache.spark.sql.api.python.*",
    "org.apache.spark.sql.hive.*",
    "scala.Tuple2",
)


class DriverExitedError(RuntimeError):
    """The driver JVM ended before it was ready (its output was logged as ``microbatch.spark``)."""


class DriverLaunch:
    """A driver JVM being started on a thread with `options` (Spark
    configuration, passed to spark-submit as ``--conf``)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = dict(options)
        self._lock = threading.Lock()
        self._cancelled = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._connection: tuple[int, str] | None = None
        self._error: BaseException | None = None
        self._folder = tempfile.mkdtemp(prefix="microbatch-driver-")
        self._port_file = os.path.join(self._folder, "connection")
        # The command is made here, by the caller; the thread only starts and
        # waits. It imports nothing (pyspark itself is not imported at all):
        # the caller may be importing meanwhile, and two threads importing
        # at once can meet a partly initialised module.
        self._command = [os.path.join(_spark_home(), "bin", "spark-submit")]
        for key, value in self.options.items():
            self._command += ["--conf", f"{key}={value}"]
        self._command += shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell"))
        self._env = {**os.environ, "SPARK_CONNECT_MODE": "0", "_PYSPARK_DRIVER_CONN_INFO_PATH": self._port_file}
        launcher = launcher_java_options()
        if launcher is not None:
            self._env[LAUNCHER_ENV] = launcher
        self._thread = threading.Thread(target=self._launch, name="microbatch-driver-launch", daemon=True)
        self._thread.start()

    def gateway(self) -> JavaGateway:
        """Wait until the JVM is up; a py4j gateway to it, as pyspark's launch returns it."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._connection is None:
            raise DriverExitedError("the driver JVM launch was cancelled")
        from py4j.clientserver import ClientServer, JavaParameters, PythonParameters
        from py4j.java_gateway import GatewayParameters, JavaGateway, java_import

        port, secret = self._connection
        # Pinned threads (pyspark's default): each Python thread talks to a JVM thread of its own.
        if os.environ.get("PYSPARK_PIN_THREAD", "true").lower() == "true":
            gateway: JavaGateway = ClientServer(
                java_parameters=JavaParameters(port=port, auth_token=secret, auto_convert=True),
                python_parameters=PythonParameters(port=0, eager_load=False),
            )
        else:
            gateway = JavaGateway(gateway_parameters=GatewayParameters(port=port, auth_token=secret, auto_convert=True))
        gateway.proc = self._proc  # as pyspark's launch sets it (the warm-up waits on it)
        for name in _JAVA_IMPORTS:
            java_import(gateway.jvm, name)
        return gateway

    def cancel(self) -> None:
        """Stop the JVM if it is starting or started, and remove the launch's files.

        Does not wait for it: SIGTERM runs its shutdown hooks, and a JVM not
        yet listening ends anyway when its standard input closes.
        """
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            if proc.stdin is not None:
                proc.stdin.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _launch(self) -> None:
        try:
            self._connection = self._start()
        except BaseException as exc:  # handed to whoever waits in `gateway`
            self._error = exc
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _start(self) -> tuple[int, str] | None:
        with self._lock:
            if self._cancelled:
                return None
            output = relay_pipe()
            try:
                # Its own process group: a Ctrl-C at a terminal reaches this
                # process, which stops the run; the JVM, watching its standard
                # input, ends after it (as pyspark's launch arranges by ignoring
                # SIGINT in the child, which needs a pre-exec hook, unsafe with
                # threads).
                self._proc = subprocess.Popen(
                    self._command, stdin=subprocess.PIPE, stdout=output, stderr=output, env=self._env, process_group=0
                )
            finally:
                os.close(output)
        proc = self._proc
        while proc.poll() is None and not os.path.isfile(self._port_file):
            if self._cancelled:
                return None
            time.sleep(_POLL_S)
        if not os.path.isfile(self._port_file):
            if self._cancelled:
                return None
            raise DriverExitedError(
                f"the Spark driver JVM exited with code {proc.returncode} before it started; its output is "
                "logged above (logger microbatch.spark). Check that Java 17 or later is installed (JAVA_HOME, "
                "or java on the PATH) and the Spark settings in the environment (PYSPARK_SUBMIT_ARGS, SPARK_CONF_DIR)."
            )
        # The JVM writes the file under another name and renames it: it is whole.
        with open(self._port_file, "rb") as info:
            port = _read_int(info)
            return port, info.read(_read_int(info)).decode("utf-8")


class EarlyDriver:
    """The one owner of a driver JVM launched ahead of need (`launch`, None
    if there is none): a session takes it (`take`), and `close` stops it if
    none did (nothing new, a dry run, a session elsewhere, an error). Used
    as a context manager by whoever launched it: the run's factory."""

    def __init__(self, launch: DriverLaunch | None) -> None:
        self._launch = launch
        self._lock = threading.Lock()

    @property
    def pending(self) -> bool:
        """Whether a launch is held: made, and neither taken nor stopped."""
        return self._launch is not None

    def take(self, options: dict[str, str]) -> DriverLaunch | None:
        """The launch, for a session that starts its driver with `options`;
        None if there is none, or it was launched with other settings (then
        it is stopped now: the session launches its own)."""
        with self._lock:
            launch, self._launch = self._launch, None
        if launch is not None and launch.options != options:
            launch.cancel()
            return None
        return launch

    def close(self) -> None:
        """Stop the launch if no session took it."""
        with self._lock:
            launch, self._launch = self._launch, None
        if launch is not None:
            launch.cancel()

    def __enter__(self) -> EarlyDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_int(stream: BinaryIO) -> int:
    """A big-endian 32-bit int, as the JVM writes them (pyspark's `read_int`)."""
    return struct.unpack("!i", stream.read(4))[0]


def _spark_home() -> str:
    """Where spark-submit is: ``SPARK_HOME``, else the pyspark package (as
    pyspark's own search finds it for a pip install), found without importing it."""
    if "SPARK_HOME" in os.environ:
        return os.environ["SPARK_HOME"]
    found = importlib.util.find_spec("pyspark")
    if found is not None and found.origin is not None:
        home = os.path.dirname(found.origin)
        for candidate in (os.path.join(home, "spark-distribution"), home):
            if os.path.isfile(os.path.join(candidate, "bin", "spark-submit")) and os.path.isdir(os.path.join(candidate, "jars")):
                return candidate
    from pyspark.find_spark_home import _find_spark_home  # its full search, and its error

    return _find_spark_home()
