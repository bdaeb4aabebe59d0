"""Pipeline specs: YAML in, a validated `PipelineSpec` out, or a `SpecError`.

Validation happens entirely in Python, before any table is opened or Spark is
started, so a bad spec can never leave half a batch behind. Each problem is
reported with the field path, the YAML line it sits on, and what to write
instead.

Identifiers (key and value columns, source schema fields) are restricted to
plain SQL identifiers because they are spliced into Spark SQL and into
delta-rs merge predicates; they are quoted there as well, but refusing odd
names up front keeps error messages readable and injection impossible.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from spark_jobs.errors import SpecError
from spark_jobs.storage.roots import check_location, parse_roots, roots_from_env

__all__ = [
    "CHANGE_COLUMNS",
    "IDENTIFIER",
    "PIPELINE_NAME",
    "SPARK_MASTER",
    "DeltaSourceSpec",
    "FilesSourceSpec",
    "KAFKA_COLUMNS",
    "KAFKA_COLUMN_TYPES",
    "KafkaSourceSpec",
    "PipelineSpec",
    "SchemaField",
    "check_cron",
    "check_locations",
    "field_problems",
    "load_spec",
    "parse_schema",
    "parse_spec",
]

# ASCII only (a Cyrillic "а" that looks like "a" is refused), and always used
# with `fullmatch`: `re.match` with `$` would accept a trailing newline.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
PIPELINE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
#: A percent-escape in a table's location, which delta-rs decodes (`_unfindable_tables`).
PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
#: Characters delta-rs cannot open a local table under (`_unfindable_tables`).
DELTA_RS_REFUSES = re.compile(r"[\\\[\]^|\x00-\x1f\x7f]")
#: Default for `source.max_line_bytes`: longer lines are quarantined unparsed.
DEFAULT_MAX_LINE_BYTES = 1024 * 1024
MERGE_RULES = ("sum", "min", "max", "first", "last")
#: Columns the job adds to tables it owns; users may not define them.
#: The state's column recording the batch that wrote a row.
BATCH_COLUMN = "_batch_id"
RESERVED_COLUMNS = frozenset({BATCH_COLUMN})

# Spark SQL atomic types accepted in `source.schema`, mapped to their canonical
# spelling. Nested types are refused: records are parsed field by field so each
# bad value gets its own quarantine reason, which needs atomic fields.
_ATOMIC_TYPES = {
    "STRING": "STRING",
    "VARCHAR": "STRING",
    "BOOLEAN": "BOOLEAN",
    "TINYINT": "TINYINT",
    "BYTE": "TINYINT",
    "SMALLINT": "SMALLINT",
    "SHORT": "SMALLINT",
    "INT": "INT",
    "INTEGER": "INT",
    "BIGINT": "BIGINT",
    "LONG": "BIGINT",
    "FLOAT": "FLOAT",
    "REAL": "FLOAT",
    "DOUBLE": "DOUBLE",
    "DATE": "DATE",
    "TIMESTAMP": "TIMESTAMP",
    "TIMESTAMP_LTZ": "TIMESTAMP",
    "TIMESTAMP_NTZ": "TIMESTAMP_NTZ",
}
_DECIMAL = re.compile(r"DECIMAL\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)", re.IGNORECASE)
_NOT_NULL = re.compile(r"(.*?)\s+NOT\s+NULL", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class SchemaField:
    """One column of the source schema."""

    name: str
    type: str  # canonical Spark SQL type, e.g. "DOUBLE" or "DECIMAL(10,2)"
    #: False for `NOT NULL` columns: records missing the field are quarantined.
    nullable: bool = True


def parse_schema(ddl: str) -> list[SchemaField]:
    """Parse a Spark DDL column list (``"a STRING, b DOUBLE NOT NULL"``) without a JVM.

    Only ``name TYPE [NOT NULL]`` is accepted, TYPE from a fixed list: every
    piece ends up in Spark SQL, so anything else is refused rather than passed on.
    """
    fields: list[SchemaField] = []
    seen: set[str] = set()
    for raw in _columns(ddl):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty column in {ddl!r}; write 'name TYPE, name TYPE'")
        bits = item.split(None, 1)
        if len(bits) != 2:
            raise ValueError(f"column {item!r} has no type; write e.g. '{bits[0]} STRING'")
        name, type_text = bits[0], bits[1].strip()
        nullable = True
        if m := _NOT_NULL.fullmatch(type_text):
            type_text, nullable = m.group(1).strip(), False
        if not IDENTIFIER.fullmatch(name):
            raise ValueError(
                f"column name {name!r} is not a plain identifier (letters, digits, _; "
                "not starting with a digit)"
            )
        if name.startswith("__"):
            raise ValueError(
                f"column name {name!r} starts with two underscores, which the job keeps for the columns "
                "it adds while reading (file, line, reason); rename the column in the files or the topic"
            )
        if name.lower() in seen:
            raise ValueError(f"column {name!r} appears twice")
        seen.add(name.lower())
        fields.append(SchemaField(name, _canonical_type(name, type_text), nullable))
    return fields


def _columns(ddl: str) -> list[str]:
    """The column definitions of a DDL list: split on commas outside
    parentheses (DECIMAL(10,2) has one inside)."""
    parts, depth, current = [], 0, ""
    for ch in ddl:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def _canonical_type(name: str, type_text: str) -> str:
    """Column `name`'s type as the job spells it, from the fixed list."""
    upper = type_text.upper()
    if upper in _ATOMIC_TYPES:
        return _ATOMIC_TYPES[upper]
    if m := _DECIMAL.fullmatch(type_text):
        precision, scale = int(m.group(1)), int(m.group(2))
        if not (1 <= precision <= 38 and 0 <= scale <= precision):
            raise ValueError(f"column {name!r}: DECIMAL({precision},{scale}) is out of range")
        return f"DECIMAL({precision},{scale})"
    raise ValueError(
        f"column {name!r} has type {type_text!r}; use one of "
        f"{', '.join(sorted(set(_ATOMIC_TYPES.values())))} or DECIMAL(p,s) "
        "(read nested data as STRING and use from_json in the transform); "
        "the only constraint allowed after the type is NOT NULL"
    )


