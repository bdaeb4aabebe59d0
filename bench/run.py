"""Side by side, in one run: the project against Structured Streaming and a Flink job.

Every figure is measured here, now, on the same generated files and the same
machine, with the anchors' runs interleaved with the project's, so load that
comes and goes hits all of them alike; ratios are the project's figure over
the anchor's.

Workload: JSON click events, 2 files of 50,000 records per 100k-record batch,
over 100,000 users (about 63,000 distinct users a batch); per user count,
sum and max, merged into keyed state.

* Structured Streaming (`bench/anchors/structured_streaming.py`, this env):
  `Trigger.AvailableNow`, `maxFilesPerTrigger` 2, RocksDB state, noop sink.
* Flink (`bench/anchors/flink_clicks.py`, its own virtualenv, made by
  `make bench-full` when missing): the same aggregation as a Flink SQL job with
  RocksDB state, 1 s checkpoints and an exactly-once file sink, run bounded.
* The project: `max_files: 2`, state in a Delta table merged by delta-rs.

Figures:

1. one 100k batch in a new process (median of `--repeat`);
2. a run with no new data in a new process (median of `--repeat`);
3. steady batches in one process, mean of batches 2-6 (median of `--repeat`
   such runs); Flink's figure is its steady throughput, as time per 100k;
4. the project alone: one batch against states of growing size, and how its
   time splits between Spark (read) and the delta-rs MERGE (commit).

Prints the table and writes docs/benchmarks.md's sections "Side by side" and
"State size", with plots (docs/bench_*.png).

`--delta-reads` measures, instead, the project's two readers of a Delta
source's batch against each other (`engine/delta_read.py`, `source.reader`):
the driver's (delta-rs: `load_cdf` and the net-change filter, or the files the
versions added, then `createDataFrame`) and Spark's (delta-spark on the
executors: `readChangeFeed` and the same filter as window functions, or the
table as of the versions kept to the files they added), in turn, in one
session with delta-spark loaded, over ranges of growing size of two upstreams
written by delta-rs (`read: changes`: `--versions` appends of `--rows` rows
over 200,000 users with the change feed on, after every fifth a MERGE updating
a tenth of the users; `read: appends`: the appends alone), checking that both
give the same result; in local mode and on a standalone cluster on loopback
(two one-core executors: there the driver's rows travel to the executors, and
Spark's read spreads the files over two processes); and the first Delta read
of a fresh JVM. It writes docs/benchmarks.md's "Reading a Delta source".

    .venv/bin/python bench/run.py [--repeat 3] [--state-sizes 100000,1000000,10000000] [--spread-sizes 1000000]
    .venv/bin/python bench/run.py --delta-reads [--versions 20] [--rows 100000] [--repeat 3] [--no-cluster] [--master URL]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from harness import FLINK_PYTHON, MERGE, event_at, flink_bounded, last_json, measured_by, microbatch, numbers
from harness import pyplot, save_plot, scratch, ss_anchor, timed, write_section, write_spec
from spark_jobs.demo.clickstream import write_wave

DOC = "benchmarks.md"
RECORDS_PER_FILE = 50_000
FILES_PER_BATCH = 2
BATCH_RECORDS = FILES_PER_BATCH * RECORDS_PER_FILE
USERS = 100_000
SEED = 11
WAVE = {"files": FILES_PER_BATCH, "records_per_file": RECORDS_PER_FILE, "users": USERS, "seed": SEED}


# -- data and runs ---------------------------------------------------------------------------


class Waves:
    """Generated batches, written once and hard-linked into each run's landing folder,
    so every engine reads the very same files (same bytes, same mtimes)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.written = 0

    def files(self, wave: int) -> list[Path]:
        while self.written <= wave:
            write_wave(self.folder, self.written, **WAVE)
            self.written += 1
        return sorted(self.folder.glob(f"clicks-s{SEED}-w{wave:05d}-*.json"))

    def land(self, landing: Path, waves: range) -> Path:
        landing.mkdir(parents=True, exist_ok=True)
        for wave in waves:
            for path in self.files(wave):
                os.link(path, landing / path.name)
        return landing


def project_pipeline(folder: Path, waves: Waves, landed: range) -> Path:
    """The project's pipeline in `folder` (`max_files: 2`) over the `landed` waves; its spec."""
    waves.land(folder / "landing", landed)
    return write_spec(folder, "bench_clicks", batch={"max_files": FILES_PER_BATCH})


def project_run(spec: Path, remote: str | None = None) -> tuple[float, dict[str, Any]]:
    """`microbatch run` in a new process, as an Airflow task runs it; on `remote`'s
    Spark Connect server when given."""
    took, stdout = microbatch(spec, *(["--master", remote] if remote else []))
    return took, json.loads(stdout)


