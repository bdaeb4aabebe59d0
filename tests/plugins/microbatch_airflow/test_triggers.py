"""NewDataTrigger: the real async loop over a real folder and ledger."""

from __future__ import annotations

import asyncio

from microbatch_airflow.triggers import NewDataTrigger
from spark_jobs.demo.clickstream import write_wave


def test_serializes_to_an_importable_path(spec_path):
    path, kwargs = NewDataTrigger(str(spec_path), poll_seconds=3).serialize()
    module, _, name = path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    again = cls(**kwargs)
    assert again.spec_path == str(spec_path) and again.poll_seconds == 3


def test_fires_when_a_file_lands(spec_path):
    async def scenario():
        trigger = NewDataTrigger(str(spec_path), poll_seconds=0.2)
        events = trigger.run()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(1)
        assert not first.done()  # nothing waiting yet
        await asyncio.to_thread(write_wave, spec_path.parent / "landing", 0, files=2, records_per_file=5)
        return await asyncio.wait_for(first, 10)

    event = asyncio.run(scenario())
    assert event.payload == {"status": "ready", "waiting": 2}


def test_between_checks_a_poll_takes_the_fingerprint_and_a_rewind_or_a_file_fires_it(spec_path, on_connect):
    """An idle poll reads no ledger (the fingerprint stands for it); what
    changes the ledger (a rewind makes consumed files new) or the folder
    (a file lands) makes the next poll check in full, and fire."""
    from tests.conftest import run_cli

    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=5)
    assert run_cli("run", str(spec_path)).returncode == 0
    write_wave(landing, 1, files=1, records_per_file=5)
    assert run_cli("run", str(spec_path)).returncode == 0

    async def wait_for_event(change):
        events = NewDataTrigger(str(spec_path), poll_seconds=0.2).run()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(1)
        assert not first.done()  # nothing waits: polls on the fingerprint
        await asyncio.to_thread(change)
        return await asyncio.wait_for(first, 20)

    rewound = asyncio.run(wait_for_event(lambda: run_cli("rewind", str(spec_path), "--to-batch", "1")))
    assert rewound.payload == {"status": "ready", "waiting": 1}, "the rewound batch's file waits again"
    assert run_cli("run", str(spec_path)).returncode == 0
    landed = asyncio.run(wait_for_event(lambda: write_wave(landing, 2, files=2, records_per_file=5)))
    assert landed.payload == {"status": "ready", "waiting": 2}


def test_reports_errors_instead_of_spinning(tmp_path):
    async def scenario():
        return await NewDataTrigger(str(tmp_path / "missing.yaml"), poll_seconds=0.1).run().__anext__()

    event = asyncio.run(scenario())
    assert event.payload["status"] == "error" and "file not found" in event.payload["message"]


def test_a_source_that_cannot_be_read_is_an_error_not_nothing_waiting(spec_path):
    """It reported 0 files waiting, so the sensor polled until its timeout and soft-failed without a word."""
    (spec_path.parent / "landing").rmdir()

    async def scenario():
        return await NewDataTrigger(str(spec_path), poll_seconds=0.1).run().__anext__()

    event = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert event.payload["status"] == "error" and "source folder" in event.payload["message"]


def test_waits_for_kafka_records_through_the_operators_connection(tmp_path, monkeypatch):
    """A Kafka source's lag, with its settings from the connection the sensor names."""
    import json

    from tests.spark_jobs.sources.test_kafka import events, produce, spec_file, start_cluster, stop_cluster

    server, servers = start_cluster()
    try:
        path = spec_file(tmp_path, "127.0.0.1:1", "waited")
        monkeypatch.setenv("AIRFLOW_CONN_KAFKA_WAIT", json.dumps({"conn_type": "kafka", "extra": {"bootstrap.servers": servers}}))

        async def scenario():
            events_ = NewDataTrigger(str(path), poll_seconds=0.2, kafka_conn_id="kafka_wait").run()
            first = asyncio.ensure_future(events_.__anext__())
            await asyncio.sleep(1)
            assert not first.done()  # the topic does not exist yet: nothing waits
            await asyncio.to_thread(produce, servers, "waited", events(0, 12))
            return await asyncio.wait_for(first, 20)

        event = asyncio.run(scenario())
        assert event.payload == {"status": "ready", "waiting": 12}
    finally:
        stop_cluster(server)


