"""State at scale beside Structured Streaming (issue 35): one steady batch as the state grows, users coming back.

For each state size N, in one run, on the same files:

* the state is seeded with N users, one row each: the project's Delta state
  written directly (as a fold leaves it: one row per key, in files of a
  million rows, keys spread over every file); Structured Streaming's RocksDB
  state by a first `AvailableNow` run over the same N users as Parquet
  (`bench/anchors/structured_streaming.py --seed`);
* then `--batches` files of 100,000 clicks each land, users drawn uniformly
  from all N (users coming back), and each engine takes one file a batch:
  Structured Streaming in one `AvailableNow` run (`maxFilesPerTrigger` 1,
  each batch's `durationMs`), the project in one `run --catch-up` process
  (`max_files: 1`), once with `state.layout: merged` copy-on-write
  (`deletion_vectors: false`: a MERGE a batch), once with the default
  settings (`deletion_vectors: auto`: copy-on-write while the state's files
  weigh under 64 MB, merged on read above: the touched files' rows
  marked deleted, one new file a batch) and once with `layout: appended`
  (an append a batch; a batch never folds);
* the appended state's fold and reads are timed on what the batches left:
  one fold as `maintain` makes it, by Spark's executors (off the batches'
  path since issue 47, so the figure is maintenance's cost), and the state
  read in full through `microbatch query`'s SQL, against the merged table's
  plain read.

Steady batch = the mean over batches 3..B (the first two of a process
warm its JVM up); for the project, a batch's seconds run from the previous
batch's outcome to its own (it reads ahead while the previous commits). The appended layout's "amortized" figure adds the fold spread over
the batches between two folds (`fold_at` x max(N, 100,000) / 100,000).
Results: docs/benchmarks.md, "State at scale: users coming back", with a plot.

    .venv/bin/python bench/state_vs_ss.py [--sizes 1000000,10000000,20000000,100000000] [--batches 8] [--no-reads]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import MERGE, measured_by, numbers, pyplot, save_plot, scratch, ss_anchor, write_section, write_spec
from run import project_steady

PLOT = "bench_state_at_scale.png"
BATCH_RECORDS = 100_000
FILE_ROWS = 1_000_000
FOLD_AT = 0.1
LABELS = (("SS", "ss"), ("copy-on-write", "merged"), ("default", "vectors"), ("appended", "appended"))
#: The project's variants: each a folder name and its `state` settings.
VARIANTS = {
    "merged": {"layout": "merged", "deletion_vectors": False},  # copy-on-write, whatever the state's size
    "vectors": {"layout": "merged"},  # the default: `deletion_vectors: auto`
    "appended": {"layout": "appended"},
}


def users(keys: Any) -> Any:
    """User ids (`u000000042`) of key numbers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.binary_join_element_wise("u", pc.utf8_lpad(pc.cast(pa.array(keys, pa.int64()), pa.string()), 9, "0"), "")


