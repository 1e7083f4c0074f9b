"""The only code that starts processes: router + workers from one Pipeline.

`Cluster(pipeline)` is a context manager: entering starts every process, waits until the
router's /health says all workers are ready and returns the URL; leaving (or any worker
dying during start-up, or Ctrl-C) stops them all — SIGTERM, then SIGKILL after a grace
period. Once started, a process that dies is restarted with backoff (cluster/supervisor.py).
Children also get PR_SET_PDEATHSIG, so even a launcher killed with SIGKILL leaves no orphan
behind.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import logging
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve import envs
from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.memory_plan import check_memory
from pdserve.cluster.supervisor import Process, RestartPolicy, Supervisor
from pdserve.cluster.warmup_client import (
    WarmupError,
    ordered,
    report_lines,
    send_warmup,
    warmup_body,
)
from pdserve.workers.spec import WorkerSpec

log = logging.getLogger(__name__)
GRACE_S = 5.0
DEFAULT_RESTART = RestartPolicy()


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Placement:
    """Where the launcher starts one process, as on another host: `prefix` goes before its
    command (e.g. `ip netns exec <ns> ...` from `pdserve.testing.netns.Hosts.prefix_of`), and
    `host` is the address it is reached at: the router's control socket, or a worker's
    control socket and KV receiver. The router runs in the launcher's network (no prefix)."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


