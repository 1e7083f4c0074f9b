"""Ray placement: the router and every worker as Ray actors (`pdserve up --ray [ADDRESS]`,
`Pipeline(placement="ray")`); docs/cluster.md explains the choices.

`RayCluster` is a `Cluster` (same context manager, health wait and warm-up) whose processes
are actors: each worker asks a node for its role's `ray_num_cpus`, `ray_num_gpus` and
`ray_resources` and is restarted by Ray up to `ray_max_restarts` times; the router runs on
this process's node (same URL as on one host). Start-up is bounded by `ray_timeout_s`. The
cluster secret and API keys go through Ray's object store (`ray.put`), never as actor
arguments or runtime_env variables, which Ray's dashboard shows. Only this module and the
actors import ray, lazily.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from pdserve import envs
from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import (
    Cluster,
    ClusterError,
    free_port,
    router_settings,
    worker_specs,
)
from pdserve.cluster.ray_actors import RouterActor, WorkerActor
from pdserve.workers.spec import WorkerSpec

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ClusterError("placement 'ray' needs Ray: pip install 'pdserve[ray]'") from None
    return ray


def actor_options(role: WorkerGroup) -> dict[str, Any]:
    """What one worker of `role` asks of a Ray node."""
    num_cpus = role.ray_num_cpus if role.ray_num_cpus is not None else (role.threads or 1)
    return {
        "num_cpus": num_cpus,
        "num_gpus": role.ray_num_gpus,
        "resources": dict(role.ray_resources or {}),
    }


class RayCluster(Cluster):
    def __init__(self, pipeline: Pipeline, log_level: str = "INFO") -> None:
        super().__init__(pipeline, log_level, restart=None)  # Ray restarts the actors
        self.router: Any = None
        self.workers: dict[str, Any] = {}  # worker_id -> actor handle
        self.placements: dict[str, dict[str, str]] = {}  # worker_id -> node id, ip, pid
        self._specs: dict[str, WorkerSpec] = {}  # worker_id -> the spec it was started with
        self._next_index: dict[str, int] = {}
        self._secret_refs: list = []
        self._started_ray = False
        self._name_prefix = f"pdserve-{secrets.token_hex(4)}-"  # this cluster's actor names

    # ---- start ----------------------------------------------------------------------------

    def start(self) -> None:
        p = self.pipeline
        if p.adaptive.enabled:
            raise ClusterError(
                "adaptive pipelines share one host's cores (adaptive.enabled); "
                "under Ray give roles their own workers"
            )
        if p.kv_pool.redis_url == "local":
            raise ClusterError(
                "kv_pool.redis_url 'local' starts redis-server on this host only; "
                "under Ray give a redis:// URL every node reaches"
            )
        ray = self._connect()  # first: an unreachable cluster fails before any conversion
        from pdserve.model.registry import resolve_model

        # Converted here once; nodes sharing the cache dir reuse it.
        resolve_model(p.model, None, p.gguf_fp32_max_bytes)
        keys = {
            "secret": secrets.token_bytes(32),
            "api_key": p.api_key,
            "admin_key": self.admin_key,
        }
        self._secret_refs = [ray.put(keys)]
        self._start_router()
        router_address = self._get(self.router.address.remote(), "place the router")
        specs = worker_specs(p, router_address["ctrl_address"])
        for spec in specs:
            self._start_worker(spec)
        for spec in specs:
            self._await_worker(spec.worker_id)
        port = self._get(
            self.router.start.remote(p.startup_timeout_s), "start the router", p.startup_timeout_s
        )
        self.url = f"http://{p.host if p.host not in ('0.0.0.0', '::') else '127.0.0.1'}:{port}"
        self._wait_healthy(p.startup_timeout_s)
        if p.warmup_prompts:
            self._warmup(list(p.warmup_prompts))

    def _connect(self) -> Any:
        """ray.init, connecting within `ray_timeout_s` (Ray itself retries an unreachable GCS
        for minutes). A new local instance starts in this thread: Ray cannot start one from
        another (the process exits)."""
        ray = _import_ray()
        p = self.pipeline
        address = p.ray_address
        if address and address != "auto":
            _probe(address, p.ray_timeout_s)
        if ray.is_initialized():  # this process is connected already (a notebook, tests)
            return ray
        if address == "auto" and not envs.ray_address():
            _check_auto(*_local_clusters(ray), p.ray_timeout_s)
        outcome: dict[str, Any] = {}

        def init() -> None:
            try:
                # "local": a new instance even where /tmp/ray names a running (or dead) one
                ray.init(
                    address=address or "local", log_to_driver=True, logging_level=logging.WARNING
                )
            except Exception as exc:
                outcome["error"] = exc

        where = address or "a new local Ray instance"
        if address is None:
            init()
        else:
            thread = threading.Thread(target=init, daemon=True)
            thread.start()
            thread.join(p.ray_timeout_s)
            if thread.is_alive():
                raise ClusterError(
                    f"could not connect to Ray at {where} within "
                    f"{p.ray_timeout_s:.0f} s (ray_timeout_s)"
                )
        if "error" in outcome:
            raise ClusterError(f"could not connect to Ray at {where}: {outcome['error']}")
        self._started_ray = True
        return ray

    def _start_router(self) -> None:
        ray = _import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On this node, at a control address chosen here: a restarted router binds the same
        # one, which the workers' sockets reconnect to. It learns the workers as they register.
        ip = ray.util.get_node_ip_address()
        config = router_settings(self.pipeline, [], f"tcp://{ip}:{free_port(ip)}", self.log_level)
        del config["workers"]
        here = ray.get_runtime_context().get_node_id()
        # num_cpus=0: the router waits on sockets; a CPU reserved for it would leave a small
        # machine (`pdserve up --ray` on 2 cores) unable to place 1P1D.
        actor = ray.remote(RouterActor).options(
            num_cpus=0,
            max_restarts=self.pipeline.ray_max_restarts,
            max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        self.router = actor.remote(
            json.dumps(config), self._secret_refs, self.log_level, self._name_prefix
        )

    def _start_worker(self, spec: WorkerSpec) -> None:
        ray = _import_ray()
        role = getattr(self.pipeline, spec.role)
        # Named, so that a restarted router finds its workers (RouterActor._recover()).
        actor = ray.remote(WorkerActor).options(
            **actor_options(role),
            max_restarts=self.pipeline.ray_max_restarts,
            max_concurrency=4,
            name=self._name_prefix + spec.worker_id,
        )
        self._specs[spec.worker_id] = spec
        index = int(spec.worker_id.rsplit("-", 1)[1])
        self._next_index[spec.role] = max(self._next_index.get(spec.role, 0), index + 1)
        self.workers[spec.worker_id] = actor.remote(spec.to_json(), self.router, self.log_level)

    def _await_worker(self, worker_id: str) -> None:
        """Placed within `ray_timeout_s`, then bound and registered within the start-up bound
        (the model loads in between)."""
        ray, p, actor = _import_ray(), self.pipeline, self.workers[worker_id]
        role = getattr(p, self._specs[worker_id].role)
        ref = actor.placed.remote()
        if ray.wait([ref], timeout=p.ray_timeout_s)[0]:
            self.placements[worker_id] = self._get(ref, f"place {worker_id}")
        else:
            offers = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            raise ClusterError(
                f"Ray placed no actor for {worker_id} within {p.ray_timeout_s:.0f} s "
                f"(ray_timeout_s): it asks {actor_options(role)}, the nodes offer {offers}"
            ) from None
        found = self._get(
            actor.endpoint.remote(p.startup_timeout_s),
            f"start {worker_id}",
            p.startup_timeout_s + 5,
        )
        log.info("%s on node %s at %s", worker_id, found["node_ip"], found["address"])

    def _get(self, ref: Any, what: str, timeout_s: float | None = None) -> Any:
        ray = _import_ray()
        timeout_s = timeout_s or self.pipeline.ray_timeout_s
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"could not {what} within {timeout_s:.0f} s") from None
        except ray.exceptions.RayError as exc:
            raise ClusterError(f"could not {what}: {_first_line(exc)}") from None

    def check_alive(self) -> None:
        """The router actor answers, or Ray is restarting it; dead for good is an error."""
        ray = _import_ray()
        if self.router is not None:
            try:
                ray.get(self.router.ping.remote(), timeout=self.pipeline.ray_timeout_s)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                pass
            except ray.exceptions.RayError as exc:
                raise ClusterError(f"the router is gone: {_first_line(exc)}") from None

    # ---- scaling --------------------------------------------------------------------------

    def add_worker(self, role: str) -> str:
        """Start one more worker of `role` (a role of the pipeline) and return its id once the
        router serves it. Where the cluster autoscales, its resource request adds a node."""
        if getattr(self.pipeline, role, None) is None:
            raise ValueError(f"role {role!r} is not in this pipeline")
        template = next(s for s in self._specs.values() if s.role == role)
        worker_id = f"{role}-{self._next_index[role]}"
        self._start_worker(dataclasses.replace(template, worker_id=worker_id))
        self._await_worker(worker_id)
        deadline = time.monotonic() + self.pipeline.startup_timeout_s
        while not self._is_healthy(worker_id):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{worker_id} not healthy after {self.pipeline.startup_timeout_s:.0f} s"
                )
            time.sleep(0.2)
        return worker_id

    def _is_healthy(self, worker_id: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:  # 503 while a role has no healthy worker
            body = exc.read()
        except OSError:
            return False
        return json.loads(body)["workers"].get(worker_id, {}).get("healthy", False)

    def remove_worker(self, role: str, drain_timeout_s: float = 60.0) -> str:
        """Stop one worker of `role` (the newest): the router routes nothing new to it, waits
        up to `drain_timeout_s` for what it holds to finish (the rest is re-driven elsewhere),
        then forgets it and the actor is killed. Refused for a role's last worker."""
        ids = [w for w in self.workers if self._specs[w].role == role]
        if len(ids) < 2:
            raise ValueError(f"{role} has {len(ids)} worker(s); a role keeps at least one")
        worker_id = max(ids, key=lambda w: int(w.rsplit("-", 1)[1]))
        deadline = time.monotonic() + drain_timeout_s
        while not self._get(self.router.retire.remote(worker_id), "retire a worker"):
            if time.monotonic() > deadline:
                log.warning(
                    "%s not drained in %.0f s: its requests are re-driven",
                    worker_id,
                    drain_timeout_s,
                )
                break
            time.sleep(0.2)
        self._get(self.router.remove_worker.remote(worker_id), "remove a worker")
        self._kill(worker_id)
        return worker_id

    # ---- stop -----------------------------------------------------------------------------

    def _kill(self, worker_id: str) -> None:
        ray = _import_ray()
        actor = self.workers.pop(worker_id)
        self._specs.pop(worker_id)
        self.placements.pop(worker_id, None)
        try:
            ray.get(actor.stop.remote(STOP_GRACE_S), timeout=STOP_GRACE_S + 1)
        except ray.exceptions.RayError:
            pass  # dead or hung: killed below either way
        ray.kill(actor, no_restart=True)

    def stop(self) -> None:
        try:
            ray = _import_ray()
        except ClusterError:
            return
        if not ray.is_initialized():
            return
        refs = [a.stop.remote(STOP_GRACE_S) for a in [*self.workers.values(), self.router] if a]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 1)
        for actor in [*self.workers.values(), self.router]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.workers, self.router = {}, None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        self._name_prefix = f"pdserve-{secrets.token_hex(4)}-"  # this cluster's actor names


