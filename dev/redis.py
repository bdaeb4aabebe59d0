"""A real Redis server on loopback: the Celery broker of the CeleryExecutor
profile (`make airflow EXECUTOR=celery`, kept with the Airflow home) and of
the live Celery tests (in a throw-away folder).

The server is Debian's ``redis-server`` package (``make tools`` installs it
where it is missing). It listens on a loopback port only, keeps nothing on
disk (a broker's queue is rebuilt by the scheduler, which re-queues what it
does not see run), and runs in a session of its own, so a Ctrl-C meant for
`make airflow` does not take the broker down under Airflow while it stops.

    with RedisServer.start() as redis:           # throw-away (the tests)
        redis.url()  # redis://127.0.0.1:port/0

    RedisServer.kept(airflow_home)               # kept (make airflow, by dev/airflow.py)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT = 30.0


class RedisMissing(RuntimeError):
    """Redis's server is not installed: ``make tools`` (or apt-get install redis-server)."""


def _server() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise RedisMissing("Redis is not installed: run `make tools` (apt-get install redis-server)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    folder: Path
    port: int
    throw_away: bool

    @classmethod
    def start(cls) -> RedisServer:
        """A server in a throw-away folder, on a free port."""
        server = cls(folder=Path(tempfile.mkdtemp(prefix="microbatch-redis-")), port=_free_port(), throw_away=True)
        try:
            server._start()
        except BaseException:
            server.stop()
            raise
        return server

    @classmethod
    def kept(cls, home: Path, *, start: bool = True) -> RedisServer:
        """The server of an Airflow home, on the port it first got, started (`start`) unless it runs."""
        digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]
        folder = Path(tempfile.gettempdir()) / f"microbatch-airflow-redis-{digest}"
        folder.mkdir(parents=True, exist_ok=True)
        port_file = folder / "port"
        port = int(port_file.read_text()) if port_file.exists() else _free_port()
        server = cls(folder=folder, port=port, throw_away=False)
        if start and not server.running():
            server._start()
            port_file.write_text(str(port))
        return server

    def _start(self) -> None:
        log = self.folder / "server.log"
        subprocess.run(
            [_server(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder), "--save", "",
             "--appendonly", "no", "--daemonize", "yes", "--pidfile", str(self.folder / "redis.pid"),
             "--logfile", str(log)],
            check=True, capture_output=True, start_new_session=True,
        )
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.running():
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server did not answer on port {self.port} within {READY_TIMEOUT:.0f} s: {tail}")
            time.sleep(0.05)

    def running(self) -> bool:
        """Whether the server answers PING."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL if it has not exited in 10 s);
        a throw-away folder goes with it. A stale pid file naming another
        program is left alone."""
        try:
            pid = int((self.folder / "redis.pid").read_text())
            is_redis = b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            pid, is_redis = None, False
        if pid is not None and is_redis:
            try:
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    os.kill(pid, 0)  # raises once it is gone
                    time.sleep(0.05)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.throw_away:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

