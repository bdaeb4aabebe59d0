"""A Kafka topic as a source: each record consumed exactly once, by partition and offset.

The offset is, per partition, the next offset to read
(``{"<topic>": {"<partition>": <next offset>}}``), and a batch is a set of
half-open ranges ``[start, end)``, one per partition with records waiting,
planned on the driver from the partitions' watermarks. The ranges are the
manifest: a replay reads exactly them. Records are fetched on Spark's
executors (`spark_jobs.engine.kafka_read`).

Planning (driver, librdkafka, no JVM):

* **Where each partition starts.** A partition the ledger knows starts at
  its recorded offset. At the pipeline's first batch, every partition starts
  at `starting_offsets`: ``earliest`` (the low watermark) or ``latest`` (the
  high watermark; that first batch then reads nothing and only pins the
  offsets, because "latest" must be fixed once, not re-read by every run).
  A partition added to the topic later is read from its start, as Spark's
  Kafka source does: its records all arrived after the pipeline began.
* **Where it ends.** At the partition's last stable offset: the consumer
  uses ``isolation.level=read_committed``, whose watermark stops before any
  open transaction, so a batch never plans into a transaction that may
  still abort. A data interval ``[start, end)`` bounds each partition by
  ``offsets_for_times(end)``: the records a scheduled or backfill run takes
  are those the broker had timestamped before the interval's end, and a
  re-run of the interval finds them consumed.
* **Caps.** `batch.max_records` is shared across the partitions with records
  waiting: each gets an equal share, a partition needing less gives the
  rest to the others, and a remainder goes to the partitions furthest
  behind (so none starves). Offsets count records plus transaction markers,
  so a batch never holds more records than the cap; a batch that moves no
  offset is never planned.
* **Refusals.** Records the ledger still needs but retention deleted (the
  low watermark passed the recorded offset) follow `on_data_loss`: ``fail``
  stops with exit 2 naming the partitions and offsets; ``skip`` records the
  lost ranges in the batch's manifest and goes on, like Spark's
  ``failOnDataLoss=false``. A recorded offset beyond the high watermark, or
  a recorded partition the topic no longer has, means the topic was deleted
  or recreated: refused. An unreachable broker is `SourceError` (exit 1,
  retryable) and nothing is written.

Settings: `source.options` (no secrets), then ``MICROBATCH_KAFKA_<SETTING>``
variables (e.g. ``MICROBATCH_KAFKA_SASL_PASSWORD`` for ``sasl.password``),
then a connection's settings (the Airflow operator's `kafka_conn_id` or
`airflow.kafka_conn_id`, handed in by `connection_settings`), each over the
last: a connection named for this pipeline is more specific than a worker's
environment. Offsets also name the cluster's id, so the same topic name on
another cluster is refused. The resolved settings travel to the executors inside the task, as
Spark's own Kafka parameters do; they are never written to the ledger, a
log or an error (`KafkaClient`'s repr names the settings, not their values).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast

from spark_jobs.errors import DataLossError, SourceChangedError, SourceError, SourceRefusedError, first_line
from spark_jobs.sources.base import BatchRange, Caps, Lag, Lineage

if TYPE_CHECKING:
    from confluent_kafka import Consumer

    from spark_jobs.core.spec import KafkaSourceSpec

__all__ = [
    "ENV_PREFIX",
    "KafkaClient",
    "KafkaManifest",
    "KafkaSource",
    "PartitionOffsets",
    "connection_settings",
    "fair_shares",
]

log = logging.getLogger("microbatch")

#: ``MICROBATCH_KAFKA_SASL_PASSWORD=...`` sets ``sasl.password``.
ENV_PREFIX = "MICROBATCH_KAFKA_"
#: How long a metadata or watermark request may take before the broker counts as unreachable.
REQUEST_TIMEOUT_S = 10.0
#: How long `lag` waits for the first waiting records, to date the oldest.
OLDEST_WAIT_S = 2.0
#: Settings that name callbacks (librdkafka takes functions there, not text).
CALLBACK_SETTINGS = frozenset({"error_cb", "throttle_cb", "stats_cb", "log_cb", "oauth_cb", "on_commit", "on_delivery"})
#: Broker answers that a retry cannot change: refused (exit 2), not retried.
_REFUSALS = ("TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED", "CLUSTER_AUTHORIZATION_FAILED", "SASL_AUTHENTICATION_FAILED", "_AUTHENTICATION")
#: Where offsets name the cluster they count in (topic names cannot hold "@").
CLUSTER_KEY = "@cluster"
#: Where offsets name the topic's id (KIP-516): a topic deleted and created
#: again under its name has another.
TOPIC_ID_KEY = "@topic_id"
#: How long a cluster may take to say a topic's id. One that cannot (brokers
#: before Kafka 2.8, librdkafka's mock cluster) is asked once per process.
TOPIC_ID_TIMEOUT_S = 2.0
#: A record timestamped more than this ahead of this machine's clock is "in the future".
FUTURE_SKEW_S = 60.0
#: Settings only consumers take: left out of the admin client that asks for ids.
_CONSUMER_ONLY = frozenset({"group.id", "enable.auto.commit", "enable.auto.offset.store", "isolation.level", "enable.partition.eof", "auto.offset.reset"})
#: Servers whose cluster did not say topic ids, in this process.
_NO_TOPIC_IDS: set[str] = set()

#: A connection's settings for the runs inside `connection_settings` (set by the Airflow glue).
_CONNECTION: ContextVar[Mapping[str, Any] | None] = ContextVar("microbatch_kafka_connection", default=None)


@contextlib.contextmanager
def connection_settings(settings: Mapping[str, Any] | None) -> Iterator[None]:
    """Runs inside use these librdkafka settings (an Airflow connection's
    extra) over the spec's options; environment variables still win."""
    token = _CONNECTION.set(dict(settings) if settings else None)
    try:
        yield
    finally:
        _CONNECTION.reset(token)