def _check_identifier(value: str, what: str) -> str:
    if not IDENTIFIER.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a plain identifier: use letters, digits and _, "
            "not starting with a digit (rename it with AS in the transform)"
        )
    # In any case: a Delta table takes `_Batch_id` for `_batch_id`.
    if value.lower() in RESERVED_COLUMNS:
        raise ValueError(f"{what} {value!r} is reserved for the job's own bookkeeping ({', '.join(sorted(RESERVED_COLUMNS))}, in any case)")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class CsvOptions(_Model):
    header: bool = True
    delimiter: str = Field(default=",", min_length=1, max_length=1)

    @field_validator("delimiter")
    @classmethod
    def _delimiter_usable(cls, value: str) -> str:
        # A quote, escape, line break or control character as the separator
        # would make records ambiguous (and the line split meaningless).
        if value in ('"', "\\") or (not value.isprintable() and value != "\t"):
            raise ValueError(
                f"{value!r} cannot separate CSV columns; use a printable character other "
                "than a quote or backslash (or a tab)"
            )
        return value


def _check_unknown_fields(data_format: str, unknown_fields: str) -> None:
    if unknown_fields == "quarantine" and data_format != "json":
        raise ValueError(
            f"unknown_fields: quarantine is for JSON records; a {data_format} record has no field names "
            "(a CSV record with more columns than the schema is quarantined already): leave it out"
        )


class FilesSourceSpec(_Model):
    """A folder of files; each file is consumed exactly once."""

    type: Literal["files"]
    path: str = Field(min_length=1)
    format: Literal["json", "csv", "parquet"]
    schema_: str = Field(alias="schema", min_length=1)
    csv: CsvOptions = CsvOptions()
    #: Lines longer than this (in UTF-8 bytes) are quarantined without being parsed.
    max_line_bytes: int = Field(default=DEFAULT_MAX_LINE_BYTES, ge=64, le=512 * 1024 * 1024)
    #: What happens to a file once its batch is committed: left where it is,
    #: deleted, or moved under `archive` (outside the source folder).
    after_commit: Literal["keep", "delete", "archive"] = "keep"
    archive: str | None = Field(default=None, min_length=1)
    #: JSON fields `schema` does not name: ignored, or their record quarantined
    #: (a misspelled field is otherwise read as a missing one: a null).
    unknown_fields: Literal["ignore", "quarantine"] = "ignore"

    @model_validator(mode="after")
    def _unknown_fields_of_json(self) -> FilesSourceSpec:
        _check_unknown_fields(self.format, self.unknown_fields)
        return self

    @model_validator(mode="after")
    def _archive_named(self) -> FilesSourceSpec:
        if (self.after_commit == "archive") != (self.archive is not None):
            raise ValueError(
                "after_commit: archive needs `archive: <folder or s3://bucket/prefix>` outside the source "
                "folder, and `archive` is only used with after_commit: archive"
            )
        if self.archive is not None and ("://" in self.archive) != ("://" in self.path):
            raise ValueError("the archive must be on the same storage as the source (both local, or both s3://)")
        return self

    @field_validator("schema_")
    @classmethod
    def _schema_parses(cls, value: str) -> str:
        parse_schema(value)
        return value

    @property
    def fields(self) -> list[SchemaField]:
        return parse_schema(self.schema_)


class DeltaSourceSpec(_Model):
    """An upstream Delta table; each of its versions is consumed exactly once."""

    type: Literal["delta"]
    path: str = Field(min_length=1)
    #: `changes`: the change data feed (inserts, updates with pre/post
    #: images, deletes); `appends`: the rows appended by append-only versions.
    read: Literal["changes", "appends"] = "changes"
    #: Versions the pipeline still needs but the table no longer has (its log
    #: was cleaned up): stop (`fail`), or record them as skipped and go on.
    on_data_loss: Literal["fail", "skip"] = "fail"
    #: Who reads a batch's versions: `driver` (delta-rs in the job's
    #: process, handed to Spark as Arrow), `spark` (delta-spark on the
    #: executors: no row passes through the job's process) or `auto`: Spark
    #: on a cluster or over Spark Connect, where the job's process may be a
    #: small Airflow task, the driver on `local[*]`, where both are one
    #: machine and delta-rs is the faster (docs/benchmarks.md), and under
    #: spark-submit, whose classpath may lack delta-spark. Resolved once
    #: a run knows its master (`spark_jobs.engine.compute_factory`).
    reader: Literal["auto", "driver", "spark"] = "auto"

    @property
    def format(self) -> str:
        return f"delta {self.read}"

    @property
    def fields(self) -> list[SchemaField]:
        """Declared columns: none (the batch has the table's own columns)."""
        return []


#: librdkafka settings the job sets itself: a spec, variable or connection may not.
KAFKA_OWN_SETTINGS = frozenset(
    {
        "bootstrap.servers",
        "isolation.level",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "enable.partition.eof",
        "auto.offset.reset",
    }
)
#: Settings that hold secrets: never in a spec (use MICROBATCH_KAFKA_* or a connection).
KAFKA_SECRET_SETTING = re.compile(r"(password|passphrase|secret|username|\.pem|oauthbearer\.config|\.key$)", re.IGNORECASE)


