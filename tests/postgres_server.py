"""A real PostgreSQL server on loopback for the tests, in a throw-away folder.

The live Airflow tests keep Airflow's metadata in it, as production does.
On SQLite, Airflow's writers contend for one lock: a command that read
before it writes gets "database is locked" at once, and pysqlite turns the
SAVEPOINTs Airflow nests its work in into commits, so a command that fails
half-way leaves its first half written (docs/airflow.md, "Backfills"). A
test that ran over SQLite was testing that, not the product.

The server is Debian's ``postgresql`` package (``make tools`` installs it
where it is missing). PostgreSQL refuses to run as root, and CI runs as
root: then the server runs as the package's ``postgres`` user, in a folder
that user owns. It listens on a free loopback port, with fsync off (the data
is thrown away with the folder), and is stopped at once on exit.

    with PostgresServer.start() as pg:
        pg.create_database("airflow")
        pg.url("airflow")  # postgresql://airflow@127.0.0.1:port/airflow
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT = 60.0
USER = "airflow"  # the database role the tests connect as (trust auth on loopback)


class PostgresMissing(RuntimeError):
    """PostgreSQL's server programs are not installed: ``make tools`` (or apt-get install postgresql)."""


def _bin_dir() -> Path:
    """The folder of ``initdb``/``pg_ctl``: Debian keeps them out of PATH."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    if not versions:
        raise PostgresMissing("PostgreSQL is not installed: run `make tools` (apt-get install postgresql)")
    return Path(versions[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    folder: Path
    port: int
    bin_dir: Path
    as_user: list[str]  # the prefix that runs a server program as a non-root user, or []

    @classmethod
    def start(cls) -> PostgresServer:
        bin_dir = _bin_dir()
        # Not under pytest's tmp_path: that is root's 0700 folder, which the
        # postgres user could not enter.
        folder = Path(tempfile.mkdtemp(prefix="microbatch-pg-"))
        as_user: list[str] = []
        if os.geteuid() == 0:
            as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(folder, "postgres", "postgres")
        server = cls(folder=folder, port=_free_port(), bin_dir=bin_dir, as_user=as_user)
        try:
            server._run("initdb", "-D", str(folder / "data"), "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8")
            log = folder / "server.log"
            options = f"-h 127.0.0.1 -p {server.port} -k {folder} -c fsync=off -c full_page_writes=off -c synchronous_commit=off -c max_connections=200"
            server._run("pg_ctl", "-D", str(folder / "data"), "-l", str(log), "-o", options, "-w", "-t", str(int(READY_TIMEOUT)), "start")
        except BaseException:
            server.stop()
            raise
        return server

    def _run(self, program: str, *args: str) -> str:
        result = subprocess.run([*self.as_user, str(self.bin_dir / program), *args], capture_output=True, text=True, cwd=self.folder)
        if result.returncode != 0:
            log = self.folder / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{program} failed (exit {result.returncode}): {result.stderr[-2000:]}{tail}")
        return result.stdout

    def psql(self, sql: str, database: str = "postgres") -> str:
        return self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, "-d", database, "-v", "ON_ERROR_STOP=1", "-Atc", sql)

    def create_database(self, name: str) -> None:
        self.psql(f'CREATE DATABASE "{name}"')

    def url(self, database: str, driver: str = "postgresql") -> str:
        return f"{driver}://{USER}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if (self.folder / "data" / "postmaster.pid").exists():
            subprocess.run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.folder / "data"), "-m", "immediate", "-w", "stop"], capture_output=True)
        deadline = time.monotonic() + 10
        while (self.folder / "data" / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
