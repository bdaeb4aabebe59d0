"""The lineage as a source sees it, and the consumed index that keeps it cheap.

A source plans the next batch after the *lineage*: the committed batches
that make up the current state. Most sources need only where the lineage
ends (a Kafka partition's next offset, a Delta table's next version: the last
batch's end offsets). A files source also needs to know which files the
lineage consumed, and deriving that from every batch's manifest costs a read
of the whole ledger: a million consumed files after 100,000 batches.

So the units a batch consumed (files, by name and version) also go to a
*consumed index*, a Delta table at ``<checkpoint>/consumed`` with one row per
unit, which answers "which of these names were consumed?" by reading only
the rows of those names. It is a cache of the ledger, never the truth:

* its rows and its fence (``microbatch.consumed/<pipeline>/<ledger id>``)
  name the offset ledger they belong to (its Delta table id), and the
  fence's position P says "these rows are the units of lineage(P)", written
  in the same commit as the rows: a checkpoint started over is a new ledger,
  whose lineage the old rows are not;
* a batch is added after its ledger row (step 5 of the protocol), a rewind
  rebuilds it for the new epoch, and `microbatch maintain` brings it up to
  date (building it for a pipeline that had none) and rewrites it sorted by
  name, so that a lookup reads only the files whose name range holds a
  name it asks about;
* a lookup at head H uses it when it stands in H's epoch: at H; before H
  (the batches it lacks are read from the ledger, by position: within an
  epoch, lineage(H) is lineage(P) plus the batches after P); or after H (a
  run recorded a batch since this view was read: a superset, which is what
  the head holds by now). Otherwise (no index for this ledger yet, or one
  from before a rewind), or if reading it fails, the lookup derives the
  answer from the whole lineage, which is slow but right, and the next
  committing run brings the index back.

Writing it is best effort: a run whose index write fails has committed its
batch all the same, and the next lookup reads the batches the index lacks
from the ledger.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Collection, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from spark_jobs.core.delta_io import (
    COMPACTION_WRITER,
    SMALL_FILE_BYTES,
    Stats,
    ensure_table,
    is_commit_conflict,
    read_all,
    read_pruned,
    refreshed,
    small_files,
    strings,
)
from spark_jobs.core.fencing import ORIGIN, Position, commit_properties, transaction_position
from spark_jobs.core.ledger import COMPACT_AT_FILES, LedgerRow, LedgerView, RowStatus, scoped
from spark_jobs.core.sql_text import pipeline_literal, string_literal
from spark_jobs.sources import Source

__all__ = ["CONSUMED_FENCE", "ConsumedIndex", "LedgerLineage"]

log = logging.getLogger("microbatch")

CONSUMED_FENCE = "microbatch.consumed"

SCHEMA = pa.schema(
    [
        ("pipeline", pa.string()),
        #: The offset ledger's Delta table id: an index belongs to one ledger
        #: (a checkpoint started over gets a new ledger, and the old rows are
        #: no longer its lineage's).
        ("ledger", pa.string()),
        ("epoch", pa.int64()),
        ("batch_id", pa.int64()),
        ("key", pa.string()),
        ("version", pa.string()),
    ]
)

#: String statistics this long may be truncated: a truncated maximum is a
#: prefix, below the true maximum, so it cannot bound a lookup.
_STATS_CHARS = 32

Versions = dict[str, set[str]]


class ConsumedIndex:
    """The consumed units of one pipeline's lineage in one ledger, at ``<checkpoint>/consumed``."""

    def __init__(self, path: str, pipeline: str) -> None:
        self.path = path
        self.pipeline = pipeline
        self._table: DeltaTable | None = None

    def fence(self, ledger: str) -> str:
        return scoped(CONSUMED_FENCE, f"{self.pipeline}/{ledger}")

    def open(self) -> DeltaTable | None:
        """The index at its latest version (one handle, brought up to date; see `OffsetLedger.snapshot`)."""
        self._table = refreshed(self._table, self.path)
        return self._table

    def _ensure(self, table: DeltaTable | None) -> DeltaTable:
        if table is None:
            table = self._table = ensure_table(self.path, SCHEMA, name=f"{self.pipeline} consumed index")
        return table

    def position(self, table: DeltaTable | None, ledger: str) -> Position | None:
        """The lineage position of `ledger` the index holds (None: nothing for it)."""
        if table is None:
            return None
        at = transaction_position(table, self.fence(ledger))
        return None if at == ORIGIN else at

    def lookup(self, table: DeltaTable, ledger: str, keys: set[str]) -> Versions:
        """The versions of `keys` the index holds for `ledger`.

        Reads only the files whose key statistics may hold one of `keys`:
        after `sort`, one or two files a key, however many came before.
        """
        wanted = sorted(keys)

        def may_hold(stats: Stats) -> bool:
            lo, hi = _bounds(stats, "pipeline")
            if not ((lo is None or lo <= self.pipeline) and (hi is None or self.pipeline <= hi)):
                return False
            lo, hi = _bounds(stats, "key")
            first = 0 if lo is None else bisect.bisect_left(wanted, lo)
            return first < len(wanted) and (hi is None or wanted[first] <= hi)

        tags = strings([self.pipeline, ledger])
        rows = read_pruned(
            table,
            may_hold,
            lambda t: pc.and_(
                pc.and_(pc.equal(t["pipeline"], tags[0]), pc.equal(t["ledger"], tags[1])),
                pc.is_in(t["key"], value_set=strings(wanted)),
            ),
            where=f"pipeline = {pipeline_literal(self.pipeline)} AND ledger = {string_literal(ledger)} AND "
            f"key IN ({', '.join(string_literal(k) for k in wanted)})",
            columns=("pipeline", "ledger", "key", "version"),
        )
        found: Versions = {}
        if rows.num_rows:
            for key, version in zip(rows.column("key").to_pylist(), rows.column("version").to_pylist()):
                found.setdefault(key, set()).add(version)
        return found

    def append(self, table: DeltaTable | None, ledger: str, rows: list[LedgerRow], at: Position, units: _Units) -> bool:
        """Add the units of `rows` (the lineage's batches after the index's
        position, up to `at`), fenced at `at`. False if another run got there first."""
        table = self._ensure(table)
        if (self.position(table, ledger) or ORIGIN) >= at:
            return False
        return self._write(table, ledger, self._rows(ledger, rows, units), at, mode="append")

    def rebuild(self, table: DeltaTable | None, ledger: str, rows: list[LedgerRow], at: Position, units: _Units) -> bool:
        """Replace this pipeline's rows (of any ledger) with the units of
        `rows` (the whole lineage of `at`), sorted by key, fenced at `at`."""
        table = self._ensure(table)
        if (self.position(table, ledger) or ORIGIN) >= at:
            return False
        data = self._rows(ledger, rows, units)
        return self._write(table, ledger, data.sort_by("key"), at, mode="overwrite")

    def sort(self, ledger: str) -> bool:
        """Rewrite this pipeline's rows sorted by key in files of about
        `SMALL_FILE_BYTES` (maintenance): each file then holds a narrow range
        of names, and a lookup reads only the files whose range holds a name
        it asks about. Fenced at the position it read, which it does not
        move: a batch appended meanwhile makes it fail (tried next time)."""
        table = self.open()
        at = self.position(table, ledger)
        if table is None or at is None:
            return False
        rows = read_all(table, where=f"pipeline = {pipeline_literal(self.pipeline)} AND ledger = {string_literal(ledger)}")
        data = pa.table({name: rows.column(name).cast(SCHEMA.field(name).type) for name in SCHEMA.names}, schema=SCHEMA)
        return self._write(table, ledger, data.sort_by("key"), at, mode="overwrite")

    def _rows(self, ledger: str, rows: list[LedgerRow], units: _Units) -> pa.Table:
        columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
        for row in rows:
            for key, version in units(row):
                columns["pipeline"].append(self.pipeline)
                columns["ledger"].append(ledger)
                columns["epoch"].append(row.epoch)
                columns["batch_id"].append(row.batch_id)
                columns["key"].append(key)
                columns["version"].append(version)
        return pa.table(columns, schema=SCHEMA)

    def _write(self, table: DeltaTable, ledger: str, data: pa.Table, at: Position, *, mode: str) -> bool:
        props = commit_properties(self.fence(ledger), at, {"microbatch.event": "consumed"})
        extra: dict[str, Any] = {}
        if mode == "overwrite":
            extra = {
                "predicate": f"pipeline = {pipeline_literal(self.pipeline)}",
                "target_file_size": SMALL_FILE_BYTES,
                "writer_properties": COMPACTION_WRITER,
            }
        try:
            write_deltalake(table, data, mode=mode, commit_properties=props, **extra)
        except Exception as exc:
            if is_commit_conflict(exc):
                return False
            raise
        return True

    def compact(self) -> None:
        """Merge the small files of recent batches (bigger files are left alone)."""
        table = self.open()
        if table is not None and small_files(table) >= COMPACT_AT_FILES:
            table.optimize.compact(target_size=SMALL_FILE_BYTES, writer_properties=COMPACTION_WRITER)


