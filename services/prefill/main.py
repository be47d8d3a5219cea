"""`lazyserve prefill-worker`: start prefill actors on Ray, keep them until SIGINT/SIGTERM."""

from __future__ import annotations

import logging

import ray

from services.prefill.actor import actor_addresses, launch_prefill_actors, set_session_niceness
from services.prefill.settings import PrefillSettings
from shared.net.lifecycle import wait_for_signal
from shared.net.telemetry import setup_logging

log = logging.getLogger(__name__)


def serve(settings: PrefillSettings, ray_address: str | None) -> int:
    setup_logging()
    if settings.niceness is not None and set_session_niceness(settings.niceness):
        log.info("this session (its Ray and actors) runs at nice %d against other sessions", settings.niceness)
    handles = launch_prefill_actors(settings, ray_address)
    for address in actor_addresses(handles):
        print(f"READY prefill {address}", flush=True)
    wait_for_signal()
    log.info("stopping %d prefill actors", len(handles))
    try:
        ray.get([handle.flush_traces.remote() for handle in handles], timeout=10)
    except Exception as error:  # a dead actor has nothing to flush; stopping goes on
        log.warning("could not flush an actor's traces: %s", error)
    for handle in handles:
        ray.kill(handle)
    ray.shutdown()
    return 0
