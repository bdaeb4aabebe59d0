"""`MicroBatchOperator`: one exactly-once micro-batch per task instance.

Outcomes: a committed batch succeeds and emits an asset event for the state
table (batch id, offsets, state version as extra); so does a rewind. Nothing
new, an interval the pipeline already passed, a batch a concurrent run
committed first, or a dry run end *skipped* (the grid tells them from work
done at a glance), with a one-line reason in the log and the summary still
the task's XCom; they emit no asset event. A run whose batch an earlier
attempt of it committed succeeds (the batch is its work): a retry after an
attempt that died before its event sends that event (Airflow sends events
only with a success), and a run cleared after it succeeded does not send
it again (downstream DAGs would run twice for one batch).

Failures follow `spark_jobs.errors`' one policy, as the CLI's exit codes do:
an error retrying cannot help (a bad spec or parameter, tables that do not
belong together, a state changed outside the job) fails at once
(`AirflowFailException`); anything else is raised as is, so the task's
normal retries apply. They are safe because every retry re-enters the
commit protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from microbatch_airflow.assets import batches_alias, state_asset
from microbatch_airflow.airflow_spec import airflow_spec
from microbatch_airflow.hooks import aws_connection, connections, spark_master
from microbatch_airflow.links import ConsoleLink, console_url
from spark_jobs.core.spec import PipelineSpec, load_spec
from spark_jobs.errors import MicrobatchError, SpecError, is_retryable

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

    from spark_jobs.core.ledger import LedgerRow
    from spark_jobs.core.outcome import BatchOutcome
    from spark_jobs.core.protocol import RunOptions

__all__ = ["MaintenanceOperator", "MicroBatchOperator", "QuarantineCheckOperator", "headline"]

#: Run types whose data interval bounds the batch. A manual trigger takes
#: whatever is available now (up to the caps).
_INTERVAL_BOUND_RUN_TYPES = {"scheduled", "backfill"}
#: What a run's conf may hold (the trigger form's fields).
RUN_PARAMS = ("max_files", "max_records", "rewind_to_batch", "rewind_only", "dry_run")


def headline(spec: PipelineSpec, outcome: BatchOutcome) -> str:
    """The one line a person reads without opening XCom, e.g. "clicks batch 3
    (epoch 0) committed: 3 inputs, 3,000 records read (60 of them
    quarantined), 412 keys updated; state version 7; 4.1 s"."""
    from spark_jobs.core.outcome import Outcome

    if outcome.status is Outcome.COMMITTED:
        return (
            f"{spec.name} batch {outcome.batch_id} (epoch {outcome.epoch}) committed: "
            f"{_counted(len(outcome.inputs or []), 'input')}, {_counted(outcome.records_in, 'record')} read "
            f"({outcome.records_quarantined or 0:,} of them quarantined), {_counted(outcome.keys_updated, 'key')} "
            f"updated; state version {outcome.state_version}; {(outcome.duration_ms or 0) / 1000:.1f} s"
        )
    labels = {
        Outcome.NO_NEW_DATA: "nothing to do",
        Outcome.ALREADY_COMMITTED: "already done by another run",
        Outcome.DRY_RUN: "dry run, nothing written",
        Outcome.REWOUND: "rewound",
    }
    return f"{spec.name}: {labels.get(outcome.status, str(outcome.status))}: {outcome.message}"


