"""`microbatch`: run, inspect and rewind pipelines from the command line.

Exit codes (`spark_jobs.errors` decides them from the error's class): 0 when
the run committed, found nothing new, or found that a concurrent run had
committed the batch (the message says which); 2 when retrying cannot help (a
bad spec or argument, tables that do not belong together, a state changed
outside the job: the message says what to do); 1 for failures where
retrying is safe (the protocol makes every retry exactly-once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

from spark_jobs import __version__
from spark_jobs.core import shutdown
from spark_jobs.errors import EXIT_OK, MicrobatchError, exit_code

if TYPE_CHECKING:
    from spark_jobs.core.outcome import BatchOutcome
    from spark_jobs.core.spec import PipelineSpec

__all__ = ["build_parser", "main"]

log = logging.getLogger("microbatch")


def _parse_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO time; write e.g. 2026-11-22T10:00:00Z") from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _master(text: str) -> str:
    from spark_jobs.core.spec import SPARK_MASTER

    if not SPARK_MASTER.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Spark master this job can use: local[*], spark://host:port or sc://host:port"
        )
    return text


def _int_at_least(minimum: int):
    """An argparse type for whole numbers >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microbatch",
        description="Exactly-once Spark micro-batches with a Delta offset ledger.",
    )
    parser.add_argument("--version", action="version", version=f"microbatch {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only print the result")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the job's own details too (DEBUG)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Every command reads the spec's locations, so every command takes the roots.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-root",
        action="append",
        metavar="ROOT",
        help="only allow source, state and checkpoint under this folder or s3://bucket/prefix "
        "(repeatable; replaces MICROBATCH_STORAGE_ROOTS)",
    )

    _add_run(sub.add_parser("run", help="run one micro-batch", parents=[common]))

    status = sub.add_parser("status", help="where the pipeline stands", parents=[common])
    status.add_argument("spec")
    status.add_argument("--json", action="store_true")

    history = sub.add_parser("history", help="the offset ledger", parents=[common])
    history.add_argument("spec")
    history.add_argument("--json", action="store_true")
    history.add_argument("--limit", type=_positive, help="only the last N rows (human output)")

    maintain = sub.add_parser(
        "maintain", help="compact and VACUUM the state, ledger and quarantine; write checkpoints", parents=[common]
    )
    maintain.add_argument("spec")
    maintain.add_argument(
        "--keep-batches", type=_positive, metavar="N", help="keep the last N batches rewindable (default: the spec's maintenance.keep_batches)"
    )
    maintain.add_argument("--json", action="store_true")
    maintain.add_argument(
        "--master",
        type=_master,
        help="Spark for a fold too big for this process, as for run (default: spark-submit's, else the spec's "
        "engine.master, else local[*])",
    )

    query = sub.add_parser(
        "query", help="the state as of its last batch, one row per key (or the SQL that reads it)", parents=[common]
    )
    query.add_argument("spec")
    query.add_argument(
        "--sql", choices=("delta-rs", "spark"), help="print the query for this engine instead of running it"
    )
    query.add_argument("--limit", type=_positive, default=20, metavar="N", help="rows to print (default 20)")
    query.add_argument("--json", action="store_true")

    rewind = sub.add_parser("rewind", help="restore state to a batch and continue from its offsets", parents=[common])
    rewind.add_argument("spec")
    rewind.add_argument("--to-batch", type=_non_negative, required=True, metavar="K")
    rewind.add_argument("--json", action="store_true")
    return parser


def _add_run(run: argparse.ArgumentParser) -> None:
    """The options of `microbatch run`."""
    run.add_argument("spec", help="pipeline spec (YAML)")
    run.add_argument("--max-files", type=_positive, help="cap files for this batch (overrides the spec)")
    run.add_argument("--max-records", type=_positive, help="cap records for this batch (files sources: in whole files; Kafka: offsets shared across partitions)")
    run.add_argument("--until", type=_parse_time, help="only read data that arrived before this ISO time")
    run.add_argument("--dry-run", action="store_true", help="plan and show the range; commit nothing")
    run.add_argument("--run-id", help="identifier recorded in the ledger (default cli-<time>-<random>)")
    run.add_argument("--json", action="store_true", help="print the outcome as JSON (with --catch-up: one object per line, per batch)")
    run.add_argument(
        "--catch-up",
        action="store_true",
        help="run batches back to back until nothing new is left (each its own exactly-once batch; "
        "the next two batches are read while one commits)",
    )
    run.add_argument("--max-batches", type=_positive, help="with --catch-up: stop after this many committed batches")
    run.add_argument(
        "--master",
        type=_master,
        help="Spark to run on: local[*], spark://host:port (standalone cluster) or sc://host:port "
        "(Spark Connect); default: spark-submit's, else the spec's engine.master, else local[*]",
    )