def seed_parquet(folder: Path, size: int) -> None:
    """The N users as clicks (one each), for Structured Streaming's seed run."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for start in range(0, size, 5 * FILE_ROWS):
        ids = users(np.arange(start, min(size, start + 5 * FILE_ROWS)))
        columns = [ids, ids, pa.array(np.ones(len(ids))), pa.nulls(len(ids), pa.timestamp("us", tz="UTC"))]
        pq.write_table(
            pa.table(columns, names=["event_id", "user_id", "amount", "ts"]), folder / f"seed-{start:012d}.parquet"
        )


def seed_state(path: str, size: int, *, change_feed: bool = False) -> None:
    """The project's state of N users as a fold leaves it, in one commit
    carrying the fence at the origin and the fold's marker (so the appended
    layout counts its rows as folded); `change_feed`: with its change data
    feed on and no fold's marker, as a chain's (merged) upstream has it."""
    import numpy as np
    import pyarrow as pa
    from deltalake import CommitProperties, Transaction, write_deltalake

    from spark_jobs.core.commits import METADATA_KEY
    from spark_jobs.core.fencing import STATE_FENCE, Position
    from spark_jobs.core.folding import FOLD_KEY

    order = np.random.default_rng(size).permutation(size)
    types = [pa.string(), pa.int64(), pa.float64(), pa.timestamp("us", tz="UTC"), pa.int64()]
    schema = pa.schema(list(zip(["user_id", *MERGE, "_batch_id"], types)))

    def pieces():
        for start in range(0, size, FILE_ROWS):
            keys = order[start : start + FILE_ROWS]
            n = len(keys)
            ones, zeros, no_time = np.ones(n, np.int64), np.zeros(n, np.int64), pa.nulls(n, types[3])
            yield pa.record_batch(
                [users(keys), pa.array(ones), pa.array(np.ones(n)), no_time, pa.array(zeros)], schema=schema
            )

    origin = Position(0, 0).encode()
    metadata = {METADATA_KEY: json.dumps({"txn": origin})}
    if not change_feed:  # (a chain's upstream is merged: a fold's marker would make it an appended state to its reader)
        metadata[FOLD_KEY] = json.dumps({"seed": size})
    props = CommitProperties(custom_metadata=metadata, app_transactions=[Transaction(STATE_FENCE, origin)])
    data = pa.RecordBatchReader.from_batches(schema, pieces())
    configuration = {"delta.enableChangeDataFeed": "true"} if change_feed else None
    write_deltalake(path, data, mode="append", commit_properties=props, target_file_size=64 * 1024 * 1024, configuration=configuration)


def click_files(folder: Path, size: int, count: int) -> list[Path]:
    """`count` JSON files of 100,000 clicks, users drawn uniformly from all `size`."""
    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(size + 7)
    out = []
    for f in range(count):
        drawn = rng.integers(0, size, BATCH_RECORDS)
        seconds = rng.integers(0, 86_400, BATCH_RECORDS)
        lines = (
            f'{{"event_id":"e{f}-{i}","user_id":"u{u:09d}","amount":1.5,"ts":"2026-11-26T{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}Z"}}'
            for i, (u, s) in enumerate(zip(drawn.tolist(), seconds.tolist()))
        )
        out.append(folder / f"clicks-{f:04d}.json")
        out[-1].write_text("\n".join(lines) + "\n")
    return out


def seeded_project(base: Path, layout: str, clicks: list[Path]) -> Path:
    """The project in `base`/`layout` (a `VARIANTS` name) on its own copy of
    the seeded state (`base/seed-state`), the clicks landed (hard links);
    its spec's path."""
    folder = base / layout
    state = {"path": "state", "keys": ["user_id"], "merge": MERGE, "fold_at": FOLD_AT, **VARIANTS[layout]}
    spec_path = write_spec(folder, f"scale_{layout}", state=state, batch={"max_files": 1})
    shutil.copytree(base / "seed-state", folder / "state")
    for path in clicks:
        os.link(path, folder / "landing" / path.name)
    return spec_path


def read_s(spec_path: Path) -> float:
    """Seconds to read the whole state as of its last batch through delta-rs (`microbatch query`'s SQL)."""
    from spark_jobs.core.folding import read_state
    from spark_jobs.core.spec import load_spec

    started = time.perf_counter()
    assert sum(batch.num_rows for batch in read_state(load_spec(spec_path))) > 0
    return time.perf_counter() - started


def fold_s(spec_path: Path) -> float:
    """One fold as `maintain` makes it (issue 47: never inside a batch): by
    Spark's executors, the job's process committing; the session is
    started before the clock does."""
    from deltalake import DeltaTable

    from spark_jobs.core.folding import fold
    from spark_jobs.core.spec import load_spec
    from spark_jobs.engine.spark_compute import SparkCompute

    spec = load_spec(spec_path)
    compute = SparkCompute()
    try:
        started = time.perf_counter()
        assert fold(spec, DeltaTable(spec.state_path), files=compute) is not None
        return time.perf_counter() - started
    finally:
        compute.close()


