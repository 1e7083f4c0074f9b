"""A worker process's loop: control messages in, engine steps, token messages out.

    loop:  drain control messages  ->  advance KV transfers  ->  one engine step
           ->  Tokens out  ->  Stats every heartbeat interval (also the liveness signal)

The loop never blocks while there is work; when idle it waits on the control socket for a
few milliseconds only, so a KV transfer landing on a decode worker is noticed at once.
Every Abort is answered with Released; a KV wait past its deadline (spec.kv_*_timeout_s,
enforced in engine/roles/) and a broken transfer are answered with Failed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch
import zmq

from pdserve import envs
from pdserve import messages as m
from pdserve.engine.engine import Engine, RequestOutput
from pdserve.engine.roles.base import KVDestination, Role
from pdserve.engine.roles.collocated import CollocatedRole
from pdserve.engine.wire_source import WireSource
from pdserve.kvcache.dropping import PromptDrop
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.receiver import SocketKVReceiver
from pdserve.transfer.sender import SocketKVSender
from pdserve.transfer.shm import shared_kv_name, unlink_shared_kv
from pdserve.workers.cores import Cores, pin_threads
from pdserve.workers.memory_report import MemoryReport
from pdserve.workers.spec import STATS_PER_HEARTBEAT, WorkerSpec
from pdserve.workers.step_report import StepLog, StepTrace

log = logging.getLogger(__name__)
KV_EVENTS_PER_MESSAGE = 4096  # block hashes (9 bytes each) in one KVEvents, stored and removed


class Worker:
    def __init__(self, spec: WorkerSpec, secret: bytes) -> None:
        if spec.cpus:
            pin_threads(spec.cpus)
        self.spec, self.secret = spec, secret
        # A decode worker's KV pool lives in shared memory when shm may be used, so a
        # prefill worker on the same host writes into it directly. An adaptive worker may
        # become a decode worker, and prefills and decodes whatever its role.
        backend = spec.kv_transfer.backend
        shm = (spec.role == "decode" or spec.adaptive) and backend in ("auto", "shm")
        kernels = "collocated" if spec.adaptive else spec.role
        self.engine = Engine(spec.engine, kernels=kernels, allocate_kv=shared_kv if shm else None)
        self.cores = Cores(spec.cpus or os.sched_getaffinity(0))
        self.memory = MemoryReport(self.engine.runner.model, self.engine.runner.kv_cache)
        self.steps = StepLog(spec.worker_id) if spec.adaptive else None
        trace_dir = envs.step_trace_dir()
        self.trace = StepTrace(trace_dir, spec.worker_id) if trace_dir else None
        self.sender: SocketKVSender | None = None
        self.receiver: SocketKVReceiver | None = None
        self._wire: WireSource | None = None
        self.engine.switch_role(self._role(spec.role))
        self._next_role: Role | None = None  # switching to it once drained
        self.ctx = zmq.Context()
        self.ctrl = self.ctx.socket(zmq.PULL)
        # The largest message: a Generate or Prefill of a whole context (messages.py).
        self.ctrl.setsockopt(zmq.MAXMSGSIZE, m.max_frame_bytes(self.engine.max_model_len))
        self.ctrl.bind(spec.ctrl_address)
        self.signer, self.verifier = m.Signer(secret), m.Verifier(secret)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 1000)
        self.out.connect(spec.router_address)
        self.running = True
        self._next_stats = 0.0
        self._num_prompts_received = 0  # Generate and Prefill taken in (Stats)
        self._stats: m.Stats | None = None  # the latest load snapshot, sent by the heartbeat
        self._step_started: float | None = None  # monotonic, while an engine step runs
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True)

    def _role(self, name: str) -> Role:
        """The role object `name` on this worker's engine; a transfer endpoint is started
        the first time a role needs it and kept (a worker may switch back)."""
        from pdserve.transfer import make_receiver, make_sender
        from pdserve.transfer.layout import KVLayout

        e, spec, transfer = self.engine, self.spec, self.spec.kv_transfer
        if name == "decode":
            if self.receiver is None:
                kv = e.runner.kv_cache
                self.receiver = make_receiver(
                    transfer.backend,
                    kv,
                    KVLayout.from_tensor(kv),
                    self.secret,
                    host=spec.transfer_host,
                    pool_bytes=transfer.buffer_pool_size,
                )
            return e.decode_role(self.receiver, transfer.reserve_timeout_s, transfer.land_timeout_s)
        if name == "prefill":
            if self.sender is None:
                self._wire = e.wire_source(spec.wire_kv_cache_dtype, spec.wire_dtype)
                kv = self._wire.kv if self._wire else e.runner.kv_cache
                self.sender = make_sender(
                    transfer.backend,
                    kv,
                    KVLayout.from_tensor(kv),
                    self.secret,
                    bandwidth_bps=transfer.bandwidth,
                    pool_bytes=transfer.buffer_pool_size,
                )
            return e.prefill_role(self.sender, transfer.mode, self._wire, transfer.send_timeout_s)
        if name == "collocated":
            return CollocatedRole()
        raise ValueError(f"role must be one of {m.ROLES}, got {name!r}")

    # ---- role switch -----------------------------------------------------------------

    def _begin_switch(self, name: str) -> None:
        """SwitchRole: take no new work from now on (it is refused as retryable), drain,
        then switch (`_maybe_switch`). A role this worker cannot take is refused at once,
        by re-announcing the current one."""
        try:
            self._next_role = self._role(name)
        except (ValueError, OSError) as exc:  # an unknown role, an endpoint that cannot start
            log.warning("%s: cannot switch to %s: %s", self.spec.worker_id, name, exc)
            self._announce()
            return
        log.info(
            "%s: draining to switch from %s to %s", self.spec.worker_id, self.engine.role.name, name
        )

    def _maybe_switch(self) -> None:
        e = self.engine
        if self._next_role is None or e.has_unfinished_requests() or e.role.num_in_flight():
            return
        e.switch_role(self._next_role)
        self._next_role = None
        self._announce()

    # ---- loop ------------------------------------------------------------------------

    def send(self, message) -> None:
        self.out.send(self.signer.encode(message))

    def _announce(self, hello: bool = False) -> None:
        from pdserve.transfer.layout import KVLayout

        # The router counts its Generate and Prefill sends from each Ready (Stats).
        self._num_prompts_received, self._next_stats = 0, 0.0
        e = self.engine
        layout = KVLayout.from_tensor(e.runner.kv_cache)
        self.send(
            m.Ready(
                self.spec.worker_id,
                e.role.name,
                self.spec.engine.model,
                e.kv.num_blocks,
                e.kv.block_size,
                e.max_model_len,
                self.cores.cpus,
                self.cores.threads,
                layout.num_layers * layout.block_bytes,
                self.signer.session.hex(),
                hello,
            )
        )
        # A router's Hello is answered with what the start said: a debug line, not a second one.
        log.log(
            logging.DEBUG if hello else logging.INFO,
            "worker %s (%s) ready%s",
            self.spec.worker_id,
            e.role.name,
            " (to a router's hello)" if hello else "",
        )

    def run(self) -> None:
        e = self.engine
        self._announce()
        self._maybe_stats()
        self._heartbeat.start()
        try:
            while self.running:
                runnable = e.has_unfinished_requests() and not self.cores.parked
                self._drain(timeout_ms=0 if runnable else self._idle_wait_ms())
                for request_id, error in e.role.poll():
                    self.send(m.Failed(self.spec.worker_id, request_id, error))
                if e.has_unfinished_requests() and not self.cores.parked:
                    self._step()
                self._maybe_switch()
                self._send_kv_events()
                self._maybe_stats()
                if self.steps is not None and (report := self.steps.due(time.perf_counter())):
                    self.send(report)
        finally:
            self.close()

    def _idle_wait_ms(self) -> int:
        return 1 if self.engine.role.num_in_flight() else 20

    def _drain(self, timeout_ms: int) -> None:
        if not self.ctrl.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.ctrl.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(self.verifier.decode(frame))
            except m.CodecError as exc:
                log.warning("dropped a control frame: %s", exc)

    def _handle(self, msg) -> None:
        log.debug(
            "%s <- %s %s", self.spec.worker_id, type(msg).__name__, getattr(msg, "request_id", "")
        )
        e, wid = self.engine, self.spec.worker_id
        if isinstance(msg, (m.Generate, m.Prefill)):  # whatever becomes of it (Stats)
            self._num_prompts_received += 1
        if isinstance(msg, m.Abort):
            e.abort_request(msg.request_id)
            self.send(m.Released(wid, msg.request_id))
            return
        if isinstance(msg, m.Shutdown):
            self.running = False
            return
        if isinstance(msg, m.Hello):  # a new router: what this worker holds is nobody's now
            num_aborted = e.abort_all()
            if num_aborted:
                log.warning("%s: a new router; aborted %d requests", wid, num_aborted)
            self._announce(hello=True)
            return
        if isinstance(msg, m.Unpin):
            self._unpin(msg)
            return
        if isinstance(msg, m.SwitchRole):
            self._begin_switch(msg.role)
            return
        if isinstance(msg, m.SetCores):
            self._set_cores(msg)
            return
        if self._next_role is not None and isinstance(msg, (m.Generate, m.Reserve, m.Prefill)):
            reason = f"switching to the {self._next_role.name} role"
            self.send(m.Rejected(wid, msg.request_id, reason, True))
            return
        if isinstance(msg, m.StartDecode):
            try:
                e.role.start(msg.request_id, msg.first_token_id)
            except KeyError as exc:  # the reservation was aborted, failed or timed out
                self.send(m.Failed(wid, msg.request_id, str(exc)))
            return
        try:
            self._admit(msg, SamplingParams(**msg.sampling))
        except (ValueError, TypeError) as exc:
            self.send(m.Rejected(wid, getattr(msg, "request_id", ""), str(exc), False))

    def _admit(self, msg, params: SamplingParams) -> None:
        """A request for the engine: Generate (collocated or decode), Reserve (decode) or
        Prefill (prefill). ValueError or TypeError: refused (the caller answers Rejected)."""
        e, wid = self.engine, self.spec.worker_id
        if isinstance(msg, m.Generate):
            prompt = msg.prompt_token_ids + msg.output_token_ids
            if msg.output_token_ids:  # resumed: what was already produced counts
                num_left = max(1, params.max_tokens - len(msg.output_token_ids))
                params = dataclasses.replace(params, max_tokens=num_left)
            e.add_request(
                msg.request_id,
                prompt,
                params,
                len(msg.output_token_ids),
                msg.pin,
                msg.prefill_chunk_tokens,
                msg.cache_salt,
                msg.stall_budget_s,
            )
        elif isinstance(msg, m.Reserve):
            r = e.reserve(msg.request_id, msg.prompt_token_ids, params, msg.cache_salt)
            if r is None:
                self.send(m.Rejected(wid, msg.request_id, "no free KV blocks", True))
            else:
                kept = dataclasses.astuple(r.drop) if r.drop else ()  # num_keep, sink, recent
                self.send(
                    m.Reserved(
                        wid,
                        msg.request_id,
                        self.receiver.address(),
                        r.block_ids,
                        r.num_cached_blocks,
                        *kept,
                    )
                )
        elif isinstance(msg, m.Prefill):
            drop = None
            if msg.num_keep_blocks is not None:
                drop = PromptDrop(msg.num_keep_blocks, msg.sink_blocks, msg.recent_blocks)
            dest = KVDestination(msg.peer, msg.block_ids, msg.num_cached_blocks, drop)
            e.add_prefill(msg.request_id, msg.prompt_token_ids, params, dest, msg.cache_salt)
        else:
            log.warning("%s: unexpected %s", wid, type(msg).__name__)

    def _unpin(self, msg: m.Unpin) -> None:
        e, wid = self.engine, self.spec.worker_id
        try:
            e.validate_prompt(msg.prompt_token_ids, msg.cache_salt)
            num_unpinned, num_cached = e.unpin(msg.prompt_token_ids, msg.cache_salt)
        except (ValueError, TypeError) as exc:
            self.send(m.Rejected(wid, msg.request_id, str(exc), False))
            return
        n = len(msg.prompt_token_ids)
        self.send(m.Unpinned(wid, msg.request_id, n, num_cached, num_unpinned))

    def _set_cores(self, msg: m.SetCores) -> None:
        """Between steps (messages are drained only there): run on the cores given, or
        refuse them, answering CoresSet with the cores in effect either way."""
        started, c = time.perf_counter(), self.cores
        refusal = c.refusal(msg.cpus, msg.threads)
        if refusal is None:
            c.apply(msg.cpus, msg.threads)
            log.debug("%s: on cpus %s with %d threads", self.spec.worker_id, c.cpus, c.threads)
        else:
            log.warning("%s: SetCores refused: %s", self.spec.worker_id, refusal)
        self.send(m.CoresSet(self.spec.worker_id, c.cpus, c.threads, time.perf_counter() - started))

    def _step(self) -> None:
        wid = self.spec.worker_id
        started, cpu = time.perf_counter(), time.thread_time()
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self._step_started = None
        now = time.perf_counter()
        if self.steps is not None:
            self.steps.record(self.engine.last_shape, self.cores.threads, now - started, now)
        if self.trace is not None:
            seconds = now - started  # its start in Unix time, read only while tracing:
            self.trace.record(
                self.engine.last_shape,
                self.cores.threads,
                time.time() - seconds,
                seconds,
                time.thread_time() - cpu,
            )
        for out in outputs:
            if out.error is not None:
                self.send(m.Failed(wid, out.request_id, out.error))
                continue
            finished = out.finished and out.finish_reason is not FinishReason.HANDOFF
            self.send(
                m.Tokens(
                    wid,
                    out.request_id,
                    out.new_token_ids,
                    finished,
                    out.finish_reason.value if finished else None,
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                    num_pinned_tokens=out.num_pinned_tokens,
                    stamps=out.stamps,
                    logprobs=self._logprobs(out),
                    prompt_logprobs=out.prompt_logprobs,
                )
            )

    def _logprobs(self, out: RequestOutput) -> list[list[float | list]] | None:
        """The step's logprobs of `out`'s token, when its request asked for them."""
        found = self.engine.runner.logprobs.get(out.request_id)
        return None if found is None or not out.new_token_ids else [found]

    def _send_kv_events(self) -> None:
        stored, removed = self.engine.kv.pool.drain_events()
        # In slices, so a large pool's churn stays far below the router's message size bound.
        for i in range(0, max(len(stored), len(removed)), KV_EVENTS_PER_MESSAGE):
            j = i + KV_EVENTS_PER_MESSAGE
            self.send(m.KVEvents(self.spec.worker_id, stored[i:j], removed[i:j]))

    def _heartbeat_loop(self) -> None:
        """Liveness on its own thread and socket (ZMQ sockets are not thread-safe): a long
        prefill step (seconds on a CPU core) must not look like a dead worker. A hung engine
        is caught by the per-stage deadlines instead."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.router_address)
        signer = m.Signer(self.secret)  # its own session: its frames interleave with `out`'s
        try:
            while not self._stop_heartbeat.wait(self.spec.heartbeat_interval_s):
                self.memory.refresh()  # here, not on the step loop (MemoryReport)
                stats, started = self._stats, self._step_started
                if stats is None:
                    continue
                if started is not None:
                    stats = dataclasses.replace(stats, step_running_s=time.monotonic() - started)
                sock.send(signer.encode(stats))
        finally:
            sock.close()

    def _maybe_stats(self) -> None:
        """Refresh the load snapshot (at most every tenth of the heartbeat interval)."""
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + self.spec.heartbeat_interval_s / STATS_PER_HEARTBEAT
        s, kv = self.engine.scheduler, self.engine.kv
        cache = self.engine.cache_stats()
        self._stats = m.Stats(
            self.spec.worker_id,
            self.engine.role.name,
            s.num_waiting,
            s.num_running,
            kv.num_free_blocks,
            kv.num_blocks,
            s.num_queued_tokens,
            self._num_prompts_received,
            kv_tiers=cache["tiers"],
            kv_moved_bytes=cache["moved_bytes"],
            num_cached_prompt_tokens=cache["cached_prompt_tokens"],
            num_computed_prompt_tokens=cache["computed_prompt_tokens"],
            num_pinned_blocks=cache["num_pinned_blocks"],
            **self.engine.role.transfer_stats(),
            **self.memory.fields(),
            **self.engine.scheduler.stall_guard.fields(),
        )

    def close(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join()
        for endpoint in (self.sender, self.receiver):
            if endpoint is not None:
                endpoint.close()
        if name := shared_kv_name(self.engine.runner.kv_cache):  # no receiver unlinked it
            unlink_shared_kv(name)
        if self.trace is not None:
            self.trace.close()
        self.ctrl.close(0)
        self.out.close()
        self.ctx.term()


def shared_kv(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A KV pool in /dev/shm (the engine's `allocate_kv`): the receiver offers it to
    prefill workers on this host, which write into it directly."""
    from pdserve.transfer.layout import KVLayout
    from pdserve.transfer.shm import create_shared_kv

    num_layers, num_blocks, _, num_kv_heads, block_size, row = shape
    kind = str(dtype).removeprefix("torch.")
    layout = KVLayout(num_layers, num_blocks, block_size, num_kv_heads, row, kind)
    return create_shared_kv(layout)[0]
