"""The metrics of every serving process of ``fuelline serve --processes N``, at one endpoint.

Each serving process serves its own metrics (``fuelline.server.serving.metrics``) on a loopback
port that only its supervisor reads. At each scrape of the supervisor's endpoint, it reads them
all and serves every sample again with a ``process`` label (0…N-1): ``sum without (process)``
gives the server's whole. A process that does not answer (it is restarting) is left out of that
scrape and counted in ``fuelline_serving_processes_up``; a counter of a process that restarted
starts again from 0, as Prometheus' ``rate`` expects of a restart.
"""

from __future__ import annotations

import logging
import urllib.request
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ProcessesCollector", "serve_merged_metrics"]

log = logging.getLogger("fuelline.server")

SCRAPE_TIMEOUT = 5.0  # seconds a serving process gets to answer


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT) as answer:
        return answer.read().decode()


class ProcessesCollector:
    """Reads a ``ServingProcesses``'s processes at scrape time."""

    def __init__(self, processes: Any) -> None:
        self.processes = processes

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        up = GaugeMetricFamily("fuelline_serving_processes_up",
                               "Whether each serving process answered this scrape (1) or not (0: starting, restarting).",
                               labels=["process"])
        for index, port in self.processes.metrics_ports().items():
            text = None
            if port is not None:
                try:
                    text = _scrape(port)
                except OSError as exc:
                    log.warning("metrics of serving process %d (port %d) unreadable: %s", index, port, exc)
            up.add_metric([str(index)], 0 if text is None else 1)
            for family in text_string_to_metric_families(text or ""):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "process": str(index)}, sample.value)
        yield from merged.values()
        yield up
        yield GaugeMetricFamily("fuelline_serving_processes", "Serving processes asked for (--processes).",
                                value=self.processes.count)
        yield CounterMetricFamily("fuelline_serving_process_restarts",
                                  "Serving processes that died and were started again.", value=self.processes.restarts)


def serve_merged_metrics(processes: Any, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` of every serving process over HTTP on a thread; returns the port bound."""
    registry = CollectorRegistry()
    registry.register(ProcessesCollector(processes))
    http, _ = start_http_server(port, addr=host, registry=registry)
    bound = http.server_address[1]
    log.info("metrics of the %d serving processes on http://%s:%d/metrics", processes.count,
             host if ":" not in host else f"[{host}]", bound)
    return bound
