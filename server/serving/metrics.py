"""Prometheus metrics of a data server (``fuelline serve --metrics-port``).

Everything is read from the server when scraped (a custom collector): no counter is kept twice,
and the serving loop pays nothing between scrapes. Names follow Prometheus conventions: counters
end in ``_total``, sizes in ``_bytes``.

What an operator finds there: batches and bytes sent; clients connected, and per client its
credit, batches in flight and batches prepared and waiting; windows dropped at start-up by reason;
hits and misses of each cache tier; remote fetches; worker processes configured, alive and
restarted; malformed messages and silent clients dropped; the time batches spend in each
preprocessing stage, and the batches in one now.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["ServerCollector", "serve_metrics"]

log = logging.getLogger("fuelline.server")

# Counters of Server.counters() exported as they are: (counter name, metric name, help).
PLAIN_COUNTERS = (
    ("batches", "fuelline_batches_sent", "Batches sent to clients."),
    ("bytes", "fuelline_sent_bytes", "Bytes of the arrays of the batches sent to clients."),
    ("batches_shared", "fuelline_batches_shared",
     "Batches placed in shared memory for clients on the server's host (also in fuelline_batches_sent)."),
    ("sessions", "fuelline_sessions", "Client sessions opened (a reconnect opens a new one)."),
    ("dropped_silent", "fuelline_clients_dropped_silent", "Clients dropped after three silent heartbeat intervals."),
    ("malformed", "fuelline_malformed_messages", "Malformed messages received (each answered with an error or dropped)."),
    ("remote_fetches", "fuelline_remote_fetches", "Shards fetched from remote storage into the disk cache."),
    ("remote_bytes", "fuelline_remote_fetched_bytes", "Bytes fetched from remote storage."),
    ("worker_tasks", "fuelline_worker_tasks", "Units decoded by worker processes."),
    ("workers_restarted", "fuelline_worker_restarts", "Worker processes that died and were replaced."),
    ("open_files_near_limit", "fuelline_open_files_near_limit",
     "Counts of the open files (every 5 s) that found them near the process's limit, past which no connection "
     "can be accepted."),
)
TIERS = ("memory", "decoded", "disk")


class ServerCollector:
    """Reads a ``fuelline.server.serving.server.Server`` at scrape time."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server = self.server
        counts = server.counters()
        for key, name, doc in PLAIN_COUNTERS:
            yield CounterMetricFamily(name, doc, value=counts.get(key, 0))
        hits = CounterMetricFamily("fuelline_cache_hits", "Cache hits by tier (memory: batches, decoded: units, disk: shards).",
                                   labels=["tier"])
        misses = CounterMetricFamily("fuelline_cache_misses", "Cache misses by tier (memory: batches, decoded: units, disk: shards).",
                                     labels=["tier"])
        for tier in TIERS:
            hits.add_metric([tier], counts.get(f"cache_{tier}_hits", 0))
            misses.add_metric([tier], counts.get(f"cache_{tier}_misses", 0))
        yield hits
        yield misses
        yield CounterMetricFamily("fuelline_cache_evictions", "Shards evicted from the disk cache (LRU).",
                                  value=counts.get("cache_disk_evictions", 0))
        yield CounterMetricFamily("fuelline_decoded_evictions", "Decoded units dropped from memory (LRU, --decoded-cache-mb).",
                                  value=counts.get("cache_decoded_evictions", 0))
        yield CounterMetricFamily("fuelline_cache_corrupt", "Cached shards that failed verification and were fetched again.",
                                  value=counts.get("cache_disk_corrupt", 0))
        yield from self._clients()
        yield from self._source()

    def _clients(self) -> Iterator[Metric]:
        sessions = list(self.server.sessions.values())  # a copy: the loop may change the dict meanwhile
        yield GaugeMetricFamily("fuelline_clients_connected", "Clients with a session.", value=len(sessions))
        labels = ["client", "split", "rank", "world_size"]
        credit = GaugeMetricFamily("fuelline_client_credit", "Batches the client has granted and not yet received.", labels=labels)
        flight = GaugeMetricFamily("fuelline_client_in_flight", "Batches sent to the client and not yet acknowledged.", labels=labels)
        queue = GaugeMetricFamily("fuelline_client_queue_depth", "Batches prepared for the client, waiting for credit.", labels=labels)
        sent = CounterMetricFamily("fuelline_client_batches_sent", "Batches sent in this session.", labels=labels)
        for s in sessions:
            key = [s.name, s.hello.split, str(s.hello.rank), str(s.hello.world_size)]
            credit.add_metric(key, s.credit)
            flight.add_metric(key, s.in_flight)
            queue.add_metric(key, s.queued)
            sent.add_metric(key, s.sent_batches)
        yield from (credit, flight, queue, sent)

    def _source(self) -> Iterator[Metric]:
        source = self.server.source
        dropped = GaugeMetricFamily("fuelline_windows_dropped", "Windows left out of a split at start-up, by reason.",
                                    labels=["split", "reason"])
        for split in source.splits:
            for reason, n in source.dropped(split).items():
                dropped.add_metric([split, reason], n)
        yield dropped
        skipped = source.skipped
        yield GaugeMetricFamily("fuelline_shards_skipped", "Shards or recordings left out (--on-bad-shard skip).",
                                value=len(skipped))
        configured = int(source.workers)
        pids = source.worker_pids()
        yield GaugeMetricFamily("fuelline_workers_configured", "Worker processes asked for (--workers).", value=configured)
        yield GaugeMetricFamily("fuelline_workers_alive", "Worker processes running now.", value=len(pids))
        seconds = CounterMetricFamily("fuelline_stage_seconds", "Seconds batches spent in each preprocessing stage.",
                                      labels=["stage"])
        batches = CounterMetricFamily("fuelline_stage_batches", "Batches each preprocessing stage finished.", labels=["stage"])
        for stage, (n, took) in source.stage_times().items():
            seconds.add_metric([stage], took)
            batches.add_metric([stage], n)
        yield seconds
        yield batches
        runs = source.stage_runs()
        yield GaugeMetricFamily("fuelline_stage_running", "Batches in a preprocessing stage now.", value=len(runs))
        yield GaugeMetricFamily("fuelline_stage_longest_running_seconds",
                                "Seconds the batch longest in a preprocessing stage now has been there (0: none).",
                                value=time.monotonic() - runs[0].started if runs else 0.0)


def serve_metrics(server: Any, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` over HTTP on a thread; returns the port bound (``port`` 0 picks one)."""
    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    http, _ = start_http_server(port, addr=host, registry=registry)
    bound = http.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]", bound)
    return bound
