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
import yaml

from spark_jobs.core.faults import ARM_FILE_ENV, ENV, MARKER
from spark_jobs.demo.clickstream import write_wave
from tests.conftest import assert_exact, kill_some, oracle_spec_dict, run_cli, start_cli, write_spec


def _drain(spec_path, tries: int, *, races_lost: bool = False) -> None:
    """Runs the pipeline until it has nothing new (at most `tries` runs),
    each run exit 0; with `races_lost`, a run that lost a race to a
    concurrent writer (`RACE_LOST`, exit 1, nothing committed) is tried again."""
    for _ in range(tries):
        result = run_cli("run", str(spec_path), "--json")
        if races_lost and result.returncode == 1 and any(phrase in result.stderr for phrase in RACE_LOST):
            continue
        assert result.returncode == 0, result.stderr[-2000:]
        if json.loads(result.stdout)["status"] == "no_new_data":
            return


def _chaos(spec_path, rounds: int, seed: int, *, armed: str | None = None) -> dict[str, int]:
    """`armed`: a fault point the first run to reach it dies at (armed once,
    for all waves), so that one kill lands there however fast this machine
    runs the batches the random kills may miss; it counts as a kill."""
    rng = random.Random(seed)
    landing = spec_path.parent / "landing"
    counts = {"runs": 0, "killed": 0}
    env = None
    if armed:
        arm = spec_path.parent / "armed"
        arm.touch()
        env = {ENV: armed, ARM_FILE_ENV: str(arm)}
    for wave in range(rounds):
        write_wave(landing, wave, files=rng.randint(1, 3), records_per_file=150, users=40, seed=seed, bad_every=41)
        procs = [start_cli("run", str(spec_path), "--max-files", "2", env=env) for _ in range(2)]
        for code, err in kill_some(procs, rng, counts, within=12.0, chance=0.7, timeout=300):
            # A run that was not killed must have succeeded (0) whatever happened around it.
            assert code in (0, -signal.SIGKILL), err
            counts["killed"] += f"{MARKER} {armed}" in err
    if armed and arm.exists():  # every run that got there was killed first: one more, alone
        write_wave(landing, rounds, files=1, records_per_file=150, users=40, seed=seed, bad_every=41)
        alone = run_cli("run", str(spec_path), env=env)
        assert alone.returncode == -signal.SIGKILL and f"{MARKER} {armed}" in alone.stderr, alone.stderr[-2000:]
        counts["runs"] += 1
        counts["killed"] += 1
    _drain(spec_path, rounds * 3 + 2)
    assert_exact(spec_path)
    return counts


def test_random_kills_and_overlapping_runs_end_exact(spec_path, on_connect):
    counts = _chaos(spec_path, rounds=4, seed=1)
    print(counts)


def test_the_executors_merging_every_batch_ends_exact_through_the_same_kills(tmp_path, on_connect):
    """Issue 47: the same chaos with every merge made by Spark's executors
    (`engine.state_write: executors`: a copy-on-write merge of the state's
    files, committed by the job), so kills land between their writes and
    the commit (one surely: the first run to reach `mid_state_merge`, after
    the executors' files and before the commit, dies there). The runs are a
    shared Connect server's clients: a killed run's executors write on
    without it, files no commit names. The soak below kills runs on their
    own Spark, inside the executors' writes."""
    spec_path = write_spec(tmp_path, oracle_spec_dict(engine={"state_write": "executors"}))
    counts = _chaos(spec_path, rounds=3, seed=5, armed="mid_state_merge")
    print(counts)
    assert counts["killed"], counts


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [6, 7])
def test_the_executors_merging_ends_exact_through_kills_of_each_run_s_own_spark(tmp_path, seed):
    """The chaos above, each run starting Spark itself: a kill takes the
    run's driver and the local executors writing the state's files with it."""
    spec_path = write_spec(tmp_path, oracle_spec_dict(engine={"state_write": "executors"}))
    counts = _chaos(spec_path, rounds=8, seed=seed)
    print(counts)
    assert counts["killed"], counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_chaos_soak(spec_path, on_connect, seed):
    print(_chaos(spec_path, rounds=30, seed=seed))


