"""The read-only views the console and `status` show: one entry per batch,
the live lineage marked, and quarantine counts of the live lineage only."""

from __future__ import annotations

import pytest

from spark_jobs.core import faults
from spark_jobs.core.delta_io import arrow, open_table, read_all
from spark_jobs.core.inspect import batches, quarantined, status
from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.rewind import rewind
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave

BAD_EVERY = 25  # one bad record in 25: 4 per 100-record wave


def _run(spec, compute) -> None:
    run_batch(spec, RunOptions(run_id="test"), compute_factory=compute)


@pytest.fixture
def rewound(spec_path, compute):
    """Two batches, a rewind to 1, and the replay: batch 2 of epoch 0 is dead."""
    spec = load_spec(spec_path)
    for wave in range(2):
        write_wave(spec.source_path, wave, files=1, records_per_file=100, bad_every=BAD_EVERY)
        _run(spec, compute)
    rewind(spec, 1, run_id="test-rewind")
    _run(spec, compute)
    return spec


def test_one_entry_per_batch_with_the_rewound_ones_marked(rewound):
    views = {(v.row.epoch, v.row.batch_id): v for v in batches(rewound, 10)}
    assert list(views) == [(0, 1), (0, 2), (1, 1), (1, 2)]  # no separate `planned` entries
    assert [(v.phase, v.live, v.rewound_in_epoch) for v in views.values()] == [
        ("committed", True, None),
        ("committed", False, 1),
        ("rewind", False, None),
        ("committed", True, None),
    ]
    replayed = views[(1, 2)].to_dict()
    # The ledger row's fields stay, the view's are added.
    assert replayed["status"] == "committed" and replayed["planned_at"] and replayed["records_in"] == 100
    assert replayed["inputs"] == views[(0, 2)].inputs and replayed["input_count"] == 1
    assert replayed["arrival_to_commit_s"] is not None and replayed["arrival_to_commit_s"] >= 0


def test_quarantine_counts_the_live_lineage_unless_asked_for_all(rewound):
    rows = read_all(open_table(rewound.quarantine_path))
    assert rows.num_rows == 12  # batch 2's bad records twice: epochs 0 and 1
    live = quarantined(rewound)
    assert live.total == 8 and live.lineage == "live"
    assert {(r["epoch"], r["batch_id"]) for r in live.rows} == {(0, 1), (1, 2)}
    everything = quarantined(rewound, lineage="all")
    assert everything.total == 12
    assert status(rewound).quarantined == 8
    # A dead batch is still there when asked for by its epoch; by its id alone, the live one answers.
    assert quarantined(rewound, batch_id=2, epoch=0).total == 4
    assert {r["epoch"] for r in quarantined(rewound, batch_id=2).rows} == {1}
    with pytest.raises(ValueError, match="lineage"):
        quarantined(rewound, lineage="dead")


def test_a_reason_filter_keeps_every_reason_counted(rewound):
    everything = quarantined(rewound)
    (reason, count), *_ = everything.by_reason.items()
    only = quarantined(rewound, reason=reason, limit=None)
    assert only.by_reason == everything.by_reason
    assert only.total == count == len(only.rows) and {r["reason"] for r in only.rows} == {reason}


def test_a_plan_left_by_a_crash_is_pending_and_a_rewound_plan_abandoned(spec_path, compute):
    spec = load_spec(spec_path)
    write_wave(spec.source_path, 0, files=1, records_per_file=20)
    _run(spec, compute)
    write_wave(spec.source_path, 1, files=1, records_per_file=20)

    def crash(point: str) -> None:
        if point == "after_plan":
            raise RuntimeError("crash after the plan")

    faults.set_hook(crash)
    try:
        with pytest.raises(RuntimeError, match="crash after the plan"):
            _run(spec, compute)
    finally:
        faults.set_hook(None)
    (*_, pending) = batches(spec, 10)
    assert (pending.row.batch_id, pending.phase, pending.live) == (2, "pending", False)
    assert pending.to_dict()["status"] == "planned"
    rewind(spec, 1, run_id="test-rewind")
    abandoned = next(v for v in batches(spec, 10) if (v.row.epoch, v.row.batch_id) == (0, 2))
    assert (abandoned.phase, abandoned.rewound_in_epoch) == ("abandoned", 1)


def test_the_readme_query_counts_the_live_quarantine(rewound):
    """The SQL the README gives users counts what the console and `status` do."""
    import re

    from deltalake import DeltaTable, QueryBuilder

    from tests.conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    (sql,) = re.findall(r'print\(qb\.execute\("""\n(SELECT q\.reason.*?)"""\)', readme, re.S)
    sql = sql.replace("'clicks_per_user'", f"'{rewound.name}'")
    qb = (
        QueryBuilder()
        .register("ledger", DeltaTable(rewound.ledger_path))
        .register("quarantine", DeltaTable(rewound.quarantine_path))
    )
    counts = dict(zip(*arrow(qb.execute(sql).read_all()).to_pydict().values()))
    assert counts == quarantined(rewound).by_reason and sum(counts.values()) == 8
