"""Fencing with Delta application transactions (`txn` actions).

Every table this job writes carries a *fence*: one application id per
purpose, whose version is the pipeline position ``(epoch, batch_id)`` packed
into one integer. A commit is made from a snapshot whose fence we have
checked, and carries the fence's next value.

Why one app id per table and not one per epoch: delta-rs's conflict checker
fails a commit when any commit that won since its snapshot carries a ``txn``
for an app id the committing transaction also carries, whatever the versions
(verified: six processes, same snapshot, different versions, one winner). So
with a single app id, *any* interleaved commit of ours invalidates a stale
writer: a run paused after reading (a zombie) cannot commit once another run
has committed anything, not even after a rewind started a new epoch. With an
app id per epoch (``pipeline#epoch``) the zombie of an old epoch would carry a
different app id and slip through.

delta-rs does not skip a commit whose (app, version) is already recorded in
the snapshot it read (delta-rs#2580), so the "has this already happened?"
check is ours: `transaction_position`.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltalake import CommitProperties, DeltaTable, Transaction

__all__ = [
    "COMMIT_FENCE",
    "ORIGIN",
    "PLAN_FENCE",
    "QUARANTINE_FENCE",
    "STATE_FENCE",
    "Position",
    "commit_properties",
    "transaction_position",
]

# App ids of the fences. Each table's fence orders one kind of event.
STATE_FENCE = "microbatch.state"  # state table: batch commits and rewinds
PLAN_FENCE = "microbatch.plan"  # ledger: `planned` rows
COMMIT_FENCE = "microbatch.commit"  # ledger: `committed` and `rewound` rows
QUARANTINE_FENCE = "microbatch.quarantine"  # quarantine table: one append per batch

_BATCH_BITS = 32


@dataclass(frozen=True, order=True)
class Position:
    """Where a pipeline is: the batch last committed, in the epoch it belongs to.

    Ordered by (epoch, batch_id): a rewind starts a higher epoch, so positions
    only ever grow even when batch ids go back.
    """

    epoch: int
    batch_id: int

    def encode(self) -> int:
        if not (0 <= self.batch_id < 2**_BATCH_BITS and 0 <= self.epoch < 2**30):
            raise ValueError(f"position out of range: {self}")
        return (self.epoch << _BATCH_BITS) | self.batch_id

    @classmethod
    def decode(cls, version: int | None) -> Position:
        if version is None:
            return ORIGIN
        return cls(version >> _BATCH_BITS, version & (2**_BATCH_BITS - 1))

    def next(self) -> Position:
        return Position(self.epoch, self.batch_id + 1)

    def __str__(self) -> str:
        return f"batch {self.batch_id} (epoch {self.epoch})"


#: Before the first batch.
ORIGIN = Position(0, 0)


def transaction_position(table: DeltaTable, app_id: str) -> Position:
    """The fence's position in the snapshot `table` holds."""
    return Position.decode(table.transaction_version(app_id))


def commit_properties(app_id: str, position: Position, metadata: dict[str, str]) -> CommitProperties:
    """Commit properties that advance fence `app_id` to `position`.

    delta-rs's default commit retries stay on: a retry re-runs the conflict
    checker, which still fails the commit if a winner carried the same app id,
    while unrelated interleavings (a `planned` row racing a `committed` row on
    the ledger, which use different fences) rebase and succeed.
    """
    return CommitProperties(
        custom_metadata=metadata,
        app_transactions=[Transaction(app_id, position.encode())],
    )