def ss_run(landing: Path, checkpoint: Path, remote: str | None = None) -> tuple[float, dict[str, Any]]:
    remote_args = ["--remote", remote] if remote else []
    return ss_anchor("--landing", landing, "--checkpoint", checkpoint, "--max-files", FILES_PER_BATCH, *remote_args)


def project_steady(spec: Path, batches: int, *, read_ahead: bool = True) -> list[dict[str, Any]]:
    """`batches` batches in one new process (this script's --child-steady)."""
    args = ["--child-steady", str(spec), "--batches", str(batches), *([] if read_ahead else ["--one-by-one"])]
    return last_json(timed([sys.executable, __file__, *args], timeout=1800)[1])


def child_steady(spec_path: str, batches: int, read_ahead: bool) -> None:
    """Run `batches` batches back to back in this process, one Spark session; print their timings.

    With `read_ahead`, as `microbatch run --catch-up` runs them (`catch_up`:
    batches N+1 and N+2 are read while N commits): a batch's seconds run
    from the previous batch's outcome to its own, and `at` is when its outcome came
    (`steady_pace` turns them into the figure). Without, each batch is a
    `run_batch` call, timed from its start to its end.
    """
    from spark_jobs.core.catch_up import catch_up
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.session import default_session
    from spark_jobs.engine.spark_compute import SparkCompute

    spec = load_spec(spec_path)
    factory = partial(SparkCompute, session=default_session(short_lived=False))
    out = []
    begun = last = time.perf_counter()

    def record(outcome: Any, started: float) -> None:
        now = time.perf_counter()
        out.append({"seconds": now - started, "at": now - begun, "status": str(outcome.status)})
        out[-1].update(records=outcome.records_in, steps_ms=outcome.steps_ms)

    if read_ahead:

        def on_outcome(outcome: Any) -> None:
            nonlocal last
            record(outcome, last)
            last = time.perf_counter()

        catch_up(spec, RunOptions(run_id="bench-catch-up"), factory, max_batches=batches, on_outcome=on_outcome)
    else:
        for n in range(batches):
            started = time.perf_counter()
            record(run_batch(spec, RunOptions(run_id=f"bench-{n}"), compute_factory=factory), started)
    print(json.dumps(out))


# -- the side-by-side figures ----------------------------------------------------------------


@dataclass
class Figure:
    """One row of the side-by-side table: samples per engine."""

    name: str
    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, engine: str, value: float) -> None:
        self.samples.setdefault(engine, []).append(value)

    def value(self, engine: str) -> float | None:
        values = self.samples.get(engine)
        return statistics.median(values) if values else None

    def ratio(self, engine: str) -> float | None:
        ours, theirs = self.value("project"), self.value(engine)
        return ours / theirs if ours is not None and theirs else None


def one_batch_and_no_data(work: Path, waves: Waves, repeat: int, flink: bool) -> tuple[Figure, Figure, dict[str, Any]]:
    """Figures 1 and 2: a fresh pipeline's first 100k batch in a new process (process start to exit: JVM start,
    planning, reading, state, commit), then runs with nothing new (Flink, a continuous job, has no such run)."""
    one, none = Figure("one 100k batch, new process"), Figure("no new data, new process")
    detail: dict[str, Any] = {"ss_session_s": [], "project_steps": [], "flink_first_record_s": []}
    for r in range(repeat):
        print(f"  round {r + 1}/{repeat}", flush=True)
        base = work / f"one-{r}"
        landing = waves.land(base / "ss" / "landing", range(r, r + 1))
        took, ss = ss_run(landing, base / "ss" / "checkpoint")
        one.add("structured streaming", took)
        detail["ss_session_s"].append(ss["session_s"])
        spec = project_pipeline(base / "project", waves, range(r, r + 1))
        took, outcome = project_run(spec)
        assert outcome["status"] == "committed" and outcome["records_in"] == BATCH_RECORDS, outcome
        one.add("project", took)
        detail["project_steps"].append(outcome["steps_ms"])
        if flink:
            took, events = flink_bounded(waves.land(base / "flink" / "landing", range(r, r + 1)), base / "flink")
            one.add("flink", took)
            detail["flink_first_record_s"].append(event_at(events, "first_record") - event_at(events, "process_start"))
        took, ss = ss_run(landing, base / "ss" / "checkpoint")
        assert not ss["batches"], ss
        none.add("structured streaming", took)
        took, outcome = project_run(spec)
        assert outcome["status"] == "no_new_data", outcome
        none.add("project", took)
    return one, none, detail


