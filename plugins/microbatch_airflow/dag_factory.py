"""Build one DAG per pipeline spec.

Parsing a spec is plain Python (pydantic + YAML): no Delta table is opened
and no Spark started at parse time.

A broken spec must show up as an import error naming the spec file and
field without taking the other pipelines' DAGs down. Airflow records import
errors per Python file, and the dag-processor marks every DAG of a file with
an import error stale: they vanish from the UI and cannot be triggered. So
the DAGs come from one file (`dags/microbatch_pipelines.py`, which builds
a broken spec's DAG from its last valid version, or skips a spec never
valid) and the errors from another (`dags/microbatch_spec_errors.py`,
which raises `BrokenPipelineSpecs` when there are any).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Asset, CronDataIntervalTimetable, Param

from microbatch_airflow.airflow_spec import DEFAULT_RETRIES, AirflowSpec, airflow_spec
from microbatch_airflow.assets import batches_alias, source_asset, state_asset
from microbatch_airflow.operators import MaintenanceOperator, MicroBatchOperator, QuarantineCheckOperator
from microbatch_airflow.sensors import NewDataSensor
from microbatch_airflow.spec_cache import SpecCache
from spark_jobs.errors import SpecError
from spark_jobs.core.spec import PipelineSpec

__all__ = [
    "BrokenPipelineSpecs",
    "SpecScan",
    "build_dag",
    "build_maintenance_dag",
    "dags_from_folder",
    "pipelines_dir",
    "raise_spec_errors",
    "scan_specs",
    "spec_doc",
    "trigger_params",
]

PIPELINES_DIR_ENV = "MICROBATCH_PIPELINES_DIR"


def _optional_int(title: str, description: str, minimum: int) -> Param:
    return Param(None, type=["null", "integer"], minimum=minimum, title=title, description=description)


def trigger_params() -> dict[str, Param]:
    """The trigger form: validated by JSON schema before a run is created.

    Booleans allow null too: Airflow's form marks every field whose type
    excludes null as required (a red asterisk), which an off switch is not;
    they still render as switches, and null reads as off.
    """
    return {
        "max_files": _optional_int(
            "Max files", "Cap the files this batch reads (overrides the spec's batch.max_files).", 1
        ),
        "max_records": _optional_int(
            "Max records", "Cap the records this batch reads, in whole files (at least one file).", 1
        ),
        "rewind_to_batch": _optional_int(
            "Rewind to batch",
            "Restore the state to this committed batch first, then process from its offsets "
            "(0 empties the state). Manual runs only: a scheduled or backfill run refuses it.",
            0,
        ),
        "rewind_only": Param(
            False,
            type=["boolean", "null"],
            title="Rewind only",
            description="With Rewind to batch: rewind and stop, processing nothing (then backfill to recompute).",
        ),
        "dry_run": Param(
            False,
            type=["boolean", "null"],
            title="Dry run",
            description="Plan the batch and show its range in the log; commit nothing.",
        ),
    }


def spec_doc(spec: PipelineSpec) -> str:
    """The DAG's Docs: what the pipeline is (the Code tab shows the factory
    file, which says nothing about it), with the spec as written."""
    doc = spec.description or f"Micro-batch pipeline `{spec.name}`."
    source = spec.source
    lines = [
        doc,
        "",
        f"* **Source**: `{source.type}` {spec.source_path} ({source.format})",
        f"* **State**: {spec.state_path}, keys {', '.join(f'`{k}`' for k in spec.state.keys)}; merge "
        + ", ".join(f"`{c}`: {rule}" for c, rule in spec.state.merge.items()),
        f"* **Checkpoint**: {spec.checkpoint_path}",
        "",
        f"Spec `{spec.spec_path}`:",
        "",
    ]
    try:
        text = Path(spec.spec_path).read_text(encoding="utf-8")
    except OSError:
        text = f"transform: |\n  {spec.transform.strip()}"
    return "\n".join(lines) + "\n```yaml\n" + text.rstrip() + "\n```\n"


def _task_defaults(settings: AirflowSpec, default_args: dict[str, Any] | None, retry_delay: timedelta) -> dict[str, Any]:
    """default_args for a pipeline's DAG: the caller's, then the spec's
    `airflow.retries`/`retry_delay_seconds` over them; 2 retries when
    neither says (a retry re-enters the commit protocol, so it is safe)."""
    merged: dict[str, Any] = {"retries": DEFAULT_RETRIES, "retry_delay": retry_delay, **(default_args or {})}
    if settings.retries is not None:
        merged["retries"] = settings.retries
    if settings.retry_delay_seconds is not None:
        merged["retry_delay"] = timedelta(seconds=settings.retry_delay_seconds)
    return merged


def build_dag(
    spec: PipelineSpec,
    upstream: PipelineSpec | None = None,
    default_args: dict[str, Any] | None = None,
    *,
    broken: str | None = None,
) -> DAG:
    """The pipeline's DAG. `upstream`: the pipeline whose state table this
    one's Delta source reads; without a schedule of its own, the DAG then
    runs whenever the upstream commits a batch (its state asset).
    `default_args`: as for any DAG; the spec's `airflow:` block wins.
    With `airflow.run_on_data`, the DAG schedules on its source's watcher
    asset instead: no run exists until data waits. `broken`: the error of
    the spec's file now, when `spec` is its last valid version (the DAG's
    docs lead with it; each run loads the file and fails with it)."""
    settings = airflow_spec(spec)
    with DAG(
        dag_id=spec.name,
        description=_description(spec, broken),
        doc_md=(f"**The spec is broken: each run fails with this error until it is fixed.** This DAG is built from "
                f"the spec's last valid version.\n\n```\n{broken}\n```\n\n" if broken else "") + spec_doc(spec),
        schedule=_schedule(spec, settings, upstream),
        start_date=settings.start_date,
        catchup=settings.catchup,
        # One batch at a time per pipeline; the commit protocol, not this,
        # is what keeps concurrent or out-of-order runs (backfills) exact.
        max_active_runs=1,
        tags=["microbatch", *settings.tags],
        params=trigger_params(),
        default_args=_task_defaults(settings, default_args, timedelta(seconds=10)),
    ) as dag:
        batch = MicroBatchOperator(
            task_id="run_batch",
            spec_path=spec.spec_path,
            outlets=[batches_alias(spec)],
            spark_conn_id=settings.spark_conn_id,
            kafka_conn_id=settings.kafka_conn_id,
            **({"aws_conn_id": settings.aws_conn_id} if settings.aws_conn_id else {}),
        )
        if _fails_over_quarantine_limits(spec):
            batch >> QuarantineCheckOperator(task_id="check_quarantine")
        if settings.wait_for_data:
            wait = settings.wait_for_data
            NewDataSensor(
                task_id="wait_for_data",
                spec_path=spec.spec_path,
                poke_interval=wait.poll_seconds,
                timeout=wait.timeout_seconds,
                soft_fail=wait.soft_fail,
                retries=0,
                kafka_conn_id=settings.kafka_conn_id,
                **({"deferrable": wait.deferrable} if wait.deferrable is not None else {}),
            ) >> batch
    return dag


def _schedule(spec: PipelineSpec, settings: AirflowSpec, upstream: PipelineSpec | None) -> CronDataIntervalTimetable | list[Asset] | None:
    """A clock (`airflow.schedule`), the source's watcher (`run_on_data`), the
    upstream's state asset (a chained pipeline), or none (manual runs)."""
    if settings.schedule:
        return CronDataIntervalTimetable(settings.schedule, timezone="UTC")
    if settings.run_on_data is not None:
        on_data = settings.run_on_data
        return [source_asset(spec, on_data.poll_seconds, on_data.refire_seconds, settings.kafka_conn_id)]
    if upstream is not None:
        return [state_asset(upstream)]
    return None


