"""`LiveLineage`: which committed positions make up the state, from the head and the rewinds alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spark_jobs.core.fencing import Position
from spark_jobs.core.ledger import LiveLineage

# A history: each step commits the next batch, or rewinds to one of the
# batches of the current lineage (0: the empty state).
steps = st.lists(st.one_of(st.just("commit"), st.integers(min_value=0, max_value=30)), max_size=40)


def _replay(history: list) -> tuple[Position, dict[int, int], list[tuple[int, int]], dict[tuple[int, int], int]]:
    """The history played the slow way: the lineage as a list, cut at each rewind."""
    epoch, lineage, rewinds, committed, cut = 0, [], {}, [], {}
    for step in history:
        if step == "commit":
            position = (epoch, len(lineage) + 1)
            lineage.append(position)
            committed.append(position)
        else:
            to = min(step, len(lineage))
            epoch += 1
            rewinds[epoch] = to
            for position in lineage[to:]:
                cut.setdefault(position, epoch)
            lineage = lineage[:to]
    head = Position(epoch, len(lineage))
    return head, rewinds, lineage, {p: cut[p] for p in committed if p in cut}


@settings(max_examples=300, deadline=None)
@given(steps)
def test_live_positions_and_the_rewinds_that_cut_the_others_match_a_replay(history):
    head, rewinds, lineage, cut = _replay(history)
    live = LiveLineage.of(head, rewinds)
    for epoch in range(head.epoch + 1):
        for batch_id in range(1, 42):
            assert live.holds(epoch, batch_id) == ((epoch, batch_id) in lineage)
    for position, epoch in cut.items():
        assert live.cut_by(*position) == epoch
    for position in lineage:
        assert live.cut_by(*position) is None


def test_the_predicate_names_each_live_range_and_nothing_without_one():
    live = LiveLineage.of(Position(2, 4), {1: 3, 2: 1})
    # Epoch 0 kept batch 1 (epoch 2 went back to 1), epoch 1 nothing, epoch 2 batches 2..4.
    assert live.ranges == {2: (1, 4), 0: (0, 1)}
    assert live.where() == "((epoch = 0 AND batch_id > 0 AND batch_id <= 1) OR (epoch = 2 AND batch_id > 1 AND batch_id <= 4))"
    assert LiveLineage.of(Position(1, 0), {1: 0}).where() == "FALSE"