def one_batch_connect(work: Path, waves: Waves, repeat: int) -> Figure:
    """Figure 1 again with the JVM kept warm: both run their batch from a new Python
    process on one Spark Connect server (local[2]) that outlives the runs."""
    from tests.spark_servers import start_connect

    figure = Figure("one 100k batch, new process, warm Spark Connect server")
    server, url = start_connect(work / "connect-server")
    try:
        # The server's first queries compile and load what every later one uses;
        # a deployment that keeps a server up pays that once, not per run.
        base = work / "connect-warm"
        ss_run(waves.land(base / "ss" / "landing", range(50, 51)), base / "ss" / "checkpoint", url)
        project_run(project_pipeline(base / "project", waves, range(50, 51)), url)
        for r in range(repeat):
            print(f"  round {r + 1}/{repeat}", flush=True)
            base = work / f"connect-{r}"
            took, _ = ss_run(waves.land(base / "ss" / "landing", range(r, r + 1)), base / "ss" / "checkpoint", url)
            figure.add("structured streaming", took)
            took, outcome = project_run(project_pipeline(base / "project", waves, range(r, r + 1)), url)
            assert outcome["status"] == "committed" and outcome["records_in"] == BATCH_RECORDS, outcome
            figure.add("project", took)
    finally:
        server.stop()
    return figure


def steady_pace(runs: list[dict[str, Any]]) -> float:
    """Seconds per batch over batches 2..N of a read-ahead run: from the start
    of batch 2's read to batch N's outcome, over N-1.

    Batch 2 is read while batch 1 commits (batch 3 with it), so its read
    starts `read_ahead_lead` seconds before batch 2 begins, which is batch
    1's outcome; counting from there puts every read and commit of batches
    2..N in the window (and part of batch 1's commit too: the figure leans
    against the project, never for it)."""
    steps = runs[1]["steps_ms"]
    lead = steps.get("read_ahead_lead", steps.get("read_ahead", steps.get("read", 0))) / 1000
    return (runs[-1]["at"] - runs[0]["at"] + lead) / (len(runs) - 1)


def steady(work: Path, waves: Waves, repeat: int, batches: int, flink: bool) -> tuple[Figure, dict[str, Any]]:
    """Figure 3: batches 2..N in one process. The project runs them as
    `microbatch run --catch-up` does (reading ahead); the same batches run
    one `run_batch` at a time are reported beside it. Flink's figure is its
    steady throughput, as seconds per 100k records (first record to the job's
    end, final checkpoint included)."""
    figure = Figure(f"steady batch in one process (mean of batches 2-{batches})")
    detail: dict[str, Any] = {"ss": [], "project": [], "one_by_one": [], "flink_records_per_s": []}
    landed = range(100, 100 + batches)
    for r in range(repeat):
        print(f"  round {r + 1}/{repeat}", flush=True)
        base = work / f"steady-{r}"
        _, ss = ss_run(waves.land(base / "ss" / "landing", landed), base / "ss" / "checkpoint")
        times = [b["duration_ms"]["triggerExecution"] / 1000 for b in ss["batches"]]
        assert len(times) == batches, ss
        figure.add("structured streaming", statistics.mean(times[1:]))
        detail["ss"].append(times)
        runs = project_steady(project_pipeline(base / "project", waves, landed), batches)
        assert all(run["status"] == "committed" for run in runs) and len(runs) == batches, runs
        figure.add("project", steady_pace(runs))
        detail["project"].append(runs)
        runs = project_steady(project_pipeline(base / "one-by-one", waves, landed), batches, read_ahead=False)
        assert all(run["status"] == "committed" for run in runs), runs
        detail["one_by_one"].append(statistics.mean(run["seconds"] for run in runs[1:]))
        if flink:
            _, events = flink_bounded(waves.land(base / "flink" / "landing", landed), base / "flink")
            took = event_at(events, "job_finished") - event_at(events, "first_record")
            detail["flink_records_per_s"].append(batches * BATCH_RECORDS / took)
            figure.add("flink", took / batches)
    return figure, detail


# -- state size ------------------------------------------------------------------------------


def state_size_curve(work: Path, sizes: str, spread_sizes: str) -> list[dict[str, Any]]:
    """Batches against a state of each size (`1000,20000`), in one process (Spark warm)."""
    args = ["--child-state", str(work / "state"), "--sizes", sizes, "--spread", spread_sizes]
    return last_json(timed([sys.executable, __file__, *args], timeout=7200)[1])