def measure(
    work: Path, size: int, batches: int, *, fold_and_reads: bool = True, reads: bool = True, variants: tuple[str, ...] = tuple(VARIANTS)
) -> dict[str, Any]:
    """One state size; `fold_and_reads`: also time the appended state's
    fold and, with `reads`, both states' full reads (`make bench` leaves
    them out; a full read of 100M keys holds them all in this process,
    about 23 GB); `variants`: which of the project's (`VARIANTS`)."""
    base = work / f"n{size}"
    clicks = click_files(base / "clicks", size, batches)
    started = time.perf_counter()
    seed_state(str(base / "seed-state"), size)
    figures: dict[str, Any] = {"keys": size, "seed_state_s": time.perf_counter() - started}
    figures["state_mb"] = sum(p.stat().st_size for p in (base / "seed-state").rglob("*.parquet")) / 1e6

    # Structured Streaming: a seed run, then the clicks.
    seed_parquet(base / "ss-seed", size)
    (base / "ss-landing").mkdir()
    anchor = ("--landing", base / "ss-landing", "--seed", base / "ss-seed", "--checkpoint", base / "ss-checkpoint")
    _, seeded = ss_anchor(*anchor, "--max-files", 1, timeout=7200)
    figures["ss_seed_s"] = seeded["query_s"]
    assert sum(b["rows"] for b in seeded["batches"]) == size, seeded["batches"]
    for path in clicks:
        os.link(path, base / "ss-landing" / path.name)
    _, run = ss_anchor(*anchor, "--max-files", 1, timeout=7200)
    assert [b["rows"] for b in run["batches"]] == [BATCH_RECORDS] * batches, run["batches"]
    figures["ss_s"] = [b["duration_ms"]["triggerExecution"] / 1000 for b in run["batches"]]
    shutil.rmtree(base / "ss-checkpoint")
    shutil.rmtree(base / "ss-seed")
    print(
        f"  {size:,} keys: structured streaming seeded in {figures['ss_seed_s']:.1f} s, batches {figures['ss_s']}",
        file=sys.stderr,
    )

    for layout in variants:
        spec_path = seeded_project(base, layout, clicks)
        runs = project_steady(spec_path, batches)
        assert [r["records"] for r in runs] == [BATCH_RECORDS] * batches, runs
        figures[f"{layout}_s"] = [r["seconds"] for r in runs]
        figures[f"{layout}_folds"] = sum(1 for r in runs if r["steps_ms"] and r["steps_ms"].get("fold", 0) > 50)
        if fold_and_reads and reads:
            figures[f"{layout}_read_s"] = read_s(spec_path)
        if fold_and_reads and layout == "appended":
            figures["fold_s"] = fold_s(spec_path)
            if reads:
                figures["appended_read_folded_s"] = read_s(spec_path)
        print(
            f"  {size:,} keys, {layout}: batches {figures[f'{layout}_s']}, pace {pace(figures[f'{layout}_s']):.2f} s",
            file=sys.stderr,
        )
        shutil.rmtree(spec_path.parent)
    print(json.dumps(figures), flush=True)
    shutil.rmtree(base)
    return figures


def pace(seconds: list[float]) -> float:
    """The steady batch: the mean of batches 3 on (the first two of a
    process warm its JVM up, for both engines). The mean, not the median:
    reading ahead, the project's batches alternate short and long (a batch
    read while the previous one committed ends soon after it), so only the
    mean is its pace."""
    return statistics.mean(seconds[2:])


def fold_every(size: int) -> float:
    """Batches of 100,000 new rows between two folds."""
    return max(1.0, FOLD_AT * max(size, 100_000) / BATCH_RECORDS)


def amortized(r: dict[str, Any]) -> float:
    """The appended steady batch with the fold spread over the batches between two folds (a run whose batches
    already folded has the fold in its pace)."""
    return pace(r["appended_s"]) + (0 if r["appended_folds"] else r["fold_s"] / fold_every(r["keys"]))


