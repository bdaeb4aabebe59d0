"""The batch record is declared once (`BatchRecord`): the commit metadata's
JSON and the ledger's columns are derived from it, so a field added there
reaches both, and survives the trip through each."""

from __future__ import annotations

import json
from dataclasses import fields
from datetime import datetime, timezone

import pytest

from spark_jobs.core.commits import RECORD_FIELDS, BatchRecord, CommitKind, CommitMetadata
from spark_jobs.core.fencing import PLAN_FENCE, Position
from spark_jobs.core.ledger import SCHEMA, LedgerRow, OffsetLedger, RowStatus
from spark_jobs.errors import NewerFormatError

WHEN = datetime(2026, 11, 26, 4, 30, tzinfo=timezone.utc)


def _full_record() -> dict:
    """A value of the right kind in every field, none left at its default."""
    values = {str: "text", int: 7, datetime: WHEN, dict: {"k": [1, 2]}}
    return {f.name: values[f.kind] for f in RECORD_FIELDS}


def test_every_batch_record_field_has_a_ledger_column():
    assert [f.name for f in RECORD_FIELDS] == [f.name for f in fields(BatchRecord)]
    assert {f.name for f in RECORD_FIELDS} <= set(SCHEMA.names)


@pytest.mark.parametrize("kind", list(CommitKind))
def test_commit_metadata_keeps_every_record_field_through_json(kind):
    metadata = CommitMetadata(**_full_record(), kind=kind, position=Position(1, 4), commit_token="t", rewound_from="0/9", restored_version=3)
    back = CommitMetadata.from_dict(json.loads(metadata.to_json()), where="test")
    assert back == metadata
    assert back.record() == _full_record()


def test_commit_metadata_of_an_older_format_reads_missing_fields_as_empty():
    old = {"format_version": 1, "kind": "batch", "pipeline": "orders", "epoch": 0, "batch_id": 1}
    back = CommitMetadata.from_dict(old, where="test")
    assert (back.start_offsets, back.manifest, back.spec, back.planned_at, back.waiting_after) == ({}, {}, None, None, None)


def test_a_newer_commit_format_is_refused_by_name():
    with pytest.raises(NewerFormatError, match="state commit v12"):
        CommitMetadata.from_dict({"format_version": 99, "kind": "batch", "pipeline": "p", "epoch": 0, "batch_id": 1}, where="v12")


def test_a_ledger_row_keeps_every_record_field_through_the_table(tmp_path):
    ledger = OffsetLedger(str(tmp_path / "ledger"), "text")
    row = LedgerRow(**_full_record(), epoch=0, batch_id=1, status=RowStatus.PLANNED)
    view = ledger.load()
    assert ledger.append(view, row, PLAN_FENCE)
    (back,) = ledger.load().rows
    assert back.record() == _full_record()


def test_a_format_3_ledger_gains_the_event_time_columns_on_its_next_write(tmp_path):
    """A ledger an older microbatch wrote (no `watermark`, no `records_late`):
    its rows read with them as None, and the next append adds the columns."""
    from deltalake import write_deltalake

    from spark_jobs.core.ledger import _to_arrow

    path = str(tmp_path / "ledger")
    ledger = OffsetLedger(path, "text")
    old = LedgerRow(**{**_full_record(), "watermark": None, "records_late": None}, epoch=0, batch_id=1, status=RowStatus.PLANNED, format_version=3)
    write_deltalake(path, _to_arrow([old]).drop_columns(["watermark", "records_late"]))
    (back,) = ledger.load().rows
    assert (back.watermark, back.records_late, back.batch_id) == (None, None, 1)
    row = LedgerRow(**_full_record(), epoch=0, batch_id=2, status=RowStatus.PLANNED)
    assert ledger.append(ledger.load(), row, PLAN_FENCE)
    rows = sorted(ledger.load().rows, key=lambda r: r.batch_id)
    assert [(r.watermark, r.records_late) for r in rows] == [(None, None), (WHEN, 7)]