class MicroBatchOperator(BaseOperator):
    """Run one micro-batch of the pipeline in `spec_path`.

    :param spec_path: the pipeline spec (YAML). Templated.
    :param spark_master: ``local[*]``, ``spark://host:port`` or
        ``sc://host:port``.
    :param spark_conn_id: an Airflow connection naming the master instead
        (see `microbatch_airflow.hooks.spark_master`). With neither, the spec's
        ``airflow.spark_conn_id``, then ``engine.master``, then
        ``MICROBATCH_SPARK_MASTER``, then ``local[*]`` apply.
    :param kafka_conn_id: for a Kafka source, an Airflow connection of the
        apache-kafka provider whose extra holds librdkafka settings and
        secrets (see `microbatch_airflow.hooks.kafka_settings`); default:
        ``airflow.kafka_conn_id``.
    :param aws_conn_id: for a pipeline on S3, the amazon provider's AWS
        connection whose session reads and commits; default: the spec's
        ``airflow.aws_conn_id``, else ``aws_default`` (when that is not
        defined, boto3's standard chain applies).
    """

    template_fields: Sequence[str] = ("spec_path", "spark_master", "spark_conn_id", "kafka_conn_id", "aws_conn_id")
    operator_extra_links = (ConsoleLink(),)
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        spec_path: str,
        spark_master: str | None = None,
        spark_conn_id: str | None = None,
        kafka_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.spark_master = spark_master
        self.spark_conn_id = spark_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        spec = self._spec()
        # The connections hold for the whole task: the rewind, the batch and
        # the ledger reads after it all go through the same credentials.
        from microbatch_airflow.lineage import source_dataset, state_dataset

        with connections(spec, kafka_conn_id=self.kafka_conn_id, aws_conn_id=self.aws_conn_id):
            self._datasets = (source_dataset(spec), state_dataset(spec))
            self._summary = self._run(context, spec)
            return self._summary

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """Lineage for Airflow's OpenLineage provider: the source in, the
        state table out, and the batch (epoch, id, offsets, records) as the
        ``microbatch`` run facet. Also sent for a skipped run, with its status."""
        from microbatch_airflow.lineage import operator_lineage, source_dataset, state_dataset

        datasets = getattr(self, "_datasets", None)
        if datasets is None:  # execute never got that far: name them from the spec
            spec = self._spec()
            datasets = (source_dataset(spec), state_dataset(spec))
        return operator_lineage(*datasets, getattr(self, "_summary", None))

    def _run(self, context: Context, spec: PipelineSpec) -> dict[str, Any]:
        from spark_jobs.core.protocol import run_batch
        from spark_jobs.engine import compute_factory

        params = context.get("params") or {}
        options = _run_options(context, params)
        rewind_to = params.get("rewind_to_batch")
        conn_id = self.spark_conn_id or airflow_spec(spec).spark_conn_id
        # The driver JVM boots while the run reconciles and plans; a run with
        # nothing new (or a rewind alone) stops it as it leaves the factory's block.
        factory = compute_factory(
            spec,
            self.spark_master or (spark_master(conn_id) if conn_id else None),
            start_driver=not options.dry_run and not params.get("rewind_only"),
        )
        rewound: BatchOutcome | None = None
        try:
            with factory:
                if rewind_to is not None and not options.dry_run:
                    rewound = self._rewind_once(spec, int(rewind_to), options.run_id)
                if params.get("rewind_only") and not options.dry_run:
                    self.log.info("rewind only: the next run processes from batch %s's offsets", rewind_to)
                    if rewound is None:  # a retry: an earlier attempt of this run rewound
                        return {"status": "rewound", "rewound_to_batch": int(rewind_to), "message": "rewound by an earlier attempt of this run"}
                    self._emit(context, spec, rewound, rewind=True)
                    return {**rewound.to_dict(), "rewound_to_batch": int(rewind_to)}
                outcome = run_batch(factory.spec, options, factory)
        except MicrobatchError as exc:
            if is_retryable(exc):
                raise
            raise AirflowFailException(str(exc)) from exc
        return self._report(context, spec, options, outcome, rewound)

    def _report(
        self, context: Context, spec: PipelineSpec, options: RunOptions, outcome: BatchOutcome, rewound: BatchOutcome | None
    ) -> dict[str, Any]:
        """The run's asset events, its one log line and its XCom summary; a
        run that changed nothing is skipped (its summary still pushed)."""
        from spark_jobs.core.outcome import Outcome
        from spark_jobs.core.quarantine import over_limit

        summary = outcome.to_dict()
        if rewound is not None:
            # The state changed even if nothing new was processed after it.
            self._emit(context, spec, rewound, rewind=True)
            summary["rewound_to_batch"] = int((context.get("params") or {})["rewind_to_batch"])
            summary["rewind"] = rewound.message
        made: list[Any] = [outcome] if outcome.status is Outcome.COMMITTED else []
        if outcome.status is Outcome.COMMITTED:
            self._emit(context, spec, outcome)
        if options.attempt > 1:
            earlier, summary["events_sent_now"] = self._emit_earlier_attempts(context, spec, options.run_id, outcome)
            summary["committed_by_earlier_attempts"] = [row.batch_id for row in earlier]
            made = earlier + made
        # Every batch this run made, an earlier attempt's too: a run cleared
        # after `check_quarantine` failed must fail it again.
        crossed = next((c for c in (over_limit(spec, batch) for batch in made) if c is not None), None)
        if crossed is not None:
            summary["quarantine_over_limit"] = str(crossed)
        # Said once, with where to see it on a line of its own (the log view
        # makes the URL a link, and a long line cuts it off), and said here
        # even for a run that is skipped: Airflow logs a skip's reason in
        # the collapsed "Post Execute" group, where nobody looks.
        said = headline(spec, outcome)
        self.log.info("%s", said)
        self.log.info("Console: %s", console_url(self.dag_id, options.run_id))
        if crossed is not None:
            # The task itself succeeds: Airflow sends a task's asset events
            # only with its success, and downstreams must see what committed.
            # With `on_exceed: fail` the DAG's `check_quarantine` task fails.
            self.log.warning("over the quarantine limit (quarantine.on_exceed: %s): %s", spec.quarantine.on_exceed, crossed)
        idle = outcome.status in (Outcome.NO_NEW_DATA, Outcome.ALREADY_COMMITTED, Outcome.DRY_RUN)
        if idle and rewound is None and not summary.get("committed_by_earlier_attempts"):
            # Skipped, not green: nothing changed, and the grid should say so
            # at a glance. The summary is still the task's XCom. (A run
            # cleared after it committed its batch stays green: the batch is
            # its work, though this attempt found it done.)
            context["ti"].xcom_push(key="return_value", value=summary)
            self._summary = summary  # for lineage: a skipped run still says what it found
            raise AirflowSkipException(said)
        return summary

    def on_kill(self) -> None:
        """Airflow stops the task (marked failed, or its run cancelled): stop
        at the protocol's next boundary, as SIGTERM does for the CLI
        (`spark_jobs.core.shutdown`); what is committed stays committed."""
        from spark_jobs.core import shutdown

        self.log.warning("stop requested: the run stops at its next protocol boundary")
        shutdown.request()

    @staticmethod
    def _emit(context: Context, spec: PipelineSpec, batch: Any, *, rewind: bool = False) -> None:
        """One asset event for a committed batch (a `BatchOutcome` or a ledger
        row), or for a rewind (`rewind`: the state table changed too)."""
        from spark_jobs.core.quarantine import over_limit

        extra: dict[str, Any] = {"pipeline": spec.name, "epoch": batch.epoch}
        if rewind:
            extra["rewound_to_batch"] = batch.batch_id
        else:
            extra.update(batch_id=batch.batch_id, start_offsets=batch.start_offsets)
            if getattr(batch, "records_in", None) is not None:  # (the counts a batch's outcome or ledger row has)
                extra.update(records_in=batch.records_in, records_quarantined=batch.records_quarantined or 0)
                crossed = over_limit(spec, batch)
                if crossed is not None:
                    extra["quarantine_over_limit"] = str(crossed)
        extra.update(end_offsets=batch.end_offsets, state_version=batch.state_version)
        context["outlet_events"][batches_alias(spec)].add(state_asset(spec), extra=extra)

    def _emit_earlier_attempts(
        self, context: Context, spec: PipelineSpec, run_id: str, outcome: BatchOutcome
    ) -> tuple[list[LedgerRow], list[int]]:
        """The ledger rows of the batches an earlier attempt of this run
        committed, and of those the ids announced now: an asset event for
        each that no event announced yet.

        An attempt killed after its state commit (or failing after it, e.g. on
        the ledger row) never emitted its event: Airflow records a task's
        events only when it succeeds. The retry then finds the batch done, and
        without this downstream DAGs would not hear of that batch until the
        next one. An attempt that succeeded did announce it: a re-run of its
        run (cleared, or a backfill reprocessing it) must not announce it
        again, or downstream DAGs run twice for one batch.
        """
        from spark_jobs.core.inspect import history
        from spark_jobs.core.ledger import RowStatus
        from spark_jobs.core.outcome import Outcome

        earlier = [
            row
            for row in history(spec)
            if row.status is RowStatus.COMMITTED
            and row.run_id == run_id
            and not (
                outcome.status is Outcome.COMMITTED and (row.epoch, row.batch_id) == (outcome.epoch, outcome.batch_id)
            )
        ]
        announced = self._announced(spec, earlier)
        unannounced = []
        for row in earlier:
            if (row.epoch, row.batch_id) in announced:
                self.log.info(
                    "batch %s (epoch %s) was committed by attempt %s of this run, and its asset event was sent then",
                    row.batch_id,
                    row.epoch,
                    row.attempt,
                )
                continue
            self.log.info(
                "batch %s (epoch %s) was committed by attempt %s of this run, which ended before its asset event "
                "was sent: sending it now",
                row.batch_id,
                row.epoch,
                row.attempt,
            )
            self._emit(context, spec, row)
            unannounced.append(row.batch_id)
        return earlier, unannounced

    @staticmethod
    def _announced(spec: PipelineSpec, rows: list[Any]) -> set[tuple[int, int]]:
        """(epoch, batch) of the state asset's events Airflow holds for
        `rows`' batches: those sent since the earliest of them committed (an
        hour's margin for clocks), read through the task's own API."""
        from airflow.sdk.execution_time.context import InletEventsAccessor

        if not rows:
            return set()
        times = [row.committed_at for row in rows if row.committed_at is not None]
        asset = state_asset(spec)
        events = InletEventsAccessor(asset_name=asset.name, asset_uri=asset.uri)
        if times:
            events = events.after((min(times) - timedelta(hours=1)).isoformat())
        found = set()
        for event in events:
            extra = event.extra or {}
            if extra.get("pipeline") == spec.name and "batch_id" in extra:
                found.add((extra.get("epoch"), extra["batch_id"]))
        return found

    def _spec(self) -> PipelineSpec:
        """The spec file as it is now, its `airflow:` block checked too: a
        broken one fails the task at once (a retry reads the same file)."""
        try:
            spec = load_spec(self.spec_path)
            airflow_spec(spec)
        except SpecError as exc:
            raise AirflowFailException(str(exc)) from exc
        return spec

    def _rewind_once(self, spec: PipelineSpec, to_batch: int, run_id: str) -> BatchOutcome | None:
        """Rewind, unless this Airflow run already did (a retry must not rewind
        twice: None then). Returns the rewind's outcome."""
        from spark_jobs.core.inspect import history
        from spark_jobs.core.ledger import RowStatus
        from spark_jobs.core.pipeline import Pipeline
        from spark_jobs.core.protocol import reconcile
        from spark_jobs.core.rewind import rewind
        from spark_jobs.errors import StateBehindLedgerError, StateChangedOutsideError

        # Record a rewind a killed attempt made before it could write its ledger row.
        try:
            reconcile(Pipeline(spec))
        except (StateBehindLedgerError, StateChangedOutsideError):
            pass  # the rewind below is the way out
        if any(row.status is RowStatus.REWOUND and row.run_id == run_id for row in history(spec)):
            self.log.info("this run already rewound the pipeline; not rewinding again")
            return None
        outcome = rewind(spec, to_batch, run_id=run_id)
        self.log.info("rewound: %s", outcome.message)
        return outcome


