"""What a pipeline's history depends on: its id, and the spec that made it.

A state is the fold of every batch in its lineage under one meaning: the
same keys, merge rules, source and transform. Change one of them silently
and the next batch is merged under another meaning (a `sum` becomes a
`max` over old totals; keys `[user_id, day]` become `[user_id]` and old rows
stop matching; CSV columns read by position swap places). So every ledger
row and state commit records the spec's `SpecIdentity` and its short
fingerprint, and a run compares the current spec with the one that produced
the lineage's last batch before it writes.

`SPEC_RULES` is the one table of what a change to each spec field does. It
names every field of the spec model (a test fails when a field is added
without a rule) with one of three rules:

* refuse: the lineage cannot carry on; the run stops before any write (exit
  2), naming the change and the ways out. Fields that change how bytes
  become records or which files count as consumed are here;
* record: the field is part of the identity, its change is logged and
  recorded by the next row, and the run goes on;
* free: not part of the identity (batch sizes, where Spark runs, the
  orchestrator's settings).

Some fields are judged by a rule of their own (a merge column may be added
but not changed; a source column may be added or widened but not removed,
narrowed or, where CSV is read by position, moved). Two fields are refused
elsewhere: `name` and `checkpoint` find the ledger, so a new one is another
ledger, and reconcile refuses a state that another ledger's batches made.

The pipeline id is a random id minted by the first run's plan and carried by
every ledger row and state commit after it. Names are not identities: two
specs named alike with their own checkpoints but one state table must not
take each other's batches for their own.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spark_jobs.core.spec import PipelineSpec

__all__ = ["IDENTITY_FORMAT", "SPEC_RULES", "FieldRule", "Rule", "SpecIdentity", "changes", "new_pipeline_id"]

#: 1: keys, merge, source {type, location, format, schema}, state, transform
#: (read as such: the fields it did not hold count as unchanged). 2: every
#: field `SPEC_RULES` keeps, by its path.
IDENTITY_FORMAT = 2

#: Source types that only ever widen along these chains (Spark casts up without loss).
_WIDENING = (("TINYINT", "SMALLINT", "INT", "BIGINT"), ("FLOAT", "DOUBLE"))
_DECIMAL = re.compile(r"DECIMAL\((\d+),(\d+)\)")

#: A judge: (path, old value, new value, old identity, new identity) -> (refused, allowed).
Judge = Callable[[str, Any, Any, dict[str, Any], dict[str, Any]], tuple[list[str], list[str]]]


def new_pipeline_id() -> str:
    return uuid.uuid4().hex


class Rule(enum.Enum):
    REFUSE = "refuse"
    RECORD = "record"
    FREE = "free"


@dataclass(frozen=True)
class FieldRule:
    """What a change to one spec field does, and why."""

    rule: Rule
    why: str
    #: The field's value in the identity; None: not in it (free, or refused elsewhere).
    value: Callable[[PipelineSpec], Any] | None = None
    #: A rule of its own, for fields whose parts change in different ways.
    judge: Judge | None = None


def _when(kind: str, get: Callable[[PipelineSpec], Any]) -> Callable[[PipelineSpec], Any]:
    """A source type's own field: its value for specs with that source type, else absent."""
    return lambda spec: get(spec) if spec.source.type == kind else _ABSENT


def _csv(kind: str, option: str) -> Callable[[PipelineSpec], Any]:
    """A CSV option: only a CSV source has one that means anything."""
    return _when(kind, lambda s: getattr(s.source.csv, option) if s.source.format == "csv" else _ABSENT)


def _strict(kind: str) -> Callable[[PipelineSpec], Any]:
    """`unknown_fields`, held only when not its default: a spec that does
    not set it keeps the fingerprint it had before the field existed."""
    return _when(kind, lambda s: s.source.unknown_fields if s.source.unknown_fields != "ignore" else _ABSENT)


#: A value a spec does not have (another source type's field, a CSV option of JSON).
_ABSENT = object()


def _schema(spec: PipelineSpec) -> list[list[Any]]:
    return [[f.name, f.type, f.nullable] for f in spec.source.fields]


def _judge_merge(path: str, old: dict[str, str], new: dict[str, str], *_: Any) -> tuple[list[str], list[str]]:
    refused = []
    for column, rule in old.items():
        if column not in new:
            refused.append(f"merge column {column!r} ({rule}) was removed or renamed")
        elif new[column] != rule:
            refused.append(f"merge rule of {column!r} changed from {rule} to {new[column]}")
    return refused, [f"new merge column {c!r} ({r}): old rows hold null" for c, r in new.items() if c not in old]


