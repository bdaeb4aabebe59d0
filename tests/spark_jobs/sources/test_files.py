"""Files source: late files, out-of-order names, files being written, caps, arrival bounds."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from spark_jobs.errors import SourceError
from spark_jobs.sources.base import Caps
from spark_jobs.sources.files import FileOffsets, FilesSource, LocalLister
from tests.conftest import BatchesLineage


def _write(folder: Path, name: str, lines: int = 1, mtime: float | None = None) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"n": {i}}}\n' for i in range(lines)))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _source(folder: Path) -> FilesSource:
    return FilesSource(LocalLister(str(folder)), "json")


def _names(batch) -> list[str]:
    return batch.manifest.inputs()


def test_file_with_earlier_name_landing_late_is_read_once(tmp_path):
    source = _source(tmp_path)
    _write(tmp_path, "b.json", mtime=1000)
    _write(tmp_path, "c.json", mtime=1001)
    first = source.plan(BatchesLineage())
    assert _names(first) == ["b.json", "c.json"]
    consumed = [first]
    # a.json sorts before everything consumed and lands afterwards.
    _write(tmp_path, "a.json", mtime=2000)
    second = source.plan(BatchesLineage(*consumed))
    assert _names(second) == ["a.json"]
    assert second.start == first.end == FileOffsets(2)
    assert second.end.to_dict() == {"files": 3}
    assert source.plan(BatchesLineage(*consumed, second)) is None


def test_late_file_with_old_mtime_is_picked_up(tmp_path):
    """A copy that preserved an old modification time is still new to the pipeline."""
    source = _source(tmp_path)
    _write(tmp_path, "new.json", mtime=5000)
    consumed = [source.plan(BatchesLineage())]
    _write(tmp_path, "old.json", mtime=10)
    assert _names(source.plan(BatchesLineage(*consumed))) == ["old.json"]


def test_files_being_written_are_ignored(tmp_path):
    source = _source(tmp_path)
    for name in [".part-1.json", "_temporary/x.json", "x.json.tmp", "y.json.inprogress", "z.json.crc", "_SUCCESS", ".hidden/a.json", "w.json._COPYING_"]:
        _write(tmp_path, name)
    assert source.plan(BatchesLineage()) is None
    _write(tmp_path, "ready.json")
    assert _names(source.plan(BatchesLineage())) == ["ready.json"]


def test_subfolders_are_listed(tmp_path):
    source = _source(tmp_path)
    _write(tmp_path, "dt=2026-01-01/a.json", mtime=1)
    _write(tmp_path, "dt=2026-01-02/a.json", mtime=2)
    assert _names(source.plan(BatchesLineage())) == ["dt=2026-01-01/a.json", "dt=2026-01-02/a.json"]


def test_max_files_cap(tmp_path):
    source = _source(tmp_path)
    for i in range(5):
        _write(tmp_path, f"f{i}.json", mtime=100 + i)
    batch = source.plan(BatchesLineage(), caps=Caps(max_files=2))
    assert _names(batch) == ["f0.json", "f1.json"]
    batch2 = source.plan(BatchesLineage(batch), caps=Caps(max_files=2))
    assert _names(batch2) == ["f2.json", "f3.json"]


def test_max_records_cap_takes_whole_files_and_at_least_one(tmp_path):
    source = _source(tmp_path)
    _write(tmp_path, "a.json", lines=3, mtime=1)
    _write(tmp_path, "b.json", lines=3, mtime=2)
    _write(tmp_path, "c.json", lines=3, mtime=3)
    assert _names(source.plan(BatchesLineage(), caps=Caps(max_records=7))) == ["a.json", "b.json"]
    # A file larger than the cap is taken alone rather than never.
    assert _names(source.plan(BatchesLineage(), caps=Caps(max_records=1))) == ["a.json"]


def test_until_bounds_by_arrival_time(tmp_path):
    source = _source(tmp_path)
    _write(tmp_path, "early.json", mtime=1_000)
    _write(tmp_path, "late.json", mtime=3_000)
    until = datetime.fromtimestamp(2_000, tz=timezone.utc)
    assert _names(source.plan(BatchesLineage(), until=until)) == ["early.json"]
    consumed = [source.plan(BatchesLineage(), until=until)]
    assert source.plan(BatchesLineage(*consumed), until=until) is None
    assert _names(source.plan(BatchesLineage(*consumed))) == ["late.json"]


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        _source(tmp_path / "nope").plan(BatchesLineage())


def test_a_path_spark_cannot_glob_is_refused_by_name_before_planning(tmp_path):
    """':' with a glob character in one path: Hadoop's globber cannot rebuild it."""
    source = _source(tmp_path)
    _write(tmp_path, "10:00:00 [retry].json")
    _write(tmp_path, "10:00:00.json")  # a ':' alone is fine
    with pytest.raises(SourceError, match=r"10:00:00 \[retry\]\.json .*both ':' and one of .*Rename it"):
        source.plan(BatchesLineage())
    os.rename(tmp_path / "10:00:00 [retry].json", tmp_path / "10-00-00 [retry].json")
    assert sorted(_names(source.plan(BatchesLineage()))) == ["10-00-00 [retry].json", "10:00:00.json"]