class KafkaSourceSpec(_Model):
    """A Kafka topic; each record (partition and offset) is consumed exactly once."""

    type: Literal["kafka"]
    bootstrap_servers: str = Field(min_length=1)
    topic: str = Field(pattern=r"^[A-Za-z0-9._\-]{1,249}$")
    #: How each record's value is parsed: one JSON object, one CSV line, or text (a `value` column).
    format: Literal["json", "csv", "text"]
    schema_: str | None = Field(default=None, alias="schema", min_length=1)
    #: `delimiter` only: a record is one line, never a header.
    csv: CsvOptions = CsvOptions(header=False)
    #: Where a pipeline starts on the topic's partitions (later partitions are read from their start).
    starting_offsets: Literal["earliest", "latest"] = "earliest"
    #: Records the pipeline still needs but retention deleted: stop (`fail`), or record the loss and go on.
    on_data_loss: Literal["fail", "skip"] = "fail"
    #: Values longer than this (UTF-8 bytes) are quarantined unparsed.
    max_line_bytes: int = Field(default=DEFAULT_MAX_LINE_BYTES, ge=64, le=512 * 1024 * 1024)
    #: Extra librdkafka settings (security.protocol, sasl.mechanism, ...): no secrets.
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    #: As for files: JSON fields `schema` does not name, ignored or quarantined.
    unknown_fields: Literal["ignore", "quarantine"] = "ignore"

    @model_validator(mode="after")
    def _unknown_fields_of_json(self) -> KafkaSourceSpec:
        _check_unknown_fields(self.format, self.unknown_fields)
        return self

    @model_validator(mode="after")
    def _schema_fits_format(self) -> KafkaSourceSpec:
        if self.format == "text":
            if self.schema_ is not None and [(f.name, f.type) for f in parse_schema(self.schema_)] != [("value", "STRING")]:
                raise ValueError("format text has one STRING column `value`: leave `schema` out (or write 'value STRING')")
        elif self.schema_ is None:
            raise ValueError(f"format {self.format} needs `schema` (e.g. 'event_id STRING, amount_cents BIGINT')")
        if self.csv.header and "header" in self.csv.model_fields_set:
            raise ValueError("a Kafka record is one CSV line with no header: leave csv.header out (or false)")
        return self

    @field_validator("schema_")
    @classmethod
    def _schema_parses(cls, value: str | None) -> str | None:
        if value is not None:
            clash = [f.name for f in parse_schema(value) if f.name.lower() in KAFKA_COLUMNS]
            if clash:
                raise ValueError(f"{clash} clash with the columns the Kafka source adds ({', '.join(KAFKA_COLUMNS)}); rename them")
        return value

    @field_validator("options")
    @classmethod
    def _options_not_ours_nor_secret(cls, options: dict[str, Any]) -> dict[str, Any]:
        for name in options:
            if name in KAFKA_OWN_SETTINGS:
                raise ValueError(f"option {name!r} is set by the job (bootstrap_servers is its own field); remove it")
            if KAFKA_SECRET_SETTING.search(name):
                raise ValueError(
                    f"option {name!r} is a secret and a spec holds none: set MICROBATCH_KAFKA_"
                    f"{name.upper().replace('.', '_')} in the environment, or use an Airflow connection "
                    "(airflow.kafka_conn_id)"
                )
        return options

    @property
    def path(self) -> str:
        """Where the records live, as a location: ``kafka://<topic>`` (the servers may change, the topic may not)."""
        return f"kafka://{self.topic}"

    @property
    def fields(self) -> list[SchemaField]:
        if self.format == "text":
            return [SchemaField("value", "STRING", True)]
        return parse_schema(self.schema_ or "")


#: The `batch` view's columns a Kafka source adds to the value's fields, with their types.
KAFKA_COLUMN_TYPES = (
    ("_kafka_topic", "STRING"),
    ("_kafka_partition", "INT"),
    ("_kafka_offset", "BIGINT"),
    ("_kafka_timestamp", "TIMESTAMP"),
    ("_kafka_key", "STRING"),
)
KAFKA_COLUMNS = tuple(name for name, _ in KAFKA_COLUMN_TYPES)


#: The `batch` view's columns that `read: changes` adds to the table's.
CHANGE_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")


class StateSpec(_Model):
    path: str = Field(min_length=1)
    keys: list[str] = Field(min_length=1)
    merge: dict[str, Literal["sum", "min", "max", "first", "last"]] = Field(min_length=1)
    #: Write Delta's change data feed (`delta.enableChangeDataFeed`), so that
    #: a downstream pipeline can read this state's changes (`source.type: delta`).
    change_feed: bool = False
    #: How a batch reaches the state (`spark_jobs.core.folding`). ``merged``:
    #: a MERGE, one row per key, a cost that grows with the state when keys
    #: come back. ``appended``: the batch's rows are appended, O(batch), and
    #: folded into one row per key once they pass `fold_at` of the state;
    #: read the state through `microbatch query`.
    layout: Literal["merged", "appended"] = "merged"
    #: Appended layout: fold when the rows appended since the last fold pass
    #: this fraction of the rows the fold left.
    fold_at: float = Field(default=0.1, gt=0, le=10)
    #: Merged layout: a batch of returning keys marks their old rows deleted
    #: with Delta deletion vectors and writes them again, merged, in one new
    #: file (merge-on-read, `spark_jobs.core.merge_on_read`), instead of
    #: rewriting every file that holds one of them. Readers need Delta 2.3
    #: or later (reader version 3). Turning it on for an existing state
    #: upgrades its table; turning it off writes copy-on-write again.
    #: ``auto`` (the default): copy-on-write, the table readable by every
    #: Delta reader, until the state's files weigh
    #: `merge_on_read.AUTO_FROM_BYTES`, where rewriting them starts to cost
    #: more than the batch; then turned on, for good. A state where it
    #: cannot be on (`may_merge_on_read`) stays copy-on-write.
    deletion_vectors: bool | Literal["auto"] = "auto"

    @field_validator("keys")
    @classmethod
    def _keys_are_identifiers(cls, keys: list[str]) -> list[str]:
        for key in keys:
            _check_identifier(key, "key")
        if len({k.lower() for k in keys}) != len(keys):
            raise ValueError("a key column is listed twice")
        return keys

    @field_validator("merge", mode="before")
    @classmethod
    def _merge_rules_known(cls, merge: Any) -> Any:
        if isinstance(merge, dict):
            named: dict[str, str] = {}
            for column, rule in merge.items():
                _check_identifier(str(column), "merge column")
                if rule not in MERGE_RULES:
                    raise ValueError(
                        f"column {column!r} has merge rule {rule!r}; use one of "
                        f"{', '.join(MERGE_RULES)}"
                    )
                # A Delta table's column names are one column whatever their case:
                # the state's first write would fail (after the ledger's planned row).
                if (other := named.setdefault(str(column).lower(), str(column))) != str(column):
                    raise ValueError(
                        f"merge columns {other!r} and {column!r} differ only in case, which a Delta table "
                        "takes as one column: rename one of them (AS in the transform)"
                    )
        return merge

    @model_validator(mode="after")
    def _appended_has_no_change_feed(self) -> StateSpec:
        if self.layout == "appended" and self.change_feed:
            raise ValueError(
                "layout: appended cannot write a change data feed a downstream pipeline reads: its "
                "versions hold partial rows, not each key's new value. Chain from a state with "
                "layout: merged, or drop change_feed"
            )
        return self

    @model_validator(mode="after")
    def _change_feed_names_free(self) -> StateSpec:
        # Delta's change data feed adds these columns to each row it gives: a
        # state column of such a name cannot be read as one (delta-rs's MERGE
        # fails from the state's second batch on, and every retry with it).
        taken = [c for c in (*self.keys, *self.merge) if c.lower() in CHANGE_COLUMNS] if self.change_feed else []
        if taken:
            raise ValueError(
                f"state column {taken[0]!r} has a name Delta's change data feed gives its own column "
                f"({', '.join(CHANGE_COLUMNS)}); rename it with AS in the transform, or drop change_feed"
            )
        return self

    @property
    def may_merge_on_read(self) -> bool:
        """Whether this state can be merged on read (`_merge_on_read_refusal`)."""
        return self._merge_on_read_refusal() is None

    @model_validator(mode="after")
    def _deletion_vectors_where_written(self) -> StateSpec:
        refusal = self._merge_on_read_refusal() if self.deletion_vectors is True else None
        if refusal:
            raise ValueError(refusal)
        return self

    def _merge_on_read_refusal(self) -> str | None:
        """Why this state cannot be merged on read (`deletion_vectors: true`
        is refused with it; `auto` stays copy-on-write), or None."""
        if self.layout == "appended":
            return (
                "deletion_vectors is for layout: merged (an appended state never rewrites its files: "
                "it has nothing to mark deleted); drop deletion_vectors or use layout: merged"
            )
        if "://" in self.path and not self.path.startswith(("file:", "s3://", "s3a://")):
            return (
                f"deletion_vectors is supported for a state on a local or mounted file system or on S3, not at "
                f"{self.path}: the job commits those batches itself, with a put-if-absent it has only there; "
                "drop deletion_vectors for this state"
            )
        if self.path.startswith(("s3://", "s3a://")) and re.search(r"[^A-Za-z0-9._~+/-]", self.path.split("://", 1)[1]):
            return (
                f"deletion_vectors on S3 needs a state path of letters, digits and ._~+/- only, not {self.path!r}: "
                "delta-rs 1.6.6 looks for a deletion-vector file under a key it percent-encodes twice, so the "
                "state would become unreadable; rename the path or drop deletion_vectors"
            )
        return None

    @model_validator(mode="after")
    def _keys_not_merged(self) -> StateSpec:
        clash = {k.lower() for k in self.keys} & {c.lower() for c in self.merge}
        if clash:
            raise ValueError(
                f"{sorted(clash)} listed both as key and under merge; keys are matched, "
                "not merged: remove them from state.merge"
            )
        return self