def write_doc(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    def read(value: float | None) -> str:
        return "not measured" if value is None else f"{value:.2f} s"

    own = pace(rows[0]["appended_s"])
    lines = [
        "## State at scale: users coming back",
        "",
        f"{measured_by('`bench/state_vs_ss.py`')}, one run. Per state size: the state seeded with N users "
        f"(one row each), then {args.batches} files of {BATCH_RECORDS:,} clicks whose users are drawn uniformly from all N, "
        "one file a batch, the same files for every engine. Structured Streaming: `Trigger.AvailableNow`, RocksDB state "
        "(seeded by a first run over the N users), `noop` sink, each batch's `durationMs`. This project: `run --catch-up`, "
        "`max_files: 1`, a batch's seconds from the previous batch's outcome to its own; means of batches 3 on, with "
        f"`state.layout: merged` copy-on-write (`deletion_vectors: false`, a MERGE a batch), `layout: merged` with the default `deletion_vectors: auto` (merged on read once the state's files weigh 64 MB) and `appended` (`fold_at: {FOLD_AT}`).",
        "",
        "| keys in state | state (Parquet) | Structured Streaming | merged, copy-on-write | / SS | merged, default (auto) | **/ SS** | appended | **appended / SS** "
        "| appended / its 100k batch | fold (every ~N batches) | appended, fold amortized | amortized / SS "
        "| read the state: merged | read: appended, before its fold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ss, merged, app, mor = pace(r["ss_s"]), pace(r["merged_s"]), pace(r["appended_s"]), pace(r["vectors_s"])
        lines.append(
            f"| {r['keys']:,} | {r['state_mb']:.0f} MB | {ss:.2f} s | {merged:.2f} s | {merged / ss:.2f} | {mor:.2f} s | **{mor / ss:.2f}** "
            f"| {app:.2f} s | **{app / ss:.2f}** | {app / own:.2f} | {r['fold_s']:.1f} s (every {fold_every(r['keys']):.0f}) "
            f"| {amortized(r):.2f} s | {amortized(r) / ss:.2f} | {read(r.get('merged_read_s'))} | {read(r.get('appended_read_s'))} |"
        )
    big, ss = rows[-1], pace(rows[-1]["ss_s"])
    batches = "; ".join(
        f"{r['keys']:,}: " + ", ".join(f"{name} {[round(x, 2) for x in r[f'{key}_s']]}" for name, key in LABELS)
        for r in rows
    )
    lines += [
        "",
        f"The goal (issue 35), at {big['keys']:,} keys: the appended steady batch at most 0.5x Structured Streaming's "
        f"(measured: {pace(big['appended_s']) / ss:.2f}) and at most 1.5x its own batch at 100,000 keys (measured: "
        f"{pace(big['appended_s']) / own:.2f}). With the fold spread over the batches between two folds: "
        f"{amortized(big) / ss:.2f}x Structured Streaming. Structured Streaming's seed runs took "
        + ", ".join(f"{r['ss_seed_s']:.0f} s ({r['keys']:,})" for r in rows)
        + f"; all batches: {batches}.",
        "",
        f"![steady batch against state size]({PLOT})",
        "",
    ]
    plot(rows)
    write_section("benchmarks.md", lines)


def plot(rows: list[dict[str, Any]]) -> None:
    keys = [r["keys"] for r in rows]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    ax.plot(keys, [pace(r["ss_s"]) for r in rows], "o-", color="#9aa5b1", label="Structured Streaming (RocksDB)")
    ax.plot(keys, [pace(r["merged_s"]) for r in rows], "s-", color="#c9a26b", label="project, merged, copy-on-write")
    ax.plot(keys, [pace(r["vectors_s"]) for r in rows], "^-", color="#5f8f4f", label="project, merged, default (auto)")
    ax.plot(keys, [pace(r["appended_s"]) for r in rows], "D-", color="#2f6f9f", label="project, layout: appended")
    ax.plot(keys, [amortized(r) for r in rows], "D--", color="#2f6f9f", alpha=0.5, label="appended, fold amortized")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("users in the state (each batch: 100,000 clicks of returning users)")
    ax.set_ylabel("steady batch (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save_plot(fig, PLOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000,20000000,100000000")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument(
        "--no-reads",
        action="store_true",
        help="leave out the full reads of each state (100M keys: about 23 GB in this process)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="the project's variants to run (of %(default)s); fewer than all: figures printed, docs left alone",
    )
    args = parser.parse_args()
    variants = tuple(v for v in args.variants.split(",") if v)
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    with scratch("state-vs-ss") as work:
        # The merged state's key directories (`core/key_directory.py`) in the scratch folder, gone with it.
        os.environ.setdefault("MICROBATCH_KEY_DIRECTORY", str(work / "keys"))
        rows = [measure(work, n, args.batches, reads=not args.no_reads, variants=variants) for n in [100_000, *numbers(args.sizes)]]
    if set(variants) == set(VARIANTS):
        write_doc(args, rows)


if __name__ == "__main__":
    main()
