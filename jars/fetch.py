"""Fetch a set of JVM JARs with Maven once, into a cache outside the repository.

``python jars/fetch.py kafka`` resolves ``jars/kafka/pom.xml`` with Maven and
copies every run-time JAR into ``~/.cache/microbatch/jars/kafka-<hash>``
(the root can be moved with ``MICROBATCH_JARS_CACHE``), then prints that
folder. Why this shape:

* The JARs are tens of megabytes of third-party binaries: they do not belong
  in the repository, and the virtualenv is the wrong place too (it is rebuilt
  from the lock file, not from a POM).
* The folder name carries a hash of the POM, so changing a version fetches a
  new folder instead of silently mixing two versions on one classpath.
* A ``.complete`` stamp is written last, after the folder was renamed into
  place: a fetch that was interrupted (Ctrl-C, network loss) never looks like
  a usable folder, and the next run simply starts over.
* Once complete, a folder is returned without touching the network, so tests
  can run offline; ``--path`` goes further and never fetches at all, for
  run-time code that must fail loudly rather than download.

Only the standard library is used: this runs during set-up, before (or
outside) the virtualenv.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIN_JAVA = 17  # Kafka 4.x brokers (and Spark 4) need Java 17 or newer
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Where a set's folder is, shared with the run-time code that finds it
# (stdlib only, so it imports before the virtualenv has anything else).
sys.path.insert(0, str(HERE.parent))
from spark_jobs.jar_cache import STAMP, cache_dir, complete_dir, pom  # noqa: E402


class MissingToolError(RuntimeError):
    """A program the fetch needs (Maven, Java) is absent: the user must install it."""


def check_tools() -> None:
    """Fail early, with the install command, rather than with Maven's or the JVM's own error."""
    if shutil.which("mvn") is None:
        raise MissingToolError("Maven is required to fetch the JARs: apt-get install maven")
    if shutil.which("java") is None:
        raise MissingToolError("Java 17 or newer is required: apt-get install openjdk-17-jre-headless")
    out = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)', out.stderr + out.stdout)
    if match and int(match.group(1)) < MIN_JAVA:
        raise MissingToolError(
            f"Java {match.group(1)} found; Java {MIN_JAVA} or newer is required: apt-get install openjdk-17-jre-headless"
        )


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """One fetch of ``name`` at a time (parallel ``make`` jobs, two shells): the others wait, then reuse it."""
    with open(root / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch(name: str) -> Path:
    """The complete JAR folder of ``name``, downloading it with Maven first if needed.

    Maven writes into a temporary folder beside the final one (same file
    system, so the rename is atomic); the stamp is written only after the
    rename, so no interruption can leave a folder that looks complete.
    """
    done = complete_dir(name)
    if done is not None:
        return done
    check_tools()
    folder = cache_dir(name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent, name):
        if (folder / STAMP).is_file():  # another process finished it while we waited
            return folder
        if folder.exists():  # renamed but never stamped: an interrupted fetch
            shutil.rmtree(folder)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
        try:
            # Maven 3.8 prints stray colour resets even with -q and --batch-mode:
            # its output is kept, cleaned, and shown only when it failed.
            maven = subprocess.run(
                [
                    "mvn",
                    "--batch-mode",
                    "-q",
                    "-C",  # strict checksums: a corrupt download fails instead of landing in the cache
                    "-f",
                    str(pom(name)),
                    "dependency:copy-dependencies",
                    f"-DoutputDirectory={tmp}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                check=False,
            )
            if maven.returncode != 0:
                print(ANSI.sub("", maven.stdout).strip(), file=sys.stderr)
                raise subprocess.CalledProcessError(maven.returncode, maven.args)
            if not any(tmp.glob("*.jar")):
                raise RuntimeError(f"Maven copied no JAR for {name!r} into {tmp}")
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache root from other users
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (folder / STAMP).write_text("")
    return folder


def main(argv: list[str] | None = None) -> int:
    """CLI: ``fetch.py NAME`` fetches and prints the folder; ``--path`` only prints a complete one."""
    parser = argparse.ArgumentParser(description="Fetch the JARs listed in jars/<name>/pom.xml into a local cache.")
    parser.add_argument("name", help="the JAR set, e.g. kafka")
    parser.add_argument(
        "--path", action="store_true", help="print the folder only if already complete (exit 1 otherwise); never fetch"
    )
    args = parser.parse_args(argv)
    try:
        if args.path:
            done = complete_dir(args.name)
            if done is None:
                print(f"{args.name}: not fetched yet (run: python jars/fetch.py {args.name})", file=sys.stderr)
                return 1
            print(done)
            return 0
        print(fetch(args.name))
        return 0
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    except MissingToolError as error:
        print(error, file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as error:
        print(f"Maven failed (exit {error.returncode}) fetching {args.name!r}; its output is above", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