def _description(spec: PipelineSpec, broken: str | None) -> str | None:
    """The DAG's one line: its spec's first line, or that the spec is broken."""
    if broken:
        return f"SPEC BROKEN: runs fail until {Path(spec.spec_path).name} is fixed"
    return (spec.description.splitlines() or [""])[0][:200] or None


def _fails_over_quarantine_limits(spec: PipelineSpec) -> bool:
    """Whether a batch over the spec's `quarantine` limits fails its DAG run
    (then the DAG has a `check_quarantine` task)."""
    limits = spec.quarantine
    return limits.on_exceed == "fail" and (limits.max_records is not None or limits.max_fraction is not None)


class BrokenPipelineSpecs(Exception):
    """One or more specs in the pipelines folder are invalid."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__(
            f"{len(errors)} pipeline spec(s) could not be loaded. A pipeline whose spec was valid before keeps "
            "its DAG, built from that version, and each of its runs fails with this error until the spec is "
            "fixed; a spec that never loaded has no DAG yet:\n" + "\n".join(errors)
        )


def pipelines_dir(default: Path) -> Path:
    return Path(os.environ.get(PIPELINES_DIR_ENV) or default)


#: A maintenance DAG's id is its pipeline's name and this.
MAINTENANCE_SUFFIX = "_maintenance"


def build_maintenance_dag(spec: PipelineSpec, default_args: dict[str, Any] | None = None) -> DAG:
    """`microbatch maintain` on the spec's `airflow.maintenance_schedule`, apart from the batches."""
    settings = airflow_spec(spec)
    with DAG(
        dag_id=f"{spec.name}{MAINTENANCE_SUFFIX}",
        description=f"Compaction, VACUUM and checkpoints for pipeline {spec.name}",
        doc_md=(
            f"Maintenance of pipeline `{spec.name}`: compacts and VACUUMs its state, offset ledger and "
            f"quarantine, keeping the last {spec.maintenance.keep_batches} batches rewindable.\n\n"
            f"Spec: `{spec.spec_path}`"
        ),
        schedule=settings.maintenance_schedule,
        start_date=settings.start_date,
        catchup=False,
        max_active_runs=1,
        tags=["microbatch", "maintenance", *settings.tags],
        default_args=_task_defaults(settings, default_args, timedelta(minutes=1)),
    ) as dag:
        MaintenanceOperator(
            task_id="maintain",
            spec_path=spec.spec_path,
            **({"aws_conn_id": settings.aws_conn_id} if settings.aws_conn_id else {}),
        )
    return dag


