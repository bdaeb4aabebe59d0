"""An upstream Delta table as a source: each version consumed exactly once.

The offset is the last version consumed (``{"version": v}``; -1 before the
first batch), and a batch is the versions ``(v, v_end]``: Delta versions are
the table's own log of commits, as a Kafka partition's offsets are its log.
Two ways to read them (`source.read`):

* ``changes``: the table's change data feed (inserts, deletes, and updates
  as pre- and post-images), with `_change_type`, `_commit_version` and
  `_commit_timestamp` columns. The feed must be on (the table property
  ``delta.enableChangeDataFeed``); a pipeline's state table turns it on with
  ``state.change_feed: true``, which is how pipelines are chained.
* ``appends``: the rows the versions appended, for append-only tables; a
  version that removed or rewrote rows (an UPDATE, a DELETE, an overwrite)
  is refused by number and operation, because its effect is not rows to
  add. (An OPTIMIZE changes no data: it is passed over.)

Data intervals bound a batch by commit time: a run for ``[start, end)``
takes the versions committed before ``end``. A table whose latest version is
behind the ledger's offset was recreated and is refused. A version the
pipeline still needs but can no longer read (its log entry removed by a log
cleanup, or a file it needs removed by a VACUUM) follows `on_data_loss`:
``fail`` stops with exit 2 naming the versions, ``skip`` records the lost
versions in the batch's manifest (so the ledger says what was skipped) and
goes on after them, as Spark's ``failOnDataLoss=false`` does. Checking a
version reads its log entry and checks its files exist: the cost is the
batch's, never the table's age.

Planning reads only the table's log (no data, no JVM), so a run with nothing
new never starts a Spark session. Who then reads the planned versions, the
driver or Spark's executors, is `source.reader` (`engine/delta_read.py`);
planning differs for Spark's in two ways: it accepts column mapping, and it
ends a change-feed batch before a version that renamed or dropped a column.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, cast

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from spark_jobs.core.commits import METADATA_KEY
from spark_jobs.core.delta_io import version_actions, with_user_metadata
from spark_jobs.core.folding import FOLD_KEY
from spark_jobs.core.widen import widens
from spark_jobs.errors import DataLossError, SourceChangedError, SourceError, SourceRefusedError, first_line
from spark_jobs.sources.base import BatchRange, Caps, Lag, Lineage
from spark_jobs.storage.consumers import Consumer, register
from spark_jobs.storage.s3 import delta_storage_options, exists

__all__ = ["READ_ON_EXECUTORS_FROM", "DeltaManifest", "DeltaSource", "VersionOffsets", "feed_files", "read_bytes_of", "version_actions"]

log = logging.getLogger("microbatch")

#: How many commits back a dated `lag` reads to date the oldest waiting commit.
_HISTORY_LOOKBACK = 1000
#: `source.reader: auto` on `local[*]`: a batch whose read weighs more than
#: this (`read_bytes_of`) is read by Spark's executors (delta-spark), and its
#: rows written by them (`write_path.executors_write`). Read by the driver,
#: 30M changed rows took 18.8 GB of this process (issue 64), 5.2 MB of change
#: files (1M inserts) 692 MB, 0.95 MB (a batch of 100k returning keys'
#: update images) 325 MB (2026-12-05). Below it the driver's read is the
#: faster: that 0.95 MB batch took 6.3 s read by the driver, 12.7 s by Spark
#: (a new process each; a chain's usual batch weighs kilobytes).
READ_ON_EXECUTORS_FROM = 4 * 1024 * 1024


def feed_files(actions: list[dict[str, Any]], read: str) -> list[tuple[str, dict[str, Any]]]:
    """The files a read of one version's rows reads (`actions`: its log
    entry), each with its action's kind: for ``changes``, its change data
    files if it has any (a change feed reads those alone: a MERGE's
    copy-on-write rewrite of a big state is not read), else the data files
    it added and removed (read as inserts and deletes: a rewind's RESTORE
    removing a 30M-row file); for ``appends``, the files it added. Files a
    compaction rewrote (no data change) are read by neither."""
    changes = [("cdc", a["cdc"]) for a in actions if "cdc" in a]
    if read == "changes" and changes:
        return changes
    kinds = ("add", "remove") if read == "changes" else ("add",)
    return [(k, a[k]) for a in actions for k in kinds if k in a and a[k].get("dataChange", True)]


def read_bytes_of(actions: list[dict[str, Any]] | None, read: str) -> int:
    """Bytes of the files a read of one version's rows reads (`feed_files`).
    A file whose size the entry does not give, or an entry that is gone,
    weighs more than `READ_ON_EXECUTORS_FROM`: alone, it sends the batch to
    Spark."""
    unknown = READ_ON_EXECUTORS_FROM + 1
    if actions is None:
        return unknown
    return sum(int(f["size"]) if f.get("size") is not None else unknown for _, f in feed_files(actions, read))


@dataclass(frozen=True)
class VersionOffsets:
    """The last upstream version consumed (-1: none yet), of which table (its
    Delta id: a table deleted and recreated at the same path is another)."""

    version: int
    table: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, **({"table": self.table} if self.table else {})}


@dataclass(frozen=True)
class DeltaManifest:
    """The versions one batch reads, and those it had to skip."""

    uri: str
    read: str  # "changes" | "appends"
    first: int
    last: int
    #: [first, last] ranges of versions lost upstream and skipped (`on_data_loss: skip`).
    skipped: tuple[tuple[int, int], ...] = ()
    #: Who reads it, chosen at planning by its size (`source.reader: auto` on
    #: `local[*]`): a replay reads it the same way. None: as the spec says.
    reader: str | None = None
    #: Bytes of the data files its versions name (None: not weighed).
    size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        extra = {k: v for k, v in (("reader", self.reader), ("size", self.size)) if v is not None}
        return {"uri": self.uri, "read": self.read, "first": self.first, "last": self.last, "skipped": [list(r) for r in self.skipped], **extra}

    def reader_for(self, configured: str) -> str:
        """Who reads this batch: the spec's reader (`configured`) if it names
        one (both read the same rows: a user who changed it after a failed
        read of a planned batch means it), else the one planning chose,
        else the driver's."""
        if configured != "auto":
            return configured
        return self.reader or "driver"

    def inputs(self) -> list[str]:
        return [f"{self.uri}@v{self.first}" + (f"..v{self.last}" if self.last != self.first else "")]

    def input_bytes(self) -> int | None:
        return self.size

    def describe(self) -> str:
        count = self.last - self.first + 1
        lost = sum(b - a + 1 for a, b in self.skipped)
        return f"{count} version(s) ({self.first}..{self.last})" + (f", {lost} lost version(s) skipped" if lost else "")

    def units(self) -> list[tuple[str, str]]:
        return []  # the versions are the offsets: nothing to look up