def child_state(folder: str, sizes: list[int], spread_sizes: list[int]) -> None:
    """For each size and layout: seed a state of that many keys, then run 3 batches
    on it and keep the median; 6 batches on a small state first warm the JVM up."""
    from spark_jobs.core.protocol import RunOptions, run_batch
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.session import default_session
    from spark_jobs.engine.spark_compute import SparkCompute

    factory = partial(SparkCompute, session=default_session(short_lived=False))
    waves = Waves(Path(folder) / "waves")
    out = []
    for size, layout in [
        (USERS, "warm-up"),
        *((n, "clustered") for n in sizes),
        *((n, "spread") for n in spread_sizes),
    ]:
        batches = 6 if layout == "warm-up" else 3
        spec = load_spec(project_pipeline(Path(folder) / f"state-{size}-{layout}", waves, range(200, 200 + batches)))
        started = time.perf_counter()
        _seed_state(spec.state_path, size, spread=layout == "spread")
        seeded = time.perf_counter() - started
        runs = []
        for n in range(batches):
            outcome = run_batch(spec, RunOptions(run_id=f"bench-{n}"), compute_factory=factory)
            assert outcome.status == "committed" and outcome.records_in == BATCH_RECORDS, outcome
            runs.append({"seconds": outcome.duration_ms / 1000, "steps_ms": outcome.steps_ms})
        median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        state_bytes = sum(p.stat().st_size for p in Path(spec.state_path).rglob("*.parquet"))
        all_s = [r["seconds"] for r in runs]
        print(f"  {layout} state of {size:,} keys: batches {all_s} {median['steps_ms']}", file=sys.stderr, flush=True)
        if layout != "warm-up":
            out.append({"keys": size, "layout": layout, **median, "all_s": all_s, "seed_s": seeded})
            out[-1]["state_bytes"] = state_bytes
        shutil.rmtree(Path(folder) / f"state-{size}-{layout}")
    print(json.dumps(out))


def _seed_state(path: str, size: int, *, spread: bool) -> None:
    """A state of `size` keys, as if many batches had run, written in files of a
    million rows. The batch's 100k users are among them; the other keys are
    older ones. `spread=False`: the users' keys sort after the old ones, so a
    batch's MERGE touches only the file holding them (the key range it prunes
    to). `spread=True`: every file holds some users, so every batch rewrites
    the whole state (keys hashed over the files: the worst case for a
    copy-on-write MERGE)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import write_deltalake

    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.fencing import STATE_FENCE, Position, commit_properties

    properties = commit_properties(STATE_FENCE, Position(0, 0), {METADATA_KEY: '{"txn": 0}'})
    stride = max(1, size // USERS) if spread else 1
    step = 1_000_000
    for start in range(0, size, step):
        keys = pa.array(range(start, min(size, start + step)), pa.int64())
        user = pc.divide(keys, stride)
        is_user = pc.and_(pc.equal(pc.subtract(keys, pc.multiply(user, stride)), 0), pc.less(user, USERS))
        users = pc.binary_join_element_wise("user", pc.utf8_lpad(pc.cast(user, pa.string()), 6, "0"), "")
        old = pc.binary_join_element_wise("old", pc.utf8_lpad(pc.cast(keys, pa.string()), 10, "0"), "")
        ids = pc.if_else(is_user, users, old)
        n = len(ids)
        columns = [ids, pa.array([1] * n, pa.int64()), pa.array([1.0] * n), pa.nulls(n, pa.timestamp("us", tz="UTC"))]
        piece = pa.table([*columns, pa.array([0] * n, pa.int64())], names=["user_id", *MERGE, "_batch_id"])
        write_deltalake(path, piece, mode="append", commit_properties=properties if start + step >= size else None)


# -- reading a Delta source (--delta-reads) --------------------------------------------------

DELTA_USERS = 200_000
DELTA_TRANSFORMS = {
    "changes": """
SELECT user_id,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN events ELSE -events END) AS events,
       sum(CASE WHEN _change_type IN ('insert', 'update_postimage') THEN amount ELSE -amount END) AS amount
FROM batch GROUP BY user_id
""",
    "appends": "SELECT user_id, sum(events) AS events, sum(amount) AS amount FROM batch GROUP BY user_id",
}


def build_upstream(uri: str, versions: int, rows: int, *, updates: bool) -> None:
    import numpy as np
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    schema = pa.schema([("user_id", pa.string()), ("events", pa.int64()), ("amount", pa.float64())])
    DeltaTable.create(uri, schema, configuration={"delta.enableChangeDataFeed": "true"} if updates else None)
    rng = np.random.default_rng(7)
    for v in range(versions):
        users = [f"u{u}" for u in rng.integers(0, DELTA_USERS, rows)]
        data = {"user_id": users, "events": rng.integers(1, 5, rows), "amount": rng.random(rows)}
        write_deltalake(uri, pa.table(data, schema=schema), mode="append")
        if updates and v % 5 == 4:  # an update of a tenth of the users: change data files with pre and post images
            picked = pa.table({"user_id": [f"u{u}" for u in range(v, DELTA_USERS, 10)]})
            merge = DeltaTable(uri).merge(picked, "t.user_id = s.user_id", source_alias="s", target_alias="t")
            merge.when_matched_update({"events": "t.events + 1"}).execute()


def read_delta(spark: Any, uri: str, read: str, last: int, reader: str) -> tuple[Any, int | None]:
    """Versions 1..`last` of `uri` through `reader` (driver or spark), then the per-user sum: the result
    (Arrow), and the rows the driver's reader read."""
    from spark_jobs.engine.delta_read import read_versions, spark_versions
    from spark_jobs.sources.delta import DeltaManifest

    manifest, rows = DeltaManifest(uri, read, 1, last, ()), None
    if reader == "driver":
        rows = read_versions(manifest)
        spark.createDataFrame(rows).createOrReplaceTempView("batch")
    else:
        spark_versions(spark, manifest).createOrReplaceTempView("batch")
    return spark.sql(DELTA_TRANSFORMS[read]).toArrow(), rows.num_rows if rows is not None else None