def main(argv: list[str] | None = None) -> int:
    """The `microbatch` command. Called without `argv` it is the program
    itself (the console script, ``python -m spark_jobs``): the process ends
    when it returns, and a driver JVM it started ends with it."""
    args = build_parser().parse_args(argv)
    args.process_ends = argv is None
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s microbatch: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # Spark's py4j bridge logs every connection at INFO.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    if args.verbose and not args.quiet:
        logging.getLogger("microbatch").setLevel(logging.DEBUG)
    # SIGTERM (Airflow stopping a task, a container stopping) stops the run at
    # the next protocol boundary with a clear, retryable error.
    shutdown.install()
    try:
        code = _dispatch(args)
    except MicrobatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exit_code(exc)
    if args.process_ends:
        _end_process(code)
    return code


def _end_process(code: int) -> NoReturn:
    """End the program now, without Python's teardown.

    By now everything the command writes is committed and its output
    printed. The teardown would add nothing but time: py4j's and pyspark's
    exit handlers and the finalisation of a thousand modules took a quarter
    of a second of a one-batch run (docs/benchmarks.md). A driver JVM this
    process started exits by itself when our end closes its standard input,
    and runs its own shutdown hooks (its temporary folders).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away: nothing left to tell it
            pass
    logging.shutdown()
    os._exit(code)


def _run_id(kind: str) -> str:
    """The CLI's own run ids, e.g. ``cli-20261123T101500-3fa2c1``."""
    return f"cli{kind}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


def _run(spec: PipelineSpec, args: argparse.Namespace) -> int:
    """`microbatch run`: one batch, or (`--catch-up`) batches until nothing new is left."""
    from spark_jobs.engine import compute_factory

    if args.max_batches and not args.catch_up:
        raise SystemExit("microbatch run: --max-batches needs --catch-up")
    if args.catch_up and args.dry_run:
        raise SystemExit("microbatch run: --catch-up plans and commits batch after batch; a --dry-run shows one batch: drop one of the two")

    # The driver JVM is launched first, so that it boots while the protocol's
    # libraries load and the batch is planned; a run that finds nothing new
    # (or fails before its batch) stops it as it leaves the factory's block.
    # A catch-up runs many batches on it, so it gets a long-lived session's flags.
    with compute_factory(
        spec, args.master, process_ends=args.process_ends, start_driver=not args.dry_run, short_lived=not args.catch_up
    ) as factory:
        from spark_jobs.core.catch_up import catch_up
        from spark_jobs.core.protocol import RunOptions, run_batch

        options = RunOptions(
            run_id=args.run_id or _run_id(""),
            interval_end=args.until,
            max_files=args.max_files,
            max_records=args.max_records,
            dry_run=args.dry_run,
        )
        if args.catch_up:

            def shown(outcome: BatchOutcome) -> None:
                _print_outcome(outcome, args.json, lines=True)
                sys.stdout.flush()  # each batch as it commits, also into a pipe or a log
                _quarantine_checked(spec, outcome)  # (a catch-up stops after a batch over the limit)

            catch_up(factory.spec, options, factory, max_batches=args.max_batches, on_outcome=shown)
            return EXIT_OK
        outcome = run_batch(factory.spec, options, factory)
    _print_outcome(outcome, args.json)
    _quarantine_checked(spec, outcome)
    return EXIT_OK


def _quarantine_checked(spec: PipelineSpec, outcome: BatchOutcome) -> None:
    """After a committed batch: raise (`on_exceed: fail`, exit 2) or warn when
    it quarantined more than the spec's `quarantine` limits."""
    from spark_jobs.core.quarantine import over_limit

    crossed = over_limit(spec, outcome)
    if crossed is None:
        return
    if spec.quarantine.on_exceed == "fail":
        raise crossed
    log.warning("warning (quarantine.on_exceed: warn): %s", crossed)


def _dispatch(args: argparse.Namespace) -> int:
    from spark_jobs.core.spec import load_spec

    spec = load_spec(args.spec, storage_roots=args.storage_root)
    command = {"run": _run, "status": _status, "history": _history, "maintain": _maintain, "query": _query, "rewind": _rewind}
    return command[args.command](spec, args)


