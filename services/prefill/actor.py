"""Prefill workers hosted on Ray: each actor loads the model once and serves the PrefillService.

Ray places the actors (num_cpus, num_gpus, a custom `prefill` resource for nodes set aside for
prefill) and restarts a crashed one (max_restarts); a restarted actor serves again on a fresh
port, so callers ask `address()` again after a failure. Ray itself is started here only when the
caller has not: locally, or joining the cluster at `ray_address`.
"""

from __future__ import annotations

import logging
import os
import time

import ray

from services.prefill.settings import PrefillSettings
from shared.compute import openmp_env

log = logging.getLogger(__name__)


class PrefillActor:
    def __init__(self, settings_json: str):
        from services.prefill.worker import start_prefill_worker
        from shared.models.weights import load_engine
        from shared.net.telemetry import setup_logging, setup_tracing

        setup_logging()
        setup_tracing("lazyserve-prefill")
        settings = PrefillSettings.model_validate_json(settings_json)
        engine = settings.engine
        if settings.niceness is not None:
            set_niceness(settings.niceness)
        # Ray sets OMP_NUM_THREADS to the actor's CPUs (1 by default), which would leave a long
        # prompt's prefill on one core: the actors of this worker share the node's cores instead.
        from shared.compute import ComputeThread
        from shared.settings import available_cores

        threads = engine.threads or max(1, available_cores() // settings.num_actors)
        log.info("prefill actor: %d torch threads", threads)
        # Ray calls the actor's methods on its main thread and gRPC's handlers run on their own:
        # neither computes. The thread that loads the model runs every prefill.
        self.compute = ComputeThread("prefill-engine")
        loaded = load_engine(engine.model_copy(update={"threads": threads}), self.compute)
        if settings.host in ("0.0.0.0", "::") and settings.advertise_host is None:  # noqa: S104 -- a check, not a bind
            # Reachable from other nodes at this node's address, wherever Ray placed the actor.
            settings = settings.model_copy(update={"advertise_host": ray.util.get_node_ip_address()})
        self.worker = start_prefill_worker(settings, loaded, self.compute)
        self.heartbeat = None
        if settings.redis_url:
            from shared.net.registry import Heartbeat, WorkerInfo

            info = WorkerInfo(
                role="prefill",
                address=self.worker.address,
                model=loaded.name,
                capacity=settings.max_concurrent_prefills,
                dtype=loaded.engine.dtype_name,
            )
            self.heartbeat = Heartbeat(settings.redis_url, info, settings.heartbeat_ttl_s)

    def address(self) -> str:
        return self.worker.address

    def flush_traces(self) -> None:
        """Export buffered spans now (before the actor is killed)."""
        from shared.net.telemetry import shutdown_tracing

        shutdown_tracing()

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> dict:
        """Which threads ran engine work (shared.compute): the compute thread alone, never Ray's."""
        import threading

        from shared.compute import OPENMP_ENV, computing_threads

        return {
            "compute": self.compute.ident,
            "ray": threading.get_ident(),
            "computing": sorted(computing_threads()),
            "openmp_env": {name: os.environ.get(name) for name in OPENMP_ENV},
        }

    def counters(self) -> dict:
        from dataclasses import asdict

        return asdict(self.worker.servicer.counters)


def set_niceness(value: int) -> None:
    """Every thread of this process at nice `value` (Linux keeps a nice value per thread; threads
    started later inherit their starter's, and this thread starts the gRPC server and torch's).

    Ray starts workers at nice 15 so its own daemons stay responsive. Prefill is the latency path:
    at nice 15 any busy neighbour (a decode worker receiving our frames) preempts its compute
    threads, and every parallel region waits for the slowest thread, so the default is 0. A value
    above 0 is a deliberate priority for the decode loop on a shared host (bench interference);
    against processes of other sessions it takes set_session_niceness as well. Lowering a value
    needs CAP_SYS_NICE; where the OS refuses, the current one stays."""
    try:
        threads = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: this thread only
        threads = [0]
    try:
        for thread in threads:
            os.setpriority(os.PRIO_PROCESS, thread, value)
    except OSError as error:
        log.info("prefill actor keeps its niceness (%d): %s", os.getpriority(os.PRIO_PROCESS, 0), error)


def set_session_niceness(value: int) -> bool:
    """This session's autogroup at nice `value`, from its leader; True if it took.

    With autogroups on (the default of most distributions' kernels), Linux shares CPU time
    between sessions first and a nice value orders only the threads within one. `up` starts
    each worker in its own session, so a decode worker competes with the prefill worker's
    session as a whole: its leader (the prefill-worker command, whose Ray and actors share its
    session) sets the session's value. Only a session leader does it, so a process that merely
    hosts actors (a test, a driver) never lowers the priority of its caller's shell."""
    if os.getsid(0) != os.getpid():
        return False
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(value))
    except FileNotFoundError:
        return False  # a kernel without autogroups: the threads' values are all there is
    except OSError as error:
        log.info("the prefill worker's session keeps its niceness: %s", error)
        return False
    return True