def _counted(n: int | None, noun: str) -> str:
    """ "1 key", "2 keys", "1,000 records"."""
    n = n or 0
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _run_options(context: Context, params: dict[str, Any]) -> RunOptions:
    """The run's options from its Airflow context, once its parameters are
    checked: a bad one fails the task before anything is read or written."""
    from spark_jobs.core.protocol import RunOptions

    dag_run = context["dag_run"]
    unknown = sorted(set(getattr(dag_run, "conf", None) or {}) - set(RUN_PARAMS))
    if unknown:
        raise AirflowFailException(
            f"unknown run parameter(s) {unknown}: a run takes {', '.join(RUN_PARAMS)}. Nothing was read or written."
        )
    run_type = str(getattr(dag_run, "run_type", "manual")).lower().rsplit(".", 1)[-1]
    bounded = run_type in _INTERVAL_BOUND_RUN_TYPES
    rewind_to = params.get("rewind_to_batch")
    if rewind_to is not None and bounded:
        # Every run of a backfill would apply it (a K=0 over dates before
        # the data empties the state and reports "no new data").
        raise AirflowFailException(
            f"rewind_to_batch is refused in {run_type} runs: a backfill would rewind once per interval. "
            "Trigger one run with rewind_to_batch (and rewind_only: true), then backfill."
        )
    if params.get("rewind_only") and rewind_to is None:
        raise AirflowFailException("rewind_only needs rewind_to_batch: the batch to rewind to")
    return RunOptions(
        run_id=context["run_id"],
        attempt=context["ti"].try_number,
        interval_start=context.get("data_interval_start") if bounded else None,
        interval_end=context.get("data_interval_end") if bounded else None,
        max_files=params.get("max_files"),
        max_records=params.get("max_records"),
        dry_run=bool(params.get("dry_run", False)),
    )


