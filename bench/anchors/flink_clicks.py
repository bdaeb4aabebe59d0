"""PyFlink anchor: the benchmark's click aggregation as a continuous Flink job with checkpoints.

Run with the Flink venv (`.venv-flink/bin/python`, see README.md), never the
project's env. The job reads the JSON-lines click files that
`spark_jobs.demo.clickstream.write_wave` lands (Flink's FileSource, text lines),
keeps per user_id `count(*), sum(amount), sum(idhash), max(ts)` (Flink SQL) in
keyed state (RocksDB or heap), checkpoints every N ms, and writes the aggregate's upsert changelog
(`+I`/`+U` rows) with the exactly-once `FileSink`: a part file becomes visible
only when the checkpoint that covers it completes. `flink_state.fold_output`
folds the visible files back into the current aggregate per user.

    .venv-flink/bin/python bench/anchors/flink_clicks.py --landing L --out O \
        --checkpoints C [--bounded | --monitor-interval-ms 1000] \
        [--backend rocksdb|hashmap] [--checkpoint-interval-ms 1000] \
        [--restore PATH|latest] [--metrics-file M.jsonl]

SIGTERM/SIGINT stops the job with a savepoint (its output committed); kill -9
leaves the last completed checkpoint, which `--restore latest` resumes from.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the slow imports: start-up overhead counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import urllib.request  # noqa: E402
from datetime import datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from py4j.protocol import Py4JError  # noqa: E402  (PyFlink's JVM bridge; light to import)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flink_state import latest_checkpoint, record_hash  # noqa: E402

HEX_DIGITS = "0123456789abcdef"


def hex_to_bigint_sql(column: str, digits: int = 10) -> str:
    """Flink SQL for int(column[:digits], 16), column being lower-case hex.

    Flink SQL has no base-16 conversion: each digit is its POSITION in
    '0123456789abcdef' minus one, times 16^k.
    """
    terms = [
        f"CAST(POSITION(SUBSTRING({column} FROM {i + 1} FOR 1) IN '{HEX_DIGITS}') - 1 AS BIGINT)"
        f" * {16 ** (digits - 1 - i)}"
        for i in range(digits)
    ]
    return "(" + " + ".join(terms) + ")"


def once(expression: str) -> str:
    """`expression`, computed once per row even when later steps use its result several times.

    The planner inlines a projection into the next one, so `SHA256(event_id) AS h` used
    by the ten digit terms of `hex_to_bigint_sql` became ten SHA-256 calls per row (seen
    in the generated code), and each JSON_VALUE ran once per use. An always-true
    `RAND() < 2` guard makes the column non-deterministic, and the planner does not
    inline such a column into several uses.
    """
    return f"CASE WHEN RAND() < 2 THEN {expression} END"


def aggregate_sql() -> str:
    """The benchmark's transform (`ORACLE_TRANSFORM` in clickstream.py) in Flink SQL, over
    the view `lines` (one JSON document per row, column f0).

    Fields are taken with JSON_VALUE: the json *format* of the SQL filesystem source would
    parse faster, but its reader loses count of the records it skipped on a restore, so a
    second restore re-reads them (see README, known limits). Like the oracle, rows that
    are not JSON or have no user_id are dropped, a missing amount counts as 0 and a
    non-numeric one drops the row. idhash is `record_hash(event_id)`: the first 10 hex
    digits of SHA-256 as a BIGINT. `ts` stays a STRING: one fixed ISO-8601 UTC format,
    whose string order is time order, so MAX needs no parsing.
    """
    paths = {"user_id": "$.user_id", "amount_text": "$.amount", "ts": "$.ts", "event_id": "$.event_id"}
    fields = ", ".join(f"{once(f'JSON_VALUE(f0, {path!r})')} AS {name}" for name, path in paths.items())
    rows = (
        "SELECT user_id, COALESCE(TRY_CAST(amount_text AS DOUBLE), 0.0) AS amount, ts, "
        f"{once('SHA256(event_id)')} AS h FROM (SELECT {fields} FROM lines) "
        "WHERE user_id IS NOT NULL AND (amount_text IS NULL OR TRY_CAST(amount_text AS DOUBLE) IS NOT NULL)"
    )
    return (
        "SELECT user_id, COUNT(*) AS events, SUM(amount) AS amount, "
        f"SUM({hex_to_bigint_sql('h')}) AS idhash, MAX(ts) AS last_seen FROM ({rows}) GROUP BY user_id"
    )


def free_port() -> int:
    """A free local port for the mini cluster's REST API (its default port is random and unknown to us)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flink_config(args: argparse.Namespace, rest_port: int, restore: Path | None) -> dict[str, str]:
    """Flink 2.x configuration (key names as of 2.0: many 1.x keys were renamed)."""
    checkpoints = Path(args.checkpoints).resolve()
    conf = {
        "execution.runtime-mode": "STREAMING",
        "parallelism.default": str(args.parallelism),
        "execution.checkpointing.interval": f"{args.checkpoint_interval_ms} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": checkpoints.as_uri(),
        "execution.checkpointing.savepoint-dir": (checkpoints / "savepoints").as_uri(),
        # Keep the last completed checkpoint when the job is cancelled or dies, so
        # that a killed run can be resumed with --restore.
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.num-retained": "1",
        "state.backend.type": args.backend,
        "execution.checkpointing.incremental": "true" if args.backend == "rocksdb" else "false",
        # A task failure ends the run (exit 1, checkpoints kept) instead of being
        # retried unseen inside the benchmark's figures; resume with --restore latest.
        "restart-strategy.type": "none",
        "rest.address": "127.0.0.1",
        "rest.bind-address": "127.0.0.1",
        "rest.bind-port": str(rest_port),
        # Fresh figures for the progress poller (the defaults cache them for seconds).
        "web.refresh-interval": "100 ms",
        "metrics.fetcher.update-interval": "100 ms",
        "rest.cache.checkpoint-statistics.timeout": "100 ms",
        "web.checkpoints.history": "100",
        "pipeline.name": "flink-clicks",
    }
    if restore:
        conf["execution.state-recovery.path"] = restore.resolve().as_uri()
    return conf