class MaintenanceSpec(_Model):
    """`microbatch maintain`: compaction, VACUUM and checkpoints (see `spark_jobs.core.maintain`)."""

    #: The last this-many batches of the lineage stay rewindable after a VACUUM.
    keep_batches: int = Field(default=100, ge=1)
    #: Files in a table's folder that no commit references (a write whose
    #: commit never landed) are removed once older than this: longer than
    #: any run, since a younger one may be a write still on its way.
    untracked_files_hours: float = Field(default=24.0, gt=0)


class QuarantineLimits(_Model):
    """How much a batch may quarantine before someone should look. Past a
    limit the batch still commits (its bad records are in the quarantine
    table, nothing is lost, and the next batch starts after it); then the
    run fails (`on_exceed: fail`: exit 2, an Airflow task failed and not
    retried, so its alerts fire) or warns (`warn`: a WARNING line, and the
    asset event's and the summary's `quarantine_over_limit`)."""

    #: More quarantined records than this in one batch.
    max_records: int | None = Field(default=None, ge=0)
    #: More than this fraction of the batch's records quarantined.
    max_fraction: float | None = Field(default=None, ge=0, lt=1)
    on_exceed: Literal["fail", "warn"] = "fail"


#: A duration in an `event_time` block: a number and a unit, e.g. ``10 minutes``.
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(second|minute|hour|day|week)s?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
#: Source column types an event time may have (a DATE counts from its midnight, UTC).
EVENT_TIME_TYPES = ("TIMESTAMP", "TIMESTAMP_NTZ", "DATE")


#: The longest duration an `event_time` block takes (a watermark that far
#: behind judges nothing late; longer ones overflow a date).
_LONGEST_DAYS = 36_500


def duration_seconds(text: str) -> float:
    """Seconds of a duration such as ``90 seconds``, ``10 minutes`` or ``1.5 hours``."""
    found = _DURATION.match(text)
    if not found:
        raise ValueError(f"{text!r} is not a duration: write a number and a unit, e.g. '10 minutes' or '2 hours' (units: seconds, minutes, hours, days, weeks)")
    seconds = float(found.group(1)) * _UNIT_SECONDS[found.group(2).lower()]
    if seconds > _LONGEST_DAYS * 86400:
        raise ValueError(f"{text!r} is longer than {_LONGEST_DAYS:,} days: no watermark that far behind judges anything late (leave event_time out instead)")
    return seconds


def _parses(text: str) -> str:
    duration_seconds(text)
    return text


#: A spec field holding a duration (`duration_seconds`), checked as it loads.
Duration = Annotated[str, AfterValidator(_parses)]


class WindowSpec(_Model):
    """A window over the event time, as part of the state's key: the state
    key `key` holds each window's start (``window(ts, '1 hour').start``;
    sliding windows too: ``window(ts, '1 hour', '15 minutes').start``), and
    the window ends `size` later. It is final once the watermark reaches its
    end: no record that is not late can fall in it any more."""

    #: A key of the state (`state.keys`), TIMESTAMP or DATE: the window's start.
    key: str = Field(min_length=1)
    #: The window's length: ``1 hour``, ``1 day``.
    size: str

    @field_validator("size")
    @classmethod
    def _size_parses(cls, size: str) -> str:
        if duration_seconds(size) <= 0:
            raise ValueError(f"{size!r}: a window lasts longer than 0 seconds")
        return size

    @property
    def size_seconds(self) -> float:
        return duration_seconds(self.size)


class FinalSpec(_Model):
    """The table of final rows: each window's state row, appended once when
    the watermark passes the window's end (`spark_jobs.core.windows`)."""

    #: A Delta table (a folder, or ``s3://``), not the state's nor the checkpoint's.
    path: str = Field(min_length=1)


class ExpirySpec(_Model):
    """State rows behind the watermark by more than `after` leave the state
    (in the commit after the batch that moved the watermark past them; a
    rewind restores them): a window's rows once its end is that far behind,
    or a key whose `column` (a TIMESTAMP state column merged with `max`,
    say the newest event time it saw) is."""

    after: Duration
    #: A state column to expire by; none: the window's end (`event_time.window`).
    column: str | None = None

    @property
    def after_seconds(self) -> float:
        return duration_seconds(self.after)


