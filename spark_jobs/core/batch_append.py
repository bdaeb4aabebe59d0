"""A table each batch appends to once: the quarantine's, the dedup table's.

Such a table is written in step 3 of the protocol (`spark_jobs.core.protocol`),
before the state commit, so an attempt that dies after it leaves the append
made. Its own fence (an app id scoped to the pipeline) holds the position of
the last batch that appended: a replay of that batch, or a second run racing
the first, finds it there and appends nothing. Rows carry the batch's
position; after a rewind those of the abandoned batches stay, and readers
keep the live lineage's (`LiveLineage.where()`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import pyarrow as pa
from deltalake import write_deltalake

from spark_jobs.core.delta_io import ensure_table, is_commit_conflict
from spark_jobs.core.fencing import Position, commit_properties, transaction_position
from spark_jobs.core.ledger import scoped
from spark_jobs.core.staged import Staged, commit_files, require_written
from spark_jobs.errors import ConcurrentRunError

__all__ = ["APPEND_TRIES", "BatchAppend"]

#: How often a batch's append is tried again after another commit with the
#: table's fence landed first (most likely the same batch's, by a racing
#: run: the next try sees it and appends nothing).
APPEND_TRIES = 3


class BatchAppend(ABC):
    """One pipeline's table of `schema` at `path`, appended to once a batch
    on the fence `app_id` (scoped to the pipeline: two pipelines sharing a
    checkpoint folder must not fence each other out)."""

    #: What the table holds, for its name and messages ("quarantine").
    what: str
    schema: pa.Schema

    def __init__(self, path: str, pipeline: str, untracked_hours: float, app_id: str) -> None:
        self.path = path
        self.pipeline = pipeline
        self.fence = scoped(app_id, pipeline)
        #: `maintenance.untracked_files_hours`: how old the executors' files may be when committed (`require_written`).
        self.untracked_hours = untracked_hours

    def write(self, data: pa.Table | Staged, position: Position) -> bool:
        """Append batch `position`'s rows, once. True if we wrote them.

        `data`: rows as `rows` takes them, or files the executors wrote into
        the table's folder in `schema` (positions included), committed as
        they are."""
        for _ in range(APPEND_TRIES):
            table = ensure_table(self.path, self.schema, name=f"{self.pipeline} {self.what}")
            if transaction_position(table, self.fence) >= position:
                # An earlier attempt at this batch wrote them. (Files of ours
                # stay: a store may report a failure for a commit of ours that
                # landed; `maintain` removes them if no commit names them.)
                return False
            props = commit_properties(self.fence, position, {"microbatch.event": self.what})
            try:
                if isinstance(data, Staged):
                    require_written(data.root, data.files, self.untracked_hours, f"pipeline {self.pipeline}: {self.what} of {position}")
                    commit_files(table, data.files, table.schema(), props)
                else:
                    write_deltalake(table, self.rows(data, position), mode="append", commit_properties=props)
                return True
            except Exception as exc:
                if not is_commit_conflict(exc):
                    raise
                # Someone else committed with the fence since our snapshot:
                # look again (it was probably the same batch).
        # Fail closed: committing the state without them would lose them.
        raise ConcurrentRunError(
            f"pipeline {self.pipeline}: could not write the {self.what} of {position} "
            "(the table kept changing); nothing was committed, run again",
            pipeline=self.pipeline,
            path=self.path,
            position=position,
        )

    @abstractmethod
    def rows(self, data: pa.Table, position: Position) -> pa.Table:
        """`data` as the table's rows, with the batch's position."""

    def positioned(self, n: int, position: Position) -> dict[str, pa.Array]:
        """The position columns (`ledger.POSITION_COLUMNS`) of `n` rows of batch `position`."""
        return {
            "pipeline": pa.array([self.pipeline] * n, pa.string()),
            "epoch": pa.array([position.epoch] * n, pa.int64()),
            "batch_id": pa.array([position.batch_id] * n, pa.int64()),
        }
