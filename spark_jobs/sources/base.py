"""The `Source` protocol: what the commit protocol needs from a source.

A source answers five questions, all in plain Python (no JVM), so that a run
with nothing new ends without starting Spark:

* where a pipeline starts (`origin`);
* which records come next, after the batches of the current lineage, within
  a run's bound and caps (`plan`); the lineage is a `Lineage`, which tells
  where it ends and, for sources that need it, which units (files) it
  consumed, without the source reading the whole history;
* how much is waiting (`lag`), in the source's own terms;
* whether a planned range can still be read as planned (`verify`), before a
  replay reads it, whether the read got what was planned (`check_read`),
  and what to do with consumed data once committed (`after_commit`);
* what a stored range means (`decode`): the ledger and the state's commit
  metadata keep offsets and manifests as JSON, and only the source turns
  them back into its own typed values.

Offsets are small JSON objects, such that batch N's start equals batch
N-1's end. A manifest holds whatever the source needs to re-read a range
deterministically (for files: which files, with size and mtime). The
compute engine reads exactly a planned range; it dispatches on the
manifest's type. Adding a source means implementing `Source` (and its
`Offsets` and `Manifest`) in one new module here, and registering it in
`spark_jobs.sources.make_source`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from spark_jobs.core.dedup import Remembered

__all__ = ["BatchRange", "Caps", "Lag", "Lineage", "Manifest", "Offsets", "Source"]


class Offsets(Protocol):
    """A position in the source, as the ledger records it."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored in the ledger (`Source.decode` reads it back)."""


class Manifest(Protocol):
    """What exactly one batch covers, beyond its offsets."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored in the ledger (`Source.decode` reads it back)."""

    def inputs(self) -> list[str]:
        """What the batch reads, named for people (file names, partition ranges)."""

    def input_bytes(self) -> int | None:
        """About how many bytes the batch reads (None: not known without
        reading more than the manifest): whether its rows are best written
        by Spark's executors (`engine.state_write: auto`)."""

    def describe(self) -> str:
        """A short phrase for logs and outcomes, e.g. ``3 file(s)``."""

    def units(self) -> list[tuple[str, str]]:
        """What the batch consumed that no later batch may take again, as
        (key, version) pairs: for files, each name with its size and mtime.
        Empty for sources whose offsets alone say what was consumed."""


@dataclass(frozen=True)
class BatchRange:
    """Exactly which source records one batch covers."""

    start: Offsets
    end: Offsets
    manifest: Manifest
    #: What still waited in the source after this batch when it was planned,
    #: in the source's unit (the console charts it as lag over time).
    waiting_after: int | None = None
    #: Event time: the watermark this batch's records are judged against
    #: (`spark_jobs.core.event_time.judged_against`): the ledger head's, set
    #: at planning, so that a read made for another watermark is not taken.
    watermark: datetime | None = None
    #: Duplicates: the ids this batch drops (`spark_jobs.core.dedup.remembered_at`),
    #: set at planning as the watermark is; None without `dedup`.
    remembered: Remembered | None = None

    def describe(self) -> str:
        return f"{self.manifest.describe()}, offsets {self.start.to_dict()} -> {self.end.to_dict()}"


@dataclass(frozen=True)
class Caps:
    """Limits on one batch: the spec's `batch:` block, or a run's overrides."""

    max_files: int | None = None
    max_records: int | None = None


@dataclass(frozen=True)
class Lag:
    """How much source data waits for the pipeline, in the source's own unit."""

    count: int
    unit: str  # plural noun, e.g. "files"
    #: Of `count`, how much is dated in the future (a clock or copy gone
    #: wrong): a run bounded by a data interval does not take it until then.
    future: int = 0
    #: Where it waits, for sources with parts (a Kafka topic's partitions):
    #: (part, count) pairs, parts with nothing waiting left out.
    detail: tuple[tuple[str, int], ...] = ()
    #: When the oldest data waiting arrived (a file's modification time, a
    #: record's or commit's timestamp); None when nothing waits, when `lag`
    #: was not asked for it, or when the source cannot tell cheaply.
    oldest: datetime | None = None
    #: What a person should know about the waiting data, each naming where
    #: it is (a Kafka record dated in the future: its partition, offset and
    #: timestamp). `status` and the console list them as problems.
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        text = f"{self.count:,} {self.unit}"
        if self.future:
            text += f" ({self.future:,} dated in the future)"
        if self.detail:
            text += " (" + ", ".join(f"{part}: {n:,}" for part, n in self.detail) + ")"
        return text


class Lineage(Protocol):
    """The committed batches that make up the current state, as a source may ask about them.

    Answers cost what the question costs, not what the history holds (see
    `spark_jobs.core.lineage`).
    """

    @property
    def end(self) -> dict[str, Any]:
        """The last batch's end offsets as stored (the origin's before the first batch)."""

    def consumed(self, keys: Collection[str]) -> dict[str, set[str]]:
        """Of `keys` (units' keys, e.g. file names), those a batch of the
        lineage consumed, each with the versions it consumed."""


class Source(Protocol):
    """Plans batches over one source (see the module docstring)."""

    @property
    def origin(self) -> Offsets:
        """Offsets before the first batch."""

    def plan(self, lineage: Lineage, *, until: datetime | None, caps: Caps) -> BatchRange | None:
        """The next batch after `lineage`, or None if nothing waits.

        `until` bounds the batch by arrival time (the end of a data
        interval). Raises `SourceError` naming what cannot be read, before
        anything is planned.
        """

    def lag(self, lineage: Lineage, *, until: datetime | None = None, dated: bool = False) -> Lag:
        """How much waits after `lineage` (what `plan` would take, uncapped).
        `dated`: also find when the oldest of it arrived (`Lag.oldest`), where
        that costs more than the count (`status` asks; a sensor's poll does not)."""

    def after_commit(self, lineage: Lineage) -> int:
        """Release what the committed batches of `lineage` consumed, as the spec
        says (for files: keep, delete or archive them). Idempotent: whatever a
        crash left behind is released by the next call. Returns how many."""

    def rewinding(self, end: dict[str, Any]) -> None:
        """The pipeline is about to rewind to `end` (its offsets after the
        target batch); called before anything is restored. A source whose
        upstream keeps data for its readers says so there (a Delta source
        records its position in the upstream table); others do nothing."""

    def verify(self, batch: BatchRange) -> None:
        """Raise `SourceChangedError` if `batch` (planned earlier) can no longer
        be read as planned: a replay must read exactly what was planned."""

    def replay_gaps(self, start: dict[str, Any], batches: Sequence[BatchRange]) -> str | None:
        """Before a rewind to the batch that ended at `start`: what of
        `batches` (the lineage's batches after it, which the new epoch reads
        again) the source can no longer give, and how to get it back, said
        for people; None when a replay can read it all (or the spec accepts
        the loss: `on_data_loss: skip`). A rewind refuses before changing
        anything unless this is None: the state would lose those records
        for good, and the pipeline could be left unable to plan."""

    def check_read(self, batch: BatchRange) -> None:
        """Right after step 3's read of `batch`: raise `SourceChangedError` if
        what was read may not be what was planned (a file replaced under its
        name while the batch read it), before anything of the batch is
        written. Sources whose planned data cannot change under its offsets
        (Delta versions, Kafka offsets) do nothing: a read of data gone
        fails by itself."""

    def decode(self, start: dict[str, Any], end: dict[str, Any], manifest: dict[str, Any]) -> BatchRange:
        """A stored range (as the ledger keeps it) in this source's own types."""