def _status(spec: PipelineSpec, args: argparse.Namespace) -> int:
    from spark_jobs.core.event_time import iso
    from spark_jobs.core.inspect import status

    st = status(spec)
    if args.json:
        print(json.dumps(st.to_dict(), indent=2))
        return EXIT_OK
    shown = st.to_dict()
    _table(
        f"pipeline {st.pipeline}",
        ["epoch", "last batch", "end offsets", "state version", "committed at", "waiting", "quarantined", "rewindable"],
        [
            [
                shown["epoch"],
                shown["last_batch"],
                _compact(st.end_offsets),
                shown["state_version"],
                _time(shown["committed_at"]),
                st.lag.describe() if st.lag else "?",
                st.quarantined,
                "" if st.oldest_rewindable is None else f"0, {st.oldest_rewindable}..{shown['last_batch']}",
            ]
        ],
    )
    if spec.event_time is not None:
        watermark = st.head.watermark if st.head else None
        print(f"watermark: {iso(watermark) if watermark else 'none yet'} (records before it are late: event_time.late {spec.event_time.late})")
    if st.merged_on_read:
        print("state: merged on read (Delta deletion vectors): its readers need Delta 2.3 or later")
    if st.final is not None:
        through = f"every window ended by {iso(st.final.through)}" if st.final.through else "no window final yet"
        print(f"final rows: {st.final.rows:,} in {st.final.path} ({through})")
    if st.note:
        print(f"note: {st.note}")
    return EXIT_OK


def _history(spec: PipelineSpec, args: argparse.Namespace) -> int:
    from spark_jobs.core.event_time import iso
    from spark_jobs.core.inspect import history

    rows = history(spec)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return EXIT_OK
    shown = rows[-args.limit :] if args.limit else rows
    timed = any(r.watermark is not None or r.records_late is not None for r in rows)
    deduped = any(r.records_duplicate is not None for r in rows)
    _table(
        f"offset ledger of {spec.name} ({len(rows)} rows)",
        ["epoch", "batch", "status", "start", "end", "records", "quarantined", *(["late", "watermark"] if timed else []),
         *(["duplicates"] if deduped else []),
         "keys", "state v", "spec", "run id", "at"],
        [
            [
                r.epoch,
                r.batch_id,
                r.status,
                _compact(r.start_offsets),
                _compact(r.end_offsets),
                r.records_in,
                r.records_quarantined,
                *([r.records_late, iso(r.watermark) if r.watermark else None] if timed else []),
                *([r.records_duplicate] if deduped else []),
                r.keys_updated,
                r.state_version,
                r.spec_fingerprint,
                r.run_id,
                _time(r.committed_at or r.planned_at),
            ]
            for r in shown
        ],
    )
    return EXIT_OK


def _maintain(spec: PipelineSpec, args: argparse.Namespace) -> int:
    from spark_jobs.core.maintain import maintain
    from spark_jobs.engine import compute_factory

    # Spark starts only for a fold too big for this process (docs/architecture.md, "Where the rows go").
    with compute_factory(spec, args.master, process_ends=args.process_ends) as factory:
        report = maintain(factory.spec, args.keep_batches, factory)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return EXIT_OK
    kept = report.kept_batches
    print(f"maintained {spec.name}: batches {kept[0]}..{kept[-1]} stay rewindable" if kept else f"maintained {spec.name}")
    for table in dict.fromkeys([*report.removed_files, *report.compacted_files]):
        if table.endswith((" untracked", "change data")):
            continue
        untracked = report.removed_files.get(f"{table} untracked", 0)
        extra = f", {untracked} file(s) no commit referenced removed" if untracked else ""
        compacted = report.compacted_files.get(table)
        # (The consumed index is sorted, not compacted: no count.)
        done = "" if compacted is None else f"{compacted} file(s) compacted, " if compacted else "nothing to compact, "
        # No VACUUM count: the state moved while maintain ran (a batch
        # committed), so its VACUUM waits for the next maintenance.
        removed = report.removed_files.get(table)
        vacuum = "VACUUM skipped (the table moved meanwhile)" if removed is None else f"{removed} unneeded file(s) removed"
        print(f"  {table}: {done}{vacuum}{extra}, checkpoint written")
    for table in ("change data", "final change data"):
        if report.removed_files.get(table):
            print(f"  {table}: {report.removed_files[table]} file(s) every reader has read removed")
    if report.forgotten_ids:
        print(f"  dedup: {report.forgotten_ids:,} id(s) no batch a rewind can reach reads deleted")
    return EXIT_OK


