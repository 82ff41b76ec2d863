"""Scraping a server's Prometheus endpoint (``fuelline serve --metrics-port``)."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metrics_port", "scrape"]

TIMEOUT = 20.0


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metrics_port(server) -> int:
    return int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", server.wait_log("metrics on")).group(1))