def _probe(address: str, timeout_s: float) -> None:
    """A TCP connect to host:port (of `host:port` or `ray://host:port`): an address nothing
    listens at fails here at once, not after Ray's own retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(
            f"ray_address must be auto, host:port or ray://host:port, got {address!r}"
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(f"cannot reach Ray at {address}: {exc}") from None


def _local_clusters(ray: Any) -> tuple[str, str | None, set[str]]:
    """(Ray's address file, the address in it or None, the GCS addresses of the raylets
    running on this host): what `ray.init(address="auto")` chooses from (Ray's internals, of
    the pinned version)."""
    from ray._common.utils import get_ray_address_file
    from ray._private.services import find_bootstrap_address, find_gcs_addresses

    return get_ray_address_file(None), find_bootstrap_address(None), set(find_gcs_addresses())


def _check_auto(
    address_file: str, recorded: str | None, running: set[str], timeout_s: float
) -> None:
    """`auto` joins the cluster in Ray's address file, which the last `ray start` on this
    host wrote and any cluster's stop removes, whoever wrote it; without the file, Ray takes
    any cluster whose raylet runs here. So right after another cluster on this host stopped,
    `auto` may join a cluster chosen by chance, or one that is gone: refused here, naming
    what was found."""
    if recorded is None and len(running) > 1:
        raise ClusterError(
            f"ray_address auto: {address_file} is absent (a Ray cluster's stop removes it) and "
            f"this host runs {len(running)} Ray clusters ({', '.join(sorted(running))}); "
            "Ray would join one by chance: give the head's host:port"
        )
    if recorded is not None:
        try:
            _probe(recorded, timeout_s)
        except ClusterError as exc:
            raise ClusterError(
                f"ray_address auto: {address_file} names {recorded}, {exc}; a cluster that "
                "stopped without `ray stop` leaves it: give the head's host:port"
            ) from None


def _first_line(exc: BaseException) -> str:
    lines = [x for x in str(exc).splitlines() if x.strip()]
    return lines[-1] if lines else type(exc).__name__
