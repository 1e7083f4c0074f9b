"""What runs inside the Ray actors of a Ray placement: the router and one actor per worker.
Plain classes (`ray.py` wraps them with `ray.remote`), so importing this loads no ray.

A worker actor does everything in its constructor's thread, so that a restart (Ray runs the
constructor again) binds again on whatever node it landed on, tells the router its new address
and sends a fresh Ready. A restarted router actor binds the control address the driver chose
(the workers' sockets reconnect to it) and finds the workers by their actor names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
from typing import Any

from pdserve import envs
from pdserve.cluster.launcher import free_port
from pdserve.workers.spec import WorkerSpec

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 30.0  # a call into the router's event loop, or from a worker to the router
RECOVER_TIMEOUT_S = 120.0  # a restarted router: until it serves again (its tokenizer loads)


def _node() -> tuple[str, str]:
    """(Ray node id, the node's IP address) of this actor."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _fetch_keys(secret_refs: list) -> dict[str, Any]:
    """The cluster secret and keys, put in the object store by the driver. The ref travels
    inside a list, so Ray passes the ref and never records the value as an argument."""
    import ray

    return ray.get(secret_refs[0], timeout=CALL_TIMEOUT_S)


class WorkerActor:
    def __init__(self, spec_json: str, router: Any, log_level: str) -> None:
        # Transfer `auto` picks shm where the receiver's segment is the very file this process
        # sees (transfer/peer.py), not by Ray node: two nodes of one machine share /dev/shm,
        # while a node in a container or namespace with its own /dev/shm does not.
        self.node_id, self.node_ip = _node()
        spec = WorkerSpec.from_json(spec_json)
        logging.basicConfig(
            level=log_level.upper(),
            format=f"%(asctime)s {spec.worker_id} %(levelname)s %(name)s: %(message)s",
        )
        self.worker = None
        self._error: str | None = None
        self._started = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, args=(spec, router), daemon=True)
        self._thread.start()

    def _serve(self, spec: WorkerSpec, router: Any) -> None:
        import ray

        envs.set_worker_thread_wait()  # as workers/main.py: effective unless torch is loaded
        from pdserve.workers.worker import Worker

        try:
            address = f"tcp://{self.node_ip}:{free_port(self.node_ip)}"
            spec = dataclasses.replace(spec, ctrl_address=address, transfer_host=self.node_ip)
            # From the router, not an argument: Ray warns that a restartable actor's
            # arguments held in the object store may be gone when it restarts.
            secret_refs = ray.get(router.secret_refs.remote(), timeout=CALL_TIMEOUT_S)
            self.worker = Worker(spec, _fetch_keys(secret_refs)["secret"])
            endpoint = {"worker_id": spec.worker_id, "role": spec.role, "address": address}
            ray.get(router.add_worker.remote(endpoint), timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # reported by endpoint(); the driver ends the start
            self._error = f"{type(exc).__name__}: {exc}"
            log.exception("worker %s did not start", spec.worker_id)
            self._started.set()
            return
        self._started.set()
        try:
            self.worker.run()
        finally:
            if not self._stopping:  # the engine died: let Ray restart the whole actor
                log.error("worker %s stopped unexpectedly: exiting for a restart", spec.worker_id)
                os._exit(1)

    def placed(self) -> dict[str, str]:
        """Answers as soon as Ray has placed the actor (the worker may still be loading)."""
        return {"node_id": self.node_id, "node_ip": self.node_ip, "pid": str(os.getpid())}

    def endpoint(self, timeout_s: float) -> dict[str, str]:
        """This worker's control address, once it has bound it and told the router."""
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"worker not started after {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(self._error)
        spec = self.worker.spec
        return {"address": spec.ctrl_address, "role": spec.role, **self.placed()}

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        if self.worker is not None:
            self.worker.running = False
        self._thread.join(timeout_s)


class RouterActor:
    """The router's asyncio loop in a thread; other threads (Ray's method calls) reach the
    control plane only through `_call`, which runs a function on that loop."""

    def __init__(
        self, config_json: str, secret_refs: list, log_level: str, worker_prefix: str
    ) -> None:
        import ray

        self.node_id, self.node_ip = _node()
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s router %(name)s: %(message)s"
        )
        self.config_data = json.loads(config_json)
        self.ctrl_address = self.config_data.pop("ctrl_address")
        self._secret_refs = secret_refs
        self._endpoints: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plane = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._recover(worker_prefix)

    def _recover(self, worker_prefix: str) -> None:
        """A restart (Ray ran the constructor again): serve the workers that registered with
        the dead router, found by their actor names. The router sends each a Hello; they drop
        the dead router's requests and announce themselves again."""
        import ray

        for name in ray.util.list_named_actors():
            if not name.startswith(worker_prefix):
                continue
            try:
                found = ray.get(
                    ray.get_actor(name).endpoint.remote(CALL_TIMEOUT_S), timeout=CALL_TIMEOUT_S + 5
                )
            except (ray.exceptions.RayError, ValueError) as exc:
                # restarting (it registers itself once up) or gone
                log.warning("router restarted: %s not found now: %s", name, exc)
                continue
            worker_id = name.removeprefix(worker_prefix)
            self._endpoints[worker_id] = {
                "worker_id": worker_id,
                "role": found["role"],
                "address": found["address"],
            }
        log.warning("router restarted: serving %s again", sorted(self._endpoints))
        self.start(RECOVER_TIMEOUT_S)

    def address(self) -> dict[str, str]:
        return {"ctrl_address": self.ctrl_address, "node_id": self.node_id, "pid": str(os.getpid())}

    def secret_refs(self) -> list:
        return self._secret_refs

    def add_worker(self, endpoint: dict[str, str]) -> None:
        """A worker (re)started at `endpoint`: served from now on, at that address."""
        from pdserve.router.config import WorkerEndpoint

        with self._lock:
            self._endpoints[endpoint["worker_id"]] = endpoint
            plane = self._plane
        if plane is not None:
            self._call(plane.add_worker, WorkerEndpoint(**endpoint))

    def retire(self, worker_id: str) -> bool:
        return self._call(self._plane.retire, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._endpoints.pop(worker_id, None)
        self._call(self._plane.remove_worker, worker_id)

    def start(self, timeout_s: float) -> int:
        """Serve the API with the workers registered so far; returns the bound HTTP port."""
        from pdserve.router.config import RouterConfig
        from pdserve.schema import from_dict

        keys = _fetch_keys(self._secret_refs)
        with self._lock:
            workers = list(self._endpoints.values())
        data = {
            **self.config_data,
            "ctrl_address": self.ctrl_address,
            "workers": workers,
            "secret": keys["secret"],
            "api_key": keys["api_key"],
            "admin_key": keys["admin_key"],
        }
        config = from_dict(RouterConfig, data, "router config")
        started: dict[str, Any] = {}
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, started, ready))
        self._thread.start()
        if not ready.wait(timeout_s) or "error" in started:
            raise RuntimeError(f"router did not start: {started.get('error', 'timed out')}")
        # A worker that restarted while the router was starting registered meanwhile.
        with self._lock:
            late = [e for e in self._endpoints.values() if e not in workers]
        for endpoint in late:
            self.add_worker(endpoint)
        return started["port"]

    def _run(self, config: Any, started: dict[str, Any], ready: threading.Event) -> None:
        from pdserve.router.completions import STATE
        from pdserve.router.server import build_app, start_server

        async def serve() -> None:
            self._stop = asyncio.Event()
            try:
                app = build_app(config)
                runner, started["port"] = await start_server(app)
            except Exception as exc:  # the port is taken, the tokenizer cannot load, ...
                started["error"] = f"{type(exc).__name__}: {exc}"
                ready.set()
                return
            with self._lock:
                self._loop, self._plane = asyncio.get_running_loop(), app[STATE].plane
            ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()

        asyncio.run(serve())

    def _call(self, fn: Any, *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)

        assert self._loop is not None, "the router is not started"
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(CALL_TIMEOUT_S)

    def ping(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def stop(self, timeout_s: float) -> None:
        with self._lock:
            loop, self._plane = self._loop, None  # a worker restarting now is not served
        if loop is not None and self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
