"""What happens to consumed files: keep, delete or archive (issue 11, section 8).
JVM-free: the pure-Arrow compute runs the real protocol on real Delta tables."""

from __future__ import annotations

import os
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


# -- releasing only what was consumed (issue 31, section 4) ---------------------------------

NEW_EVENT = '{"event_id": "new-1", "user_id": "late", "amount": 7.0, "ts": "2026-01-01T00:00:00Z"}\n'


def _land(landing: Path, name: str, text: str) -> None:
    """A writer landing a file as writers should: written under a temporary
    name, then renamed into place (atomic; it replaces a file of that name)."""
    staged = landing / f"_{name}.tmp"
    staged.write_text(text)
    os.rename(staged, landing / name)


def _late_user_events(spec_path: Path) -> int | None:
    from spark_jobs.core.delta_io import open_table, read_all

    rows = {r["user_id"]: r for r in read_all(open_table(load_spec(spec_path).state_path)).to_pylist()}
    return rows["late"]["events"] if "late" in rows else None


@pytest.mark.parametrize("release", ["delete", "archive"])
def test_a_file_landed_under_a_consumed_name_after_the_listing_is_not_released(tmp_path, monkeypatch, release):
    """Reproduced: the release listed the folder, a writer renamed a new file
    into place under a consumed name, and the release deleted it unread."""
    from spark_jobs.core import faults
    from spark_jobs.sources.files import LocalLister

    extra = {"archive": "archive"} if release == "archive" else {}
    spec_path = _spec(tmp_path, after_commit=release, **extra)
    landing = tmp_path / "landing"
    [consumed] = write_wave(landing, 0, files=1, records_per_file=20)
    releasing = []
    faults.set_hook(lambda point: releasing.append(True) if point == "after_ledger_commit" else None)
    listing = LocalLister.list

    def list_then_a_writer_lands(self, until):
        found = listing(self, until)
        if releasing and consumed.name in {f.name for f in found}:
            _land(landing, consumed.name, NEW_EVENT)
        return found

    monkeypatch.setattr(LocalLister, "list", list_then_a_writer_lands)
    try:
        assert _run(spec_path) == "committed"
    finally:
        faults.set_hook(None)
    assert (landing / consumed.name).read_text() == NEW_EVENT, "the writer's file stays"
    monkeypatch.undo()
    assert _run(spec_path) == "committed"
    assert _late_user_events(spec_path) == 1
    assert _files(landing) == []


def test_a_writer_renaming_into_place_during_the_release_keeps_its_file(tmp_path, monkeypatch):
    """The narrowest window: between the release's check of the file and its
    removal. The release holds the file aside first and finds that what it
    moved is not what it checked: it puts the writer's file back."""
    from spark_jobs.sources import files

    spec_path = _spec(tmp_path, after_commit="delete")
    landing = tmp_path / "landing"
    [consumed] = write_wave(landing, 0, files=1, records_per_file=20)
    rename = os.rename

    def writer_first(src, dst):
        if os.path.basename(str(dst)).startswith(files.RELEASE_PREFIX) and not (landing / "_raced").exists():
            (landing / "_raced").mkdir()
            _land(landing, consumed.name, NEW_EVENT)
        rename(src, dst)

    monkeypatch.setattr(files.os, "rename", writer_first)
    assert _run(spec_path) == "committed"
    assert (landing / "_raced").exists(), "the writer raced the release"
    assert (landing / consumed.name).read_text() == NEW_EVENT
    assert not [p for p in landing.iterdir() if p.name.startswith(files.RELEASE_PREFIX)]
    monkeypatch.undo()
    assert _run(spec_path) == "committed"
    assert _late_user_events(spec_path) == 1