def build_job(args: argparse.Namespace, conf: dict[str, str], metrics: Metrics) -> Any:
    """File source -> SQL aggregate -> upsert changelog -> FileSink; returns the environment.

    Why a DataStream sink and not a SQL filesystem sink: the SQL sink only takes
    insert-only rows with the bundled csv format, and with a changelog format
    (debezium-json, a row encoder) it rolls part files by size/time instead of
    on every checkpoint, so results would stay invisible for up to 30 minutes.
    `FileSink` with OnCheckpointRollingPolicy commits exactly what each
    checkpoint covers. Rows are written with `Row.toString()` (a Java encoder,
    no Python in the data path), e.g. `+U[user000001, 3, 57.1, 12345, 2026-...]`.
    """
    from pyflink.common import Configuration, Duration, Encoder, WatermarkStrategy
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.connectors.file_system import (
        BucketAssigner,
        FileSink,
        FileSource,
        OutputFileConfig,
        RollingPolicy,
        StreamFormat,
    )
    from pyflink.table import ChangelogMode, Schema, StreamTableEnvironment

    config = Configuration()
    for key, value in conf.items():
        config.set_string(key, value)
    env = StreamExecutionEnvironment.get_execution_environment(config)
    t_env = StreamTableEnvironment.create(env)
    metrics.emit("jvm_ready")  # PyFlink has launched its JVM: the rest of start-up is planning and deploying
    if args.mini_batch_ms > 0:
        # Mini-batches aggregate a bundle per key before touching state and emit one
        # update per key per bundle (flushed at every checkpoint barrier too), much
        # like one Spark micro-batch; without it every record updates state and output.
        table_conf = t_env.get_config()
        table_conf.set("table.exec.mini-batch.enabled", "true")
        table_conf.set("table.exec.mini-batch.allow-latency", f"{args.mini_batch_ms} ms")
        table_conf.set("table.exec.mini-batch.size", "20000")
    # The DataStream FileSource with text lines: its reader keeps exact positions across
    # any number of restores. It skips names starting with '.' or '_' (write_wave's temp
    # files); monitoring makes it unbounded, and the set of files seen is checkpointed.
    files = FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(Path(args.landing).resolve()))
    if not args.bounded:
        files = files.monitor_continuously(Duration.of_millis(args.monitor_interval_ms))
    lines = env.from_source(files.build(), WatermarkStrategy.no_watermarks(), "clicks").uid("clicks-files")
    t_env.create_temporary_view("lines", lines)
    table = t_env.sql_query(aggregate_sql())
    # Upsert mode: no -U rows (the fold only needs the new value per key).
    schema = Schema.new_builder().from_resolved_schema(table.get_resolved_schema()).build()
    changelog = t_env.to_changelog_stream(table, schema, ChangelogMode.upsert())
    sink = (
        FileSink.for_row_format(str(Path(args.out).resolve()), Encoder.simple_string_encoder())
        .with_bucket_assigner(BucketAssigner.base_path_bucket_assigner())
        .with_rolling_policy(RollingPolicy.on_checkpoint_rolling_policy())
        .with_output_file_config(
            OutputFileConfig.builder().with_part_prefix("changelog").with_part_suffix(".txt").build()
        )
        .build()
    )
    changelog.sink_to(sink).uid("changelog-file-sink").name("changelog files")
    return env


