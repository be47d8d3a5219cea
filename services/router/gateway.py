"""What one gateway process holds: its settings and text model, the workers, the admission queue,
the dispatcher, the API keys, the metrics and the request records. The routes that use it are in
services.router.completions and services.router.admin; services.router.app puts them together.

Every Redis call runs in a thread (admission.off_loop), never on the event loop.
"""

from __future__ import annotations

from services.router.admission import Admission, AdmissionQueue, off_loop
from services.router.auth import KeyStore
from services.router.client import DecodeClient
from services.router.dispatch import Dispatcher
from services.router.errors import status_of
from services.router.fallback import FallbackWorkers, GuardedRedis
from services.router.metrics import GatewayMetrics
from services.router.policy import make_policy
from services.router.prefixes import MemoryPrefixIndex, RedisPrefixIndex
from services.router.records import RequestRecords
from services.router.responses import JobGroup, TextJob
from services.router.settings import GatewaySettings
from services.router.workers import RedisWorkers, StaticWorkers, Workers
from shared.api.logprobs import LogprobFormatter
from shared.api.serving import RequestError
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def static_workers(settings: GatewaySettings, model: str) -> StaticWorkers:
    workers = [
        WorkerInfo(worker_id=f"prefill@{a}", role="prefill", address=a, model=model) for a in settings.prefill_workers
    ]
    workers += [
        WorkerInfo(worker_id=f"decode@{a}", role="decode", address=a, model=model) for a in settings.decode_workers
    ]
    return StaticWorkers(workers)


def status_capacity(auth):
    """StaticWorkers' ask_capacity: a decode worker's max_sequences, from its Status (blocking)."""

    def ask(worker: WorkerInfo) -> int | None:
        client = DecodeClient(worker.address, auth)
        try:
            return client.status(timeout=1.0).max_sequences or None  # 0: a worker too old to say
        finally:
            client.close()

    return ask


class Gateway:
    """Everything one gateway process holds."""

    def __init__(self, settings: GatewaySettings, text: TextModel, workers: Workers | None = None):
        self.settings, self.text = settings, text
        self.formatter = LogprobFormatter(text.tokenizer)
        client = None
        if workers is None:
            if settings.redis_url:  # Redis is a help, not a gate: FallbackWorkers serves without it
                workers = FallbackWorkers(RedisWorkers(settings.redis_url))
                client = GuardedRedis(workers.client, workers.state)
            else:
                workers = static_workers(settings, text.name)
        if isinstance(workers, StaticWorkers) and workers.ask_capacity is None:
            workers.ask_capacity = status_capacity(settings.internal_auth())
        self.workers = workers
        self.metrics = GatewayMetrics()
        self.metrics.degraded.set_function(lambda: float(self.degraded))
        self.records = RequestRecords(client, settings.request_record_ttl_s) if client is not None else None
        required = settings.require_api_key
        if required is None:  # on by default, except for a gateway only reachable from this host
            required = settings.host not in LOOPBACK
        self.keys = KeyStore([k.get_secret_value() for k in settings.api_keys], required, client)
        prefixes = None  # where prompts are cached; None when the workers cache nothing
        if settings.engine.enable_prefix_caching:
            prefixes = RedisPrefixIndex(client) if client is not None else MemoryPrefixIndex()
        self.queue = AdmissionQueue(self.metrics, settings.max_queued)
        self.dispatcher = Dispatcher(
            workers,
            make_policy(settings.routing, settings.local_threshold, settings.route_by_wait),
            text,
            self.metrics,
            settings.retries,
            settings.internal_auth(),
            prefixes=prefixes,
            queue=self.queue,
            migration_limit=settings.migration_limit,
            migration_max_tokens=settings.migration_max_tokens,
            migration_wait_s=settings.migration_wait_s,
        )
        self.admission = Admission(workers, self.metrics, self.queue, settings.max_streams_per_key)
        self.model_names = list(dict.fromkeys([text.name, *settings.served_model_names]))

    def check_model(self, name: str | None) -> None:
        """404 for a model this gateway does not serve (an absent name means the one it serves)."""
        if name is not None and name not in self.model_names:
            served = ", ".join(self.model_names)
            raise RequestError(404, f"model {name!r} does not exist here; served: {served}", "model", "model_not_found")

    async def record(self, job: TextJob | JobGroup, outcome: str, error: Exception | None = None) -> None:
        """The request's record in Redis (multi-host mode), written in a thread."""
        if self.records is not None:
            message = error and status_of(error)[1].message
            await off_loop(self.records.write, job.request_id, job.record(outcome, message))

    async def close(self) -> None:
        await self.dispatcher.close()
        if isinstance(self.workers, FallbackWorkers | RedisWorkers):
            self.workers.close()

    @property
    def degraded(self) -> bool:
        """Serving without Redis (services.router.fallback)."""
        return isinstance(self.workers, FallbackWorkers) and self.workers.state.degraded