def _rewind_or_maintain(spec, rng: random.Random, counts: dict[str, int], wave: int, rounds: int, *, chance: float, back: int, keep: int) -> None:
    """Now and then rewind `spec` up to `back` batches, and maintain it keeping `keep` batches.

    Random, but each tried at least once before the drain: the kills'
    timing changes which draws the generator makes, so no seed can promise it.
    A rewind goes no further back than an earlier maintain kept rewindable
    (`status`'s oldest rewindable batch): past it, the refusal by name is
    right (`test_maintain.py` shows it)."""
    if rng.random() < chance or (wave >= rounds - 2 and not counts["rewinds"]):
        status = json.loads(run_cli("status", str(spec), "--json").stdout)
        head, oldest = status["last_batch"], status["oldest_rewindable"] or 1
        if head > oldest:
            result = run_cli("rewind", str(spec), "--to-batch", str(rng.randint(max(head - back, oldest), head - 1)))
            assert result.returncode == 0, result.stderr[-2000:]
            counts["rewinds"] += 1
    if rng.random() < chance or (wave == rounds - 1 and not counts["maintains"]):
        result = run_cli("maintain", str(spec), "--keep-batches", str(keep))
        assert result.returncode == 0, result.stderr[-2000:]
        counts["maintains"] += 1


def _chain_chaos(
    folder, rounds: int, seed: int, reader: str = "driver", upstream_write: str = "auto", vectors: bool = False,
    wave_size: tuple[int, int, int] = (80, 80, 30),
) -> dict[str, int]:
    """Chained pipelines driven through the CLI: each round lands a wave,
    runs the upstream and the downstream at once and kills some of them, and
    now and then rewinds the upstream or maintains it (keeping 2 batches).
    The drain must leave the downstream equal to the upstream's state, summed.
    `upstream_write`: the upstream's `engine.state_write` (`executors`: its
    batches merged by the executors' join, change files and all;
    `alternate`: `auto` and `executors` wave by wave, as a user may switch
    it, its runs' batches all counting as big (`BIG_BATCHES`): with
    `vectors`, the `auto` waves merge on read and the executors' waves join
    over the vectors they left);
    `vectors`: the upstream's state merged
    on read (`state.deletion_vectors`), its dead vector files removed by
    `maintain` after 18 s; `wave_size`: records a file in the first wave and in the others, users."""
    from tests.conftest import assert_chain_exact, chain_specs

    rng = random.Random(seed)
    upstream, downstream = chain_specs(folder, reader)
    spec = yaml.safe_load(upstream.read_text())
    if upstream_write not in ("auto", "alternate"):
        spec["engine"] = {"state_write": upstream_write}
    spec["state"]["deletion_vectors"] = vectors
    if vectors:  # `maintain` removes the vector files of versions it does not keep (18 s: longer than any run here)
        spec["maintenance"] = {"untracked_files_hours": 0.005}
    upstream.write_text(yaml.safe_dump(spec, sort_keys=False))
    landing = folder / "landing"
    counts = {"runs": 0, "killed": 0, "rewinds": 0, "maintains": 0}
    for wave in range(rounds):
        first, records, users = wave_size
        if upstream_write == "alternate":
            spec = yaml.safe_load(upstream.read_text())
            spec["engine"] = {"state_write": "executors" if wave % 2 else "auto"}
            upstream.write_text(yaml.safe_dump(spec, sort_keys=False))
        write_wave(landing, wave, files=rng.randint(1, 2), records_per_file=records if wave else first, users=users, seed=seed)
        procs = [start_cli("run", str(upstream), big=upstream_write == "alternate"), start_cli("run", str(downstream))]
        for code, err in kill_some(procs, rng, counts, within=10.0, chance=0.5, timeout=300):
            # Before the upstream's first commit, its state is not a table yet: retryable.
            assert code in (0, -signal.SIGKILL) or (code == 1 and "does not exist yet" in err), err
        if upstream_write != "alternate" or wave % 2:
            # (Alternating, not after an `auto` wave: its rewind or compaction
            # would take back the vectors the next wave is to be merged over.)
            _rewind_or_maintain(upstream, rng, counts, wave, rounds, chance=0.5, back=2, keep=2)
    for spec in (upstream, downstream):
        for _ in range(rounds * 4 + 4):  # drain
            result = run_cli("run", str(spec), "--json")
            assert result.returncode == 0, result.stderr[-2000:]
            if json.loads(result.stdout)["status"] == "no_new_data":
                break
    assert_chain_exact(upstream, downstream)
    return counts


def test_chained_pipelines_end_exact_through_kills_upstream_rewinds_and_maintenance(tmp_path, on_connect):
    counts = _chain_chaos(tmp_path, rounds=4, seed=11)
    print(counts)
    # A rewind needs a head past batch 1, which kills can keep it from reaching.
    assert counts["maintains"], counts