class Metrics:
    """JSON lines with wall-clock timestamps (`t`, seconds since the epoch) as the job progresses."""

    def __init__(self, path: str | None) -> None:
        self.handle = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def emit(self, event: str, t: float | None = None, **fields: Any) -> None:
        record = {"event": event, "t": round(t if t is not None else time.time(), 3), **fields}
        if self.handle:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()
        if event != "checkpoint":
            print(json.dumps(record), file=sys.stderr, flush=True)


def rest_get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.load(response)


class Progress:
    """Polls the mini cluster's REST API: job status, first record read, completed checkpoints."""

    def __init__(self, rest: str, job_id: str, metrics: Metrics) -> None:
        self.rest, self.job_id, self.metrics = rest, job_id, metrics
        self.reported: set[int] = set()
        self.running = self.first_record = False

    def poll(self) -> None:
        try:
            job = rest_get(f"{self.rest}/jobs/{self.job_id}")
            self._status(job)
            self._checkpoints(rest_get(f"{self.rest}/jobs/{self.job_id}/checkpoints"))
        except (OSError, ValueError, KeyError):
            pass  # not up yet, or already shut down after the job ended: the log fills gaps

    def _status(self, job: dict[str, Any]) -> None:
        if not self.running and job["state"] == "RUNNING" and all(v["status"] == "RUNNING" for v in job["vertices"]):
            self.running = True
            started = max(v["start-time"] for v in job["vertices"]) / 1000
            self.metrics.emit("job_running", t=time.time(), job_start=job["start-time"] / 1000, tasks_started=started)
        # The source task's read-records counts the records its source has read.
        if self.running and not self.first_record and job["vertices"][0]["metrics"]["read-records"] > 0:
            self.first_record = True
            self.metrics.emit("first_record")

    def _checkpoints(self, stats: dict[str, Any]) -> None:
        for c in sorted(stats.get("history", []), key=lambda c: c["id"]):
            if c["status"] == "COMPLETED" and c["id"] not in self.reported:
                self.reported.add(c["id"])
                self.metrics.emit(
                    "checkpoint",
                    t=c["latest_ack_timestamp"] / 1000,
                    id=c["id"],
                    source="rest",
                    savepoint=c.get("is_savepoint", False),
                    trigger_t=c["trigger_timestamp"] / 1000,
                    duration_ms=c["end_to_end_duration"],
                    checkpointed_size=c["checkpointed_size"],
                    state_size=c["state_size"],
                    path=c.get("external_path"),
                )


LOG_CHECKPOINT = re.compile(
    r"^(\S+ \S+) .*Completed checkpoint (\d+) for job (\w+) \((\d+) bytes, checkpointDuration=(\d+) ms"
)