class _Watcher:
    """A `NewDataEventTrigger` running in a thread of its own, its events
    collected as they come (the triggerer runs it the same way: forever)."""

    def __init__(self, trigger) -> None:
        import threading

        self.events: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._task = None

        async def collect():
            async for event in trigger.run():
                self.events.append(event.payload)

        def main():
            self._task = self._loop.create_task(collect())
            try:
                self._loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()

    def wait_for(self, n: int, timeout: float = 20) -> list[dict]:
        import time

        deadline = time.monotonic() + timeout
        while len(self.events) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.events) >= n, self.events
        return self.events

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)


def test_the_watcher_emits_once_per_news_never_while_idle_and_not_for_a_batch_starting(spec_path, on_connect):
    """The watcher behind `run_on_data`: an event when files land, none while
    nothing changes, none when a batch only starts (the ledger moves, the
    count does not), one when a commit leaves files behind, none when the
    last batch drains the source."""
    import time

    from microbatch_airflow.triggers import NewDataEventTrigger
    from tests.conftest import land_at_once, run_cli

    landing = spec_path.parent / "landing"
    watcher = _Watcher(NewDataEventTrigger(str(spec_path), poll_seconds=0.2))
    try:
        time.sleep(1.5)
        assert watcher.events == [], "nothing landed: no event"
        land_at_once(landing, 0, files=3, records_per_file=5)
        assert watcher.wait_for(1) == [{"status": "ready", "waiting": 3, "spec_path": str(spec_path)}]
        time.sleep(1.5)
        assert len(watcher.events) == 1, "the same files waiting are no news"
        assert run_cli("run", str(spec_path), "--max-files", "2").returncode == 0
        assert [e["waiting"] for e in watcher.wait_for(2)] == [3, 1], "the commit left one file: news"
        assert run_cli("run", str(spec_path)).returncode == 0
        time.sleep(1.5)
        assert [e["waiting"] for e in watcher.events] == [3, 1], "drained: no event, and none for the runs starting"
        write_wave(landing, 1, files=1, records_per_file=5)
        assert [e["waiting"] for e in watcher.wait_for(3)] == [3, 1, 1]
    finally:
        watcher.stop()


def test_the_watcher_emits_again_while_data_waits_with_no_news_and_errors_once_each(spec_path):
    import time

    from microbatch_airflow.triggers import NewDataEventTrigger
    from tests.conftest import land_at_once

    landing = spec_path.parent / "landing"
    write_wave(landing, 0, files=1, records_per_file=5)
    watcher = _Watcher(NewDataEventTrigger(str(spec_path), poll_seconds=0.1, refire_seconds=0.5))
    try:
        assert [e["waiting"] for e in watcher.wait_for(3, timeout=10)][:3] == [1, 1, 1], "a run that failed for good is not the end"
    finally:
        watcher.stop()
    for f in landing.iterdir():
        f.unlink()
    landing.rmdir()
    watcher = _Watcher(NewDataEventTrigger(str(spec_path), poll_seconds=0.1))
    try:
        (event,) = watcher.wait_for(1)
        assert event["status"] == "error" and "source folder" in event["message"]
        time.sleep(1)
        assert len(watcher.events) == 1, "the same error once: its run says why"
        land_at_once(landing, 0, files=2, records_per_file=5)
        assert watcher.wait_for(2)[1] == {"status": "ready", "waiting": 2, "spec_path": str(spec_path)}, "the source came back"
    finally:
        watcher.stop()


def test_the_watcher_serializes_to_an_importable_path(spec_path):
    from microbatch_airflow.triggers import NewDataEventTrigger

    path, kwargs = NewDataEventTrigger(str(spec_path), poll_seconds=3, refire_seconds=60).serialize()
    module, _, name = path.rpartition(".")
    again = getattr(__import__(module, fromlist=[name]), name)(**kwargs)
    assert (again.spec_path, again.poll_seconds, again.refire_seconds) == (str(spec_path), 3, 60)