def first_read_s(uri: str) -> float:
    """The first Delta read of a fresh long-lived session, in its own process."""
    code = (
        "import time; from spark_jobs.engine.session import default_session; "
        "s = default_session('local[*]', short_lived=False, delta=True); t = time.perf_counter(); "
        "s.read.format('delta').option('readChangeFeed', 'true').option('startingVersion', 1)"
        f".option('endingVersion', 1).load({uri!r}).count(); print(time.perf_counter() - t)"
    )
    return float(timed([sys.executable, "-c", code])[1].strip().splitlines()[-1])


def time_reads(master: str, uris: dict[str, str], spans: list[int], repeat: int) -> tuple[dict, dict]:
    """Both readers over each span of each upstream, alternately, in one session on `master`:
    {(read, span): {reader: seconds}}, {(read, span): rows read}."""
    from spark_jobs.engine.session import default_session

    figures: dict[tuple[str, int], dict[str, list[float]]] = {}
    rows_in: dict[tuple[str, int], int] = {}
    spark = default_session(master, app_name="delta-read-ways", short_lived=False, delta=True)
    try:
        for read, uri in uris.items():
            read_delta(spark, uri, read, 1, "spark")  # warm both paths once
            read_delta(spark, uri, read, 1, "driver")
            for span in spans:
                last = span + (span // 5 if read == "changes" else 0)  # the updates come in between the appends
                times = figures[read, span] = {"driver": [], "spark": []}
                for _ in range(repeat):
                    for reader in ("driver", "spark"):
                        started = time.perf_counter()
                        result, n = read_delta(spark, uri, read, last, reader)
                        times[reader].append(time.perf_counter() - started)
                        got = sorted((r["user_id"], r["events"], round(r["amount"], 6)) for r in result.to_pylist())
                        if n is not None:
                            rows_in[read, span], expected = n, got
                        assert got == expected, f"the readers differ over {read} 1..{last} ({master})"
                print(master, read, span, {k: [f"{x:.2f}" for x in v] for k, v in times.items()}, flush=True)
    finally:
        spark.stop()
    return figures, rows_in


def delta_reads(args: argparse.Namespace) -> None:
    with scratch("delta-read") as work:
        uris = {read: str(work / f"upstream-{read}") for read in ("changes", "appends")}
        for read, uri in uris.items():
            build_upstream(uri, args.versions, args.rows, updates=read == "changes")
        cold = first_read_s(uris["changes"])
        print(f"first Delta read of a fresh session: {cold:.1f} s", flush=True)
        spans = sorted({1, max(1, args.versions // 4), args.versions})
        engines, cluster = {}, None
        try:
            if not args.no_cluster:
                from tests.spark_servers import start_cluster

                cluster, engines["cluster"] = start_cluster(work / "cluster", cores=2)
                # Two one-core executors on the worker. Given at the driver JVM's
                # launch, which the local session after it reuses (it ignores the setting).
                os.environ["PYSPARK_SUBMIT_ARGS"] = "--conf spark.executor.cores=1 pyspark-shell"
            engines["local"] = "local[*]"
            if args.master:
                engines["given"] = args.master
            measured = {engine: time_reads(master, uris, spans, args.repeat) for engine, master in engines.items()}
        finally:
            if cluster is not None:
                cluster.stop()
    write_reads_doc(args, measured, spans, cold)


def write_reads_doc(
    args: argparse.Namespace, measured: dict[str, tuple[dict, dict]], spans: list[int], cold: float
) -> None:
    where = {"local": "local mode", "cluster": "standalone cluster, 2 executors of 1 core", "given": args.master}
    lines = [
        "## Reading a Delta source",
        "",
        f"{measured_by('`bench/run.py --delta-reads`')}. Two upstreams written by delta-rs: for "
        f"`read: changes`, {args.versions} appends of {args.rows:,} rows over {DELTA_USERS:,} users with the change feed "
        "on, and after every fifth a MERGE updating a tenth of the users; for `read: appends`, the same appends "
        "alone. Per engine, one long-lived session that loads delta-spark (`default_session(delta=True)`), the two "
        f"readers of `engine/delta_read.py` in turn, each followed by a per-user sum, medians of {args.repeat}; both "
        "gave the same result (checked). The cluster runs on loopback on the same two cores "
        "(`tests/spark_servers.py`).",
        "",
        "| engine | read | appends in the range | rows read | driver (`reader: driver`) | Spark (`reader: spark`) | Spark / driver |",
        "|---|---|---|---|---|---|---|",
    ]
    ratio: dict[tuple[str, str, int], float] = {}
    for engine in sorted(measured, key=list(where).index):
        figures, rows_in = measured[engine]
        for (read, span), times in sorted(figures.items(), key=lambda item: (item[0][0] != "changes", item[0][1])):
            d, s = statistics.median(times["driver"]), statistics.median(times["spark"])
            ratio[engine, read, span] = s / d
            lines.append(
                f"| {where[engine]} | {read} | {span} | {rows_in[read, span]:,} | {d:.2f} s | {s:.2f} s | {s / d:.2f} |"
            )
    at_small = [r for key, r in ratio.items() if key[2] == spans[0]]
    at_large = [r for key, r in ratio.items() if key[2] == spans[-1]]
    lines += [
        "",
        f"The first Delta read of a fresh JVM took {cold:.1f} s (Delta reconstructs the table's snapshot with a Spark "
        "job of generated code); the driver's reader needs no JVM warm-up of its own.",
        "",
        f"Which is used when. The driver's reader is the default: at one append's rows Spark's reader took "
        f"{min(at_small):.2f} to {max(at_small):.2f} times as long, and a session that loads delta-spark makes every "
        "one-batch start and catch-up batch slower (\"Figures behind the code's choices\"), plus the first read's "
        "snapshot job above. Chained pipelines make such batches: an upstream's few commits, bounded by "
        f"`batch.max_versions` (and the driver's memory with them). At {args.versions} appends' rows Spark's reader "
        f"took {min(at_large):.2f} to {max(at_large):.2f} times as long, at its best on the cluster, where it spreads "
        "the files over the executors and no row passes through the driver: set `source.reader: spark` for a "
        "pipeline whose batches are millions of rows on a cluster, or whose upstream uses column mapping. "
        "`--master spark://...` adds a real cluster to this comparison.",
        "",
    ]
    write_section(DOC, lines)


# -- report ----------------------------------------------------------------------------------


TARGETS = {"one 100k batch, new process": 0.4, "no new data, new process": 0.1, "steady": 0.5}


def side_by_side_table(figures: list[Figure]) -> list[str]:
    engines = ["structured streaming", "flink"]
    lines = [
        "| figure | Structured Streaming | Flink | project | project / SS | project / Flink | target (project / SS) |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        cells = [f.name, *(f"{v:.2f} s" if (v := f.value(e)) is not None else "-" for e in [*engines, "project"])]
        for engine in engines:
            # Three decimals: a ratio a hair above its target must not print as on it.
            r = f.ratio(engine)
            cells.append("-" if r is None else f"**{r:.3f}**" if engine == "structured streaming" else f"{r:.3f}")
        target = TARGETS.get(f.name, TARGETS["steady"] if f.name.startswith("steady") else None)
        reached = f.ratio("structured streaming")
        met = "met" if target and reached is not None and reached <= target else "not met"
        cells.append(f"<= {target} ({met})" if target else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def samples_line(f: Figure) -> str:
    return f"{f.name}: " + "; ".join(f"{e} " + ", ".join(f"{v:.2f}" for v in vs) for e, vs in f.samples.items()) + " s"


def seconds(values: list[float], digits: int = 2) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def plot_side_by_side(figures: list[Figure]) -> None:
    plt = pyplot()
    engines = [("structured streaming", "#9aa5b1"), ("flink", "#c9a26b"), ("project", "#2f6f9f")]
    fig, axes = plt.subplots(1, len(figures), figsize=(4.2 * len(figures), 3.6))
    for ax, f in zip(axes, figures):
        names = [e for e, _ in engines if f.value(e) is not None]
        bars = ax.bar(range(len(names)), [f.value(e) for e in names], color=[c for e, c in engines if e in names])
        for bar, name in zip(bars, names):
            for v in f.samples[name]:
                ax.plot(bar.get_x() + bar.get_width() / 2, v, "k.", markersize=4)
        ax.set_xticks(range(len(names)), [n.replace("structured streaming", "SS") for n in names])
        ax.set_title(f.name.replace(" (mean", "\n(mean").replace(", warm", ",\nwarm"), fontsize=9)
        ax.set_ylabel("seconds")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    fig.suptitle("One run, same files, same machine (bars: medians; dots: each run)", fontsize=10)
    save_plot(fig, "bench_side_by_side.png")


def plot_state(curve: list[dict[str, Any]]) -> None:
    fig, ax = pyplot().subplots(figsize=(6.8, 4.0))
    for layout, marker in (("clustered", "o"), ("spread", "s")):
        rows = [c for c in curve if c["layout"] == layout]
        keys = [c["keys"] for c in rows]
        if not rows:
            continue
        ax.plot(keys, [c["seconds"] for c in rows], marker + "-", color="black", label=f"whole batch, {layout}")
        read, commit = ([c["steps_ms"].get(step, 0) / 1000 for c in rows] for step in ("read", "commit"))
        ax.plot(keys, read, marker + ":", color="#2f6f9f", label=f"read (Spark), {layout}")
        ax.plot(keys, commit, marker + "--", color="#c9a26b", label=f"commit (delta-rs MERGE), {layout}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("keys in the state")
    ax.set_ylabel("seconds")
    ax.set_title("One 100k-record batch against states of growing size", fontsize=10)
    ax.legend(fontsize=7)
    save_plot(fig, "bench_state_size.png")


def write_docs(
    figures: list[Figure], detail_one: dict, detail_steady: dict, flink_missing: str | None, minutes: float
) -> None:
    plot_side_by_side(figures)
    one, _, steady_figure, connect = figures
    steps = detail_one["project_steps"]
    median_step = {k: statistics.median(s.get(k, 0) for s in steps) / 1000 for k in steps[0]}
    lines = [
        "## Side by side",
        "",
        f"{measured_by('`make bench-full` (`bench/run.py`)', minutes)}.",
        "Each figure's anchor runs were interleaved with the project's, on the same files (hard links of one set of "
        "generated files). Workload: JSON click events, 2 files of 50,000 records per 100k-record batch, over 100,000 "
        "users; per user count, sum and max merged into keyed state.",
        "",
        "* **Structured Streaming** (`bench/anchors/structured_streaming.py`): `Trigger.AvailableNow`, "
        "`maxFilesPerTrigger` 2, RocksDB state store, 8 shuffle partitions, noop sink (its state stays in the state store: "
        "it writes less than the project, which writes a queryable Delta table), Spark's default JVM flags.",
        "* **Flink** (`bench/anchors/flink_clicks.py`, PyFlink 2.3 in its own virtualenv): the same aggregation as Flink SQL, "
        "RocksDB state with incremental checkpoints every second, exactly-once file sink, bounded run, parallelism 2."
        + (f" Not run this time: {flink_missing}." if flink_missing else ""),
        "* **The project**: `microbatch run` (a new process, as an Airflow task) with `max_files: 2`; the steady figure runs "
        "the batches in one process with one Spark session, as `microbatch run --catch-up` does: batches N+1 and N+2 are "
        "read, at once, while N commits. Its figure is the time from the start of batch 2's read to batch N's commit, "
        "over N-1 batches (which counts part of batch 1's commit as well).",
        "",
        *side_by_side_table(figures),
        "",
        "Ratios are the project's median over the anchor's (lower is better for the project).",
        "",
        *[f"* {samples_line(f)}" for f in figures],
        "* Where a new-process batch of the project goes (medians): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in median_step.items())
        + "; the rest is Python's start and imports, and the process's exit.",
        f"* The project on a warm Spark Connect server against Structured Streaming in its own JVM (the first row's anchor): "
        f"{connect.value('project') / one.value('structured streaming'):.2f}; on a warm server a new-process batch is "
        "Python's start, the plan, the server's work and the commit.",
        f"* Structured Streaming's session start in those runs: {seconds(detail_one['ss_session_s'], 1)} s.",
    ]
    if detail_one["flink_first_record_s"]:
        lines.append(
            f"* Flink, process start to the first record read: {seconds(detail_one['flink_first_record_s'], 1)} s."
        )
    if detail_steady["flink_records_per_s"]:
        rates = ", ".join(f"{v:,.0f}" for v in detail_steady["flink_records_per_s"])
        lines.append(f"* Flink's steady throughput: {rates} records/s.")
    for runs in detail_steady["project"][:1]:
        lines.append(
            "* One steady run of the project, time from each batch's outcome to the next (the first: from the start): "
            + "; ".join(
                f"{r['seconds']:.2f} s (read ahead {r['steps_ms'].get('read_ahead', 0) / 1000:.2f}, "
                f"commit {r['steps_ms'].get('commit', 0) / 1000:.2f})"
                for r in runs
            )
        )
    if detail_steady["one_by_one"]:
        ss_steady = steady_figure.value("structured streaming")
        one_by_one = statistics.median(detail_steady["one_by_one"])
        lines.append(
            f"* The same batches, one `run_batch` call each, nothing read ahead (as one Airflow task a batch on a warm "
            f"engine would run them): {seconds(detail_steady['one_by_one'])} s a batch, "
            f"median {one_by_one:.2f} s"
            + (f", {one_by_one / ss_steady:.2f} of Structured Streaming." if ss_steady else ".")
        )
    for times in detail_steady["ss"][:1]:
        lines.append(
            f"* One steady run of Structured Streaming, batch by batch (`triggerExecution`): {seconds(times)} s"
        )
    lines += ["", "![side by side](bench_side_by_side.png)", ""]
    write_section(DOC, lines)


def write_state_doc(curve: list[dict[str, Any]]) -> None:
    """The "State size" section of docs/benchmarks.md, and its plot."""
    plot_state(curve)
    lines = [
        "## State size",
        "",
        f"{measured_by('`make bench-full` (`bench/run.py`)')}. A 100k-record batch (about 63,000 keys) merged into a state of N keys, "
        "in one process with Spark warm (6 batches on a small state first); each row is the median of 3 batches on its "
        "state. The state is seeded in files of a million rows, two ways: **clustered**, the batch's users' keys sort "
        "apart from the old ones, so the MERGE (unstreamed, so delta-rs prunes files by the batch's key range) rewrites one file; "
        "**spread**, every file holds some of the batch's keys, so every batch rewrites the whole state: the worst case "
        "of a copy-on-write MERGE. `read` is Spark (read, parse, aggregate, result to Arrow), `commit` the delta-rs "
        "MERGE and the ledger's commit.",
        "",
        "| keys in state | layout | state on disk | batch | read (Spark) | commit (MERGE) | commit's share | batch / batch at 100k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = next((c["seconds"] for c in curve if c["keys"] == USERS), curve[0]["seconds"])
    for c in curve:
        read, commit = c["steps_ms"].get("read", 0) / 1000, c["steps_ms"].get("commit", 0) / 1000
        lines.append(
            f"| {c['keys']:,} | {c['layout']} | {c['state_bytes'] / 1e6:,.0f} MB | {c['seconds']:.2f} s | {read:.2f} s | "
            f"{commit:.2f} s | {commit / c['seconds']:.0%} | {c['seconds'] / base:.2f} |"
        )
    each = "; ".join(f"{c['keys']:,} {c['layout']} {seconds(c['all_s'])}" for c in curve)
    lines += ["", f"Each case's three batches: {each} s.", "", "![state size](bench_state_size.png)", ""]
    write_section(DOC, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steady-batches", type=int, default=6)
    parser.add_argument(
        "--state-sizes", default="100000,1000000,10000000,100000000", help="the batch's keys in one file"
    )
    parser.add_argument(
        "--spread-sizes", default="1000000,10000000", help="state sizes, the batch's keys in every file"
    )
    parser.add_argument("--delta-reads", action="store_true", help="only the two readers of a Delta source's batch")
    parser.add_argument("--versions", type=int, default=20, help="--delta-reads: the upstreams' appends")
    parser.add_argument("--rows", type=int, default=100_000, help="--delta-reads: rows an append")
    parser.add_argument("--no-cluster", action="store_true", help="--delta-reads: no loopback cluster")
    parser.add_argument("--master", help="--delta-reads: also on this cluster (spark://host:port)")
    parser.add_argument("--child-steady", help=argparse.SUPPRESS)
    parser.add_argument("--one-by-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-state", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--spread", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_steady:
        return child_steady(args.child_steady, args.batches, read_ahead=not args.one_by_one)
    if args.child_state:
        return child_state(args.child_state, numbers(args.sizes), numbers(args.spread))
    if args.delta_reads:
        return delta_reads(args)
    missing = (
        None
        if FLINK_PYTHON.exists()
        else f"no Flink virtualenv at {FLINK_PYTHON.parents[1]} (`make bench-full` makes it)"
    )
    if missing:
        print(f"Flink anchor: {missing}", flush=True)
    started = time.time()
    with scratch("bench") as work:
        waves = Waves(work / "waves")
        print("one batch, then nothing new, each in a new process (SS, project, Flink interleaved)...", flush=True)
        one, none, detail_one = one_batch_and_no_data(work, waves, args.repeat, flink=missing is None)
        print("one batch in a new process, both on a warm Spark Connect server...", flush=True)
        connect = one_batch_connect(work, waves, args.repeat)
        print("steady batches in one process...", flush=True)
        steady_figure, detail_steady = steady(work, waves, args.repeat, args.steady_batches, flink=missing is None)
        print("state size (project alone)...", flush=True)
        curve = state_size_curve(work, args.state_sizes, args.spread_sizes)
    write_docs([one, none, steady_figure, connect], detail_one, detail_steady, missing, (time.time() - started) / 60)
    write_state_doc(curve)


if __name__ == "__main__":
    main()