def test_a_file_held_aside_by_a_release_that_died_is_put_back(tmp_path, monkeypatch):
    """A release that died between holding a file aside and releasing it: the
    next run puts a writer's file back (here before it plans, so the file is
    read at once) and releases a consumed one; one held for less than
    `HELD_GRACE_S` may be another run's release in progress and is left alone."""
    from spark_jobs.sources import files

    spec_path = _spec(tmp_path, after_commit="delete")
    landing = tmp_path / "landing"
    write_wave(landing, 0, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    held = landing / f"{files.RELEASE_PREFIX}0123abcd-events.json"
    held.write_text(NEW_EVENT)
    assert _run(spec_path) == "no_new_data", "held a moment ago: another run's release, left to it"
    assert held.exists()
    monkeypatch.setattr(files, "HELD_GRACE_S", 0.0)
    assert _run(spec_path) == "committed"  # put back before planning, and read
    assert not held.exists() and _late_user_events(spec_path) == 1


def test_a_consumed_file_held_aside_is_released_not_read_again(tmp_path, monkeypatch):
    """The crash left the consumed events.json held aside, and a writer has
    landed a new events.json since: the held file is released, never put back
    under another name to be read twice."""
    from spark_jobs.sources import files

    monkeypatch.setattr(files, "HELD_GRACE_S", 0.0)
    spec_path = _spec(tmp_path, after_commit="delete")
    landing = tmp_path / "landing"
    [consumed] = write_wave(landing, 0, files=1, records_per_file=20)
    before = consumed.stat()

    def die_after_holding(held: str) -> None:
        raise SystemExit("the release died after holding the file aside")

    monkeypatch.setattr(files.LocalLister, "remove", lambda self, f: self._release(f, die_after_holding))
    with pytest.raises(SystemExit):
        _run(spec_path)
    monkeypatch.undo()
    monkeypatch.setattr(files, "HELD_GRACE_S", 0.0)
    [held] = [p for p in landing.iterdir() if p.name.startswith(files.RELEASE_PREFIX)]
    assert held.stat().st_mtime_ns == before.st_mtime_ns
    _land(landing, consumed.name, NEW_EVENT)
    assert _run(spec_path) == "committed"
    assert sorted(p.name for p in landing.iterdir()) == [], "the held file released, the writer's read and released"
    spec = load_spec(spec_path)
    from spark_jobs.core.delta_io import open_table, read_all

    assert sum(r["events"] for r in read_all(open_table(spec.state_path)).to_pylist()) == 21, "20 + the writer's 1, none twice"


def _orders_spec(tmp_path: Path, after_commit: str) -> Path:
    return write_spec(tmp_path, {
        "name": "orders",
        "source": {"type": "files", "path": "landing", "format": "json", "schema": "k STRING, n BIGINT",
                   "after_commit": after_commit, **({"archive": "archive"} if after_commit == "archive" else {})},
        "transform": "SELECT k, sum(n) AS n FROM batch GROUP BY k",
        "state": {"path": "lake/state", "keys": ["k"], "merge": {"n": "sum"}},
        "checkpoint": "lake/_checkpoints/orders",
    })


def _state(spec_path: Path) -> dict[str, int]:
    import json

    from tests.conftest import run_cli

    result = run_cli("query", str(spec_path), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    return {row["k"]: row["n"] for row in json.loads(result.stdout)}


@pytest.mark.parametrize("after_commit", ["delete", pytest.param("archive", marks=pytest.mark.slow)])
def test_a_file_renamed_over_a_planned_one_before_the_read_is_never_counted_for_it(tmp_path, after_commit, on_connect):
    """Issue 46, item 2, through the CLI with real Spark: `orders.json`
    (`a: 1`) is planned, then a writer renames a new `orders.json` (`a: 100`,
    `b: 5`) over it before Spark reads it. The batch read the new bytes under
    the old file's size and mtime, so the release kept the new file and the
    next batch read it again: a = 200, b = 10, and the original never counted.
    Now the read is checked against the plan: the batch stops before any
    write, the replay is refused by name, and after the rewind the new file
    counts once."""
    import json
    import time

    from tests.conftest import run_cli, start_cli

    spec_path = _orders_spec(tmp_path, after_commit)
    landing = tmp_path / "landing"
    (landing / "orders.json").write_text('{"k": "a", "n": 1}\n')
    hold = tmp_path / "hold"
    hold.touch()
    run = start_cli("run", str(spec_path), env={"MICROBATCH_HOLD_POINT": "after_plan", "MICROBATCH_HOLD_FILE": str(hold)})
    assert "hold after_plan" in _until_hold(run)
    time.sleep(0.05)  # a distinct mtime
    replacement = landing / ".orders.json.tmp"
    replacement.write_text('{"k": "a", "n": 100}\n{"k": "b", "n": 5}\n')
    os.rename(replacement, landing / "orders.json")
    hold.unlink()
    _, err = run.communicate(timeout=300)
    assert run.returncode == 2, err[-2000:]
    assert "orders.json" in err and "while this batch read it" in err
    assert not (tmp_path / "lake" / "state" / "_delta_log").exists(), "no state table: nothing committed"
    assert not list((tmp_path / "lake" / "state").rglob("*.parquet")), "the files the read wrote were dropped"
    again = run_cli("run", str(spec_path))
    assert again.returncode == 2 and "was rewritten" in again.stderr, again.stderr[-2000:]
    assert run_cli("rewind", str(spec_path), "--to-batch", "0").returncode == 0
    done = run_cli("run", str(spec_path), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["status"] == "committed", done.stderr[-2000:]
    assert run_cli("run", str(spec_path)).returncode == 0
    assert _state(spec_path) == {"a": 100, "b": 5}
    assert _files(landing) == []


def _until_hold(run) -> str:
    """Stderr lines up to the hold's marker."""
    seen = []
    for line in run.stderr:
        seen.append(line)
        if "hold after_plan" in line:
            break
    return "".join(seen)


def test_a_rewind_past_files_delete_released_is_refused_and_changes_nothing(tmp_path):
    """Issue 46, item 3, for files: a rewind re-reads the files of the
    batches after its target, and `after_commit: delete` deleted them, so
    the rewind would drop their records from the state for good. Refused by
    name before anything changes: the pipeline goes on exactly."""
    from spark_jobs.core.rewind import rewind
    from spark_jobs.errors import RewindError

    spec_path = _spec(tmp_path, after_commit="delete")
    kept = tmp_path / "copy"
    for wave in range(2):
        write_wave(kept, wave, files=1, records_per_file=20)
        write_wave(tmp_path / "landing", wave, files=1, records_per_file=20)
        assert _run(spec_path) == "committed"
    spec = load_spec(spec_path)
    with pytest.raises(RewindError, match=r"cannot rewind to batch 1: .*1 file\(s\) those batches read are no longer in .*after_commit: delete"):
        rewind(spec, 1, run_id="test")
    write_wave(kept, 2, files=1, records_per_file=20)
    write_wave(tmp_path / "landing", 2, files=1, records_per_file=20)
    assert _run(spec_path) == "committed"
    assert [r.batch_id for r in assert_exact(spec_path, mirror=kept)] == [1, 2, 3]
