"""Chaos: overlapping CLI runs SIGKILLed at random moments from outside.

Each round lands a wave, starts two runs at once, and kills one or both at a
random time; a final drain must leave the state equal to the oracle. CI runs
a short version; `make soak` runs the long one (marked slow).
"""

from __future__ import annotations

import json
import random
import signal

import pytest

from spark_jobs.demo.clickstream import write_wave
from tests.conftest import assert_exact, kill_some, oracle_spec_dict, run_cli, start_cli, write_spec


def _chaos(spec_path, rounds: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    landing = spec_path.parent / "landing"
    counts = {"runs": 0, "killed": 0}
    for wave in range(rounds):
        write_wave(landing, wave, files=rng.randint(1, 3), records_per_file=150, users=40, seed=seed, bad_every=41)
        procs = [start_cli("run", str(spec_path), "--max-files", "2") for _ in range(2)]
        for code, err in kill_some(procs, rng, counts, within=12.0, chance=0.7, timeout=300):
            # A run that was not killed must have succeeded (0) whatever happened around it.
            assert code in (0, -signal.SIGKILL), err
    for _ in range(rounds * 3 + 2):  # drain
        result = run_cli("run", str(spec_path), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        if json.loads(result.stdout)["status"] == "no_new_data":
            break
    assert_exact(spec_path)
    return counts


def test_random_kills_and_overlapping_runs_end_exact(spec_path):
    counts = _chaos(spec_path, rounds=4, seed=1)
    print(counts)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_chaos_soak(spec_path, seed):
    print(_chaos(spec_path, rounds=30, seed=seed))


def _rewind_or_maintain(spec, rng: random.Random, counts: dict[str, int], wave: int, rounds: int, *, chance: float, back: int, keep: int) -> None:
    """Now and then rewind `spec` up to `back` batches, and maintain it keeping `keep` batches.

    Random, but each tried at least once before the drain: the kills'
    timing changes which draws the generator makes, so no seed can promise it."""
    if rng.random() < chance or (wave >= rounds - 2 and not counts["rewinds"]):
        head = json.loads(run_cli("status", str(spec), "--json").stdout)["last_batch"]
        if head > 1:
            result = run_cli("rewind", str(spec), "--to-batch", str(rng.randint(max(head - back, 1), head - 1)))
            assert result.returncode == 0, result.stderr[-2000:]
            counts["rewinds"] += 1
    if rng.random() < chance or (wave == rounds - 1 and not counts["maintains"]):
        result = run_cli("maintain", str(spec), "--keep-batches", str(keep))
        assert result.returncode == 0, result.stderr[-2000:]
        counts["maintains"] += 1


def _chain_chaos(folder, rounds: int, seed: int, reader: str = "driver") -> dict[str, int]:
    """Chained pipelines driven through the CLI: each round lands a wave,
    runs the upstream and the downstream at once and kills some of them, and
    now and then rewinds the upstream or maintains it (keeping 2 batches).
    The drain must leave the downstream equal to the upstream's state, summed."""
    from tests.conftest import assert_chain_exact, chain_specs

    rng = random.Random(seed)
    upstream, downstream = chain_specs(folder, reader)
    landing = folder / "landing"
    counts = {"runs": 0, "killed": 0, "rewinds": 0, "maintains": 0}
    for wave in range(rounds):
        write_wave(landing, wave, files=rng.randint(1, 2), records_per_file=80, users=30, seed=seed)
        procs = [start_cli("run", str(upstream)), start_cli("run", str(downstream))]
        for code, err in kill_some(procs, rng, counts, within=10.0, chance=0.5, timeout=300):
            # Before the upstream's first commit, its state is not a table yet: retryable.
            assert code in (0, -signal.SIGKILL) or (code == 1 and "does not exist yet" in err), err
        _rewind_or_maintain(upstream, rng, counts, wave, rounds, chance=0.5, back=2, keep=2)
    for spec in (upstream, downstream):
        for _ in range(rounds * 4 + 4):  # drain
            result = run_cli("run", str(spec), "--json")
            assert result.returncode == 0, result.stderr[-2000:]
            if json.loads(result.stdout)["status"] == "no_new_data":
                break
    assert_chain_exact(upstream, downstream)
    return counts


def test_chained_pipelines_end_exact_through_kills_upstream_rewinds_and_maintenance(tmp_path):
    counts = _chain_chaos(tmp_path, rounds=4, seed=11)
    print(counts)
    # A rewind needs a head past batch 1, which kills can keep it from reaching.
    assert counts["maintains"], counts


@pytest.mark.slow
def test_a_chain_read_by_spark_ends_exact_through_the_same_chaos(tmp_path):
    """The downstream reads with delta-spark on the executors (`source.reader:
    spark`): the same kills, rewinds and maintenance, the same exact end."""
    counts = _chain_chaos(tmp_path, rounds=3, seed=21, reader="spark")
    print(counts)
    assert counts["maintains"], counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", [12, 13, 14])
@pytest.mark.parametrize("reader", ["driver", "spark"])
def test_chain_chaos_soak(tmp_path, seed, reader):
    print(_chain_chaos(tmp_path, rounds=20, seed=seed, reader=reader))


def _appended_chaos(folder, spark, rounds: int, seed: int) -> dict[str, int]:
    """An appended state (`state.layout: appended`, folded every few batches)
    through overlapping runs killed at random, rewinds and maintenance. At
    the end, the state as of every batch of the lineage, read by delta-rs
    (`read_state`) and by delta-spark (the query `microbatch query --sql
    spark` prints, over that version), equals the oracle of exactly the files
    the lineage consumed up to that batch."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from spark_jobs.core.folding import read_state, spark_sql
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import differences, fold, totals_of

    rng = random.Random(seed)
    spec_path = write_spec(folder, oracle_spec_dict(
        state={**oracle_spec_dict()["state"], "layout": "appended", "fold_at": 0.001},  # a fold every ~3 batches
        batch={"max_files": 1},
    ))
    landing = folder / "landing"
    counts = {"runs": 0, "killed": 0, "rewinds": 0, "maintains": 0}
    for wave in range(rounds):
        write_wave(landing, wave, files=rng.randint(1, 3), records_per_file=150, users=40, seed=seed, bad_every=41)
        procs = [start_cli("run", str(spec_path), "--catch-up") for _ in range(2)]
        for code, err in kill_some(procs, rng, counts, within=12.0, chance=0.6, timeout=300):
            assert code in (0, -signal.SIGKILL), err
        _rewind_or_maintain(spec_path, rng, counts, wave, rounds, chance=0.4, back=3, keep=50)
    for _ in range(rounds * 6 + 2):  # drain
        result = run_cli("run", str(spec_path), "--json")
        assert result.returncode == 0, result.stderr[-2000:]
        if json.loads(result.stdout)["status"] == "no_new_data":
            break
    lineage = assert_exact(spec_path)
    spec = load_spec(spec_path)
    history = DeltaTable(spec.state_path).history()
    counts["folds"] = sum(1 for info in history if info.get("microbatch.fold"))
    consumed: list = []
    for row in lineage:
        consumed += [landing / f["name"] for f in row.manifest["files"]]
        expected = fold(consumed)
        table = DeltaTable(spec.state_path, version=row.state_version)
        by_rs = totals_of(r for b in read_state(spec, table) for r in b.to_pylist())
        problems = differences(expected, by_rs)
        assert not problems, f"delta-rs, batch {row.batch_id} (state version {row.state_version}):\n" + "\n".join(problems[:10])
        sql = spark_sql(spec, pa.schema(table.schema().to_arrow()), version=row.state_version)
        by_spark = totals_of(spark.sql(sql).toArrow().to_pylist())
        problems = differences(expected, by_spark)
        assert not problems, f"delta-spark, batch {row.batch_id} (state version {row.state_version}):\n" + "\n".join(problems[:10])
    counts["batches"] = len(lineage)
    return counts


def test_an_appended_state_ends_exact_and_reads_exact_at_every_batch_through_kills_rewinds_and_folds(tmp_path, spark):
    counts = _appended_chaos(tmp_path, spark, rounds=3, seed=31)
    print(counts)
    assert counts["folds"] and counts["maintains"], counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", [32, 33, 34])
def test_appended_chaos_soak(tmp_path, spark, seed):
    print(_appended_chaos(tmp_path, spark, rounds=20, seed=seed))