@pytest.mark.slow
def test_a_chain_whose_upstream_merges_on_read_ends_exact_through_the_same_chaos(tmp_path, on_connect):
    """The upstream's batches merged on read (`state.deletion_vectors`: the
    job's own commits of deletion vectors and change files, issue 64 part
    2): kills amid them, racing runs, rewinds (the job's RESTORE across
    vectors) and `maintain` (OPTIMIZE, VACUUM and the dead vector files'
    removal across them), the same exact end downstream, which reads the
    job's change files."""
    # Many users, small waves after a big first one: batches that merge on read (`merge_on_read._pays`).
    counts = _chain_chaos(tmp_path, rounds=4, seed=29, vectors=True, wave_size=(1500, 30, 2000))
    print(counts)
    assert counts["maintains"], counts
    log = (tmp_path / "lake" / "state" / "_delta_log").glob("*.json")
    merged_on_read = [p for p in log if '"merge-on-read"' in p.read_text()]
    assert merged_on_read and list((tmp_path / "lake" / "state").glob("deletion_vector_*.bin")), "no batch was merged on read"


@pytest.mark.slow
def test_a_chain_read_by_spark_ends_exact_through_the_same_chaos(tmp_path, on_connect):
    """The downstream reads with delta-spark on the executors (`source.reader:
    spark`): the same kills, rewinds and maintenance, the same exact end."""
    counts = _chain_chaos(tmp_path, rounds=3, seed=21, reader="spark")
    print(counts)
    assert counts["maintains"], counts


@pytest.mark.slow
def test_a_chain_whose_upstream_the_executors_join_merges_ends_exact_through_the_same_chaos(tmp_path, on_connect):
    """The upstream's batches merged by the Connect server's executors, whose
    join writes the change files the job commits (issue 64): kills amid
    them, racing runs, rewinds and `maintain` racing the commit, the same
    exact end downstream."""
    counts = _chain_chaos(tmp_path, rounds=4, seed=23, upstream_write="executors")
    print(counts)
    assert counts["maintains"], counts
    log = (tmp_path / "lake" / "state" / "_delta_log").glob("*.json")
    assert any("executors' join" in p.read_text() for p in log), "no batch was merged by the join"


@pytest.mark.slow
def test_a_chain_whose_upstream_the_join_merges_over_vectors_ends_exact_through_the_same_chaos(tmp_path, on_connect):
    """The upstream merged on read, its writer switched wave by wave: the
    `auto` waves leave vectors, and the `executors` waves are merged over
    them by the Connect server's join, which reads each file without the
    rows its vector deletes: kills, rewinds and `maintain` racing its
    commit, the same exact end downstream."""
    counts = _chain_chaos(tmp_path, rounds=6, seed=24, upstream_write="alternate", vectors=True, wave_size=(1500, 30, 2000))
    print(counts)
    assert counts["maintains"], counts
    log = [p.read_text() for p in (tmp_path / "lake" / "state" / "_delta_log").glob("*.json")]
    over = [e for e in log if "executors' join" in e and any(json.loads(a).get("remove", {}).get("deletionVector") for a in e.splitlines())]
    assert over, "no batch was merged by the join over vectors"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [12, 13, 14])
@pytest.mark.parametrize("reader", ["driver", "spark"])
def test_chain_chaos_soak(tmp_path, seed, reader, on_connect):
    print(_chain_chaos(tmp_path, rounds=20, seed=seed, reader=reader))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [30, 31])
def test_chain_chaos_soak_merged_on_read(tmp_path, seed, on_connect):
    """The chain chaos's long run with the upstream merged on read: its
    deleted rows pile up past `merge_on_read.MAX_DEAD` and batches rewrite
    them away again, between kills, rewinds and `maintain`."""
    print(_chain_chaos(tmp_path, rounds=20, seed=seed, vectors=True, wave_size=(1500, 30, 2000)))


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
    _drain(spec_path, rounds * 6 + 2)
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


def test_an_appended_state_ends_exact_and_reads_exact_at_every_batch_through_kills_rewinds_and_folds(tmp_path, spark, on_connect):
    counts = _appended_chaos(tmp_path, spark, rounds=3, seed=31)
    print(counts)
    assert counts["folds"] and counts["maintains"], counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", [32, 33, 34])
def test_appended_chaos_soak(tmp_path, spark, seed, on_connect):
    print(_appended_chaos(tmp_path, spark, rounds=20, seed=seed))


#: What a run, a maintain or a rewind that lost a race says (exit 1): anything else fails the chaos.
RACE_LOST = ("run again", "run maintain again", "run the rewind again", "nothing was committed", "changed while", "kept moving", "moved during")
#: What a rewind racing others may rightly refuse (exit 2): a target the pipeline moved past.
REWIND_OVERTAKEN = ("committed batches are", "nothing to rewind")