class QuarantineCheckOperator(BaseOperator):
    """Fails when the batch its DAG run committed quarantined more than the
    spec's `quarantine` limits (`on_exceed: fail`), from `run_batch`'s summary.

    A task of its own, after `run_batch`: that task succeeds, so its asset
    event goes out (Airflow sends a task's events only with its success) and
    downstreams run on the commit; this one turns the run red, without a
    retry (a retry cannot un-quarantine records), so failure alerts fire.
    """

    ui_color = "#fbe9e7"

    def __init__(self, *, batch_task_id: str = "run_batch", **kwargs: Any) -> None:
        kwargs.setdefault("retries", 0)
        super().__init__(**kwargs)
        self.batch_task_id = batch_task_id

    def execute(self, context: Context) -> None:
        summary = context["ti"].xcom_pull(task_ids=self.batch_task_id) or {}
        crossed = summary.get("quarantine_over_limit")
        if crossed:
            raise AirflowFailException(crossed)
        if summary.get("status") == "committed":
            self.log.info(
                "batch %s quarantined %s of %s records: within the spec's quarantine limits",
                summary.get("batch_id"), summary.get("records_quarantined") or 0, summary.get("records_in") or 0,
            )
        else:
            self.log.info("this run's batches are within the spec's quarantine limits (%s)", summary.get("message") or summary.get("status"))