def test_without_a_fingerprint_a_commit_that_moved_the_ledger_is_news_even_at_the_same_count(monkeypatch):
    """S3 and Kafka sources have no fingerprint: every poll checks in full.
    A commit followed by an equal landing between two polls leaves the count
    as it was; the committed position moving still makes it news (it waited
    for `refire_seconds` before). Scripted polls: (waiting, ledger position)."""
    from microbatch_airflow import triggers

    polls = [(1, (0, 1)), (1, (0, 1)), (1, (0, 2)), (0, (0, 3)), (2, (0, 3)), (2, (0, 3))]

    def check(spec_path, kafka_conn_id=None):
        if not polls:
            raise OSError("end of the script")
        return polls.pop(0)

    monkeypatch.setattr(triggers, "_fingerprint", lambda spec_path: None)
    monkeypatch.setattr(triggers, "_check", check)

    async def scenario():
        found = []
        async for event in triggers.NewDataEventTrigger("s3-pipeline.yaml", poll_seconds=0.01).run():
            if event.payload["status"] == "error":
                return found
            found.append(event.payload["waiting"])

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [1, 1, 2]


def _before_a_check(monkeypatch, action):
    """`action` runs once, just before the watcher's next full check lists
    the source, once the returned event is set: a change landing between a
    poll's fingerprint and its check."""
    import threading

    from microbatch_airflow import triggers

    real_check = triggers._check
    armed = threading.Event()

    def check(*args):
        if armed.is_set():
            armed.clear()
            action()
        return real_check(*args)

    monkeypatch.setattr(triggers, "_check", check)
    return armed


def test_a_file_landing_between_the_fingerprint_and_the_check_is_one_event(spec_path, monkeypatch):
    """A file that lands after a poll's fingerprint but before its full
    check is counted by that check; the next poll's fingerprint has moved,
    and that move is no second landing (on CI, 2026-12-03, such a file made
    two events and so a run that found nothing)."""
    import time

    from microbatch_airflow.triggers import NewDataEventTrigger

    landing = spec_path.parent / "landing"
    staged = write_wave(spec_path.parent / "staged", 0, files=1, records_per_file=5)[0]
    _before_a_check(monkeypatch, lambda: staged.rename(landing / staged.name)).set()  # the first check
    watcher = _Watcher(NewDataEventTrigger(str(spec_path), poll_seconds=0.1))
    try:
        assert watcher.wait_for(1) == [{"status": "ready", "waiting": 1, "spec_path": str(spec_path)}]
        time.sleep(1.5)
        assert len(watcher.events) == 1, f"one file, one event: {watcher.events}"
    finally:
        watcher.stop()


def test_a_file_replaced_by_another_during_a_check_is_news_at_the_next_poll(spec_path, monkeypatch):
    """The other side of the test above: a waiting file replaced by another
    while a check that found no news runs (the count the same, the ledger
    the same) is not taken in by it; the next poll sees the folder moved
    and emits, so the new file never waits without an event."""
    import time

    from microbatch_airflow.triggers import NewDataEventTrigger
    from tests.conftest import land_at_once

    landing = spec_path.parent / "landing"
    (old,) = land_at_once(landing, 0, files=1, records_per_file=5)
    (new,) = write_wave(spec_path.parent / "staged", 1, files=1, records_per_file=5)
    replace = _before_a_check(monkeypatch, lambda: (old.unlink(), new.rename(landing / new.name)))
    watcher = _Watcher(NewDataEventTrigger(str(spec_path), poll_seconds=0.1))
    try:
        assert [e["waiting"] for e in watcher.wait_for(1)] == [1]
        replace.set()
        spec_path.touch()  # the next poll checks in full, and the file is replaced as it does
        assert [e["waiting"] for e in watcher.wait_for(2, timeout=5)] == [1, 1], "the replacement is news"
        time.sleep(1)
        assert len(watcher.events) == 2, watcher.events
    finally:
        watcher.stop()