class EventTimeSpec(_Model):
    """Event time (`spark_jobs.core.event_time`): which column of the source's
    records says when each happened, and how far behind the newest such time
    a record may still arrive. After each batch the pipeline's watermark is
    the newest event time it accepted minus `delay` (never moving back); a
    later batch's record older than that is late, and `late` says what
    becomes of it."""

    #: A TIMESTAMP or DATE column of the source's records (Kafka: also `_kafka_timestamp`).
    column: str = Field(min_length=1)
    #: How late a record may be and still count: ``10 minutes``, ``1 hour``, ``0 seconds``.
    delay: Duration
    #: `quarantine`: to the quarantine table, reason `late`, with its event
    #: time (nothing lost); `drop`: left out and counted; `accept`: taken
    #: like any other record, and counted.
    late: Literal["quarantine", "drop", "accept"] = "quarantine"
    #: Also move the watermark, after a batch that took everything waiting,
    #: to the planned data interval's end minus `delay` when that is later
    #: (safe only when records reach the source within `delay` of their
    #: event time: docs/spec.md).
    advance_with_schedule: bool = False
    #: Windows (`WindowSpec`): which state key holds each window's start,
    #: and how long a window is; needed by `final` and a window's `expire`.
    window: WindowSpec | None = None
    #: Where each window's final row is appended once the watermark passes
    #: its end (`spark_jobs.core.windows`); none by default.
    final: FinalSpec | None = None
    #: When state rows leave the state (`ExpirySpec`); never by default.
    expire: ExpirySpec | None = None

    @model_validator(mode="after")
    def _windows_declared(self) -> EventTimeSpec:
        """Final rows need windows, and a window's final row must stay final."""
        if self.final is not None and self.window is None:
            raise ValueError("event_time.final needs event_time.window: which state key holds each window's start, and its size")
        if self.final is not None and self.late == "accept":
            raise ValueError(
                "event_time.late 'accept' would change a window whose final row was already appended: "
                "use quarantine (the default) or drop with event_time.final"
            )
        if self.expire is not None and self.expire.column is None and self.window is None:
            raise ValueError("event_time.expire needs a column (a TIMESTAMP state column, merged with max) or an event_time.window")
        return self

    @property
    def delay_seconds(self) -> float:
        return duration_seconds(self.delay)


class DedupSpec(_Model):
    """Duplicates dropped (`spark_jobs.core.dedup`): a record whose `key`
    was taken before, in an earlier batch of the pipeline's lineage or
    earlier in its own batch, never reaches the transform; it is counted.
    The ids taken are remembered in the checkpoint's `dedup` table, each
    with its event time: `within` forgets an id once the watermark is that
    far past it (so they stay bounded); without `within` an id is
    remembered for ever (for a bounded key space)."""

    #: Source fields that identify a record (a producer's retry repeats them).
    key: list[str] = Field(min_length=1)
    #: How long after its event time an id is remembered, e.g. ``1 day``:
    #: it is forgotten once the watermark passes its event time plus this.
    within: Duration | None = None

    @field_validator("key")
    @classmethod
    def _distinct(cls, key: list[str]) -> list[str]:
        twice = sorted({name for name in key if key.count(name) > 1})
        if twice:
            raise ValueError(f"names {', '.join(twice)} twice: list each field of the key once")
        return key

    @property
    def within_seconds(self) -> float | None:
        return duration_seconds(self.within) if self.within is not None else None


class BatchLimits(_Model):
    max_files: int | None = Field(default=None, ge=1)
    max_records: int | None = Field(default=None, ge=1)
    #: Delta sources: at most this many upstream versions a batch.
    max_versions: int | None = Field(default=None, ge=1)


def check_cron(schedule: str | None) -> str | None:
    """A cron expression or preset, or a ValueError saying what to write."""
    if schedule is None or schedule in CRON_PRESETS:
        return schedule
    if len(schedule.split()) != 5:
        raise ValueError(
            f"{schedule!r} is not a cron expression; write five fields (e.g. '0 * * * *') "
            f"or a preset ({', '.join(CRON_PRESETS)})"
        )
    try:
        from croniter import croniter
    except ImportError:  # validated again by Airflow when it parses the DAG
        return schedule
    if not croniter.is_valid(schedule):
        raise ValueError(f"{schedule!r} is not a valid cron expression")
    return schedule


CRON_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly", "@annually", "@midnight")


SPARK_MASTER = re.compile(r"local(\[(\*|[1-9][0-9]{0,3})\])?|spark://[A-Za-z0-9.\-]+:[0-9]{1,5}|sc://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/(;[A-Za-z0-9_=;.%~\-]*)?)?")


class EngineSpec(_Model):
    """Where Spark runs: `local[*]` in the job's process, a standalone
    cluster (`spark://host:port`, the job's process is the driver) or a
    Spark Connect server (`sc://host:port`, the job is a thin client).

    A `--master` on the command line, the operator's `spark_master` or
    Spark connection (`airflow.spark_conn_id`), and `spark-submit --master`
    take precedence over this; with none of them, ``MICROBATCH_SPARK_MASTER``
    and then `local[*]` apply.
    """

    master: str | None = None
    #: Where a batch's rows are written (docs/architecture.md, "Where the
    #: rows go"). `auto`: by Spark's executors, as data files the job's
    #: process commits; a merged state's small batch is merged in the job's
    #: process, a big one by the executors. `executors`: every merge by the
    #: executors too (but a change-feed state's). `driver`: the rows come back
    #: to the job's process, which writes them (bounded by its memory).
    state_write: Literal["auto", "executors", "driver"] = "auto"

    @field_validator("master")
    @classmethod
    def _master_known(cls, value: str | None) -> str | None:
        if value is not None and not SPARK_MASTER.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Spark master this job can use; write local[*], "
                "spark://host:port (standalone cluster) or sc://host:port (Spark Connect)"
            )
        return value


