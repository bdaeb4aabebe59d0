"""What happens to consumed files: keep, delete or archive (issue 11, section 8).
JVM-free: the pure-Arrow compute runs the real protocol on real Delta tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark_jobs.core.protocol import RunOptions, run_batch
from spark_jobs.core.spec import load_spec
from spark_jobs.demo.clickstream import write_wave
from spark_jobs.errors import SpecError
from tests.conftest import assert_exact, crash_at, oracle_spec_dict, write_spec
from tests.spark_jobs.arrow_compute import ArrowCompute


def _spec(tmp_path: Path, **source) -> Path:
    base = oracle_spec_dict()
    return write_spec(tmp_path, oracle_spec_dict(source={**base["source"], **source}))


def _run(spec_path: Path) -> str:
    return run_batch(load_spec(spec_path), RunOptions(run_id="test"), ArrowCompute).status


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_archive_moves_committed_files_out_of_the_source(tmp_path):
    spec_path = _spec(tmp_path, after_commit="archive", archive="archive")
    landing, archive = tmp_path / "landing", tmp_path / "archive"
    written = write_wave(landing / "dt=1", 0, files=2, records_per_file=20)
    assert _run(spec_path) == "committed"
    assert _files(landing) == [] and _files(archive) == sorted(f"dt=1/{p.name}" for p in written)
    assert _run(spec_path) == "no_new_data", "archived files are not new files"
    write_wave(landing, 1, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    assert_exact(spec_path, mirror=archive)


def test_delete_releases_only_committed_files_and_catches_up_after_a_crash(tmp_path):
    spec_path = _spec(tmp_path, after_commit="delete")
    landing = tmp_path / "landing"
    kept = tmp_path / "copy"
    write_wave(kept, 0, files=1, records_per_file=20)
    write_wave(landing, 0, files=1, records_per_file=20)

    with crash_at("after_plan"):
        _run(spec_path)
    assert len(_files(landing)) == 1, "a planned, uncommitted batch keeps its files for the replay"

    with crash_at("after_state_commit"):
        _run(spec_path)
    assert len(_files(landing)) == 1, "committed, but the run died before releasing"
    write_wave(kept, 1, files=1, records_per_file=20)
    write_wave(landing, 1, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    assert _files(landing) == [], "the next committing run released both batches' files"
    assert_exact(spec_path, mirror=kept)


def test_an_archive_inside_the_source_is_refused(tmp_path):
    """Reproduced: consumed files moved into a subfolder of the source were new files, read again."""
    with pytest.raises(SpecError, match=r"source.archive.*overlaps source.path"):
        load_spec(_spec(tmp_path, after_commit="archive", archive="landing/archive"))
    with pytest.raises(SpecError, match="after_commit: archive needs `archive"):
        load_spec(_spec(tmp_path, after_commit="archive"))


def test_once_released_a_name_may_be_used_again(tmp_path):
    """With delete, writers reuse names: a new `events.json` is new data, not the consumed one."""
    spec_path = _spec(tmp_path, after_commit="delete")
    landing, kept = tmp_path / "landing", tmp_path / "copy"
    for wave in range(3):
        [written] = write_wave(kept / f"w{wave}", wave, files=1, records_per_file=10)
        (landing / "events.json").write_bytes(written.read_bytes())
        assert _run(spec_path) == "committed", f"wave {wave}"
        assert _files(landing) == []
    spec = load_spec(spec_path)
    from spark_jobs.core.delta_io import open_table, read_all

    events = sum(r["events"] for r in read_all(open_table(spec.state_path)).to_pylist())
    assert events == 30