class MaintenanceOperator(BaseOperator):
    """Compact, VACUUM and checkpoint a pipeline's tables (`microbatch maintain`).

    :param spec_path: the pipeline spec (YAML). Templated.
    :param keep_batches: batches kept rewindable; default: the spec's
        ``maintenance.keep_batches``.
    :param aws_conn_id: as for `MicroBatchOperator`.
    """

    template_fields: Sequence[str] = ("spec_path", "aws_conn_id")
    ui_color = "#eef3e8"

    def __init__(
        self, *, spec_path: str, keep_batches: int | None = None, aws_conn_id: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.keep_batches = keep_batches
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        from spark_jobs.core.maintain import maintain
        from spark_jobs.engine import compute_factory

        try:
            spec = load_spec(self.spec_path)
            conn_id = airflow_spec(spec).spark_conn_id
            # Spark starts only for a fold too big for the task's process.
            with aws_connection(spec, self.aws_conn_id), compute_factory(spec, spark_master(conn_id) if conn_id else None) as factory:
                report = maintain(factory.spec, self.keep_batches, factory)
        except MicrobatchError as exc:
            if is_retryable(exc):
                raise
            raise AirflowFailException(str(exc)) from exc
        self.log.info("kept batches %s rewindable; files removed: %s", report.kept_batches, report.removed_files)
        return report.to_dict()