class PipelineSpec(_Model):
    name: str
    description: str = ""
    source: FilesSourceSpec | DeltaSourceSpec | KafkaSourceSpec = Field(discriminator="type")
    transform: str = Field(min_length=1)
    state: StateSpec
    checkpoint: str = Field(min_length=1)
    batch: BatchLimits = BatchLimits()
    engine: EngineSpec = EngineSpec()
    maintenance: MaintenanceSpec = MaintenanceSpec()
    #: When a batch quarantines too much (`QuarantineLimits`); no limit by default.
    quarantine: QuarantineLimits = QuarantineLimits()
    #: Event time and the watermark (`EventTimeSpec`); none by default.
    event_time: EventTimeSpec | None = None
    #: Duplicates dropped (`DedupSpec`); none by default.
    dedup: DedupSpec | None = None
    #: Settings for an orchestrator, owned and validated by its plugin (for
    #: Airflow, `microbatch_airflow.airflow_spec`: schedule, connections,
    #: retries, ...). The job never reads them: it does not know Airflow.
    airflow: dict[str, Any] = Field(default_factory=dict)

    #: Folder of the spec file; relative paths resolve against it.
    base_dir: Path = Field(default=Path("."), exclude=True)
    #: Where the spec was loaded from (for messages).
    spec_path: str = Field(default="<memory>", exclude=True)

    @field_validator("name")
    @classmethod
    def _name_safe(cls, name: str) -> str:
        if not PIPELINE_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a valid pipeline name: use lowercase letters, digits "
                "and _, starting with a letter, at most 64 characters (e.g. clicks_per_user)"
            )
        return name

    @field_validator("transform")
    @classmethod
    def _transform_reads_batch(cls, sql: str) -> str:
        if not re.search(r"\bbatch\b", sql, re.IGNORECASE):
            raise ValueError("the transform must read the new records from the view `batch`")
        return sql

    @model_validator(mode="after")
    def _event_time_column(self) -> PipelineSpec:
        """The event time is a TIMESTAMP or DATE column of the records the source declares."""
        if self.event_time is None:
            return self
        column = self.event_time.column
        if isinstance(self.source, DeltaSourceSpec):
            return self  # (its columns are the upstream table's: checked when a batch is planned)
        types = {f.name: f.type for f in self.source.fields}
        if isinstance(self.source, KafkaSourceSpec):
            types.update(KAFKA_COLUMN_TYPES)
        if column not in types:
            raise ValueError(f"event_time.column {column!r} is not a column of the source's records: declare it in source.schema ({', '.join(types) or 'no columns'})")
        if types[column] not in EVENT_TIME_TYPES:
            raise ValueError(f"event_time.column {column!r} is {types[column]}: an event time is a TIMESTAMP or DATE column (cast it in source.schema)")
        return self

    @model_validator(mode="after")
    def _dedup_key(self) -> PipelineSpec:
        """The key is fields of the source's records; `within` counts from their event time."""
        dedup = self.dedup
        if dedup is None:
            return self
        if dedup.within is not None and self.event_time is None:
            raise ValueError("dedup.within counts from each record's event time: declare event_time (its column and delay), or leave within out to remember ids for ever")
        if isinstance(self.source, DeltaSourceSpec):
            return self  # (its columns are the upstream table's: checked when a batch is planned)
        names = [f.name for f in self.source.fields]
        if isinstance(self.source, KafkaSourceSpec):
            names += list(KAFKA_COLUMNS)
        missing = [name for name in dedup.key if name not in names]
        if missing:
            raise ValueError(f"dedup.key names {', '.join(map(repr, missing))}, not a column of the source's records: declare it in source.schema ({', '.join(names) or 'no columns'})")
        return self

    @model_validator(mode="after")
    def _event_time_state_columns(self) -> PipelineSpec:
        """A window is a key of the state; an expiry column is a state column
        that only grows (a key, or merged with `max`); final rows go to a
        table of their own."""
        event_time = self.event_time
        if event_time is None:
            return self
        window, expire, final = event_time.window, event_time.expire, event_time.final
        if window is not None and window.key not in self.state.keys:
            raise ValueError(f"event_time.window.key {window.key!r} is not among state.keys ({', '.join(self.state.keys)}): a window is part of the key")
        if expire is not None and expire.column is not None and window is not None:
            raise ValueError(
                f"event_time.expire.column {expire.column!r} with a window: a window's rows expire by its end "
                "(a row must not leave before its window is final); leave expire.column out"
            )
        if expire is not None and expire.column is not None and expire.column not in self.state.keys and self.state.layout == "appended":
            raise ValueError(
                f"event_time.expire.column {expire.column!r} in an appended state, whose rows are partial: an old "
                "row of a key would leave while the key stays; expire by a key, or use `state.layout: merged`"
            )
        if expire is not None and expire.column is not None:
            rule = self.state.merge.get(expire.column)
            if expire.column not in self.state.keys and rule != "max":
                raise ValueError(
                    f"event_time.expire.column {expire.column!r} is "
                    + (f"merged with {rule!r}" if rule else "not a state column")
                    + ": expire by a key or a column merged with `max` (say `max(ts) AS last_seen`), which only grows"
                )
        if final is not None:
            target = self.resolve(final.path).rstrip("/")
            for what, path in (("state.path", self.state_path), ("checkpoint", self.checkpoint_path)):
                path = path.rstrip("/")
                if target == path or target.startswith(path + "/") or path.startswith(target + "/"):
                    raise ValueError(f"event_time.final.path {final.path!r} overlaps {what} ({path}): give the final rows a table of their own")
        return self

    # -- resolved locations -------------------------------------------------

    def resolve(self, location: str) -> str:
        """Resolve a path from the spec against the spec file's folder."""
        if "://" in location:
            return location
        path = Path(location).expanduser()
        if not path.is_absolute():
            path = self.base_dir / path
        return str(path.resolve())

    @property
    def source_path(self) -> str:
        return self.resolve(self.source.path)

    @property
    def state_path(self) -> str:
        return self.resolve(self.state.path)

    @property
    def archive_path(self) -> str | None:
        archive = self.source.archive if isinstance(self.source, FilesSourceSpec) else None
        return self.resolve(archive) if archive else None

    @property
    def checkpoint_path(self) -> str:
        return self.resolve(self.checkpoint)

    @property
    def ledger_path(self) -> str:
        return self.checkpoint_path.rstrip("/") + "/offsets"

    @property
    def final_path(self) -> str | None:
        final = self.event_time.final if self.event_time is not None else None
        return self.resolve(final.path) if final is not None else None

    @property
    def quarantine_path(self) -> str:
        return self.checkpoint_path.rstrip("/") + "/quarantine"

    @property
    def dedup_path(self) -> str:
        return self.checkpoint_path.rstrip("/") + "/dedup"

    @property
    def consumed_path(self) -> str:
        return self.checkpoint_path.rstrip("/") + "/consumed"

    @property
    def value_columns(self) -> list[str]:
        return list(self.state.merge)


# -- loading ----------------------------------------------------------------


class _Lines(Mapping[tuple[str, ...], int]):
    """Each YAML mapping path's 1-based line, for error messages: found on
    the first look-up, so a valid spec never pays for it (composing a
    spec's node tree in pure Python cost more than loading it)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._found: dict[tuple[str, ...], int] | None = None

    def _index(self) -> dict[tuple[str, ...], int]:
        if self._found is None:
            self._found = _line_index(self._text)
        return self._found

    def __getitem__(self, key: tuple[str, ...]) -> int:
        return self._index()[key]

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        return iter(self._index())

    def __len__(self) -> int:
        return len(self._index())


def _line_index(text: str) -> dict[tuple[str, ...], int]:
    """Map each YAML mapping path to its 1-based line, for error messages."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                child = path + (str(key_node.value),)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (str(i),))

    try:
        # The loader that loaded the spec: libyaml accepts tabs the
        # pure-Python one refuses, which would leave every error lineless.
        root = yaml.compose(text, Loader=_YAML_LOADER)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _at(lines: Mapping[tuple[str, ...], int], loc: tuple[str, ...], problem: str) -> str:
    """A problem as reported: "line N, field `a.b`: ...", with the line of the
    field or, if the field is missing, of its nearest parent."""
    line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
    return f"{f'line {line}, ' if line else ''}field `{'.'.join(loc) or '(top level)'}`: {problem}"