class _Units:
    """A ledger row's consumed units, as its source decodes them."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def __call__(self, row: LedgerRow) -> list[tuple[str, str]]:
        return self.source.decode(row.start_offsets, row.end_offsets, row.manifest).manifest.units()


class LedgerLineage:
    """The lineage at the ledger's head, as `spark_jobs.sources.base.Lineage`."""

    def __init__(self, view: LedgerView, source: Source, index: ConsumedIndex) -> None:
        self.view = view
        self.source = source
        self.index = index
        self._units = _Units(source)

    @property
    def end(self) -> dict[str, Any]:
        head = self.view.head
        return head.end_offsets if head is not None else self.source.origin.to_dict()

    @property
    def ledger(self) -> str | None:
        """The ledger's table id (None: no ledger yet)."""
        return self.view.table.metadata().id if self.view.table is not None else None

    def consumed(self, keys: Collection[str]) -> Versions:
        """Of `keys`, those a batch of the lineage consumed, with the versions consumed."""
        wanted = set(keys)
        if not wanted:
            return {}
        ledger = self.ledger
        head = self.view.position
        try:
            table = self.index.open() if ledger is not None else None
            at = self.index.position(table, ledger) if ledger is not None else None
            if table is not None and ledger is not None and at is not None and at.epoch == head.epoch:
                # Within an epoch the lineage only grows: an index ahead of
                # this view (a run recorded a batch since) holds a superset,
                # which is what the head holds by now; one behind lacks the
                # batches after it, read from the ledger.
                found = self.index.lookup(table, ledger, wanted)
                for row in self._tail(at):
                    _add(found, self._units(row), wanted)
                return found
        except Exception as exc:  # noqa: BLE001 - the index is a cache: the ledger answers
            log.warning("consumed index not read (%s); the ledger answers instead", exc)
        found = {}
        for row in self.view.lineage():
            _add(found, self._units(row), wanted)
        return found

    def record(self) -> None:
        """Bring the index to the ledger's head: add the batches it lacks, or
        rebuild it if it belongs to another epoch or ledger (or does not
        exist yet). Best effort: a failure leaves lookups slower, never wrong."""
        head = self.view.position
        ledger = self.ledger
        if ledger is None:
            return
        try:
            table = self.index.open()
            at = self.index.position(table, ledger)
            if at is not None and at >= head:
                return
            if at is not None and at.epoch == head.epoch:
                self.index.append(table, ledger, self._tail(at), head, self._units)
            elif table is not None or self._head_units():
                # No index for this ledger yet (a pipeline older than it, or a
                # checkpoint started over), or one of an earlier epoch: derive
                # it once from the whole lineage. A source whose batches
                # consume no units never gets one.
                self.index.rebuild(table, ledger, self.view.lineage(), head, self._units)
            self.index.compact()
        except Exception as exc:  # noqa: BLE001 - the index is a cache of the ledger
            log.warning("consumed index not updated this time (%s); lookups read the ledger until it is", exc)

    def sort(self) -> None:
        """`ConsumedIndex.sort` for this ledger (maintenance)."""
        if self.ledger is not None and not self.index.sort(self.ledger):
            log.info("consumed index not sorted this time (a batch landed meanwhile, or there is none)")

    def _head_units(self) -> bool:
        head = self.view.head
        return head is not None and head.status is RowStatus.COMMITTED and bool(self._units(head))

    def _tail(self, at: Position) -> list[LedgerRow]:
        """The lineage's batches after `at`, in `at`'s epoch (which is the head's)."""
        head = self.view.position
        if at >= head:
            return []
        if head.batch_id - at.batch_id == 1 and self.view.head is not None and self.view.head.status is RowStatus.COMMITTED:
            return [self.view.head]
        return self.view.ledger.committed_between(self.view.table, head.epoch, at.batch_id, head.batch_id)


def _bounds(stats: Stats, column: str) -> tuple[Any, Any]:
    """A string column's statistics as bounds: a maximum that may have been
    truncated (a prefix, below the true maximum) bounds nothing."""
    lo, hi = stats(column)
    return lo, (None if hi is not None and len(hi) >= _STATS_CHARS else hi)


def _add(found: Versions, units: Iterable[tuple[str, str]], keys: set[str]) -> None:
    for key, version in units:
        if key in keys:
            found.setdefault(key, set()).add(version)
