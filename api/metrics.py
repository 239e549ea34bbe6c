"""Prometheus metrics: request counts and latency per route, jobs by status, live workers, queue depth.

Counters live in a registry per app (tests build many apps). Job, worker and queue gauges
are read from the job store and the broker when Prometheus scrapes, not kept in memory, so
any number of API replicas report the same numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.graph.engines import queue_name
from workers.queues import queue_engines

__all__ = ["Metrics", "MetricsMiddleware"]

log = logging.getLogger("kiln.api")


class _StateCollector(Collector):
    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("kiln_jobs", "Jobs in the job store by status.", labels=["status"])
        try:
            counts = self.state.jobs.count_by_status()
            for status in ("queued", "running", "succeeded", "failed", "cancelled"):
                jobs.add_metric([status], counts.get(status, 0))
        except Exception:
            log.warning("metrics: job store unavailable", exc_info=True)
        yield jobs
        workers = GaugeMetricFamily("kiln_workers", "Live workers serving each engine.", labels=["engine"])
        try:
            live = self.state.workers.live_workers(self.state.worker_max_age)
            for name in queue_engines():
                workers.add_metric([name], sum(1 for w in live if name in w.engines))
        except Exception:
            log.warning("metrics: worker list unavailable", exc_info=True)
        yield workers
        depth = GaugeMetricFamily("kiln_queue_messages", "Messages waiting in each engine queue.", labels=["queue"])
        try:
            with self.state.celery.connection_for_read() as conn:
                channel = conn.default_channel
                for name in queue_engines():
                    q = queue_name(name)
                    depth.add_metric([q], channel.queue_declare(q, passive=True).message_count)
        except Exception:
            log.warning("metrics: broker unavailable", exc_info=True)
        yield depth


class Metrics:
    """The app's metric registry and instruments."""

    def __init__(self, state: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kiln_http_requests",
            "HTTP requests by method, route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kiln_http_request_seconds",
            "HTTP request latency by route.",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
        )
        self.jobs_submitted = Counter("kiln_jobs_submitted", "Jobs accepted by POST /compile.", registry=self.registry)
        self.upload_bytes = Counter("kiln_upload_bytes", "Bytes received by POST /compile.", registry=self.registry)
        self.registry.register(_StateCollector(state))


class MetricsMiddleware:
    """Pure ASGI middleware (no per-request task or body copy) timing every HTTP request."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "(unmatched)")
            self.metrics.requests.labels(scope["method"], route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