def _outside_commit(path: str, rng: random.Random, counts: dict[str, int]) -> None:
    """A commit on the state from outside the job, as a user's tool makes
    one: a table property, or an OPTIMIZE. It may lose a race to a run (a
    commit conflict), like any writer's."""
    from deltalake import DeltaTable

    try:
        table = DeltaTable(path)
        if rng.random() < 0.5:
            table.alter.set_table_properties({"delta.logRetentionDuration": f"interval {rng.randint(30, 60)} days"})
        else:
            table.optimize.compact()
        counts["outside commits"] += 1
    except Exception:  # noqa: BLE001 - lost a race with the job, or no table yet: a writer's own business
        counts["outside commits lost"] += 1


def _appended_concurrent_chaos(folder, spark, rounds: int, seed: int, state_write: str = "auto") -> dict[str, int]:
    """Issue 46: an appended state through overlapping catch-up runs,
    `maintain` (folds, VACUUM, untracked files) and rewinds all at once,
    SIGKILLs at random, and commits from outside the job (a property, an
    OPTIMIZE) landing in the middle. Afterwards: the lineage is exact, every
    committed ledger row of every epoch names the state commit that carries
    its batch, and a rewind to each batch of the lineage reads exactly that
    batch's oracle (through delta-rs and through Spark's SQL)."""
    import threading

    import pyarrow as pa

    from spark_jobs.core.folding import read_state, spark_sql
    from spark_jobs.core.rewind import rewind
    from spark_jobs.core.spec import load_spec
    from spark_jobs.demo.clickstream import differences, fold, totals_of
    from tests.conftest import assert_versions_carry_batches

    rng = random.Random(seed)
    base = oracle_spec_dict()
    spec_path = write_spec(folder, oracle_spec_dict(
        state={**base["state"], "layout": "appended", "fold_at": 0.001},  # a fold every ~3 batches
        batch={"max_files": 1},
        maintenance={"keep_batches": 100, "untracked_files_hours": 0.02},  # 72 s: longer than any run here
        engine={"state_write": state_write},
    ))
    spec = load_spec(spec_path)
    landing = folder / "landing"
    counts = {"runs": 0, "killed": 0, "rewinds": 0, "maintains": 0, "outside commits": 0, "outside commits lost": 0, "races lost": 0}
    for wave in range(rounds):
        write_wave(landing, wave, files=rng.randint(1, 3), records_per_file=150, users=40, seed=seed, bad_every=41)
        procs = [start_cli("run", str(spec_path), "--catch-up") for _ in range(2)]
        head = json.loads(run_cli("status", str(spec_path), "--json").stdout)["last_batch"]
        rewinding = head > 1 and rng.random() < 0.5
        if rewinding:
            procs.append(start_cli("rewind", str(spec_path), "--to-batch", str(rng.randint(max(head - 3, 1), head - 1))))
            counts["rewinds"] += 1
        procs.append(start_cli("maintain", str(spec_path)))
        counts["maintains"] += 1
        outside = threading.Timer(rng.uniform(0.5, 8.0), _outside_commit, (spec.state_path, rng, counts))
        outside.start()
        for i, (code, err) in enumerate(kill_some(procs, rng, counts, within=12.0, chance=0.4, timeout=300)):
            if code == 1 and any(phrase in err for phrase in RACE_LOST):
                counts["races lost"] += 1
                continue
            overtaken = rewinding and i == 2 and code == 2 and any(p in err for p in REWIND_OVERTAKEN)
            assert code in (0, -signal.SIGKILL) or overtaken, f"exit {code}: {err[-3000:]}"
        outside.join()
    _drain(spec_path, rounds * 6 + 4, races_lost=True)
    lineage = assert_exact(spec_path)
    assert_versions_carry_batches(spec_path)
    counts["batches"] = len(lineage)
    consumed = {row.batch_id: [landing / f["name"] for r in lineage[: i + 1] for f in r.manifest["files"]] for i, row in enumerate(lineage)}
    for row in reversed(lineage[:-1]):
        assert rewind(spec, row.batch_id, run_id=f"check-{row.batch_id}").status == "rewound"
        expected = fold(consumed[row.batch_id])
        problems = differences(expected, totals_of(r for b in read_state(spec) for r in b.to_pylist()))
        assert not problems, f"delta-rs after a rewind to batch {row.batch_id}:\n" + "\n".join(problems[:10])
        from deltalake import DeltaTable

        table = DeltaTable(spec.state_path)
        by_spark = totals_of(spark.sql(spark_sql(spec, pa.schema(table.schema().to_arrow()), version=table.version())).toArrow().to_pylist())
        problems = differences(expected, by_spark)
        assert not problems, f"Spark after a rewind to batch {row.batch_id}:\n" + "\n".join(problems[:10])
    assert_versions_carry_batches(spec_path)
    return counts