class DeltaSource:
    """Plans batches of versions of an upstream Delta table."""

    unit = "versions"

    def __init__(
        self,
        uri: str,
        *,
        read: str,
        on_data_loss: str,
        max_versions: int | None,
        reader: str = "driver",
        pipeline: str = "",
        checkpoint: str = "",
    ) -> None:
        self.uri = uri
        self.read = read
        #: Who reads the batches (`source.reader`): only the driver's reader
        #: refuses column mapping. A run resolves `auto` once it knows its
        #: master (`engine.session.with_reader`); left `auto` (`local[*]`, or
        #: a plan without an engine) each batch is read by the driver, or by
        #: Spark's executors once its versions' files weigh more than
        #: `READ_ON_EXECUTORS_FROM` (`plan`).
        self.reader = reader
        self.on_data_loss = on_data_loss
        self.max_versions = max_versions
        #: Who reads: the position is recorded in the upstream as this pipeline's (`storage.consumers`).
        self.pipeline = pipeline
        self.checkpoint = checkpoint
        #: Log entries read (a version's entry never changes; one that is gone stays gone).
        self._log: dict[int, list[dict[str, Any]] | None] = {}
        #: The upstream as of a version (`_as_of`): a past version never changes.
        self._at: dict[int, DeltaTable] = {}

    @property
    def origin(self) -> VersionOffsets:
        return VersionOffsets(-1)

    def decode(self, start: dict[str, Any], end: dict[str, Any], manifest: dict[str, Any]) -> BatchRange:
        first, last = manifest.get("first", 0), manifest.get("last", -1)
        skipped = tuple((a, b) for a, b in manifest.get("skipped", []))
        return BatchRange(
            VersionOffsets(start.get("version", -1), start.get("table")),
            VersionOffsets(end.get("version", -1), end.get("table")),
            DeltaManifest(
                manifest.get("uri", self.uri), manifest.get("read", self.read), first, last, skipped,
                manifest.get("reader"), manifest.get("size"),
            ),
        )

    def table(self) -> DeltaTable:
        """The upstream table at its latest version, or `SourceError` naming it."""
        try:
            return DeltaTable(self.uri, storage_options=delta_storage_options(self.uri))
        except TableNotFoundError as exc:
            raise SourceError(
                f"source table {self.uri} is not a Delta table (or does not exist yet); create it, or fix "
                "source.path in the spec. Nothing was planned.",
                path=self.uri,
            ) from exc
        except Exception as exc:
            raise SourceError(f"cannot open source table {self.uri}: {first_line(exc)}", path=self.uri) from exc

    def _after(self, lineage: Lineage, table: DeltaTable, latest: int) -> int:
        after = int(lineage.end.get("version", -1))
        consumed_from = lineage.end.get("table")
        if latest < after or (consumed_from is not None and consumed_from != table.metadata().id):
            raise SourceChangedError(
                f"source table {self.uri} (version {latest}) is not the table whose versions up to {after} this "
                "pipeline consumed: it was deleted and recreated (or replaced). Nothing was read. Point "
                "source.path back at the original table, or start the pipeline over with a new checkpoint "
                "and state.",
                path=self.uri,
            )
        return after

    def lag(self, lineage: Lineage, *, until: datetime | None = None, dated: bool = False) -> Lag:
        table = self.table()
        latest = table.version()
        after = self._after(lineage, table, latest)
        if latest <= after:
            return Lag(0, self.unit)
        # Commit times cost a log file per commit: read for a bound, or to date
        # the oldest waiting commit when that is at most `_HISTORY_LOOKBACK` back.
        times = self._commit_times(table, after) if until is not None or (dated and latest - after <= _HISTORY_LOOKBACK) else {}
        end = self._bound(times, after, latest, until) if until is not None else latest
        first = times.get(after + 1) if dated and end > after else None
        return Lag(max(end - after, 0), self.unit, oldest=datetime.fromtimestamp(first / 1000, timezone.utc) if first is not None else None)

    def plan(self, lineage: Lineage, *, until: datetime | None = None, caps: Caps = Caps()) -> BatchRange | None:
        table = self.table()
        latest = table.version()
        after = self._after(lineage, table, latest)
        if latest > after:
            # Before registering: a refused upstream must not keep versions for a reader that never reads them.
            self._check_not_appended_state(table, {after + 1, latest})
        # Before anything is read: from now on the upstream's maintenance
        # keeps the versions after `after` (a first run, or one after a rewind).
        self._register(after, table.metadata().id)
        if latest <= after:
            return None
        end = latest if until is None else self._bound(self._commit_times(table, after), after, latest, until)
        if end <= after:
            return None
        first, skipped = self._skip_lost(table, after + 1, end)
        if self.max_versions is not None:
            end = min(end, first + self.max_versions - 1)
        # A batch reads a contiguous range: it ends before the next lost version (the next batch meets it).
        last = first - 1
        while last < end and not self._lost(table, last + 1):
            last += 1
        reader, last = self._read_by(table, first, last)
        size = self._size(table, first, last)
        if first <= last:
            self._check_not_appended_state(table, range(first, last + 1))
            if reader == "driver":
                self._check_column_mapping(table)
            if self.read == "changes":
                self._check_change_feed(table, first, last)
            else:
                self._check_appends(table, first, last)
        offset_end = last if first <= last else skipped[-1][1]
        table_id = table.metadata().id
        return BatchRange(
            VersionOffsets(after, lineage.end.get("table")),
            VersionOffsets(offset_end, table_id),
            DeltaManifest(self.uri, self.read, first, last, skipped, reader if self.reader == "auto" else None, size),
            waiting_after=latest - offset_end,
        )

    def _read_by(self, table: DeltaTable, first: int, last: int) -> tuple[str, int]:
        """Who reads versions `first`..`last`, and the last version they read:
        Spark reads a change feed with the table's columns as they are now,
        so its batch ends before a version that renamed or dropped a column,
        and a column widened since is refused (`_check_columns_since`).
        `auto` (on `local[*]`) chooses by the versions' size, and the driver
        where Spark would refuse: it reads each version with its own columns."""
        reader = self.reader
        if reader == "auto":
            big = first <= last and self._size(table, first, last) > READ_ON_EXECUTORS_FROM
            reader = "spark" if big and not self._column_mapped(table) else "driver"
        if reader != "spark" or self.read != "changes" or first > last:
            return reader, last
        end = self._before_schema_break(table, first, last) if first < last else last
        try:
            self._check_columns_since(table, first, end)
        except SourceRefusedError:
            if self.reader != "auto":
                raise
            return "driver", last
        return reader, end

    def _size(self, table: DeltaTable, first: int, last: int) -> int:
        """Bytes of the files a read of versions `first`..`last` reads, from
        the log entries planning reads anyway (`read_bytes_of`)."""
        return sum(read_bytes_of(self._actions(table, version), self.read) for version in range(first, last + 1))

    def _column_mapped(self, table: DeltaTable) -> bool:
        """(`auto` keeps a column-mapped table on the driver, whose refusal
        names `reader: spark`: Spark's planning of it differs.)"""
        return column_mapped(table.metadata().configuration)

    def replay_gaps(self, start: dict[str, Any], batches: Sequence[BatchRange]) -> str | None:
        """The versions the batches read after `start` that the upstream has
        let go (its `maintain` kept only what recorded readers had yet to
        read, and a rewind reads earlier ones again)."""
        if not batches:
            return None
        last = max(cast(DeltaManifest, b.manifest).last for b in batches)
        table = self.table()
        gone = [v for v in range(int(start.get("version", -1)) + 1, last + 1) if self._lost(table, v)]
        if not gone:
            return None
        if self.on_data_loss == "skip":
            log.warning("source %s: versions %s are gone upstream; the replay skips them (on_data_loss: skip)", self.uri, _ranges(gone))
            return None
        return (
            f"source table {self.uri} can no longer give versions {_ranges(gone)}, which those batches read "
            "(the upstream's `maintain` or a log cleanup removed their files or log entries). Rewind to a "
            "later batch, recompute the upstream, or set `source.on_data_loss: skip` to rewind without "
            "those versions' changes"
        )

    def check_read(self, batch: BatchRange) -> None:
        """Nothing to check: a version is immutable, and a read of a version whose files are gone fails."""

    def verify(self, batch: BatchRange) -> None:
        """The planned versions must still be readable (their log entries and files there)."""
        manifest: DeltaManifest = batch.manifest  # type: ignore[assignment]
        table = self.table()
        gone = [v for v in range(manifest.first, manifest.last + 1) if self._lost(table, v)]
        if gone:
            raise SourceChangedError(
                f"source table {self.uri} can no longer give versions {gone[0]}..{gone[-1]} of this planned "
                "batch (a log cleanup or a VACUUM removed them since it was planned). A replay must read "
                "exactly what was planned; nothing was read or written. Rewind to the last committed batch "
                "(`microbatch rewind SPEC --to-batch K`): the next run plans afresh and `source.on_data_loss` "
                "decides about the lost versions.",
                path=self.uri,
            )

    def after_commit(self, lineage: Lineage) -> int:
        """Nothing to release (versions are the upstream's); the upstream's
        maintenance may now let go of the versions consumed."""
        self._register(int(lineage.end.get("version", -1)), lineage.end.get("table"))
        return 0

    def rewinding(self, end: dict[str, Any]) -> None:
        """Move the recorded position back before the rewind restores: the
        replay needs the versions after it, and the upstream's `maintain`
        must keep them from now on."""
        self._register(int(end.get("version", -1)), end.get("table"))

    def _register(self, version: int, table_id: str | None) -> None:
        if self.pipeline:
            register(self.uri, Consumer(self.pipeline, self.checkpoint, table_id, version))

    # -- checks -------------------------------------------------------------------

    def _skip_lost(self, table: DeltaTable, wanted: int, end: int) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Where reading can start: `wanted`, or past the lost versions from it (per `on_data_loss`)."""
        first = wanted
        while first <= end and self._lost(table, first):
            first += 1
        if first == wanted:
            return wanted, ()
        lost = (wanted, first - 1)
        if self.on_data_loss == "fail":
            raise DataLossError(
                f"source table {self.uri} can no longer give versions {lost[0]}..{lost[1]}, which this "
                "pipeline has not consumed (a log cleanup or a VACUUM removed their log entries or files). "
                "Nothing was read. Set `source.on_data_loss: skip` to record them in the ledger as lost and go "
                "on, or recompute from a source that still has them.",
                path=self.uri,
            )
        log.warning("source %s: versions %d..%d are gone upstream; skipped (on_data_loss: skip)", self.uri, *lost)
        return first, (lost,)

    def _actions(self, table: DeltaTable, version: int) -> list[dict[str, Any]] | None:
        """A version's log entry, read once per source (a run): planning reads
        it to check the version is there, then for what the version did."""
        if version not in self._log:
            self._log[version] = version_actions(table.table_uri, version)
        return self._log[version]

    def _as_of(self, version: int) -> DeltaTable:
        """The upstream as of `version`, opened once per source (a batch's
        checks all ask for its first version)."""
        if version not in self._at:
            self._at[version] = DeltaTable(self.uri, version=version, storage_options=delta_storage_options(self.uri))
        return self._at[version]

    def _lost(self, table: DeltaTable, version: int) -> bool:
        """Whether `version` can no longer be read: its log entry is gone, or a
        file it needs (for changes: its change files, or the files it added
        and removed; for appends: the files it added) was vacuumed."""
        actions = self._actions(table, version)
        if actions is None:
            return True
        changes = [a["cdc"]["path"] for a in actions if "cdc" in a]
        if self.read == "changes" and changes:
            needed = changes
        else:
            kinds = ("add", "remove") if self.read == "changes" else ("add",)
            needed = [a[k]["path"] for a in actions for k in kinds if k in a and a[k].get("dataChange", True)]
        root = table.table_uri.rstrip("/")
        return not all(exists(f"{root}/{path}") for path in needed)

    def _commit_times(self, table: DeltaTable, after: int) -> dict[int, int]:
        """Each version after `after` and its commit time (ms): the newest
        commits back to `after`, what a batch may span, never the whole history."""
        times = {}
        for version in range(after + 1, table.version() + 1):
            # Each log entry read by its number (`delta_io.commit_info` says why not `history()`).
            info = next((a["commitInfo"] for a in self._actions(table, version) or [] if "commitInfo" in a), {})
            if isinstance(info.get("timestamp"), int):
                times[version] = info["timestamp"]
        return times

    def _bound(self, times: dict[int, int], after: int, end: int, until: datetime) -> int:
        """The last version in (after, end] committed before `until` (after: none); `times` from `_commit_times`."""
        limit_ms = int(until.timestamp() * 1000)
        return max((v for v, t in times.items() if after < v <= end and t < limit_ms), default=after)

    def _check_change_feed(self, table: DeltaTable, first: int, last: int) -> None:
        """Every version of the batch must have been written with the feed on:
        for an earlier one, delta-rs reads each rewritten file as a delete and
        an insert of every row in it."""
        feed = _feeds(self._as_of(first).metadata().configuration)
        off = None if feed else first
        for version in range(first + 1, last + 1):
            for action in self._actions(table, version) or []:
                if "metaData" in action:
                    feed = _feeds(action["metaData"].get("configuration") or {})
            if not feed and off is None:
                off = version
        if off is not None:
            raise SourceRefusedError(
                f"source table {self.uri}: version {off} was written without a change data feed, which "
                "`source.read: changes` reads. Set the table property delta.enableChangeDataFeed = true (for a "
                "pipeline's state: `state.change_feed: true`); versions written before that cannot be read as "
                "changes (start a new pipeline on the table after it, or read an append-only table with "
                "`source.read: appends`). Nothing was planned.",
                path=self.uri,
            )

    def _before_schema_break(self, table: DeltaTable, first: int, last: int) -> int:
        """The last version of a batch read by delta-spark's change feed:
        before the first version after `first` that renamed or dropped a
        column (column mapping, or an overwrite of the schema). Delta cannot
        read a feed across one (DELTA_CHANGE_DATA_FEED_INCOMPATIBLE_DATA_SCHEMA)
        but reads each side with its own columns, so the next batch starts at
        it, under the new names. Added columns do not break a range."""
        columns = _column_paths(json.loads(self._as_of(first).schema().to_json()))
        for version in range(first + 1, last + 1):
            for action in self._actions(table, version) or []:
                if "metaData" in action:
                    now = _column_paths(json.loads(action["metaData"]["schemaString"]))
                    if not columns <= now:
                        log.info("source %s: version %d renamed or dropped a column: the batch ends before it", self.uri, version)
                        return version - 1
                    columns = now
        return last

    def _check_not_appended_state(self, table: DeltaTable, versions: Iterable[int]) -> None:
        """A pipeline's state with `state.layout: appended` is no upstream:
        its batches append partial rows and its folds rewrite them, so neither
        its appends nor its changes are the keys' values."""
        for version in versions:
            actions = self._actions(table, version) or []
            for action in actions:
                info = with_user_metadata(action.get("commitInfo") or {}, actions)
                raw = info.get(METADATA_KEY)
                layout = (json.loads(raw).get("spec") or {}).get("fields", {}).get("state.layout") if raw else None
                if info.get(FOLD_KEY) or layout == "appended":
                    raise SourceRefusedError(
                        f"source table {self.uri} is a pipeline's state with `state.layout: appended` (version "
                        f"{version}): its versions hold partial rows and folds, not each key's value. Chain from "
                        "a state with `layout: merged` and `change_feed: true`, or read this state's values with "
                        "`microbatch query`. Nothing was planned.",
                        path=self.uri,
                    )

    def _check_column_mapping(self, table: DeltaTable) -> None:
        """A table with column mapping is refused to the driver's reader: its
        Parquet files name columns by id or physical name, which delta-rs
        1.6.6 cannot read as a change feed and, worse, reads as nulls when it
        reads the files a version added (delta-spark, `source.reader: spark`,
        reads them). Mapping cannot be turned off
        on a table once a column was renamed or dropped, so the latest
        version's property decides."""
        if column_mapped(table.metadata().configuration):
            mode = table.metadata().configuration["delta.columnMapping.mode"]
            raise SourceRefusedError(
                f"source table {self.uri} uses column mapping (delta.columnMapping.mode = {mode}), which this "
                "project's driver reader (delta-rs 1.6.6) cannot read exactly. Read it with delta-spark "
                "instead (`source.reader: spark`), or follow a table without column mapping: write the "
                "upstream with delta.columnMapping.mode = none, or copy it into one (CREATE TABLE ... AS "
                "SELECT) and point `source.path` there. Nothing was planned.",
                path=self.uri,
            )

    def _check_columns_since(self, table: DeltaTable, first: int, last: int) -> None:
        """delta-spark reads a change feed with one set of columns for the
        whole range (`spark_feed_types`: the table's latest, or with column
        mapping the range's last version's), not as the range's files were
        written. A column widened since (a state's sum from INT to BIGINT:
        `StateTable._widen`; Delta's own `ALTER COLUMN ... TYPE`) reads right,
        the old files' values widened by Spark's Parquet reader, once the read
        allows it (`delta_read.spark_versions`). So every type the range's
        files may hold a column in (`range_column_types`: as the version
        before the range left it, and as each version in it set it) must be
        the read's or widen to it; anything else is refused here rather than
        read wrongly (a DECIMAL's unscaled digits read as a BIGINT) or failed
        on every retry. A dropped column is left to delta-spark, as before."""
        read_with, at = spark_feed_types(self.uri, table, last)
        for version, types in range_column_types(self.uri, first, last):
            for name, kind in types.items():
                if name not in read_with:
                    continue
                became = read_with[name]
                if became == kind or widens(kind, became):
                    continue
                is_now = f"now {became}" if at == "now" else f"{became} {at}"
                raise SourceRefusedError(
                    f"source table {self.uri}: column {name!r} was {kind} at version {version} and is {is_now}. "
                    f"delta-spark (`source.reader: spark`) reads a change feed with the columns as they are {at}, "
                    "so versions written before that change cannot be read by it. Read this source with "
                    "`source.reader: driver`, which reads each version with its own columns. Nothing was planned.",
                    path=self.uri,
                )

    def _check_appends(self, table: DeltaTable, first: int, end: int) -> None:
        """Each version may only add rows: no file removed with a data change
        (an OPTIMIZE's removes change no data, and its adds are not read)."""
        for version in range(first, end + 1):
            actions = self._actions(table, version) or []
            if any(a["remove"].get("dataChange", True) for a in actions if "remove" in a):
                operation = next((a["commitInfo"].get("operation") for a in actions if "commitInfo" in a), "a commit")
                raise SourceRefusedError(
                    f"source table {self.uri}: version {version} ({operation}) removed or rewrote rows, and "
                    "`source.read: appends` reads append-only tables. Turn the table's change data feed on and "
                    "use `source.read: changes` to follow updates and deletes. Nothing was planned.",
                    path=self.uri,
                )


