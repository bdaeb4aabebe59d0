"""The console's own calls to Airflow (its pages and API are tested in a live
Airflow and in Chromium: tests/plugins/test_airflow_live.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("settings", "root"),
    [
        ({"AIRFLOW__API__BASE_URL": "https://airflow.example.com/team/"}, "https://airflow.example.com/team"),
        ({"AIRFLOW__API__HOST": "0.0.0.0", "AIRFLOW__API__PORT": "8793"}, "http://127.0.0.1:8793"),
        ({"AIRFLOW__API__HOST": "10.1.2.3", "AIRFLOW__API__PORT": "9000", "AIRFLOW__API__BASE_URL": "/airflow"}, "http://10.1.2.3:9000/airflow"),
        ({"AIRFLOW__API__HOST": "::1", "AIRFLOW__API__PORT": "8080", "AIRFLOW__API__SSL_CERT": "/etc/cert.pem"}, "https://[::1]:8080"),
    ],
    ids=["base_url", "any-address", "path-only-base_url", "ipv6-tls"],
)
def test_the_rewind_calls_airflow_where_the_configuration_says(monkeypatch, settings, root):
    """Not where the request's Host header says: a forged Host would get the
    caller's token and the trigger (the live test forges one)."""
    from microbatch_airflow.console.app import airflow_root

    for name in ("AIRFLOW__API__BASE_URL", "AIRFLOW__API__HOST", "AIRFLOW__API__PORT", "AIRFLOW__API__SSL_CERT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert airflow_root() == root
