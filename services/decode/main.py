"""`lazyserve decode-worker`: load the model, serve DecodeService until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import time

from services.decode.server import start_decode_worker
from services.decode.settings import DecodeSettings
from shared.compute import ComputeThread
from shared.models.weights import load_engine
from shared.net.lifecycle import wait_for_signal
from shared.net.registry import Heartbeat, WorkerInfo
from shared.net.telemetry import setup_logging, setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


def serve(settings: DecodeSettings) -> int:
    setup_logging()
    setup_tracing("lazyserve-decode")
    # The thread that loads the model is the one that runs it; this one waits for a signal.
    compute = ComputeThread("decode-engine")
    loaded = load_engine(settings.engine, compute)
    worker = start_decode_worker(settings, loaded, compute)
    # One line on stdout that scripts (and tests) wait for; the port may have been picked by the OS.
    heartbeat = None
    if settings.redis_url:
        info = WorkerInfo(
            role="decode",
            address=worker.address,
            model=loaded.name,
            capacity=settings.max_sequences,
            dtype=loaded.engine.dtype_name,
        )
        heartbeat = Heartbeat(settings.redis_url, info, settings.heartbeat_ttl_s)
    print(f"READY decode {worker.address}", flush=True)
    wait_for_signal()
    # Draining: not ready at once (probes, the registry), nothing new admitted, the running
    # streams' grace period, then the rest handed over to the gateways by migration.
    log.info("draining decode worker on %s (up to %g s)", worker.address, settings.drain_seconds)
    worker.not_ready()
    if heartbeat is not None:
        heartbeat.stop()
    started = time.monotonic()
    handed = worker.servicer.drain(settings.drain_seconds)
    log.info("drained in %.1f s; %d sequences handed over; stopping", time.monotonic() - started, handed)
    worker.stop()
    compute.close()
    shutdown_tracing()
    return 0
