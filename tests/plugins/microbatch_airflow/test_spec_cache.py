"""Issue 48: the dag-processor loads a spec only when its file changed
(`spec_cache`), and builds the same DAGs from the specs it kept."""

from __future__ import annotations

import os
import pickle

from tests.conftest import oracle_spec_dict, write_spec
from tests.plugins.microbatch_airflow.test_dag_factory import _parsed_as_a_task, write_plain_kept_and_chained


def _folder(tmp_path):
    folder = tmp_path / "pipelines"
    (folder / "landing").mkdir(parents=True)
    write_plain_kept_and_chained(folder)
    return folder


def test_an_unchanged_spec_is_not_loaded_again_and_its_dag_is_the_same(tmp_path, monkeypatch):
    from airflow.serialization.serialized_objects import DagSerialization

    folder, cache = _folder(tmp_path), tmp_path / "cache"
    first, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert len(loaded) == 3
    again, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert loaded == []
    assert sorted(again.dag_ids) == ["chained", "kept", "kept_maintenance", "plain"]
    for dag_id in first.dag_ids:
        assert DagSerialization.to_dict(again.dags[dag_id]) == DagSerialization.to_dict(first.dags[dag_id]), dag_id
    # A task's parse reads what the dag-processor kept, too.
    alone, loaded = _parsed_as_a_task(monkeypatch, folder, "plain", cache)
    assert alone.dag_ids == ["plain"] and loaded == []


def test_an_edit_shows_at_the_next_parse_even_with_its_size_and_time_kept(tmp_path, monkeypatch):
    """The edit a cache keyed on size and modification time would miss: the
    same number of bytes, the old modification time put back (`cp -p`,
    `touch -r`, some editors and sync tools). The change time still moves."""
    folder, cache = _folder(tmp_path), tmp_path / "cache"
    first, _ = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert "test pipeline" in first.dags["plain"].doc_md
    spec = folder / "plain.yaml"
    before = spec.stat()
    text = spec.read_text()
    assert "test pipeline" in text
    spec.write_text(text.replace("test pipeline", "best pipeline", 1))
    os.utime(spec, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (spec.stat().st_size, spec.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    edited, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert loaded == [str(spec)]
    assert "best pipeline" in edited.dags["plain"].doc_md


def test_a_broken_spec_is_not_kept_a_removed_one_is_forgotten_and_a_damaged_cache_is_ignored(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    from tests.conftest import ROOT

    folder, cache = _folder(tmp_path), tmp_path / "cache"
    (folder / "broken.yaml").write_text("name: broken\nsource: {type: files}\n")
    _parsed_as_a_task(monkeypatch, folder, None, cache)
    monkeypatch.setenv("MICROBATCH_PIPELINES_DIR", str(folder))
    # Its error, again at each parse of the errors' file.
    for _ in range(2):
        bag = DagBag(dag_folder=str(ROOT / "dags" / "microbatch_spec_errors.py"))
        (error,) = bag.import_errors.values()
        assert "broken.yaml" in error
    (kept_file,) = (cache / "specs").glob("*.pickle")
    assert sorted(os.path.basename(p) for p in pickle.loads(kept_file.read_bytes())["specs"]) == ["chained.yaml", "kept.yaml", "plain.yaml"]
    write_spec(folder, oracle_spec_dict(name="broken", checkpoint="lake/_checkpoints/broken"), "broken.yaml")
    (folder / "kept.yaml").unlink()
    fixed, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert loaded == [str(folder / "broken.yaml")]
    assert sorted(fixed.dag_ids) == ["broken", "chained", "plain"]
    assert sorted(os.path.basename(p) for p in pickle.loads(kept_file.read_bytes())["specs"]) == ["broken.yaml", "chained.yaml", "plain.yaml"]
    kept_file.write_bytes(b"not a pickle")
    damaged, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert sorted(damaged.dag_ids) == ["broken", "chained", "plain"] and len(loaded) == 3


def test_specs_kept_by_other_code_are_loaded_again(tmp_path, monkeypatch):
    """An upgrade (or an edit) of the code that validates a spec changes its
    digest, and the specs an older version kept are validated afresh."""
    from microbatch_airflow import spec_cache

    folder, cache = _folder(tmp_path), tmp_path / "cache"
    _parsed_as_a_task(monkeypatch, folder, None, cache)
    _, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert loaded == []
    real = spec_cache._code_version()
    monkeypatch.setattr(spec_cache, "_code_version", lambda: real + "-upgraded")
    _, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert len(loaded) == 3


def test_what_the_file_does_not_decide_is_checked_at_every_parse(tmp_path, monkeypatch):
    """Found by a review: the storage roots (an environment variable) and
    the symlinks a location resolves through are not in the spec's file; a
    kept spec is checked against them as they are now."""
    from airflow.dag_processing.dagbag import DagBag

    from tests.conftest import ROOT

    folder, cache = _folder(tmp_path), tmp_path / "cache"
    monkeypatch.setenv("MICROBATCH_STORAGE_ROOTS", str(tmp_path))
    first, _ = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert "plain" in first.dag_ids
    # The operator narrows the roots: the kept specs are outside them now.
    monkeypatch.setenv("MICROBATCH_STORAGE_ROOTS", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MICROBATCH_CACHE_DIR", str(cache))
    bag = DagBag(dag_folder=str(ROOT / "dags" / "microbatch_spec_errors.py"))
    (error,) = bag.import_errors.values()
    assert "plain.yaml" in error and "outside the allowed storage roots" in error
    # A symlink that takes a location out of the roots, under unchanged specs.
    monkeypatch.setenv("MICROBATCH_STORAGE_ROOTS", str(folder))
    _parsed_as_a_task(monkeypatch, folder, None, cache)
    (tmp_path / "outside").mkdir()
    (folder / "landing").rmdir()
    (folder / "landing").symlink_to(tmp_path / "outside")
    bag = DagBag(dag_folder=str(ROOT / "dags" / "microbatch_spec_errors.py"))
    assert "outside the allowed storage roots" in "".join(bag.import_errors.values())


def test_a_damaged_entry_loads_its_file_and_a_cache_others_may_write_is_not_read(tmp_path, monkeypatch):
    """A pickle runs code as it loads: a cache file or folder that another
    user may write is ignored (and its specs loaded); an entry cut short
    loads its spec's file instead of failing the parse."""
    folder, cache = _folder(tmp_path), tmp_path / "cache"
    _parsed_as_a_task(monkeypatch, folder, None, cache)
    (kept_file,) = (cache / "specs").glob("*.pickle")
    data = pickle.loads(kept_file.read_bytes())
    plain = next(k for k in data["specs"] if k.endswith("plain.yaml"))
    signature, spec = data["specs"][plain]
    data["specs"][plain] = (signature, spec[: len(spec) // 2])
    kept_file.write_bytes(pickle.dumps(data))
    bag, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert loaded == [plain] and "plain" in bag.dag_ids
    kept_file.chmod(0o666)
    bag, loaded = _parsed_as_a_task(monkeypatch, folder, None, cache)
    assert len(loaded) == 3 and sorted(bag.dag_ids) == ["chained", "kept", "kept_maintenance", "plain"]
