"""librdkafka's mock cluster, hosted by a process of its own for the tests.

The mock cluster is a real Kafka protocol server on loopback (metadata,
produce, fetch, list offsets, idempotent and transactional producers), run
inside a librdkafka client: this process keeps one alive and prints its
bootstrap servers as ``BOOTSTRAP host:port,...``, then waits for its stdin
to close. What it does not do, and what the tests do instead, is said where
it matters (tests/spark_jobs/sources/test_kafka.py).
"""

from __future__ import annotations

import sys

from confluent_kafka import Producer


def main() -> None:
    host = Producer({"test.mock.num.brokers": 3, "log_level": 3})
    brokers = host.list_topics(timeout=10).brokers.values()
    print("BOOTSTRAP " + ",".join(f"{b.host}:{b.port}" for b in brokers), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
