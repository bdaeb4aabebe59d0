"""Synthetic click events and their exact expected aggregates (the oracle).

Used by the demo, the benchmarks and the exactly-once tests. Each record has
a unique id; per user the oracle keeps the count, the amount sum and a
*multiset hash*: the sum of a 40-bit hash of each record id. A lost record
hidden by a duplicated one leaves the count unchanged but changes the hash
sum (unless two ids collide in 40 bits). 40 bits, not 64, so that the sum
fits a BIGINT in Spark's ANSI mode for up to 2^23 records per key; the
transform computes the same hash with ``sha2`` (see `HASH_SQL`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_jobs.core.spec import PipelineSpec

__all__ = [
    "BAD_LINES",
    "HASH_SQL",
    "ORACLE_MERGE",
    "ORACLE_TRANSFORM",
    "Totals",
    "differences",
    "fold",
    "record_hash",
    "state_totals",
    "totals_of",
    "write_wave",
]

#: Spark SQL for the per-record hash; must agree with `record_hash`.
HASH_SQL = "CAST(conv(substr(sha2(event_id, 256), 1, 10), 16, 10) AS BIGINT)"

#: Spec transform that keeps the oracle's columns (count, sum, hash sum, max).
ORACLE_TRANSFORM = (
    "SELECT user_id, count(*) AS events, sum(amount) AS amount, "
    f"sum({HASH_SQL}) AS idhash, max(ts) AS last_seen FROM batch GROUP BY user_id"
)
ORACLE_MERGE = {"events": "sum", "amount": "sum", "idhash": "sum", "last_seen": "max"}

BAD_LINES = (
    "this is not json",
    '{"event_id": "broken", "user_id": "u",',
    '{"event_id": "nokey", "amount": 1.0}',
    '{"event_id": "nullkey", "user_id": null, "amount": 1.0}',
    '{"event_id": "badamount", "user_id": "user000001", "amount": "twelve"}',
    "[1, 2, 3]",
)


def record_hash(event_id: str) -> int:
    return int(hashlib.sha256(event_id.encode()).hexdigest()[:10], 16)


def write_wave(
    folder: str | Path,
    wave: int,
    *,
    files: int = 3,
    records_per_file: int = 1000,
    users: int = 500,
    seed: int = 7,
    bad_every: int = 0,
    start: datetime = datetime(2026, 1, 1, tzinfo=timezone.utc),
) -> list[Path]:
    """Write one wave of JSON-lines files, atomically (temp name, then rename).

    Deterministic for (wave, seed). `bad_every`: every Nth line is malformed.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}-{wave}")
    written = []
    for f in range(files):
        lines = []
        for r in range(records_per_file):
            if bad_every and (r + 1) % bad_every == 0:
                lines.append(BAD_LINES[(wave + f + r) % len(BAD_LINES)])
                continue
            ts = start + timedelta(hours=wave, seconds=rng.randrange(3600))
            lines.append(
                json.dumps(
                    {
                        "event_id": f"s{seed}-w{wave}-f{f}-r{r}",
                        "user_id": f"user{rng.randrange(users):06d}",
                        "amount": round(rng.uniform(0, 100), 2),
                        "ts": ts.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    }
                )
            )
        path = folder / f"clicks-s{seed}-w{wave:05d}-{f:03d}.json"
        tmp = folder / f".{path.name}.tmp"
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        written.append(path)
    return written


@dataclass
class Totals:
    events: int = 0
    amount: float = 0.0
    idhash: int = 0
    last_seen: datetime | None = None


def fold(paths: Iterable[str | Path]) -> dict[str, Totals]:
    """Expected state from input files: what exactly-once processing yields."""
    out: dict[str, Totals] = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(record, dict) or record.get("user_id") is None:
                    continue
                amount = record.get("amount")
                if amount is not None and not isinstance(amount, (int, float)):
                    continue
                t = out.setdefault(str(record["user_id"]), Totals())
                t.events += 1
                t.amount += float(amount or 0.0)
                t.idhash += record_hash(str(record["event_id"]))
                ts = datetime.fromisoformat(record["ts"].replace("Z", "+00:00")) if record.get("ts") else None
                if ts and (t.last_seen is None or ts > t.last_seen):
                    t.last_seen = ts
    return out


def state_totals(spec: PipelineSpec) -> dict[str, Totals]:
    """The state as of its last batch read back as `Totals` (columns it lacks
    stay default); an appended state's partial rows folded."""
    from spark_jobs.core.delta_io import open_table
    from spark_jobs.core.folding import read_state

    table = open_table(spec.state_path)
    if table is None:
        return {}
    return totals_of(row for batch in read_state(spec, table) for row in batch.to_pylist())


def totals_of(rows: Iterable[dict]) -> dict[str, Totals]:
    """State rows (one per user, whoever read them) as `Totals`. A user in
    two rows is an error of the state, never a row quietly dropped here."""
    totals: dict[str, Totals] = {}
    for row in rows:
        if row["user_id"] in totals:
            raise ValueError(f"the state holds user {row['user_id']!r} in more than one row")
        totals[row["user_id"]] = Totals(
            events=row.get("events") or 0,
            amount=row.get("amount") or 0.0,
            idhash=row.get("idhash") or 0,
            last_seen=row.get("last_seen"),
        )
    return totals


def differences(expected: dict[str, Totals], actual: dict[str, Totals], *, check_hash: bool = True) -> list[str]:
    """Human-readable differences between the oracle and the state (empty: exact)."""
    problems = []
    for key in sorted(set(expected) | set(actual)):
        e, a = expected.get(key), actual.get(key)
        if e is None or a is None:
            problems.append(f"{key}: expected {e}, state has {a}")
            continue
        if e.events != a.events:
            problems.append(f"{key}: events expected {e.events}, state has {a.events}")
        if not math.isclose(e.amount, a.amount, rel_tol=1e-9, abs_tol=1e-6):
            problems.append(f"{key}: amount expected {e.amount}, state has {a.amount}")
        if check_hash and e.idhash != a.idhash:
            problems.append(f"{key}: id hash-sum differs (a record lost and another duplicated?)")
        if e.last_seen != a.last_seen:
            problems.append(f"{key}: last_seen expected {e.last_seen}, state has {a.last_seen}")
    return problems


def main() -> None:
    """`python -m spark_jobs.demo.clickstream FOLDER --wave N`: land one wave of click files."""
    import argparse

    parser = argparse.ArgumentParser(description="Land synthetic click events (JSON lines) in a folder.")
    parser.add_argument("folder")
    parser.add_argument("--wave", type=int, default=0, help="wave number (files of a wave are deterministic)")
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--records", type=int, default=1000, help="records per file")
    parser.add_argument("--users", type=int, default=500)
    parser.add_argument("--bad-every", type=int, default=0, help="make every Nth line malformed")
    args = parser.parse_args()
    for path in write_wave(args.folder, args.wave, files=args.files, records_per_file=args.records,
                           users=args.users, bad_every=args.bad_every):
        print(path)


if __name__ == "__main__":
    main()