# A port picked here is bound later, by the process it is handed to (a worker's control
# socket, the router's). bind(0) draws from the kernel's ephemeral range, as every outgoing
# connection does, so in between a client's connect could take it (a 1P1D start failed with
# EADDRINUSE on such a port). Picks come from below that range, where no connect lands. A
# cluster picks its ports (router, control sockets) before any is bound, so two random picks
# could meet (1 in ~2,000 starts of a 1P1D cluster; a worker's control socket did, in a full
# test run): a pick is never handed out twice by one process (the last PICKS_KEPT).
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_PORTS_LOW = 20000
LISTEN_PORT_TRIES = 64
PICKS_KEPT = 1024
_picked: collections.deque[int] = collections.deque(maxlen=PICKS_KEPT)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a listener another process binds (module note)."""
    below = range(LISTEN_PORTS_LOW, _ephemeral_low())
    for port in secrets.SystemRandom().sample(below, min(LISTEN_PORT_TRIES, len(below))):
        if port in _picked:  # handed out already, perhaps not bound yet
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken, or lingering in TIME_WAIT: another
                continue
        _picked.append(port)
        return port
    with socket.socket() as s:  # no free port below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def worker_specs(p: Pipeline, router_address: str, kv_pool=None) -> list[WorkerSpec]:
    kv_pool = kv_pool or p.kv_pool
    if p.adaptive.enabled:
        # Every worker may run on the whole pool; the planner sends each its share on Ready.
        pool = p.adaptive_cpus()
        role = dataclasses.replace(p.workers or WorkerGroup(), threads=len(pool))
        engine = role.engine_config(p, kv_pool)
        roles = ["prefill"] + ["decode"] * (p.adaptive.workers - 1)
        layout = [(f"worker-{i}", name, engine, pool) for i, name in enumerate(roles)]
    else:
        layout = [
            (f"{name}-{i}", name, r.engine_config(p, kv_pool), r.cpus_of(i))
            for name, r in p.roles
            for i in range(r.num)
        ]
    return [
        WorkerSpec(
            worker_id=worker_id,
            role=role,
            engine=engine,
            adaptive=p.adaptive.enabled,
            ctrl_address=f"tcp://127.0.0.1:{free_port()}",
            router_address=router_address,
            cpus=cpus,
            kv_transfer=p.kv_transfer,
            wire_kv_cache_dtype=p.decode.kv_cache_dtype if p.decode else "auto",
            wire_dtype=p.decode.dtype_of(p.dtype) if p.decode else None,
        )
        for worker_id, role, engine, cpus in layout
    ]


def router_settings(
    p: Pipeline, specs: list[WorkerSpec], router_address: str, log_level: str
) -> dict:
    """The router's RouterConfig fields, as JSON data (its `--config-json`). `specs` may be
    empty: workers placed by Ray register themselves later."""
    adaptive = dataclasses.asdict(p.adaptive)
    if specs:  # the planner prices a local prefill in the workers' own chunks
        adaptive["prefill_chunk_tokens"] = specs[0].engine.scheduler.long_prefill_token_threshold
    return {
        "host": p.host,
        "port": p.port,
        "model": p.model,
        "ctrl_address": router_address,
        "workers": [
            {
                "worker_id": s.worker_id,
                "role": s.role,
                "address": s.ctrl_address,
                "cpus": s.cpus if s.adaptive else (),
            }
            for s in specs
        ],
        "policy": p.routing,
        "load_balancer": p.load_balancer,
        "log_level": log_level,
        "adaptive": adaptive,
        "cache_scope": p.cache_scope,
    }


class Cluster:
    """`restart`: how dead processes are restarted once started; None: they are not."""

    def __init__(
        self,
        pipeline: Pipeline,
        log_level: str = "INFO",
        restart: RestartPolicy | None = DEFAULT_RESTART,
        placements: Mapping[str, Placement] | None = None,
        report: Callable[[str], None] | None = None,
    ) -> None:
        """`placements`: by process name (router, prefill-0, ...); the others run here.
        `report`: where the memory plan's lines go (default: the log)."""
        self.pipeline, self.log_level, self.restart = pipeline, log_level, restart
        self.report = report or log.info
        self.placements = dict(placements or {})
        if self.placements.get("router", Placement()).prefix:
            raise ValueError("the router runs in the launcher's network: give it a host only")
        self.processes: list[Process] = []
        self.supervisor: Supervisor | None = None
        self._lock = threading.Lock()  # no process starts while stop() holds it
        self.url = f"http://{pipeline.host}:{pipeline.port}"
        # The launcher warms `warmup_prompts` itself, so a cluster always has an admin key.
        self.admin_key = pipeline.admin_key or secrets.token_urlsafe(24)

    def __enter__(self) -> str:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        p = self.pipeline
        from pdserve.model.registry import resolve_model

        check_memory(p, worker_specs(p, router_address=""), self.report)
        # Convert once here, not in every worker at the same time.
        resolve_model(p.model, None, p.gguf_fp32_max_bytes)
        secret = secrets.token_bytes(32)
        router_host = self.placements.get("router", Placement()).host
        router_address = f"tcp://{router_host}:{free_port(router_host)}"
        kv_pool, redis_password = p.kv_pool, None
        if kv_pool.redis_url == "local":
            redis_url, redis_password = self._start_redis()
            kv_pool = dataclasses.replace(kv_pool, redis_url=redis_url)
        specs = [self._placed(s) for s in worker_specs(p, router_address, kv_pool)]
        for spec in specs:
            self._spawn(
                spec.worker_id,
                ["pdserve.workers.main", "--spec", spec.to_json(), "--log-level", self.log_level],
                envs.child_env(secret, redis_password=redis_password),
            )
        router = router_settings(p, specs, router_address, self.log_level)
        # The keys go in the environment, like the secret: never on a command line.
        self._spawn(
            "router",
            ["pdserve.router.main", "--config-json", json.dumps(router)],
            envs.child_env(secret, p.api_key, self.admin_key),
        )
        self._wait_healthy(p.startup_timeout_s)
        if p.warmup_prompts:
            self._warmup(list(p.warmup_prompts))
        if self.restart is not None:
            self.supervisor = Supervisor(self.processes, self.restart, self._lock)
            self.supervisor.start()

    def _warmup(self, prompts: list) -> None:
        """Prefill and pin the pipeline's warm-up prompts on every prefill-capable worker;
        a prompt any worker could not warm is an error of the deployment's config."""
        self._wait_healthy(self.pipeline.startup_timeout_s, every_worker=True)
        body = warmup_body(prompts, shared=self.pipeline.warmup_shared)
        try:
            answer = send_warmup(
                self.url, body, self.admin_key, timeout_s=self.pipeline.startup_timeout_s
            )
        except WarmupError as exc:
            raise ClusterError(f"warm-up failed: {exc}") from None
        lines, num_errors = report_lines(answer, ordered(body))
        for line in lines:
            log.info("warm-up: %s", line)
        if num_errors:
            raise ClusterError("warm-up failed: " + next(x for x in lines if " error: " in x))

    def _start_redis(self) -> tuple[str, str]:
        """A private redis-server for a one-host cluster (L4), LRU-evicting at 1 GiB, behind
        a generated password; its URL (without the password) and the password. The config
        goes in on stdin (`redis-server -`), so the password is on no command line."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError(
                "kv_pool.redis_url is 'local' but redis-server is not installed "
                "(apt-get install redis-server)"
            )
        port, password = free_port(), secrets.token_hex(32)
        config = (
            f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\nmaxmemory 1gb\n'
            f"maxmemory-policy allkeys-lru\nrequirepass {password}\n"
        )

        def launch() -> subprocess.Popen:
            popen = subprocess.Popen(
                [binary, "-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
            popen.stdin.write(config.encode())
            popen.stdin.close()
            return popen

        self.processes.append(Process("redis", launch, launch()))
        return f"redis://127.0.0.1:{port}/0", password

    def _placed(self, spec: WorkerSpec) -> WorkerSpec:
        """The spec with its worker's placement's host; the port stays (a fresh network
        namespace has every port free)."""
        placement = self.placements.get(spec.worker_id)
        if placement is None:
            return spec
        port = spec.ctrl_address.rsplit(":", 1)[1]
        address = f"tcp://{placement.host}:{port}"
        return dataclasses.replace(spec, ctrl_address=address, transfer_host=placement.host)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        prefix = self.placements.get(name, Placement()).prefix
        cmd = [*prefix, sys.executable, "-m", *args]

        def launch() -> subprocess.Popen:
            return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)

        self.processes.append(Process(name, launch, launch()))

    def _wait_healthy(self, timeout_s: float, every_worker: bool = False) -> None:
        """Until /health is 200 (each role has a ready worker) or, with `every_worker` (as
        warm-up wants), every worker is ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    workers = json.loads(resp.read())["workers"]
                if not every_worker or all(w["healthy"] for w in workers.values()):
                    return
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        what = "every worker" if every_worker else "the cluster"
        raise ClusterError(f"{what} not healthy after {timeout_s:.0f} s ({self.url}/health)")

    def check_alive(self) -> None:
        """During start: any process that died. Once supervised: the supervisor gave up."""
        if self.supervisor is not None:
            if self.supervisor.failure is not None:
                raise ClusterError(self.supervisor.failure)
            return
        for proc in self.processes:
            code = proc.popen.poll()
            if code is not None:
                raise ClusterError(f"{proc.name} {proc.exit_reason(code)} (its log is above)")
            proc.sample_rss()

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        with self._lock:  # a restart in progress finishes first; none starts after
            self._terminate()

    def _terminate(self) -> None:
        for proc in self.processes:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for proc in self.processes:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", proc.name, GRACE_S)
                proc.popen.kill()
                proc.popen.wait()
        self.processes = []
