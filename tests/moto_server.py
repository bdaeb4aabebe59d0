"""moto's S3 server in its own process: ``python -m tests.moto_server``.

It prints ``PORT <n>`` once listening and stops when its stdin closes (so it
never outlives the test session). It must not run inside the test process:
delta-rs holds the GIL through some blocking calls (`QueryBuilder`), and an
in-process server thread then cannot answer them.
"""

from __future__ import annotations

import logging
import sys

from moto.server import ThreadedMotoServer


def main() -> None:
    # One log line per request drowns a failing test's output; keep warnings.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(f"PORT {server.get_host_and_port()[1]}", flush=True)
    sys.stdin.read()  # until the parent closes the pipe or exits
    server.stop()


if __name__ == "__main__":
    main()