def _judge_layout(path: str, old: str, new: str, *_: Any) -> tuple[list[str], list[str]]:
    if old == "appended" and new == "merged":
        return [
            "state.layout changed from appended to merged: the state holds partial rows, which a MERGE "
            "would add to again; keep layout: appended, or start a new state path and checkpoint"
        ], []
    return [], [f"state.layout changed from {old} to {new}: batches are appended and folded from now on"]


def _positional(identity: dict[str, Any], kind: str) -> bool:
    """Whether the source's records are parsed by column position: CSV with
    no header to name the columns (a file's header is checked against the
    schema, so a file written in another order is quarantined, not misread)."""
    return identity.get(f"source.{kind}.format") == "csv" and not identity.get(f"source.{kind}.csv.header")


def _judge_schema(path: str, old: list, new: list, _: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    refused: list[str] = []
    allowed: list[str] = []
    old_fields = {name: kind for name, kind, _ in old}
    new_fields = {name: kind for name, kind, _ in new}
    for name, kind in old_fields.items():
        if name not in new_fields:
            refused.append(f"source column {name!r} was removed or renamed")
        elif new_fields[name] != kind:
            change = f"source column {name!r} changed type from {kind} to {new_fields[name]}"
            (allowed if _widens(kind, new_fields[name]) else refused).append(change)
    allowed += [f"new source column {n!r}" for n in new_fields if n not in old_fields]
    old_order, new_order = [f[0] for f in old], [f[0] for f in new]
    if _positional(now, path.split(".")[1]) and not refused and new_order[: len(old_order)] != old_order:
        refused.append(
            f"source columns moved from {old_order} to {new_order}: CSV without a header is read by position, "
            "so each old column must keep its place (new columns go at the end)"
        )
    return refused, allowed


def _judge_release(path: str, old: str, new: str, *_: Any) -> tuple[list[str], list[str]]:
    def by(rule: str) -> str:
        return "name" if rule == "keep" else "name, size and modification time"

    change = f"{path} changed from {old!r} to {new!r}"
    if by(old) == by(new):
        return [], [change]
    return [
        f"{change}: a consumed file was told by its {by(old)}, and would now be told by its {by(new)}, "
        f"so files the lineage consumed would be {'skipped' if old != 'keep' else 'read again'}"
    ], []


_LOCATION = "where the records come from: another location is another source"
_VECTORS = (
    "how a batch writes a merged state, not what it holds: turned on (or `auto` once the state passes its "
    "bound), the table needs readers of Delta 2.3 or later from the next batch; turned off, batches rewrite "
    "files again"
)
_PARSE = "how bytes become records"
_UNKNOWN = "which records are quarantined for fields the schema does not name; nothing is lost either way"
_READER = "read by the first batch of a lineage (and after `rewind --to-batch 0`); later batches go on from the ledger"

#: Every field of the spec model, by path (`source.<type>.<field>` for a
#: source type's own fields), and what a change to it does.
SPEC_RULES: dict[str, FieldRule] = {
    "name": FieldRule(Rule.REFUSE, "finds the pipeline's rows in the ledger: a new name is another pipeline, and reconcile refuses the state the old one committed"),
    "description": FieldRule(Rule.FREE, "text for people"),
    "transform": FieldRule(Rule.RECORD, "what a batch computes; the next batches compute under the new text", value=lambda s: s.transform.strip()),
    "checkpoint": FieldRule(Rule.REFUSE, "holds the ledger: a new checkpoint is another ledger, and reconcile refuses the state the old one's batches made"),
    "airflow": FieldRule(Rule.FREE, "the orchestrator's settings; the job never reads them"),
    "source.type": FieldRule(Rule.REFUSE, "what kind of offsets the ledger holds", value=lambda s: s.source.type),
    "source.files.path": FieldRule(Rule.REFUSE, _LOCATION, value=_when("files", lambda s: s.source_path)),
    "source.files.format": FieldRule(Rule.REFUSE, _PARSE, value=_when("files", lambda s: s.source.format)),
    "source.files.schema": FieldRule(Rule.REFUSE, _PARSE + ": columns may be added or widened, not removed, narrowed or (CSV without a header) moved", value=_when("files", _schema), judge=_judge_schema),
    "source.files.csv.header": FieldRule(Rule.REFUSE, _PARSE + ": whether a file's first line is a record", value=_csv("files", "header")),
    "source.files.csv.delimiter": FieldRule(Rule.REFUSE, _PARSE, value=_csv("files", "delimiter")),
    "source.files.unknown_fields": FieldRule(Rule.RECORD, _UNKNOWN, value=_strict("files")),
    "source.files.max_line_bytes": FieldRule(Rule.RECORD, "which lines are quarantined unparsed; nothing is lost either way", value=_when("files", lambda s: s.source.max_line_bytes)),
    "source.files.after_commit": FieldRule(Rule.REFUSE, "which files count as consumed: by name with `keep`, by name, size and mtime with `delete` or `archive` (switching between those two is recorded)", value=_when("files", lambda s: s.source.after_commit), judge=_judge_release),
    "source.files.archive": FieldRule(Rule.RECORD, "where consumed files go; they leave the source folder either way", value=_when("files", lambda s: s.archive_path)),
    "source.delta.path": FieldRule(Rule.REFUSE, _LOCATION, value=_when("delta", lambda s: s.source_path)),
    "source.delta.read": FieldRule(Rule.REFUSE, "which rows a version gives (changes or appends)", value=_when("delta", lambda s: s.source.read)),
    "source.delta.on_data_loss": FieldRule(Rule.RECORD, "what a later batch does when versions it needs are gone; recorded batches stay as they were", value=_when("delta", lambda s: s.source.on_data_loss)),
    "source.delta.reader": FieldRule(Rule.FREE, "who reads the versions (the driver or Spark's executors); both read the same rows"),
    "source.kafka.bootstrap_servers": FieldRule(Rule.FREE, "how to reach the cluster; offsets carry the cluster's id, so another cluster is refused"),
    "source.kafka.topic": FieldRule(Rule.REFUSE, _LOCATION, value=_when("kafka", lambda s: s.source.topic)),
    "source.kafka.format": FieldRule(Rule.REFUSE, _PARSE, value=_when("kafka", lambda s: s.source.format)),
    "source.kafka.schema": FieldRule(Rule.REFUSE, _PARSE + ": columns may be added or widened, not removed, narrowed or (CSV) moved", value=_when("kafka", _schema), judge=_judge_schema),
    "source.kafka.csv.header": FieldRule(Rule.REFUSE, _PARSE + " (always false: a record is one line)", value=_csv("kafka", "header")),
    "source.kafka.csv.delimiter": FieldRule(Rule.REFUSE, _PARSE, value=_csv("kafka", "delimiter")),
    "source.kafka.starting_offsets": FieldRule(Rule.RECORD, _READER, value=_when("kafka", lambda s: s.source.starting_offsets)),
    "source.kafka.on_data_loss": FieldRule(Rule.RECORD, "what a later batch does when retention deleted records it needs", value=_when("kafka", lambda s: s.source.on_data_loss)),
    "source.kafka.unknown_fields": FieldRule(Rule.RECORD, _UNKNOWN, value=_strict("kafka")),
    "source.kafka.max_line_bytes": FieldRule(Rule.RECORD, "which values are quarantined unparsed; nothing is lost either way", value=_when("kafka", lambda s: s.source.max_line_bytes)),
    "source.kafka.options": FieldRule(Rule.FREE, "client settings (security, timeouts); never secrets, never what a record is"),
    "state.path": FieldRule(Rule.REFUSE, "where the state is: another path is another state", value=lambda s: s.state_path),
    "state.keys": FieldRule(Rule.REFUSE, "what a row is: old rows would stop matching", value=lambda s: list(s.state.keys)),
    "state.merge": FieldRule(Rule.REFUSE, "how a batch folds into a row: columns may be added (old rows hold null), not changed or removed", value=lambda s: dict(s.state.merge), judge=_judge_merge),
    "state.change_feed": FieldRule(Rule.RECORD, "turned on, the feed starts with the next batch; turned off, the table keeps writing it", value=lambda s: s.state.change_feed),
    "state.layout": FieldRule(Rule.REFUSE, "how a batch reaches the state: merged may become appended (a merged state is a folded one), not back", value=lambda s: s.state.layout, judge=_judge_layout),
    "state.fold_at": FieldRule(Rule.FREE, "when an appended state is folded; folding changes no value"),
    "state.deletion_vectors": FieldRule(Rule.RECORD, _VECTORS, value=lambda s: s.state.deletion_vectors),
    "batch.max_files": FieldRule(Rule.FREE, "how much one batch takes; every record is still taken once"),
    "batch.max_records": FieldRule(Rule.FREE, "how much one batch takes; every record is still taken once"),
    "batch.max_versions": FieldRule(Rule.FREE, "how much one batch takes; every version is still taken once"),
    "engine.master": FieldRule(Rule.FREE, "where Spark runs; the result is the same"),
    "engine.state_write": FieldRule(Rule.FREE, "where a batch's rows are written; the result is the same"),
    "maintenance.keep_batches": FieldRule(Rule.FREE, "how many batches stay rewindable after `maintain`"),
    "maintenance.untracked_files_hours": FieldRule(Rule.FREE, "when `maintain` removes files no commit references"),
    "quarantine.max_records": FieldRule(Rule.FREE, "when a run fails or warns after its commit; what a batch quarantines is the same"),
    "quarantine.max_fraction": FieldRule(Rule.FREE, "when a run fails or warns after its commit; what a batch quarantines is the same"),
    "quarantine.on_exceed": FieldRule(Rule.FREE, "whether such a run fails or warns"),
    "event_time.window": FieldRule(
        Rule.REFUSE,
        "which windows are final: rows the old windows appended to the final table would be appended again, or windows missed; "
        "keep it, or start a new state, checkpoint and final table",
        value=lambda s: s.event_time.window.model_dump() if s.event_time is not None and s.event_time.window is not None else _ABSENT,
    ),
    "event_time": FieldRule(
        Rule.RECORD,
        "which records the next batches judge late, and how the watermark moves; the recorded batches and the watermark stand",
        value=lambda s: s.event_time.model_dump() if s.event_time is not None else _ABSENT,
    ),
    "dedup": FieldRule(
        Rule.RECORD,
        "which records the next batches drop as duplicates; the recorded batches stand, and ids remembered under "
        "another key match none of the new key's",
        value=lambda s: s.dedup.model_dump() if s.dedup is not None else _ABSENT,
    ),
}


@dataclass(frozen=True)
class SpecIdentity:
    """The values of the spec's fields that `SPEC_RULES` keeps, by path."""

    values: dict[str, Any]

    @classmethod
    def of(cls, spec: PipelineSpec) -> SpecIdentity:
        values = {}
        for path, rule in SPEC_RULES.items():
            if rule.value is not None and (value := rule.value(spec)) is not _ABSENT:
                values[path] = value
        return cls(values)

    def to_dict(self) -> dict[str, Any]:
        return {"format": IDENTITY_FORMAT, "fields": self.values}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecIdentity:
        if data.get("format") == IDENTITY_FORMAT:
            return cls(dict(data["fields"]))
        # Format 1 (before the rules table): the fields it held, under their paths.
        source = data["source"]
        kind = source["type"]
        values: dict[str, Any] = {
            "transform": data["transform"],
            "source.type": kind,
            "state.path": data["state"],
            "state.keys": list(data["keys"]),
            "state.merge": dict(data["merge"]),
        }
        if kind == "kafka":
            values["source.kafka.topic"] = source["location"].removeprefix("kafka://")
        else:
            values[f"source.{kind}.path"] = source["location"]
        if kind == "delta":
            values["source.delta.read"] = source["format"].split()[-1]
        else:
            values[f"source.{kind}.format"] = source["format"]
            values[f"source.{kind}.schema"] = source["schema"]
        return cls(values)

    @property
    def fingerprint(self) -> str:
        """16 hex digits of a hash of the canonical identity: equal specs, equal fingerprints."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def changes(old: SpecIdentity, new: SpecIdentity) -> tuple[list[str], list[str]]:
    """(incompatible, compatible) differences from `old` to `new`, each a phrase for people.

    Judged field by field as `SPEC_RULES` says. A field the old identity
    does not hold (recorded before the field had a rule) counts as
    unchanged: the next row records it. When the source type changed, its
    fields are not compared: the type change says it all.
    """
    refused: list[str] = []
    allowed: list[str] = []
    a, b = old.values, new.values
    type_changed = a.get("source.type") != b.get("source.type")
    for path, rule in SPEC_RULES.items():
        if path not in a or path not in b or a[path] == b[path]:
            continue
        if type_changed and path.startswith("source.") and path != "source.type":
            continue
        if rule.judge is not None:
            r, ok = rule.judge(path, a[path], b[path], a, b)
            refused += r
            allowed += ok
        elif path == "transform":
            allowed.append("new transform text")
        else:
            (refused if rule.rule is Rule.REFUSE else allowed).append(f"{path} changed from {a[path]!r} to {b[path]!r}")
    return refused, allowed


def _widens(old: str, new: str) -> bool:
    """Whether every value of type `old` is a value of type `new`."""
    for chain in _WIDENING:
        if old in chain and new in chain:
            return chain.index(new) > chain.index(old)
    a, b = _DECIMAL.fullmatch(old), _DECIMAL.fullmatch(new)
    if a and b:
        (p1, s1), (p2, s2) = (int(x) for x in a.groups()), (int(x) for x in b.groups())
        return s2 >= s1 and p2 - s2 >= p1 - s1
    return False