@dataclass(frozen=True)
class SpecScan:
    """What a folder of specs holds: `specs`, the pipelines by name (each
    file's spec, or for a file whose spec broke after a parse kept it valid,
    that last valid spec); `errors`, by file, why each broken file does not
    load (naming its line and field); `broken`, by pipeline name, the error
    of each pipeline served from its last valid spec."""

    specs: dict[str, PipelineSpec]
    errors: dict[Path, str]
    broken: dict[str, str]


def scan_specs(folder: Path, names: set[str] | None = None) -> SpecScan:
    """The specs (`*.yaml`, `*.yml`) in `folder` (`SpecScan`).

    A spec that breaks after a parse loaded it valid keeps its pipeline:
    the DAG is built from its last valid version, kept with the parses'
    specs (`SpecCache.last_valid`), so its schedule goes on and each run
    fails with the spec's error (not retried), which Airflow's alerting
    sees; a pipeline that vanished would stop without one failed task. A
    spec never valid here has no DAG, only its error.

    `names`: only the specs named one of these. A file is
    loaded only if its text holds one of the names (a read and a search,
    not a load: a spec's name is written in it), so a task's parse of a
    folder of specs loads its own and those that mention its name. (A name
    spelled through YAML escapes is not found that way.)

    A spec whose file has not changed since a parse kept it is not loaded
    again (`spec_cache.SpecCache`)."""
    errors: dict[Path, str] = {}
    specs: dict[str, PipelineSpec] = {}
    broken: dict[str, str] = {}
    kept = SpecCache(folder)
    paths = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
    for path in paths:
        if names is not None and not _mentions(path, names, kept.last_valid_text(path.resolve())):
            continue
        try:
            spec = kept.load(path.resolve(), check=airflow_spec)
        except SpecError as exc:
            errors[path] = str(exc)
            last = kept.last_valid(path.resolve(), check=airflow_spec)
            if last is None or last.name in specs or (names is not None and last.name not in names):
                continue
            spec = last
            broken[spec.name] = str(exc)
        if names is not None and spec.name not in names:
            continue
        if spec.name in specs:
            errors[path] = f"{path}: pipeline name {spec.name!r} is used by another spec; names must be unique"
            continue
        specs[spec.name] = spec
    kept.save([p.resolve() for p in paths] if names is None else None)
    # A pipeline's maintenance DAG is `<name>_maintenance`: a pipeline of that
    # name would share its DAG id, and each would overwrite the other.
    for name, spec in list(specs.items()):
        owner = specs.get(name.removesuffix(MAINTENANCE_SUFFIX)) if name.endswith(MAINTENANCE_SUFFIX) else None
        if owner is not None and airflow_spec(owner).maintenance_schedule:
            del specs[name]
            broken.pop(name, None)
            errors[Path(spec.spec_path)] = (
                f"{spec.spec_path}: pipeline name {name!r} is the DAG id of pipeline {owner.name!r}'s maintenance "
                f"DAG ({owner.spec_path} sets airflow.maintenance_schedule); rename this pipeline (a new name "
                "is a new pipeline: give it its own checkpoint too), or rename the other"
            )
    return SpecScan(specs, errors, broken)


