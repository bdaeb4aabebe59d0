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

* it carries a fence (``microbatch.consumed``) whose position P says "these
  rows are the units of lineage(P)", written in the same commit as its rows;
* a batch is added after its ledger row (step 5 of the protocol), a rewind
  rebuilds it for the new epoch, and `microbatch maintain` brings it up to
  date (and builds it for a pipeline that had none);
* a lookup at head H uses it only when it stands at H, or earlier in H's
  epoch (then the missing batches' manifests are read from the ledger, by
  position: within an epoch, lineage(H) is lineage(P) plus the batches
  after P). Otherwise (no index yet, or one from before a rewind) the
  lookup derives the answer from the whole lineage, which is slow but
  right, and the next write brings the index back.

Writing it is best effort: a run whose index write fails has committed its
batch all the same, and the next lookup reads the batches the index lacks
from the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from spark_jobs.core.delta_io import SMALL_FILE_BYTES, ensure_table, is_commit_conflict, open_table, read_all
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
        ("epoch", pa.int64()),
        ("batch_id", pa.int64()),
        ("key", pa.string()),
        ("version", pa.string()),
    ]
)

#: Lookups of more keys than this read the index's key column whole instead
#: of naming each key in the query (a listing that large costs more itself).
_NAMED_LOOKUP_LIMIT = 500

Versions = dict[str, set[str]]


class ConsumedIndex:
    """The consumed units of one pipeline's lineage, at ``<checkpoint>/consumed``."""

    def __init__(self, path: str, pipeline: str) -> None:
        self.path = path
        self.pipeline = pipeline
        self.fence = scoped(CONSUMED_FENCE, pipeline)
        self._table: DeltaTable | None = None

    def open(self) -> DeltaTable | None:
        """The index at its latest version (one handle, brought up to date; see `OffsetLedger.snapshot`)."""
        if self._table is None:
            self._table = open_table(self.path)
        else:
            self._table.update_incremental()
        return self._table

    def _ensure(self, table: DeltaTable | None) -> DeltaTable:
        if table is None:
            table = self._table = ensure_table(self.path, SCHEMA, name=f"{self.pipeline} consumed index")
        return table

    def position(self, table: DeltaTable | None) -> Position | None:
        """The lineage position the index holds (None: it holds nothing for this pipeline)."""
        if table is None:
            return None
        at = transaction_position(table, self.fence)
        return None if at == ORIGIN else at

    def lookup(self, table: DeltaTable, keys: Collection[str]) -> Versions:
        """The versions of `keys` the index holds."""
        if len(keys) > _NAMED_LOOKUP_LIMIT:
            rows = read_all(table, where=f"pipeline = {pipeline_literal(self.pipeline)}", columns=("key", "version"))
        else:
            # Names go into the query as quoted literals (quotes doubled) so
            # that Delta's file statistics narrow the read to the files that
            # may hold them.
            named = ", ".join(string_literal(k) for k in keys)
            where = f"pipeline = {pipeline_literal(self.pipeline)} AND key IN ({named})"
            rows = read_all(table, where=where, columns=("key", "version"))
        # (DataFusion hands strings over as string views, which not every
        # Arrow kernel takes: plain strings first.)
        names, versions = (rows.column(c).cast(pa.string()) for c in ("key", "version"))
        wanted = pc.is_in(names, value_set=pa.array(list(keys), pa.string()))
        found: Versions = {}
        for key, version in zip(names.filter(wanted).to_pylist(), versions.filter(wanted).to_pylist()):
            found.setdefault(key, set()).add(version)
        return found

    def append(self, table: DeltaTable | None, rows: list[LedgerRow], at: Position, units: _Units) -> bool:
        """Add the units of `rows` (the lineage's batches after the index's
        position, up to `at`), fenced at `at`. False if another run got there first."""
        table = self._ensure(table)
        if (self.position(table) or ORIGIN) >= at:
            return False
        return self._write(table, rows, at, units, mode="append")

    def rebuild(self, table: DeltaTable | None, rows: list[LedgerRow], at: Position, units: _Units) -> bool:
        """Replace this pipeline's rows with the units of `rows` (the whole
        lineage of `at`), fenced at `at`."""
        table = self._ensure(table)
        if (self.position(table) or ORIGIN) >= at:
            return False
        return self._write(table, rows, at, units, mode="overwrite")

    def _write(self, table: DeltaTable, rows: list[LedgerRow], at: Position, units: _Units, *, mode: str) -> bool:
        columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
        for row in rows:
            for key, version in units(row):
                columns["pipeline"].append(self.pipeline)
                columns["epoch"].append(row.epoch)
                columns["batch_id"].append(row.batch_id)
                columns["key"].append(key)
                columns["version"].append(version)
        props = commit_properties(self.fence, at, {"microbatch.event": "consumed"})
        extra: dict[str, Any] = {"predicate": f"pipeline = {pipeline_literal(self.pipeline)}"} if mode == "overwrite" else {}
        try:
            write_deltalake(table, pa.table(columns, schema=SCHEMA), mode=mode, commit_properties=props, **extra)
        except Exception as exc:
            if is_commit_conflict(exc):
                return False
            raise
        return True

    def compact(self) -> None:
        """Merge the small files of recent batches (bigger files are left alone)."""
        table = self.open()
        if table is not None and len(table.file_uris()) >= COMPACT_AT_FILES:
            table.optimize.compact(target_size=SMALL_FILE_BYTES)

    def sort(self, table: DeltaTable) -> None:
        """Rewrite the index sorted by key (maintenance): each file then holds
        a narrow range of names, and a lookup reads only the files whose range
        holds a name it asks about, however many names came before."""
        table.optimize.z_order(["key"], target_size=SMALL_FILE_BYTES)


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

    def consumed(self, keys: Collection[str]) -> Versions:
        """Of `keys`, those a batch of the lineage consumed, with the versions consumed."""
        wanted = set(keys)
        if not wanted:
            return {}
        table = self.index.open()
        at = self.index.position(table)
        head = self.view.position
        if table is not None and at is not None and at.epoch == head.epoch and at <= head:
            found = self.index.lookup(table, wanted)
            for row in self._tail(at):
                _add(found, self._units(row), wanted)
            return found
        found = {}
        for row in self.view.lineage():
            _add(found, self._units(row), wanted)
        return found

    def record(self) -> None:
        """Bring the index to the ledger's head: add the batches it lacks, or
        rebuild it if it belongs to another epoch (or does not exist yet).
        Best effort: a failure leaves lookups slower, never wrong."""
        head = self.view.position
        try:
            table = self.index.open()
            at = self.index.position(table)
            if at is not None and at >= head:
                return
            if at is not None and at.epoch == head.epoch:
                self.index.append(table, self._tail(at), head, self._units)
            elif table is not None or self._head_units():
                # No index yet (a pipeline older than it), or one of an
                # earlier epoch: derive it once from the whole lineage. A
                # source whose batches consume no units never gets one.
                self.index.rebuild(table, self.view.lineage(), head, self._units)
            self.index.compact()
        except Exception as exc:  # noqa: BLE001 - the index is a cache of the ledger
            log.warning("consumed index not updated this time (%s); lookups read the ledger until it is", exc)

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


def _add(found: Versions, units: Iterable[tuple[str, str]], keys: set[str]) -> None:
    for key, version in units:
        if key in keys:
            found.setdefault(key, set()).add(version)