def _query(spec: PipelineSpec, args: argparse.Namespace) -> int:
    """The state as users read it: for an appended state, its partial rows folded."""
    import pyarrow as pa

    from spark_jobs.core.agreement import check_spec
    from spark_jobs.core.delta_io import open_table
    from spark_jobs.core.folding import read_state, spark_sql, state_sql
    from spark_jobs.core.pipeline import Pipeline

    # The query applies the spec's layout and merge rules: only those the
    # state was made with (an edited spec a run would refuse is refused here).
    pipeline = Pipeline(spec)
    check_spec(pipeline, pipeline.ledger.load())
    table = open_table(spec.state_path)
    if table is None:
        print(f"pipeline {spec.name}: no state yet at {spec.state_path} (no batch committed)", file=sys.stderr)
        return EXIT_OK
    schema = pa.schema(table.schema().to_arrow())
    if args.sql == "spark":
        print(spark_sql(spec, schema))
        return EXIT_OK
    if args.sql == "delta-rs":
        print(f"-- register the table at {spec.state_path} as `state` (deltalake.QueryBuilder().register)")
        print(state_sql(spec.state, schema))
        return EXIT_OK
    rows: list[dict[str, Any]] = []
    for batch in read_state(spec, table):
        rows += batch.slice(0, args.limit - len(rows)).to_pylist()
        if len(rows) >= args.limit:
            break
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return EXIT_OK
    _table(f"state of {spec.name} (version {table.version()}, first {len(rows)} keys)", schema.names, [list(r.values()) for r in rows])
    return EXIT_OK


def _rewind(spec: PipelineSpec, args: argparse.Namespace) -> int:
    from spark_jobs.core.rewind import rewind

    _print_outcome(rewind(spec, args.to_batch, run_id=_run_id("-rewind")), args.json)
    return EXIT_OK


# -- output -------------------------------------------------------------------------


def _print_outcome(outcome: BatchOutcome, as_json: bool, *, lines: bool = False) -> None:
    """An outcome for people, or as JSON (`lines`: on one line, one outcome of several)."""
    from spark_jobs.core.event_time import iso
    from spark_jobs.core.outcome import Outcome

    if as_json:
        print(json.dumps(outcome.to_dict(), indent=None if lines else 2, default=str))
        return
    print(f"{outcome.status}: {outcome.message}")
    if outcome.status is Outcome.COMMITTED:
        _table(
            None,
            ["batch", "epoch", "inputs", "records", "quarantined", "keys updated", "state version", "seconds"],
            [
                [
                    outcome.batch_id,
                    outcome.epoch,
                    len(outcome.inputs),
                    outcome.records_in,
                    outcome.records_quarantined,
                    outcome.keys_updated,
                    outcome.state_version,
                    f"{(outcome.duration_ms or 0) / 1000:.1f}",
                ]
            ],
        )
        if outcome.records_late is not None:
            watermark = iso(outcome.watermark) if outcome.watermark else "none yet"
            print(f"event time: {outcome.records_late:,} late record(s); watermark {watermark}")
        if outcome.records_duplicate is not None:
            print(f"dedup: {outcome.records_duplicate:,} duplicate record(s) dropped")
        if outcome.steps_ms:
            print("time by step: " + ", ".join(f"{step} {ms / 1000:.2f} s" for step, ms in outcome.steps_ms.items()))
    elif outcome.status is Outcome.DRY_RUN:
        for name in outcome.inputs:
            print(f"  {name}")


def _table(title: str | None, headers: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    Console(width=160 if not sys.stdout.isatty() else None).print(table)


def _compact(offsets: dict[str, Any] | None) -> str:
    """Offsets as people read them: ``12 files``, ``v7`` (a Delta version),
    ``clicks 0:40 1:38`` (a topic's partitions and next offsets)."""
    if not offsets:
        return ""
    if set(offsets) == {"files"}:
        return f"{offsets['files']} files"
    if "version" in offsets and set(offsets) <= {"version", "table"}:
        return f"v{offsets['version']}"
    topics = {name: parts for name, parts in offsets.items() if isinstance(parts, dict)}
    if topics and all(name.startswith("@") for name in set(offsets) - set(topics)):  # "@cluster": an id, not a position
        return "; ".join(f"{topic} " + " ".join(f"{p}:{n}" for p, n in sorted(parts.items(), key=lambda i: int(i[0]))) for topic, parts in topics.items())
    return json.dumps(offsets, separators=(",", ":"))


def _time(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


if __name__ == "__main__":
    sys.exit(main())