def _describe(error: dict[str, Any], lines: Mapping[tuple[str, ...], int]) -> str:
    loc = tuple("schema" if p == "schema_" else str(p) for p in error["loc"])
    if loc[:1] == ("source",) and loc[1:2] in (("files",), ("delta",), ("kafka",)):
        loc = loc[:1] + loc[2:]  # the source type's tag, which pydantic puts in the path
    field = ".".join(loc)
    message = error["msg"].removeprefix("Value error, ")
    kind = error["type"]
    if kind == "missing":
        message = "is required"
    elif kind == "extra_forbidden":
        message = "is not a known field (check the spelling; see docs/spec.md)"
    elif kind == "literal_error" and field == "source.format":
        message = f"{error.get('input')!r} is not a format; use {str((error.get('ctx') or {}).get('expected', 'json, csv or parquet')).replace(chr(39), '')}"
    elif kind == "union_tag_not_found":
        message = "is required: write `type: files`, `type: delta` or `type: kafka`"
        loc = loc + ("type",)
    elif kind == "union_tag_invalid":
        message = f"type {error.get('input', {}).get('type')!r} is not a source type; use files, delta or kafka"
        loc = loc + ("type",)
    elif kind == "literal_error" and field == "source.type":
        message = f"{error.get('input')!r} is not a source type; use files, delta or kafka"
    elif loc[:1] in ((), ("event_time",)) and (named := re.match(r"(event_time(?:\.[a-z_]+)+) ", message)):
        # A check across fields (`PipelineSpec`'s) names the field it is about first: placed there.
        loc, message = tuple(named.group(1).split(".")), message[named.end():]
    return _at(lines, loc, message)


def field_problems(exc: ValidationError, text: str, prefix: tuple[str, ...] = ()) -> list[str]:
    """Each validation error as "line N, field `a.b`: ...". `prefix`: where
    in the spec the validated mapping sits (a plugin validating its block)."""
    lines = _line_index(text)
    return [_describe({**e, "loc": (*prefix, *e["loc"])}, lines) for e in exc.errors()]


#: Fields older specs held at the top (or in `engine`/`source`), now in the
#: `airflow:` block that the Airflow plugin owns.
MOVED_TO_AIRFLOW = {
    ("schedule",): "airflow.schedule",
    ("catchup",): "airflow.catchup",
    ("start_date",): "airflow.start_date",
    ("tags",): "airflow.tags",
    ("wait_for_data",): "airflow.wait_for_data",
    ("engine", "airflow_conn_id"): "airflow.spark_conn_id",
    ("source", "airflow_conn_id"): "airflow.kafka_conn_id",
    ("maintenance", "schedule"): "airflow.maintenance_schedule",
}


def _moved_fields(data: dict[str, Any], text: str) -> list[str]:
    lines = _Lines(text)
    found = []
    for loc, target in MOVED_TO_AIRFLOW.items():
        node: Any = data
        for key in loc:
            node = node.get(key, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:
            found.append(
                _at(lines, loc, f"moved to `{target}`: the Airflow-only settings are one `airflow:` block now "
                    "(see docs/spec.md); move it there")
            )
    return found


_ABSENT = object()
#: libyaml's safe loader when PyYAML was built with it (several times faster).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def yaml_problem(exc: yaml.YAMLError, text: str = "") -> str:
    """Where a YAML error starts, and where the parser gave up if that is
    another line. An unclosed quote, bracket or brace is named where it
    opens: one left open on line 6 is found only where the file ends, and
    "line 13: unexpected end of stream" alone sends the user to the wrong
    line. Any other error is named where the parser stopped, with the block
    it was in."""
    opened, stop = getattr(exc, "context_mark", None), getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None) or ""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    quote = _quote_run_on(text, stop)
    if quote is not None:
        # A quote left open and closed by the next quote further down (the
        # usual case: a spec has more quoted values) fails there, lines on.
        return (
            f"{at(quote.start_mark)}: not valid YAML (a quoted value opens here and runs on to line "
            f"{quote.end_mark.line + 1}: is its closing quote missing? The parser stopped at {at(stop)}: "
            f"{context + ': ' if context else ''}{problem})"
        )
    if opened is None or stop is None or (opened.line, opened.column) == (stop.line, stop.column):
        mark = stop or opened
        return f"{at(mark) + ': ' if mark else ''}not valid YAML ({context + ': ' if context else ''}{problem})"
    if any(word in context for word in ("quoted scalar", "flow sequence", "flow mapping")):
        return f"{at(opened)}: not valid YAML ({context} that opens here: {problem} at {at(stop)})"
    return f"{at(stop)}: not valid YAML ({problem}; {context} that starts at {at(opened)})"


