"""Prefill workers hosted on Ray: each actor loads the model once and serves the PrefillService.

Ray places the actors (num_cpus, num_gpus, a custom `prefill` resource for nodes set aside for
prefill) and restarts a crashed one (max_restarts); a restarted actor serves again on a fresh
port, so callers ask `address()` again after a failure. Ray itself is started here only when the
caller has not: locally, or joining the cluster at `ray_address`.
"""

from __future__ import annotations

import logging
import os

import ray

from services.prefill.settings import PrefillSettings


class PrefillActor:
    def __init__(self, settings_json: str):
        from services.prefill.worker import start_prefill_worker
        from shared.models import load_model

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        settings = PrefillSettings.model_validate_json(settings_json)
        engine = settings.engine
        # Ray sets OMP_NUM_THREADS to the actor's CPUs; an explicit setting wins.
        import torch

        torch.set_num_threads(engine.threads or max(1, int(settings.num_cpus)))
        loaded = load_model(engine.model, device=engine.device, dtype=engine.dtype, cache_dir=engine.cache_dir)
        self.worker = start_prefill_worker(settings, loaded)

    def address(self) -> str:
        return self.worker.address

    def pid(self) -> int:
        return os.getpid()

    def counters(self) -> dict:
        from dataclasses import asdict

        return asdict(self.worker.servicer.counters)


def ensure_ray(address: str | None = None, **init_kwargs) -> None:
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, **init_kwargs)


def launch_prefill_actors(settings: PrefillSettings, ray_address: str | None = None) -> list:
    """Start settings.num_actors prefill actors and wait until each serves; returns their handles."""
    ensure_ray(ray_address)
    resources = {"prefill": settings.prefill_resource} if settings.prefill_resource else None
    remote = ray.remote(PrefillActor).options(
        num_cpus=settings.num_cpus,
        num_gpus=settings.num_gpus,
        resources=resources,
        max_restarts=settings.max_restarts,
        # A call that was running when the actor died is retried once it is back.
        max_task_retries=1,
    )
    handles = [remote.remote(settings.model_dump_json()) for _ in range(settings.num_actors)]
    ray.get([handle.address.remote() for handle in handles])
    return handles


def actor_addresses(handles: list, timeout_s: float = 120.0) -> list[str]:
    return ray.get([handle.address.remote() for handle in handles], timeout=timeout_s)
