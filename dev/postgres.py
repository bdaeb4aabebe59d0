"""A real PostgreSQL server on loopback: Airflow's metadata database for
`make airflow` (kept in a folder between runs) and for the live tests (in a
throw-away folder).

Airflow keeps its metadata in it, as production does. On SQLite, Airflow's
writers contend for one lock: a command that read before it writes gets
"database is locked" at once, and pysqlite turns the SAVEPOINTs Airflow
nests its work in into commits, so a command that fails half-way leaves its
first half written (docs/airflow.md, "Backfills"). A test that ran over
SQLite was testing that, not the product.

The server is Debian's ``postgresql`` package (``make tools`` installs it
where it is missing). PostgreSQL refuses to run as root, and CI runs as
root: then the server runs as the package's ``postgres`` user, in a folder
that user owns (for a kept folder, one under the system's temporary folder
named after the Airflow home, since a root-owned home is closed to it). It
listens on a loopback port with fsync off (a local development database),
and is stopped at once.

    with PostgresServer.start() as pg:           # throw-away (the tests)
        pg.create_database("airflow")
        pg.url("airflow")  # postgresql://airflow@127.0.0.1:port/airflow

    python -m dev.postgres start AIRFLOW_HOME    # kept (make airflow): prints the URL
    python -m dev.postgres stop AIRFLOW_HOME
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT = 60.0
USER = "airflow"  # the database role Airflow connects as (trust auth on loopback)


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


def _as_postgres(folder: Path) -> list[str]:
    """The prefix that runs the server's programs (as `postgres` when we are
    root, which it refuses), after handing it `folder`."""
    if os.geteuid() != 0:
        return []
    shutil.chown(folder, "postgres", "postgres")
    return ["runuser", "-u", "postgres", "--"]


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

    #: False for a kept folder (`make airflow`): `stop` leaves the data.
    throw_away: bool = True

    @classmethod
    def start(cls) -> PostgresServer:
        """A new server in a throw-away folder, on a free port."""
        # Not under pytest's tmp_path: that is root's 0700 folder, which the
        # postgres user could not enter.
        folder = Path(tempfile.mkdtemp(prefix="microbatch-pg-"))
        as_user = _as_postgres(folder)
        server = cls(folder=folder, port=_free_port(), bin_dir=_bin_dir(), as_user=as_user)
        try:
            server._initdb()
            server._start()
        except BaseException:
            server.stop()
            raise
        return server

    @classmethod
    def kept(cls, home: Path, *, start: bool = True) -> PostgresServer:
        """The server of an Airflow home, started (`start`) on the port it
        first got; created (with its `airflow` database) on first start."""
        folder = home / "postgres" if os.geteuid() != 0 else cls._root_folder(home, create=start)
        if not start and not folder.exists():  # nothing of this home's to look at or stop
            return cls(folder=folder, port=0, bin_dir=_bin_dir(), as_user=[], throw_away=False)
        folder.mkdir(parents=True, exist_ok=True)
        as_user = _as_postgres(folder)
        port_file = folder / "port"
        port = int(port_file.read_text()) if port_file.exists() else _free_port()
        server = cls(folder=folder, port=port, bin_dir=_bin_dir(), as_user=as_user, throw_away=False)
        if not start:
            return server
        created = not (folder / "data" / "PG_VERSION").exists()
        if created:
            shutil.rmtree(folder / "data", ignore_errors=True)  # an initdb cut short
            server._initdb()
        if not server.running():
            server._start()
        if created:
            server.create_database("airflow")
            port_file.write_text(str(port))
        return server

    @classmethod
    def _root_folder(cls, home: Path, *, create: bool = True) -> Path:
        """Where root's server keeps its data: the postgres user it runs as
        cannot enter root's home, so the folder is in the system temp
        folder, named by the home and by a token the home holds. Deleting
        the home (`rm -rf .airflow`) drops the token: the next start makes a
        new, empty database, and removes the old one's folder. A home from
        before the token keeps the folder it had (named by the home alone).
        `create`: False only looks (`stop`): no home made, nothing removed."""
        prefix = f"microbatch-airflow-pg-{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]}"
        temp = Path(tempfile.gettempdir())
        token_file = home / "postgres-folder-token"
        if token_file.exists():
            token = token_file.read_text().strip()
        elif not create:
            token = "none"  # no token, no database of this home's: a folder that is not there
        else:
            home.mkdir(parents=True, exist_ok=True)
            kept_from_before = (temp / prefix).exists() and any(p.name != "postgres-folder-token" for p in home.iterdir())
            token = "" if kept_from_before else secrets.token_hex(6)
            token_file.write_text(token)
        folder = temp / (f"{prefix}-{token}" if token else prefix)
        if create:
            # Another token's folder, or the tokenless one of a home made afresh.
            for stale in [temp / prefix, *temp.glob(f"{prefix}-*")]:
                if stale != folder and stale.exists():
                    cls(folder=stale, port=0, bin_dir=_bin_dir(), as_user=_as_postgres(stale), throw_away=True).stop()
        return folder

    def running(self) -> bool:
        """Whether the server runs (`pg_ctl status`: a stale pid file after a kill does not count)."""
        status = subprocess.run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.folder / "data"), "status"], capture_output=True)
        return status.returncode == 0

    def _initdb(self) -> None:
        self._run("initdb", "-D", str(self.folder / "data"), "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8")

    def _start(self) -> None:
        log = self.folder / "server.log"
        options = (f"-h 127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off -c full_page_writes=off "
                   "-c synchronous_commit=off -c max_connections=200")
        # In a session of its own: a Ctrl-C meant for `make airflow` must not
        # shut the database down under Airflow while Airflow stops.
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-l", str(log), "-o", options, "-w", "-t", str(int(READY_TIMEOUT)), "start",
                  new_session=True)

    def _run(self, program: str, *args: str, new_session: bool = False) -> str:
        result = subprocess.run([*self.as_user, str(self.bin_dir / program), *args], capture_output=True, text=True, cwd=self.folder,
                                start_new_session=new_session)
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
        """Stop the server; a throw-away folder goes with it (so `immediate`:
        nothing to keep), a kept one shuts down cleanly (`fast`)."""
        if (self.folder / "data" / "postmaster.pid").exists():
            mode = "immediate" if self.throw_away else "fast"
            subprocess.run([*self.as_user, str(self.bin_dir / "pg_ctl"), "-D", str(self.folder / "data"), "-m", mode, "-w", "stop"], capture_output=True)
        deadline = time.monotonic() + 10
        while (self.folder / "data" / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.throw_away:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="the PostgreSQL server of a local Airflow home (make airflow)")
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("home", type=Path, help="the Airflow home the database belongs to")
    args = parser.parse_args()
    try:
        server = PostgresServer.kept(args.home, start=args.action == "start")
    except PostgresMissing as exc:
        sys.exit(str(exc))
    if args.action == "start":
        print(server.url("airflow", driver="postgresql+psycopg2"))
    else:
        server.stop()


if __name__ == "__main__":
    main()