def _quote_run_on(text: str, stop: Any) -> Any:
    """The last quoted value before the error that spans lines (a spec's
    values are one line each), when the parser gave up on a later line: the
    likely place of a missing closing quote. None otherwise."""
    if stop is None or not text:
        return None
    found = None
    try:
        for token in yaml.scan(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if token.start_mark.line > stop.line or (token.start_mark.line == stop.line and token.start_mark.column >= stop.column):
                break
            if isinstance(token, yaml.ScalarToken) and token.style in ('"', "'") and token.end_mark.line > token.start_mark.line:
                found = token
    except yaml.YAMLError:
        pass
    return found if found is not None and found.start_mark.line < stop.line else None


def parse_spec(
    text: str, *, base_dir: Path, spec_path: str, storage_roots: list[str] | None = None
) -> PipelineSpec:
    """Validate spec text. Raises `SpecError` listing every problem found.

    `storage_roots`: where the spec's locations may be (see
    `spark_jobs.storage.roots`); None reads ``MICROBATCH_STORAGE_ROOTS``.
    """
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise SpecError(spec_path, [yaml_problem(exc, text)]) from None
    if not isinstance(data, dict):
        raise SpecError(spec_path, ["the spec must be a YAML mapping with name, source, transform, state, checkpoint"])
    moved = _moved_fields(data, text)
    if moved:
        raise SpecError(spec_path, moved)
    try:
        spec = PipelineSpec.model_validate({**data, "base_dir": base_dir, "spec_path": spec_path})
    except ValidationError as exc:
        raise SpecError(spec_path, field_problems(exc, text)) from None
    check_locations(spec, text, storage_roots)
    return spec


def check_locations(spec: PipelineSpec, text: str, storage_roots: list[str] | None = None) -> None:
    """Refuse locations outside the storage roots (``MICROBATCH_STORAGE_ROOTS``
    when None) or climbing out of the spec's folder, as they resolve now;
    `text`, the spec's YAML, for the lines an error names. Part of every
    load, and again for a spec kept between parses (its answer depends on
    the environment and the disk, not only on the file)."""
    storage_roots = roots_from_env() if storage_roots is None else storage_roots
    try:
        roots = parse_roots(storage_roots)
    except ValueError as exc:
        raise SpecError(spec.spec_path, [f"storage roots: {exc}"]) from None
    lines = _Lines(text)
    problems = []
    locations = [(("state", "path"), spec.state.path), (("checkpoint",), spec.checkpoint)]
    if not isinstance(spec.source, KafkaSourceSpec):  # a topic is not a storage location
        locations.insert(0, (("source", "path"), spec.source.path))
    if isinstance(spec.source, FilesSourceSpec) and spec.source.archive:
        locations.append((("source", "archive"), spec.source.archive))
    if spec.event_time is not None and spec.event_time.final is not None:
        locations.append((("event_time", "final", "path"), spec.event_time.final.path))
    for loc, raw in locations:
        problem = check_location(raw, spec.resolve(raw), roots)
        if problem:
            problems.append(_at(lines, loc, problem))
    problems.extend(_overlaps(spec, lines))
    problems.extend(_unfindable_tables(spec, lines))
    if problems:
        raise SpecError(spec.spec_path, problems)


def _unfindable_tables(spec: PipelineSpec, lines: Mapping[tuple[str, ...], int]) -> list[str]:
    """Table locations delta-rs (1.6) would write a first entry under and
    then fail to open, so that the pipeline's first batch fails after a
    write: a percent-escape (``%41``), which delta-rs decodes when it opens
    the table (``A``), locally and on S3, where Spark's executors write the
    key as it is spelled; and, in a local folder's name, a backslash, a
    square bracket, ``^``, ``|`` or a control character (a tab, a newline),
    which delta-rs reads as another path or refuses. (A ``%`` not followed
    by two hex digits is taken as it is.)"""
    tables = [(("state", "path"), spec.state_path), (("checkpoint",), spec.checkpoint_path)]
    if isinstance(spec.source, DeltaSourceSpec):
        tables.append((("source", "path"), spec.source_path))
    if spec.final_path is not None:
        tables.append((("event_time", "final", "path"), spec.final_path))
    found = []
    for loc, path in tables:
        escape = PERCENT_ESCAPE.search(path)
        odd = DELTA_RS_REFUSES.search(path) if "://" not in path else None
        if escape is not None:
            decoded = bytes.fromhex(escape.group()[1:]).decode("latin-1")
            found.append(_at(lines, loc, (
                f"{path} holds {escape.group()!r}, which delta-rs reads as {decoded!r} when it opens the table: it would "
                "write the table and then not find it. Rename the folder (or move the spec) so that no '%' is followed by "
                "two hex digits"
            )))
        elif odd is not None:
            found.append(_at(lines, loc, (
                f"{path} holds {odd.group()!r}, which delta-rs cannot open a table under (it would write the table's first "
                "entry and then fail): rename the folder (or move the spec) without backslashes, square brackets, '^', '|' "
                "or control characters"
            )))
    return found


def _inside(location: str, folder: str) -> bool:
    """Whether `location` is `folder` or under it (same spelling: both resolved)."""
    location, folder = location.rstrip("/"), folder.rstrip("/")
    return location == folder or location.startswith(folder + "/")


def _overlaps(spec: PipelineSpec, lines: Mapping[tuple[str, ...], int]) -> list[str]:
    """Locations that would read or clobber each other's files.

    The source lists every file under its folder, so a state or checkpoint
    inside it would be fed back in as input (or the source would read a
    table's Parquet parts if it sat inside one). A checkpoint inside the
    state table's folder would be deleted by a VACUUM of the state, which
    removes files its log does not know, and so would an archive inside a
    table's folder (`maintain` removes files no commit references); and the
    state cannot be one of the checkpoint's own tables.
    """
    source, state, checkpoint = spec.source_path, spec.state_path, spec.checkpoint_path
    found: list[str] = []

    def problem(loc: tuple[str, ...], text: str) -> None:
        found.append(_at(lines, loc, text))

    others = [(("state", "path"), state), (("checkpoint",), checkpoint)] if not isinstance(spec.source, KafkaSourceSpec) else []
    if spec.final_path and not isinstance(spec.source, KafkaSourceSpec):
        others.append((("event_time", "final", "path"), spec.final_path))
    if spec.archive_path:
        # Archived files moved to a folder the source lists would be new files, read again.
        others.append((("source", "archive"), spec.archive_path))
    for loc, other in others:
        if _inside(other, source) or _inside(source, other):
            problem(loc, f"{other} overlaps source.path {source}; keep the source folder apart from the tables and the archive")
    if _inside(checkpoint, state):
        problem(("checkpoint",), f"{checkpoint} is inside the state table's folder {state}; put it beside it")
    if spec.archive_path and (_inside(spec.archive_path, state) or _inside(spec.archive_path, checkpoint)):
        # `maintain` removes files no commit of a table references from its folder.
        problem(("source", "archive"), f"{spec.archive_path} is inside a table's folder ({state} or {checkpoint}); put it beside them")
    for table in (spec.ledger_path, spec.quarantine_path, spec.consumed_path):
        if _inside(state, table) or _inside(table, state):
            problem(("state", "path"), f"{state} overlaps the checkpoint's table {table}; put the state elsewhere")
    return found


def load_spec(path: str | Path, *, storage_roots: list[str] | None = None) -> PipelineSpec:
    """Load and validate a spec file; relative paths resolve against its folder."""
    spec_file = Path(path)
    try:
        text = spec_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(path), ["file not found; pass the path to a pipeline YAML"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), [f"cannot read the file: {exc}"]) from None
    return parse_spec(text, base_dir=spec_file.resolve().parent, spec_path=str(path), storage_roots=storage_roots)
