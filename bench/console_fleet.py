"""The console with many pipelines, one of them unreachable: its API and its
page in a real Airflow (api-server on loopback, metadata in PostgreSQL) and
headless Chromium, with 1, 30 and 200 pipelines.

Every pipeline but one has 20 committed batches (fast-forwarded, as
`bench/long_life.py` does); the first is the shipped Kafka example pointed at
a closed port, whose status probe waits out librdkafka's timeouts. The
anchor, on the same pipelines in the same run, is the console's previous
pipelines route: every status read at once, the answer sent when the last
one is done (measured in this process, as the route ran it: one thread per
pipeline, anyio's 40 at most).

Figures: the anchor; the API's first answer after the specs appear (nothing
cached: the probes that answer within the console's wait, the rest shown as
"probing"); the API warm (medians of 5); the page loaded in Chromium until
every pipeline's row and the first one's batches are drawn, warm, and
while the values it shows are being probed again.

    .venv/bin/python bench/console_fleet.py --counts 1,30,200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]
# The anchor imports the console in this process: Airflow's configuration
# goes to a throw-away home, not ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="microbatch-bench-airflow-"))

from bench.doc_sections import replace_section  # noqa: E402
from bench.long_life import fast_forward  # noqa: E402
from tests.conftest import oracle_spec_dict, write_spec  # noqa: E402
from tests.plugins.live_airflow import LiveAirflow  # noqa: E402

HEADING = "## Console with many pipelines"
AGE = 20


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


def add_pipelines(folder: Path, have: int, want: int) -> None:
    for i in range(have, want):
        if i == 0:
            spec = (ROOT / "dags" / "pipelines" / "kafka_clicks.yaml").read_text()
            spec = spec.replace('bootstrap_servers: "localhost:9092"', f'bootstrap_servers: "127.0.0.1:{closed_port()}"')
            (folder / "kafka_clicks.yaml").write_text(spec)
            continue
        name = f"clicks_{i:03d}"
        spec = oracle_spec_dict(name=name)
        spec["source"]["path"] = f"landing/{name}"
        spec["state"]["path"] = f"lake/{name}"
        spec["checkpoint"] = f"lake/_checkpoints/{name}"
        fast_forward(folder, write_spec(folder, spec, f"{name}.yaml"), AGE, 2)


def anchor_seconds(folder: Path) -> float:
    """The previous route: every `_summary` at once, the answer when the last is done."""
    from microbatch_airflow.console.app import _summary
    from microbatch_airflow.dag_factory import scan_specs

    start = time.perf_counter()
    specs, _ = scan_specs(folder)
    with ThreadPoolExecutor(40) as pool:
        list(pool.map(_summary, specs.values()))
    return time.perf_counter() - start


def get(live: LiveAirflow, path: str) -> tuple[float, list]:
    request = urllib.request.Request(f"http://127.0.0.1:{live.port}{path}", headers={"Authorization": f"Bearer {live.token('admin')}"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        body = json.loads(response.read())
    return time.perf_counter() - start, body


def page_seconds(browser, live: LiveAirflow, count: int) -> float:
    base = f"http://127.0.0.1:{live.port}"
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_cookies([{"name": "_token", "value": live.token("admin"), "url": base}])
    page = context.new_page()
    start = time.perf_counter()
    page.goto(f"{base}/microbatch/")
    page.wait_for_function(f"document.querySelectorAll('#pipelines tbody tr.pipeline').length >= {count}", timeout=120_000)
    if count > 1:
        page.wait_for_selector("#batches tbody tr[data-batch]", timeout=120_000)
    took = time.perf_counter() - start
    context.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,30,200")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    counts = sorted(int(c) for c in args.counts.split(","))
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("needs chromium (make tools)")
    from playwright.sync_api import sync_playwright

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pipelines"
        folder.mkdir()
        live = LiveAirflow(Path(tmp) / "home", folder).start()
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
                have = 0
                for count in counts:
                    add_pipelines(folder, have, count)
                    have = count
                    first, body = get(live, "/microbatch/api/pipelines")
                    probing = sum(1 for p in body if p["status"] == "probing")
                    warm = statistics.median(get(live, "/microbatch/api/pipelines")[0] for _ in range(5))
                    page_warm = page_seconds(browser, live, count)
                    # Until the cache calls its values stale and probes again behind them.
                    while not any(p["probing"] and p["probed_at"] for p in get(live, "/microbatch/api/pipelines")[1]):
                        time.sleep(1)
                    page_stale = page_seconds(browser, live, count)
                    anchor = anchor_seconds(folder)
                    r = {"count": count, "anchor": anchor, "first": first, "probing": probing, "warm": warm,
                         "page_warm": page_warm, "page_stale": page_stale}
                    results.append(r)
                    print(f"{count:>4} pipelines: previous route {anchor:.2f} s; API first {first:.2f} s "
                          f"({probing} probing), warm {warm:.3f} s ({anchor / warm:.0f}x faster); page {page_warm:.2f} s, "
                          f"with stale values {page_stale:.2f} s", flush=True)
                browser.close()
        finally:
            live.stop()
    lines = [
        HEADING,
        "",
        f"`bench/console_fleet.py`, {date.today().isoformat()}, {platform.machine()} with 2 cores. A real api-server "
        "(metadata in PostgreSQL) and headless Chromium; every pipeline has 20 committed batches but one, the "
        "Kafka example pointed at a closed port. Anchor, same pipelines, same run: the previous pipelines route "
        "(every status read at once, answered when the slowest is done), timed in the bench's own process (no "
        "HTTP, so it flatters the anchor slightly). API warm: median of 5. Page: until every "
        "pipeline's row and the first one's batches are drawn; stale: while the values shown are being probed "
        "again.",
        "",
        "| pipelines | previous route (anchor) | API, first answer | probing in it | API, warm | anchor / warm | page | page, stale values |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['count']:,} | {r['anchor']:.2f} s | {r['first']:.2f} s | {r['probing']} | {r['warm']:.3f} s | "
            f"{r['anchor'] / r['warm']:.0f}x | {r['page_warm']:.2f} s | {r['page_stale']:.2f} s |"
        )
    lines.append("")
    print("\n".join(lines))
    if not args.no_write:
        replace_section(ROOT / "docs" / "benchmarks.md", HEADING, lines)


if __name__ == "__main__":
    main()