def dags_from_folder(folder: Path, default_args: dict[str, Any] | None = None, *, only: str | None = None) -> dict[str, DAG]:
    """A DAG per valid spec in `folder`, and a maintenance DAG per spec with
    `airflow.maintenance_schedule`. Broken specs are skipped here:
    `raise_spec_errors` reports them from a file of their own.

    `only`: the one DAG id wanted, as Airflow's parsing context names it in
    a task process (`dags/microbatch_pipelines.py`). Then only the specs
    that mention the names that decide it are loaded (`scan_specs(names=...)`):
    a task in a folder of N specs costs about one spec's load, not N. A pipeline reading a
    Delta table loads them all, since its upstream (which sets its schedule)
    is whichever spec writes that table. The DAG built is the one a full
    parse builds."""
    with _older_objects_frozen():
        return _dags(folder, default_args, only)


def _dags(folder: Path, default_args: dict[str, Any] | None, only: str | None) -> dict[str, DAG]:
    scan = scan_specs(folder, names=_defining(only) if only else None)
    if only and (not scan.specs or any(spec.source.type == "delta" for spec in scan.specs.values())):
        # (None found: the full parse decides, naming a spec's errors as well.)
        scan = scan_specs(folder)
    specs = scan.specs
    dags: dict[str, DAG] = {}
    # A Delta source that is another pipeline's state chains the two.
    by_state = {spec.state_path.rstrip("/"): spec for spec in specs.values()}
    # (A DAG built in a `with` block registers itself with the parse, kept
    # or not: a task process builds none but its own.)
    wanted = (lambda dag_id: dag_id == only) if only else (lambda dag_id: True)
    with _each_schema_checked_once():
        for spec in specs.values():
            if wanted(spec.name):
                upstream = by_state.get(spec.source_path.rstrip("/")) if spec.source.type == "delta" else None
                dags[spec.name] = build_dag(spec, upstream, default_args, broken=scan.broken.get(spec.name))
            maintenance = f"{spec.name}{MAINTENANCE_SUFFIX}"
            if airflow_spec(spec).maintenance_schedule and wanted(maintenance):
                dags[maintenance] = build_maintenance_dag(spec, default_args)
    return dags


@contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """The objects made before the parse are left out of garbage collections
    during it (`gc.freeze`), and put back after (`gc.unfreeze`).

    A process that imported Airflow holds so many objects that one full
    collection walks them for 0.2 CPU-s, and the objects a parse makes set
    one off: a task's parse took 0.27 CPU-s with it and 0.03 without, the
    dag-processor's a quarter more. The parse's own garbage is collected as
    before, and what was frozen is collected again once it is put back.

    Nothing is done where objects are frozen already: Airflow's
    dag-processor freezes its objects before it forks a parse, so that the
    child does not copy their pages, and `gc.unfreeze` cannot tell its
    objects from ours (a review measured the child's private memory go
    from 8 to 59 MiB when a parse unfroze them). A task forked after
    `task_imports` is frozen too (the module freezes what it imported as
    its last step), which its presence says at no cost: counting the
    frozen objects walks them all, 40 ms in a task. (Not always true: a
    Celery pool process that replaces one forks from a worker that
    Airflow's provider unfroze once ready, `on_celery_worker_ready`, and
    parses then without a freeze; a review measured no difference, a
    task's parse setting off no full collection.)"""
    if "microbatch_airflow.task_imports" in sys.modules or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _each_schema_checked_once() -> Iterator[None]:
    """While the DAGs are built, `jsonschema.validate` checks each distinct
    schema against its metaschema once, not at every call.

    A scheduled DAG validates its Params' defaults as it is made, and each
    `Param.resolve` calls `jsonschema.validate`, which first checks the
    schema itself against JSON Schema's metaschema: 60% of building a DAG,
    for the same five trigger-form schemas in every one (a dag-processor's
    parse of 200 pipelines checked them 1,000 times). The values are still
    validated each time, as `jsonschema.validate` does; a schema is checked
    the same way, once. Restored on the way out: the parse is one thread."""
    import jsonschema
    from jsonschema.exceptions import best_match
    from jsonschema.validators import validator_for

    original = jsonschema.validate
    checked: set[str] = set()

    def validate(instance: Any, schema: Any, cls: Any = None, *args: Any, **kwargs: Any) -> None:
        cls = cls or validator_for(schema)
        key = f"{cls.__name__}:{json.dumps(schema, sort_keys=True, default=repr)}"
        if key not in checked:
            cls.check_schema(schema)
            checked.add(key)
        error = best_match(cls(schema, *args, **kwargs).iter_errors(instance))
        if error is not None:
            raise error

    jsonschema.validate = validate
    try:
        yield
    finally:
        jsonschema.validate = original


def _defining(dag_id: str) -> set[str]:
    """The pipeline names whose specs decide DAG `dag_id`: the pipeline of
    that name, the one whose maintenance DAG it is, and so on down (a
    maintenance DAG's owner may itself clash with another's)."""
    names = {dag_id}
    while dag_id.endswith(MAINTENANCE_SUFFIX):
        # `x_maintenance_maintenance`: pipeline `x_maintenance`'s maintenance
        # DAG, unless pipeline `x` has one, which makes `x_maintenance` a clash.
        dag_id = dag_id.removesuffix(MAINTENANCE_SUFFIX)
        names.add(dag_id)
    return names


def raise_spec_errors(folder: Path) -> None:
    """Raise `BrokenPipelineSpecs` if any spec in `folder` is broken: called
    at import of a DAG file that holds no pipeline, so the import error it
    becomes stales no pipeline's DAG."""
    with _older_objects_frozen():
        scan = scan_specs(folder)
    if scan.errors:
        raise BrokenPipelineSpecs(list(scan.errors.values()))


def _mentions(path: Path, names: set[str], last_valid: str | None) -> bool:
    """Whether the file's text holds one of `names`, or its last valid text
    did (an unreadable file is loaded, to report it the way the full parse
    does)."""
    if last_valid is not None and any(name in last_valid for name in names):
        return True
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return True
    return any(name in text for name in names)
