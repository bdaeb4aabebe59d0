"""One pipeline's tables and source, as its spec names them."""

from __future__ import annotations

from spark_jobs.core.dedup import SeenIds
from spark_jobs.core.fencing import Position
from spark_jobs.core.ledger import LedgerRow, LedgerView, OffsetLedger
from spark_jobs.core.lineage import ConsumedIndex, LedgerLineage
from spark_jobs.core.quarantine import Quarantine
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.core.state import StateTable
from spark_jobs.sources import BatchRange, Source, make_source

__all__ = ["Pipeline"]


class Pipeline:
    """The offset ledger, consumed index, state, quarantine, dedup table and source of one spec."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        self.ledger = OffsetLedger(spec.ledger_path, spec.name)
        self.consumed = ConsumedIndex(spec.consumed_path, spec.name)
        self.state = StateTable(spec)
        self.quarantine = Quarantine(spec.quarantine_path, spec.name, spec.maintenance.untracked_files_hours)
        self.dedup = SeenIds(spec.dedup_path, spec.name, spec.maintenance.untracked_files_hours)
        self.source: Source = make_source(spec)
        #: The ledger version and head this process last settled its windows
        #: at (`windows.settle`): a catch-up's step 1 finds the view its step 5
        #: just settled, and need not settle it again.
        self.settled_at: tuple[int, Position] | None = None

    def batch(self, row: LedgerRow) -> BatchRange:
        """A ledger row's range, in the source's own types."""
        return self.source.decode(row.start_offsets, row.end_offsets, row.manifest)

    def lineage(self, view: LedgerView) -> LedgerLineage:
        """The lineage at `view`'s head, as the source asks about it."""
        return LedgerLineage(view, self.source, self.consumed)