# In `make soak` with its long variants. `make test` guards the appended
# layout's chaos with test_an_appended_state_ends_exact_* above, `maintain`
# racing batches and outside commits with the merged chaos below, and a
# fold racing a batch or a compaction in the job's process with
# core/test_folding.py, core/test_state_commit_guards.py and
# engine/test_spark_state.py (a fold by the executors, rewound through).
@pytest.mark.slow
def test_an_appended_state_stays_exact_through_concurrent_maintain_rewinds_kills_and_outside_commits(tmp_path, spark, on_connect):
    """With `engine.state_write: executors`, every fold `maintain` makes is
    Spark's executors' (issue 47), racing the batches and the rewinds."""
    counts = _appended_concurrent_chaos(tmp_path, spark, rounds=3, seed=46, state_write="executors")
    print(counts)
    assert counts["maintains"] and counts["outside commits"], counts


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 20 rounds of about 40 s, then a rewind to every batch
@pytest.mark.parametrize("seed", [47, 48, 49])
@pytest.mark.parametrize("state_write", ["auto", "executors"])
def test_appended_concurrent_chaos_soak(tmp_path, spark, seed, state_write, on_connect):
    print(_appended_concurrent_chaos(tmp_path, spark, rounds=20, seed=seed, state_write=state_write))


def _merged_maintain_chaos(folder, rounds: int, seed: int, state_write: str) -> dict[str, int]:
    """Issue 62: a merged state written by each path (`engine.state_write`)
    through overlapping runs, `maintain` (compaction, VACUUM, the removal of
    files no commit names, after a short window) and commits from outside
    the job (an OPTIMIZE, a property) all at once, SIGKILLs at random. The
    drain must leave the state equal to the oracle, each key once, and
    every committed ledger row naming the commit that carries its batch."""
    import threading

    from spark_jobs.core.spec import load_spec
    from tests.conftest import assert_versions_carry_batches

    rng = random.Random(seed)
    spec_path = write_spec(folder, oracle_spec_dict(
        batch={"max_files": 1},
        maintenance={"keep_batches": 3, "untracked_files_hours": 0.02},  # 72 s: longer than any run here
        engine={"state_write": state_write},
    ))
    spec = load_spec(spec_path)
    landing = folder / "landing"
    counts = {"runs": 0, "killed": 0, "maintains": 0, "outside commits": 0, "outside commits lost": 0, "races lost": 0}
    for wave in range(rounds):
        write_wave(landing, wave, files=rng.randint(1, 3), records_per_file=150, users=40, seed=seed, bad_every=41)
        procs = [start_cli("run", str(spec_path), "--catch-up") for _ in range(2)] + [start_cli("maintain", str(spec_path))]
        counts["maintains"] += 1
        outside = threading.Timer(rng.uniform(0.5, 8.0), _outside_commit, (spec.state_path, rng, counts))
        outside.start()
        for code, err in kill_some(procs, rng, counts, within=12.0, chance=0.4, timeout=300):
            if code == 1 and any(phrase in err for phrase in RACE_LOST):
                counts["races lost"] += 1
                continue
            assert code in (0, -signal.SIGKILL), f"exit {code}: {err[-3000:]}"
        outside.join()
    _drain(spec_path, rounds * 6 + 4, races_lost=True)
    assert run_cli("maintain", str(spec_path)).returncode == 0
    counts["batches"] = len(assert_exact(spec_path))
    assert_versions_carry_batches(spec_path)
    return counts


def test_a_merged_state_written_by_the_executors_stays_exact_through_maintain_and_outside_compactions(tmp_path, on_connect):
    """The executors' file-by-file merge, the path whose commits an OPTIMIZE
    once doubled (issue 62); the other paths in `make soak`."""
    counts = _merged_maintain_chaos(tmp_path, rounds=3, seed=62, state_write="executors")
    print(counts)
    assert counts["maintains"] and counts["outside commits"], counts


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [63, 64])
@pytest.mark.parametrize("state_write", ["driver", "auto", "executors"])
def test_merged_maintain_chaos_soak(tmp_path, request, seed, state_write):
    """`executors`' runs start Spark themselves (a kill takes their executors
    with them), the others' are the shared Connect server's clients."""
    if state_write != "executors":
        request.getfixturevalue("on_connect")
    print(_merged_maintain_chaos(tmp_path, rounds=15, seed=seed, state_write=state_write))