def autogroup_niceness(pid: int | str = "self") -> int | None:
    """The nice value of a process's autogroup (None: the kernel has none)."""
    try:
        with open(f"/proc/{pid}/autogroup") as autogroup:
            return int(autogroup.read().split("nice")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return None


# How long a local Ray head waits for its GCS to publish its port (Ray's default: 30 s). `up`
# starts the prefill worker's head beside decode workers loading their models, on hosts of two
# cores; 30 s was not always enough there. Set only when no address is given (Ray then starts a
# head here, unless a `ray start` on this host left one to join): a driver joining a cluster reads
# the same variable as its count of connection retries (a refused one would retry for as long).
LOCAL_GCS_WAIT_S = "120"


def ensure_ray(address: str | None = None, **init_kwargs) -> None:
    if ray.is_initialized():
        return
    local = address is None and not os.environ.get("RAY_ADDRESS")
    key = "RAY_gcs_server_port_wait_time_s"
    given = os.environ.get(key)
    if local and given is None:
        os.environ[key] = LOCAL_GCS_WAIT_S
    try:
        ray.init(address=address, include_dashboard=False, **init_kwargs)
    finally:
        if local and given is None:
            os.environ.pop(key, None)


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
        # Set before the actor's process loads torch (importing this module does), also on a
        # cluster whose raylets were started without them.
        runtime_env={"env_vars": openmp_env()},
    )
    # A fixed port is the first actor's; the others take the next ones (0: each picks a free port).
    handles = [
        remote.remote(settings.model_copy(update={"port": settings.port and settings.port + i}).model_dump_json())
        for i in range(settings.num_actors)
    ]
    _wait_started([handle.address.remote() for handle in handles], _needs(settings))
    return handles


def _needs(settings: PrefillSettings) -> str:
    needs = f"num_cpus={settings.num_cpus}, num_gpus={settings.num_gpus}"
    return needs + (f", prefill={settings.prefill_resource}" if settings.prefill_resource else "")


def _wait_started(refs: list, needs: str, every_s: float = 30.0) -> None:
    """Wait for every actor to serve, saying every `every_s` what is still awaited and what Ray
    has free: an actor Ray cannot place (no node with the resources, a worker that cannot
    start) waits without an error of its own, and on a cluster an autoscaler may yet add a node."""
    started, pending = time.monotonic(), refs
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=every_s)
        if pending:
            log.warning(
                "%d of %d prefill actors not serving after %.0f s (each needs %s; Ray has free: %s)",
                len(pending),
                len(refs),
                time.monotonic() - started,
                needs,
                ray.available_resources(),
            )
    ray.get(refs)  # an actor that failed to start raises its error here


def actor_addresses(handles: list, timeout_s: float = 120.0) -> list[str]:
    return ray.get([handle.address.remote() for handle in handles], timeout=timeout_s)