@dataclass(frozen=True)
class KafkaClient:
    """The librdkafka settings one pipeline's consumers use. Holds secrets: its
    repr lists the setting names only."""

    settings: Mapping[str, Any] = field(repr=False)

    @classmethod
    def for_source(cls, source: KafkaSourceSpec, pipeline: str) -> KafkaClient:
        settings: dict[str, Any] = {"bootstrap.servers": source.bootstrap_servers, "group.id": f"microbatch-{pipeline}", **source.options}
        settings.update(
            {name[len(ENV_PREFIX):].lower().replace("_", "."): value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
        )
        # A connection the operator names is the most specific choice: it wins over worker-wide variables.
        settings.update(_CONNECTION.get() or {})
        # Callbacks (a provider connection may name one as a dotted path)
        # cannot be handed to librdkafka as text, nor pickled to executors.
        dropped = sorted(k for k, v in settings.items() if k in CALLBACK_SETTINGS or not isinstance(v, (str, int, float, bool)))
        if dropped:
            log.warning("Kafka settings %s are callbacks, which this job cannot use; ignored", dropped)
        settings = {k: v for k, v in settings.items() if k not in dropped}
        # The job's own: offsets live in the ledger, never in a consumer group
        # (`group.id` only names the consumers, for ACLs); and a fetch whose
        # offsets retention deleted must fail, never jump elsewhere.
        settings.update(
            {
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "auto.offset.reset": "error",
            }
        )
        return cls(settings)

    @property
    def servers(self) -> str:
        return str(self.settings.get("bootstrap.servers", "?"))

    def __repr__(self) -> str:
        return f"KafkaClient(servers={self.servers!r}, settings={sorted(self.settings)})"

    def consumer(self) -> Consumer:
        """A consumer with these settings, or `SourceRefusedError` naming a
        setting librdkafka does not accept (never its value: it may be a secret)."""
        from confluent_kafka import Consumer, KafkaException

        try:
            return Consumer(dict(self.settings), logger=_quiet)
        except (KafkaException, TypeError, ValueError) as exc:
            problem = re.sub(r'value "[^"]*"', "value", first_line(exc))
            raise SourceRefusedError(
                f"Kafka settings for {self.servers} are not accepted: {problem}. Fix source.options, the "
                f"{ENV_PREFIX}* variables or the Airflow connection; nothing was read or written.",
            ) from exc


class _QuietLogger:
    """librdkafka's log lines go to our logger at debug level (they repeat
    connection failures many times a second)."""

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        log.debug("librdkafka: " + msg, *args)


_quiet = _QuietLogger()


@dataclass(frozen=True)
class PartitionOffsets:
    """Per partition of one topic, the next offset to read."""

    topic: str
    next: Mapping[int, int]
    #: The id of the Kafka cluster they count in: offsets of another cluster's topic of the same name mean nothing.
    cluster: str | None = None
    #: The topic's id, where the cluster tells it: offsets of a topic since recreated under the name mean nothing.
    topic_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if not self.next:
            return {}
        ids = {CLUSTER_KEY: self.cluster, TOPIC_ID_KEY: self.topic_id}
        return {self.topic: {str(p): n for p, n in sorted(self.next.items())}, **{k: v for k, v in ids.items() if v}}

    @classmethod
    def from_dict(cls, topic: str, data: Mapping[str, Any]) -> PartitionOffsets:
        return cls(topic, {int(p): int(n) for p, n in (data.get(topic) or {}).items()}, data.get(CLUSTER_KEY), data.get(TOPIC_ID_KEY))


#: What a batch's record is taken to weigh before it is read (`KafkaManifest.input_bytes`).
RECORD_BYTES = 256


@dataclass(frozen=True)
class KafkaManifest:
    """The offset ranges one batch reads, and those retention had deleted (skipped)."""

    topic: str
    #: (partition, start, end): offsets ``start <= o < end``, one per partition read.
    ranges: tuple[tuple[int, int, int], ...]
    #: (partition, start, end) ranges deleted by retention and skipped (`on_data_loss: skip`).
    skipped: tuple[tuple[int, int, int], ...] = ()
    #: How to reach the topic (set by the source; never stored).
    client: KafkaClient | None = field(default=None, compare=False, repr=False)
    #: The id of the topic the ranges are in, where the cluster tells it.
    topic_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        ranges = {"topic": self.topic, "ranges": [list(r) for r in self.ranges], "skipped": [list(r) for r in self.skipped]}
        return {**ranges, **({"topic_id": self.topic_id} if self.topic_id else {})}

    def inputs(self) -> list[str]:
        return [f"kafka://{self.topic}/{p} [{s}, {e})" for p, s, e in self.ranges]

    def input_bytes(self) -> int | None:
        # Records are not sized before they are read: a small JSON event's size, per offset.
        return RECORD_BYTES * sum(e - s for _, s, e in self.ranges)

    def describe(self) -> str:
        offsets = sum(e - s for _, s, e in self.ranges)
        text = f"{offsets:,} offset(s) in {len(self.ranges)} partition(s)"
        lost = sum(e - s for _, s, e in self.skipped)
        return text + (f", {lost:,} deleted offset(s) skipped" if lost else "")

    def units(self) -> list[tuple[str, str]]:
        return []  # the offsets say what was consumed


@dataclass(frozen=True)
class _Partition:
    """One partition as the broker reports it now (read_committed watermarks)."""

    low: int
    high: int


@dataclass(frozen=True)
class _Topic:
    """The topic's partitions now, the id of the cluster that has it, and its own id."""

    partitions: dict[int, _Partition]
    cluster: str | None
    topic_id: str | None = None


class KafkaSource:
    """Plans batches of per-partition offset ranges of one topic."""

    unit = "records"

    def __init__(self, spec: KafkaSourceSpec, client: KafkaClient, *, max_records: int | None) -> None:
        self.spec = spec
        self.topic = spec.topic
        self.client = client
        self.max_records = max_records

    @property
    def origin(self) -> PartitionOffsets:
        return PartitionOffsets(self.topic, {})

    def decode(self, start: dict[str, Any], end: dict[str, Any], manifest: dict[str, Any]) -> BatchRange:
        return BatchRange(
            PartitionOffsets.from_dict(self.topic, start),
            PartitionOffsets.from_dict(self.topic, end),
            KafkaManifest(
                manifest.get("topic", self.topic),
                tuple((int(p), int(s), int(e)) for p, s, e in manifest.get("ranges", [])),
                tuple((int(p), int(s), int(e)) for p, s, e in manifest.get("skipped", [])),
                self.client,
                manifest.get("topic_id"),
            ),
        )

    # -- planning -------------------------------------------------------------

    def plan(self, lineage: Lineage, *, until: datetime | None = None, caps: Caps = Caps()) -> BatchRange | None:
        known = self._known(lineage)
        with self._connected() as consumer:
            topic = self._topic(consumer, known)
            if topic is None:
                return None
            starts, skipped = self._starts(known, topic.partitions)
            ends = self._ends(consumer, topic.partitions, until)
            if until is not None:
                # A bound that stops at a record dated in the future holds its
                # partition there for every interval until that date: say so.
                stopped = {p: (ends[p], part.high) for p, part in topic.partitions.items() if starts[p] <= ends[p] < part.high}
                for warning in self._future(consumer, stopped, bounded=True):
                    log.warning("%s", warning)
        waiting = {p: max(ends[p] - starts[p], 0) for p in topic.partitions}
        cap = caps.max_records if caps.max_records is not None else self.max_records
        shares = fair_shares(waiting, cap) if cap is not None else waiting
        ranges = tuple((p, starts[p], starts[p] + n) for p, n in sorted(shares.items()) if n > 0)
        end = {**known.next, **starts, **{p: e for p, _, e in ranges}}
        if not ranges and not skipped and not self._pins(known):
            return None
        return BatchRange(
            PartitionOffsets.from_dict(self.topic, lineage.end),
            PartitionOffsets(self.topic, end, topic.cluster, topic.topic_id),
            KafkaManifest(self.topic, ranges, tuple(skipped), self.client, topic.topic_id),
            waiting_after=sum(waiting.values()) - sum(e - s for _, s, e in ranges),
        )

    def lag(self, lineage: Lineage, *, until: datetime | None = None, dated: bool = False) -> Lag:
        known = self._known(lineage)
        with self._connected() as consumer:
            topic = self._topic(consumer, known)
            if topic is None:
                return Lag(0, self.unit)
            if self._pins(known):
                # The first run pins "latest" (and reads nothing): a sensor must let it run.
                return Lag(1, "start to pin (starting_offsets: latest)")
            # Lost records are not waiting: start where they can be read.
            starts = {p: max(known.next.get(p, part.low), part.low) for p, part in topic.partitions.items()}
            ends = self._ends(consumer, topic.partitions, until)
            behind = {p: max(ends[p] - starts[p], 0) for p in topic.partitions}
            oldest = self._oldest(consumer, {p: starts[p] for p, n in behind.items() if n}) if dated else None
            warnings = self._future(consumer, {p: (starts[p], topic.partitions[p].high) for p, n in behind.items() if n}) if dated else []
        return Lag(
            sum(behind.values()),
            self.unit,
            detail=tuple((f"{self.topic}/{p}", n) for p, n in sorted(behind.items()) if n),
            oldest=oldest,
            warnings=tuple(warnings),
        )

    def _future(self, consumer: Consumer, ranges: dict[int, tuple[int, int]], *, bounded: bool = False) -> list[str]:
        """A warning for each partition whose records in ``[start, end)`` hold
        one timestamped in the future (its first such record), naming the
        partition, the offset and the timestamp.

        A run bounded by a data interval takes a partition's records up to
        the first one timestamped at or after the interval's end
        (`offsets_for_times`), so such a record stops its partition there for
        every scheduled interval until its date. Found by asking for the
        first offset at or after now (+ `FUTURE_SKEW_S`), then reading that
        one record's timestamp.
        """
        from confluent_kafka import KafkaException, TopicPartition

        if not ranges:
            return []
        limit_ms = int((time.time() + FUTURE_SKEW_S) * 1000)
        try:
            found = consumer.offsets_for_times([TopicPartition(self.topic, p, limit_ms) for p in ranges], timeout=REQUEST_TIMEOUT_S)
        except KafkaException as exc:
            raise self._broker_error(exc) from exc
        at = {tp.partition: tp.offset for tp in found if tp.error is None and ranges[tp.partition][0] <= tp.offset < ranges[tp.partition][1]}
        warnings = []
        for p, wanted in sorted(at.items()):
            offset, stamp = self._timestamp(consumer, p, wanted)
            when = datetime.fromtimestamp(stamp / 1000, timezone.utc).isoformat(timespec="seconds") if stamp is not None else "a future time"
            held = "holds" if bounded else "will hold"
            warnings.append(
                f"topic {self.topic} partition {p} offset {offset} is timestamped {when}, in the future: a run bounded "
                f"by a data interval (scheduled, backfill) {held} partition {p} at offset {offset} until an interval "
                "ends after that time. Check the producer's clock; a manual run (no data interval) takes the records now."
            )
        return warnings

    def _timestamp(self, consumer: Consumer, partition: int, offset: int) -> tuple[int, int | None]:
        """The first record at or after `offset` in `partition` (an aborted or
        compacted record takes an offset but is never delivered): its offset
        and timestamp (ms); `offset` and None if none arrives within `OLDEST_WAIT_S`."""
        from confluent_kafka import TopicPartition

        consumer.assign([TopicPartition(self.topic, partition, offset)])
        deadline = time.monotonic() + OLDEST_WAIT_S
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None or message.error() is not None or message.partition() != partition or message.offset() < offset:
                continue
            kind, stamp = message.timestamp()
            return message.offset(), (stamp if kind and stamp >= 0 else None)
        return offset, None

    def _oldest(self, consumer: Consumer, starts: dict[int, int]) -> datetime | None:
        """The earliest timestamp of the first waiting record of each partition
        in `starts` (None if none arrives within `OLDEST_WAIT_S`: it is a
        courtesy of `status`, not worth a stalled sensor)."""
        from confluent_kafka import TopicPartition

        if not starts:
            return None
        consumer.assign([TopicPartition(self.topic, p, offset) for p, offset in starts.items()])
        seen: dict[int, int] = {}
        deadline = time.monotonic() + OLDEST_WAIT_S
        while len(seen) < len(starts) and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None or message.error() is not None or message.partition() in seen:
                continue
            kind, stamp = message.timestamp()
            if kind and stamp >= 0:
                seen[message.partition()] = stamp
        return datetime.fromtimestamp(min(seen.values()) / 1000, timezone.utc) if seen else None

    def check_read(self, batch: BatchRange) -> None:
        """Nothing to check: an offset is one record for good, and a read of records retention deleted fails (`auto.offset.reset=error`)."""

    def verify(self, batch: BatchRange) -> None:
        """The planned ranges must still be there: retention may have deleted
        their start since the plan, or the topic been recreated."""
        gone = self._gone(batch.start, batch.end, [batch])
        if gone:
            raise SourceChangedError(
                f"topic {self.topic} can no longer give this planned batch's records {', '.join(gone)}: retention "
                "deleted them since the plan, or the topic was recreated. A replay must read exactly what was "
                "planned; nothing was read or written. Rewind to the last committed batch (`microbatch rewind "
                "SPEC --to-batch K`): the next run plans afresh and `source.on_data_loss` decides about the loss.",
                path=f"kafka://{self.topic}",
            )

    def replay_gaps(self, start: dict[str, Any], batches: Sequence[BatchRange]) -> str | None:
        """The ranges the batches read after `start` that retention has deleted since."""
        if not batches:
            return None
        try:
            gone = self._gone(self.decode(start, start, {}).start, batches[-1].end, batches)
        except SourceChangedError:
            # Deleted and created again: every record those batches read went with the old topic.
            gone = [f"{self.topic} (deleted and created again since)"]
        if not gone:
            return None
        if self.spec.on_data_loss == "skip":
            log.warning("topic %s: %s deleted since; the replay skips them (on_data_loss: skip)", self.topic, ", ".join(gone))
            return None
        return (
            f"topic {self.topic} can no longer give records {', '.join(gone)}, which those batches read "
            "(retention deleted them, or the topic was recreated). Rewind to a later batch, or set "
            "`source.on_data_loss: skip` to rewind without those records"
        )

    def _gone(self, start: Any, end: Any, batches: Sequence[BatchRange]) -> list[str]:
        """Of the batches' ranges, those the topic no longer holds whole, named."""
        with self._connected() as consumer:
            topic = self._topic(consumer, PartitionOffsets(self.topic, start.next, end.cluster, end.topic_id))
        partitions = topic.partitions if topic is not None else {}
        gone = []
        for batch in batches:
            for p, first, last in cast(KafkaManifest, batch.manifest).ranges:
                part = partitions.get(p)
                if part is None or part.low > first or part.high < last:
                    gone.append(f"{self.topic}/{p} [{first}, {last})" + (f" (now {part.low}..{part.high})" if part else " (no such partition)"))
        return gone

    def rewinding(self, end: dict[str, Any]) -> None:
        pass  # nothing upstream keeps data for this pipeline

    def after_commit(self, lineage: Lineage) -> int:
        return 0  # the topic's retention is the broker's business

    # -- internals ------------------------------------------------------------

    def _known(self, lineage: Lineage) -> PartitionOffsets:
        end = lineage.end
        others = [name for name in end if name not in (self.topic, CLUSTER_KEY, TOPIC_ID_KEY)]
        if others:
            raise SourceChangedError(
                f"the ledger's offsets are for topic(s) {others}, not {self.topic}: this checkpoint belongs to "
                "another source. Point source.topic back, or give the pipeline a new checkpoint and state.",
                path=f"kafka://{self.topic}",
            )
        return PartitionOffsets.from_dict(self.topic, end)

    def _pins(self, known: PartitionOffsets) -> bool:
        """Whether the next batch pins `latest` (the pipeline's first, reading nothing)."""
        return not known.next and self.spec.starting_offsets == "latest"

    @contextlib.contextmanager
    def _connected(self) -> Iterator[Consumer]:
        consumer = self.client.consumer()
        try:
            yield consumer
        finally:
            consumer.close()

    def _broker_error(self, exc: BaseException) -> SourceError | SourceRefusedError:
        """An unreachable broker is retryable; a refusal of our credentials or rights is not."""
        from confluent_kafka import KafkaError

        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if error is not None and error.name() in _REFUSALS:
            return SourceRefusedError(
                f"Kafka at {self.client.servers} refused this job for topic {self.topic}: {error.name()} "
                f"({first_line(exc)}). Nothing was read or written. Grant the principal read access to the topic "
                f"(and describe on the consumer group {self.client.settings.get('group.id')!r}; set another with "
                "source.options group.id), or fix the security settings.",
                path=f"kafka://{self.topic}",
            )
        return SourceError(
            f"cannot reach Kafka at {self.client.servers} for topic {self.topic}: {first_line(exc)}. Nothing was "
            "read or written; the run can be retried once the brokers answer (check source.bootstrap_servers, "
            "the network, and the security settings).",
            path=f"kafka://{self.topic}",
        )

    def _metadata(self, consumer: Consumer) -> Any:
        from confluent_kafka import KafkaException

        try:
            return consumer.list_topics(self.topic, timeout=REQUEST_TIMEOUT_S)
        except KafkaException as exc:
            raise self._broker_error(exc) from exc

    def _topic(self, consumer: Consumer, known: PartitionOffsets) -> _Topic | None:
        """The topic's partitions with their watermarks, and its cluster; None
        if the topic does not exist yet and the pipeline has read nothing from it."""
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        def missing(metadata: Any) -> bool:
            found = metadata.topics.get(self.topic)
            return found is None or (found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)

        metadata = self._metadata(consumer)
        if known.cluster and metadata.cluster_id and metadata.cluster_id != known.cluster:
            raise SourceChangedError(
                f"Kafka at {self.client.servers} is cluster {metadata.cluster_id}, but this pipeline read topic "
                f"{self.topic} on cluster {known.cluster}: its offsets mean nothing there. Nothing was read. Point "
                "the servers back at that cluster, or give the pipeline a new checkpoint and state to start over.",
                path=f"kafka://{self.topic}",
            )
        if missing(metadata) and known.next:
            time.sleep(1.0)  # a broker that has not caught up answers the same: ask once more
            metadata = self._metadata(consumer)
        if missing(metadata):
            if not known.next:
                log.info("topic %s does not exist yet: nothing to read", self.topic)
                return None
            raise SourceChangedError(
                f"topic {self.topic} no longer exists, but this pipeline has read it up to offsets "
                f"{dict(known.next)}. Nothing was read. If it was deleted by mistake, restore it; to start over on "
                "a new topic, give the pipeline a new checkpoint and state.",
                path=f"kafka://{self.topic}",
            )
        found = metadata.topics[self.topic]
        if found.error is not None:
            raise self._broker_error(KafkaException(found.error))
        partitions: dict[int, _Partition] = {}
        try:
            for p in sorted(found.partitions):
                low, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=REQUEST_TIMEOUT_S)
                partitions[p] = _Partition(low, high)
        except KafkaException as exc:
            raise self._broker_error(exc) from exc
        self._check_offsets_fit(known, partitions)
        topic_id = self._topic_id(metadata.cluster_id, required=bool(known.topic_id))
        if known.topic_id and topic_id and topic_id != known.topic_id:
            raise SourceChangedError(
                f"topic {self.topic} is not the topic this pipeline read: its id is {topic_id}, and the offsets in "
                f"the ledger were counted in topic id {known.topic_id}. It was deleted and created again; its "
                "offsets start over, and reading on from the old ones would skip the new topic's first records. "
                "Nothing was read. To read the new topic from its start, give the pipeline a new checkpoint and "
                "state (a rewind cannot: the new epoch would read again what the old topic gave); if the topic "
                "was recreated by mistake, restore the old one's data under a new topic name and point "
                "source.topic at it.",
                path=f"kafka://{self.topic}",
            )
        return _Topic(partitions, metadata.cluster_id or known.cluster, topic_id or known.topic_id)

    def _check_offsets_fit(self, known: PartitionOffsets, partitions: Mapping[int, _Partition]) -> None:
        """Refuse a topic whose partitions cannot hold the recorded offsets
        (one is gone, or ends before them): it was deleted and recreated.
        (The topic id says so too, where the cluster tells ids.)"""
        vanished = sorted(set(known.next) - set(partitions))
        beyond = {p: (n, partitions[p].high) for p, n in known.next.items() if p in partitions and n > partitions[p].high}
        if vanished or beyond:
            problems = [f"partition {p} is gone" for p in vanished] + [
                f"partition {p} ends at offset {high}, but this pipeline has read it up to {n}" for p, (n, high) in sorted(beyond.items())
            ]
            raise SourceChangedError(
                f"topic {self.topic} is not the topic this pipeline read ({'; '.join(problems)}): it was deleted and "
                "recreated. Nothing was read. Offsets of the old topic mean nothing in the new one: give the "
                "pipeline a new checkpoint and state to start over on it.",
                path=f"kafka://{self.topic}",
            )

    def _topic_id(self, cluster: str | None, *, required: bool) -> str | None:
        """The topic's id (KIP-516), or None where the cluster does not tell it
        (asked once per process of such a cluster: a timeout each run would cost).

        `required`: the ledger holds an id, so this cluster told one before;
        not getting it now is a failure to retry (exit 1), never a pass.
        """
        from confluent_kafka import KafkaException, TopicCollection
        from confluent_kafka.admin import AdminClient

        where = cluster or self.client.servers
        if where in _NO_TOPIC_IDS and not required:
            return None
        settings = {k: v for k, v in self.client.settings.items() if k not in _CONSUMER_ONLY}
        admin = AdminClient({**settings, "logger": _quiet})  # kept until the answer: its end cancels the request
        wait = REQUEST_TIMEOUT_S if required else TOPIC_ID_TIMEOUT_S
        try:
            futures = admin.describe_topics(TopicCollection([self.topic]), request_timeout=wait)
            described = futures[self.topic].result(timeout=wait * 2)
        except (KafkaException, TimeoutError) as exc:
            if required:
                raise SourceError(
                    f"Kafka at {self.client.servers} did not say the id of topic {self.topic} ({first_line(exc)}), "
                    "which this pipeline's offsets were counted in: whether the topic is still the same one cannot "
                    "be checked. Nothing was read or written; the run can be retried.",
                    path=f"kafka://{self.topic}",
                ) from exc
            error = exc.args[0] if exc.args and hasattr(exc.args[0], "name") else None
            if error is None or error.name() in ("_TIMED_OUT", "UNSUPPORTED_VERSION", "_UNSUPPORTED_FEATURE"):
                _NO_TOPIC_IDS.add(where)
            log.debug("Kafka at %s did not say topic ids (%s): recreated topics are found by their offsets only", where, first_line(exc))
            return None
        topic_id = str(getattr(described, "topic_id", "") or "")
        return topic_id if topic_id.strip("A=") else None  # all zero: no id

    def _starts(self, known: PartitionOffsets, partitions: Mapping[int, _Partition]) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
        """Where each partition's next range starts, and the ranges lost before it.

        A partition the ledger knows starts at its offset. At the first
        batch, all start at `starting_offsets`. A partition added later
        starts at 0: its records all arrived after the pipeline began, so
        any retention already deleted are lost records like any other."""
        if not known.next:
            edge = "high" if self.spec.starting_offsets == "latest" else "low"
            return {p: getattr(part, edge) for p, part in partitions.items()}, []
        starts = {p: known.next.get(p, 0) for p in partitions}
        lost = [(p, starts[p], part.low) for p, part in partitions.items() if starts[p] < part.low]
        if lost and self.spec.on_data_loss == "fail":
            raise DataLossError(
                f"topic {self.topic}: records this pipeline has not consumed were deleted by retention: "
                + ", ".join(f"partition {p} offsets {a}..{b - 1}" for p, a, b in lost)
                + ". Nothing was read. Set `source.on_data_loss: skip` to record the loss in the ledger and go on, "
                "or lengthen the topic's retention and recompute from a source that still has them.",
                path=f"kafka://{self.topic}",
            )
        for p, a, b in lost:
            log.warning("topic %s partition %d: offsets %d..%d were deleted by retention; skipped (on_data_loss: skip)", self.topic, p, a, b - 1)
            starts[p] = b
        return starts, lost

    def _ends(self, consumer: Consumer, partitions: Mapping[int, _Partition], until: datetime | None) -> dict[int, int]:
        """Each partition's last stable offset, bounded by `until` (the first
        offset timestamped at or after it, where the broker has one)."""
        from confluent_kafka import KafkaException, TopicPartition

        ends = {p: part.high for p, part in partitions.items()}
        if until is None or not partitions:
            return ends
        limit_ms = int(until.timestamp() * 1000)
        try:
            found = consumer.offsets_for_times([TopicPartition(self.topic, p, limit_ms) for p in partitions], timeout=REQUEST_TIMEOUT_S)
        except KafkaException as exc:
            raise self._broker_error(exc) from exc
        for tp in found:
            if tp.error is not None:
                raise self._broker_error(KafkaException(tp.error))
            if tp.offset >= 0:  # -1: no record at or after `until` yet, so all of them are before it
                ends[tp.partition] = min(ends[tp.partition], tp.offset)
        return ends


def fair_shares(waiting: Mapping[int, int], cap: int) -> dict[int, int]:
    """How many offsets each partition gets of `cap`: equal shares, a
    partition needing less than its share gives the rest to the others, and
    what cannot be split evenly goes to those furthest behind (ties: the
    lower partition)."""
    shares = {p: 0 for p in waiting}
    left = cap
    open_ = [p for p in sorted(waiting) if waiting[p] > 0]
    while left > 0 and open_:
        each = left // len(open_)
        if each == 0:
            for p in sorted(open_, key=lambda q: (-(waiting[q] - shares[q]), q))[:left]:
                shares[p] += 1
            break
        for p in open_:
            give = min(each, waiting[p] - shares[p])
            shares[p] += give
            left -= give
        open_ = [p for p in open_ if shares[p] < waiting[p]]
    return shares