def _column_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted names of a Delta schema's columns, nested struct fields included."""
    paths = set()
    for field in schema.get("fields", []):
        path = f"{prefix}{field['name']}"
        paths.add(path)
        if isinstance(field.get("type"), dict) and field["type"].get("type") == "struct":
            paths |= _column_paths(field["type"], f"{path}.")
    return paths


def range_column_types(uri: str, first: int, last: int) -> list[tuple[int, dict[str, pa.DataType]]]:
    """(version, {column: type}) for every schema the files a range of
    versions reads may hold columns in: as the version before the range
    left them (the files its first versions remove), and as each version of
    the range that changed the schema set them."""
    changed = [v for v in range(first, last + 1) if any("metaData" in a for a in version_actions(uri, v) or [])]
    found = []
    for version in sorted({max(first - 1, 0), first, *changed}):
        schema = pa.schema(DeltaTable(uri, version=version, storage_options=delta_storage_options(uri)).schema().to_arrow())
        found.append((version, {f.name: f.type for f in schema}))
    return found


def column_mapped(configuration: dict[str, Any]) -> bool:
    """Whether the table names its columns' data by column mapping."""
    return str(configuration.get("delta.columnMapping.mode", "none")).lower() != "none"


def spark_feed_types(uri: str, latest: DeltaTable, last: int) -> tuple[dict[str, pa.DataType], str]:
    """The column types delta-spark reads a change feed ending at `last`
    with, and when they are from (for messages): the table's latest
    (`latest`, a handle on it), or, for a table with column mapping, version
    `last`'s (delta-spark's default for such tables; a rename after the
    range does not reach it)."""
    if column_mapped(latest.metadata().configuration) and last != latest.version():
        at = DeltaTable(uri, version=last, storage_options=delta_storage_options(uri))
        return {f.name: f.type for f in pa.schema(at.schema().to_arrow())}, f"at version {last}"
    return {f.name: f.type for f in pa.schema(latest.schema().to_arrow())}, "now"


def _feeds(configuration: dict[str, Any]) -> bool:
    return str(configuration.get("delta.enableChangeDataFeed", "false")).lower() == "true"


def _ranges(versions: list[int]) -> str:
    """Sorted versions as ranges: `2..4, 7`."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in runs)