def checkpoints_from_log(log_dir: Path, job_id: str, progress: Progress) -> None:
    """Report completed checkpoints the poller missed, from the JobManager's log.

    The mini cluster shuts down (REST API included) as soon as the job ends, so the
    final checkpoint of a bounded run is often only in the log; it gives id, full
    state size and duration (no incremental size).
    """
    for log in sorted(log_dir.glob("flink-*-python-*.log")):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            match = LOG_CHECKPOINT.match(line)
            if not match or match[3] != job_id or int(match[2]) in progress.reported:
                continue
            progress.reported.add(int(match[2]))
            t = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            progress.metrics.emit(
                "checkpoint", t=t, id=int(match[2]), source="log", duration_ms=int(match[5]), state_size=int(match[4])
            )


def java_error(error: BaseException) -> str:
    """The root cause of a Java exception seen through py4j (its first line says only 'calling o141.get')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if line.startswith("Caused by:")]
    return (causes[-1] if causes else lines[0] if lines else repr(error))[:500]


def stop_with_savepoint(client: Any, directory: str) -> Any:
    """`JobClient.stop_with_savepoint` of PyFlink 2.3 calls a Java method that no longer
    exists (it lacks the SavepointFormatType argument), so call the Java client directly."""
    from pyflink.common.completable_future import CompletableFuture
    from pyflink.java_gateway import get_gateway

    fmt = get_gateway().jvm.org.apache.flink.core.execution.SavepointFormatType.DEFAULT
    return CompletableFuture(client._j_job_client.stopWithSavepoint(False, directory, fmt), str)


def stop_jvm() -> None:
    """End PyFlink's JVM and wait for it, so that no process outlives the run (left
    alone it lingers a second or two until it notices our end of its stdin pipe)."""
    from pyflink.java_gateway import get_gateway

    gateway = get_gateway()
    pid = gateway.jvm.java.lang.ProcessHandle.current().pid()
    gateway.close()
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)


def check_hash() -> None:
    """`--check-hash`: compare the SQL hash run by Flink with `record_hash` on a few ids."""
    from pyflink.table import EnvironmentSettings, TableEnvironment

    ids = [f"s11-w{w}-f{f}-r{r}" for w in (0, 5) for f in (0, 1) for r in (0, 1, 49999)] + ["", "x" * 200]
    t_env = TableEnvironment.create(EnvironmentSettings.in_batch_mode())
    values = ", ".join(f"('{i}')" for i in ids)
    inner = f"SELECT event_id, {once('SHA256(event_id)')} AS h FROM (VALUES {values}) AS t(event_id)"
    rows = t_env.execute_sql(f"SELECT event_id, {hex_to_bigint_sql('h')} FROM ({inner})").collect()
    with rows:
        got = {row[0]: row[1] for row in rows}
    bad = {i: (got.get(i), record_hash(i)) for i in ids if got.get(i) != record_hash(i)}
    if bad:
        sys.exit(f"the SQL hash disagrees with record_hash (flink, python): {bad}")
    print(f"SQL hash == record_hash on {len(ids)} ids")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landing", help="folder of JSON-lines click files")
    parser.add_argument("--out", help="sink folder (changelog part files)")
    parser.add_argument("--checkpoints", help="checkpoint folder (kept across runs for --restore)")
    parser.add_argument("--checkpoint-interval-ms", type=int, default=1000)
    parser.add_argument("--backend", choices=("rocksdb", "hashmap"), default="rocksdb", help="rocksdb: incremental")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--bounded", action="store_true", help="read the files present at start, final checkpoint, end")
    mode.add_argument("--monitor-interval-ms", type=int, default=1000, help="unbounded: look for new files this often")
    parser.add_argument("--restore", help="retained checkpoint/savepoint folder to resume from, or 'latest'")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--mini-batch-ms", type=int, default=1000, help="mini-batch aggregation's bound; 0: off")
    parser.add_argument("--metrics-file", help="append progress events here as JSON lines")
    parser.add_argument("--log-dir", help="Flink log folder (default: CHECKPOINTS/_logs)")
    parser.add_argument("--check-hash", action="store_true", help="only verify the SQL hash against Python, then exit")
    args = parser.parse_args(argv)
    if not args.check_hash and not (args.landing and args.out and args.checkpoints):
        parser.error("--landing, --out and --checkpoints are required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check_hash:
        check_hash()
        return 0
    if not Path(args.landing).is_dir():
        sys.exit(f"landing folder {args.landing} does not exist: create it (files may arrive later) or fix the path")
    checkpoints = Path(args.checkpoints)
    checkpoints.mkdir(parents=True, exist_ok=True)
    restore = None
    if args.restore == "latest":
        restore = latest_checkpoint(checkpoints)
        if restore is None:
            sys.exit(
                f"--restore latest: no completed checkpoint (*/chk-*/_metadata) under {checkpoints}; "
                "run without --restore to start from scratch"
            )
    elif args.restore:
        restore = Path(args.restore)
        if not (restore / "_metadata").is_file():
            sys.exit(f"--restore {restore}: no _metadata there; pass a chk-<n> or savepoint folder, or 'latest'")
    log_dir = Path(args.log_dir or checkpoints / "_logs").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["FLINK_LOG_DIR"] = str(log_dir)  # read when PyFlink launches its JVM

    stop: list[int] = []  # signals received; the main loop acts on them (no py4j calls in a handler)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    metrics = Metrics(args.metrics_file)
    metrics.emit("process_start", t=PROCESS_START, argv=sys.argv[1:], restore=str(restore) if restore else None)
    rest_port = free_port()
    env = build_job(args, flink_config(args, rest_port, restore), metrics)
    try:
        client = env.execute_async("flink-clicks")
    except Exception as error:  # e.g. a corrupt or incompatible --restore
        metrics.emit("job_finished", status=f"FAILED: {java_error(error)}", job_id=None)
        hint = " (--restore must name a checkpoint of this job with the same options)" if restore else ""
        sys.exit(f"could not start the Flink job{hint}: {java_error(error)}")
    job_id = str(client.get_job_id())
    metrics.emit("job_submitted", job_id=job_id, rest=f"http://127.0.0.1:{rest_port}")

    try:
        return watch(client, job_id, rest_port, checkpoints, log_dir, metrics, stop)
    except Py4JError as error:  # e.g. SIGTERM sent to the whole process group killed the JVM
        metrics.emit("job_finished", status=f"FAILED: the Flink JVM is gone ({type(error).__name__})", job_id=job_id)
        return 1


def watch(
    client: Any, job_id: str, rest_port: int, checkpoints: Path, log_dir: Path, metrics: Metrics, stop: list[int]
) -> int:
    """Follow the job to its end, report progress, and turn a signal into a graceful stop."""
    progress = Progress(f"http://127.0.0.1:{rest_port}", job_id, metrics)
    result = client.get_job_execution_result()
    savepoint = cancelled = None
    while not result.done():
        progress.poll()
        if stop and savepoint is None and cancelled is None:
            metrics.emit("stopping", signal=stop[0])
            if progress.running:  # graceful: a savepoint, then the sink commits what it covers
                savepoint = stop_with_savepoint(client, (checkpoints / "savepoints").resolve().as_uri())
            else:  # tasks not running yet: nothing to save
                cancelled = client.cancel()
        elif savepoint is not None and cancelled is None and savepoint.done() and savepoint.exception() is not None:
            metrics.emit("stop_failed", error=java_error(savepoint.exception()))
            cancelled = client.cancel()  # the retained checkpoint remains for --restore
        time.sleep(0.1)
    progress.poll()
    status = "FINISHED"
    try:
        result.result()
    except Exception as error:  # the job failed or was cancelled: report, keep the checkpoints
        status = "CANCELED" if cancelled is not None else f"FAILED: {java_error(error)}"
    checkpoints_from_log(log_dir, job_id, progress)
    saved = savepoint.result() if savepoint and not cancelled and status == "FINISHED" else None
    metrics.emit("job_finished", status=status, job_id=job_id, savepoint=saved, checkpoints=len(progress.reported))
    stop_jvm()
    return 0 if status == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
