"""A worker process's loop: control messages in, engine steps, token messages out.

    loop:  drain control messages  ->  advance KV transfers  ->  one engine step
           ->  Tokens out  ->  Stats every heartbeat interval (also the liveness signal)

The loop never blocks while there is work; when idle it waits on the control socket for a
few milliseconds only, so a KV transfer landing on a decode worker is noticed at once.
Every Abort is answered with Released; a KV wait past its deadline (spec.kv_*_timeout_s,
enforced in engine/kv_handoff.py) and a broken transfer are answered with Failed.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import zmq

from pdserve import messages as m
from pdserve.engine.engine import Engine
from pdserve.kvcache.dropping import PromptDrop
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from pdserve.workers.spec import WorkerSpec

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, spec: WorkerSpec, secret: bytes) -> None:
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        self.spec, self.secret = spec, secret
        self.engine = self._build_engine()
        self.ctx = zmq.Context()
        self.ctrl = self.ctx.socket(zmq.PULL)
        self.ctrl.bind(spec.ctrl_address)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 1000)
        self.out.connect(spec.router_address)
        self.running = True
        self._next_stats = 0.0
        self._stats: m.Stats | None = None  # the latest load snapshot, sent by the heartbeat
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True)

    def _build_engine(self) -> Engine:
        from pdserve.transfer.layout import KVLayout
        from pdserve.transfer.registry import make_receiver, make_sender

        spec = self.spec
        self.receiver = self.sender = None
        if spec.role == "decode":
            engine = self._decode_engine()
            kv = engine.runner.kv_cache
            self.receiver = make_receiver(
                spec.transfer_backend, kv, KVLayout.from_tensor(kv), self.secret,
                host=spec.transfer_host, pool_bytes=spec.transfer_buffer_bytes,
            )  # fmt: skip
            engine.attach_receiver(self.receiver)
            # Deadlines are set here until Engine.attach_* take them (engine.py is not ours).
            engine.decode_handoff.reserve_timeout_s = spec.kv_reserve_timeout_s
            engine.decode_handoff.land_timeout_s = spec.kv_land_timeout_s
            return engine
        engine = Engine(spec.engine, role=spec.role)
        if spec.role == "prefill":
            wire = engine.wire_source(spec.wire_kv_cache_dtype)
            kv = wire.kv if wire else engine.runner.kv_cache
            self.sender = make_sender(
                spec.transfer_backend, kv, KVLayout.from_tensor(kv), self.secret,
                bandwidth_bps=spec.transfer_bandwidth, pool_bytes=spec.transfer_buffer_bytes,
            )  # fmt: skip
            engine.attach_sender(self.sender, spec.transfer_mode, wire)
            engine.prefill_handoff.send_timeout_s = spec.kv_send_timeout_s
        return engine

    def _decode_engine(self) -> Engine:
        """A decode worker's KV pool lives in shared memory when shm may be used, so a
        prefill worker on the same host can write into it directly."""
        if self.spec.transfer_backend == "tcp":
            return Engine(self.spec.engine, role="decode")
        from pdserve.engine.model_runner import kv_cache_shape, num_kv_blocks
        from pdserve.model.config import ModelConfig
        from pdserve.model.kv_cache import storage_dtype
        from pdserve.model.loader import torch_dtype
        from pdserve.model.registry import resolve_model
        from pdserve.transfer.layout import KVLayout
        from pdserve.transfer.shm import create_shared_kv

        cfg = self.spec.engine
        model_dir = resolve_model(cfg.model)
        mc = ModelConfig.from_dir(model_dir)
        dtype = torch_dtype(cfg.device.dtype)
        num_blocks = num_kv_blocks(mc, cfg.cache, torch.device("cpu"), dtype)
        shape = kv_cache_shape(mc, num_blocks, cfg.cache.block_size, cfg.cache.kv_cache_dtype)
        kind = str(storage_dtype(cfg.cache.kv_cache_dtype, dtype)).removeprefix("torch.")
        num_layers, _, _, num_kv_heads, block_size, row = shape
        layout = KVLayout(num_layers, num_blocks, block_size, num_kv_heads, row, kind)
        kv, _ = create_shared_kv(layout)
        return Engine(cfg, model_dir, role="decode", kv_cache=kv)

    # ---- loop ------------------------------------------------------------------------

    def send(self, message) -> None:
        self.out.send(m.encode(message, self.secret))

    def run(self) -> None:
        e = self.engine
        self.send(
            m.Ready(
                self.spec.worker_id,
                self.spec.role,
                self.spec.engine.model,
                e.kv.num_blocks,
                e.kv.block_size,
                e.max_model_len,
            )
        )
        log.info("worker %s (%s) ready", self.spec.worker_id, self.spec.role)
        self._maybe_stats()
        self._heartbeat.start()
        try:
            while self.running:
                self._drain(timeout_ms=0 if e.has_unfinished_requests() else self._idle_wait_ms())
                for request_id, error in e.poll_transfers():
                    self.send(m.Failed(self.spec.worker_id, request_id, error))
                if e.has_unfinished_requests():
                    self._step()
                self._send_kv_events()
                self._maybe_stats()
        finally:
            self.close()

    def _idle_wait_ms(self) -> int:
        e = self.engine
        waiting_kv = (e.decode_handoff and e.decode_handoff.awaiting) or (
            e.prefill_handoff and e.prefill_handoff.sending
        )
        return 1 if waiting_kv else 20

    def _drain(self, timeout_ms: int) -> None:
        if not self.ctrl.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.ctrl.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(m.decode(frame, self.secret))
            except m.CodecError as exc:
                log.warning("dropped a control frame: %s", exc)

    def _handle(self, msg) -> None:
        log.debug("%s <- %s", self.spec.worker_id, type(msg).__name__)
        e, wid = self.engine, self.spec.worker_id
        if isinstance(msg, m.Abort):
            e.abort_request(msg.request_id)
            self.send(m.Released(wid, msg.request_id))
            return
        if isinstance(msg, m.Shutdown):
            self.running = False
            return
        if isinstance(msg, (m.Warmup, m.Unpin)):
            self._handle_warmup(msg)
            return
        if isinstance(msg, m.StartDecode):
            try:
                e.start_decode(
                    msg.request_id, msg.first_token_id, msg.num_dropped_tokens,
                    msg.kv_block_scores,
                )  # fmt: skip
            # KeyError: reservation already aborted, failed or timed out; ValueError: the
            # prefill's drop does not match it (the reservation is freed).
            except (KeyError, ValueError) as exc:
                self.send(m.Failed(wid, msg.request_id, str(exc)))
            return
        try:
            params = SamplingParams(**msg.sampling)
            if isinstance(msg, m.Generate):
                prompt = msg.prompt_token_ids + msg.output_token_ids
                if msg.output_token_ids:  # resumed: what was already produced counts
                    params = _remaining(params, len(msg.output_token_ids))
                e.add_request(msg.request_id, prompt, params, len(msg.output_token_ids))
            elif isinstance(msg, m.Reserve):
                r = e.reserve(msg.request_id, msg.prompt_token_ids, params)
                if r is None:
                    self.send(m.Rejected(wid, msg.request_id, "no free KV blocks", True))
                else:
                    d = r.drop
                    self.send(m.Reserved(
                        wid, msg.request_id, self.receiver.address(),
                        r.block_ids, r.num_cached_blocks,
                        d.num_keep_blocks if d else None, d.sink_blocks if d else 0,
                        d.recent_blocks if d else 0,
                    ))  # fmt: skip
            elif isinstance(msg, m.Prefill):
                drop = None
                if msg.kv_keep_blocks is not None:
                    drop = PromptDrop(msg.kv_keep_blocks, msg.kv_sink_blocks, msg.kv_recent_blocks)
                e.add_prefill(
                    msg.request_id, msg.prompt_token_ids, params, msg.kv_peer,
                    msg.kv_block_ids, msg.kv_skip_blocks, drop,
                )  # fmt: skip
            else:
                log.warning("%s: unexpected %s", wid, type(msg).__name__)
        except (ValueError, TypeError) as exc:
            self.send(m.Rejected(wid, getattr(msg, "request_id", ""), str(exc), False))

    def _handle_warmup(self, msg: m.Warmup | m.Unpin) -> None:
        """A Warmup is answered once its prefill is done (`_send_warmed`); an Unpin at once."""
        e, wid = self.engine, self.spec.worker_id
        try:
            if isinstance(msg, m.Warmup):
                e.warmup(msg.request_id, msg.prompt_token_ids, msg.pin)
                return
            e.validate_prompt(msg.prompt_token_ids)
            num_unpinned, num_cached = e.unpin(msg.prompt_token_ids)
        except (ValueError, TypeError) as exc:
            self.send(m.Rejected(wid, msg.request_id, str(exc), False))
            return
        n = len(msg.prompt_token_ids)
        self.send(m.WarmedUp(wid, msg.request_id, n, num_cached, num_unpinned))

    def _step(self) -> None:
        for out in self.engine.step():
            finished = out.finished and out.finish_reason is not FinishReason.HANDOFF
            self.send(m.Tokens(
                self.spec.worker_id, out.request_id, out.new_token_ids, finished,
                out.finish_reason.value if finished else None,
                out.num_prompt_tokens, out.num_cached_tokens,
                out.kv_num_dropped_tokens, out.kv_block_scores,
            ))  # fmt: skip
        self._send_warmed()

    def _send_warmed(self) -> None:
        wid = self.spec.worker_id
        for r in self.engine.drain_warmed():
            if r.error is not None:
                self.send(m.Failed(wid, r.request_id, r.error))
            else:
                self.send(m.WarmedUp(
                    wid, r.request_id, r.num_prompt_tokens, r.num_cached_tokens,
                    r.num_pinned_tokens,
                ))  # fmt: skip

    def _send_kv_events(self) -> None:
        stored, removed = self.engine.kv.pool.drain_events()
        if stored or removed:
            self.send(m.KVEvents(self.spec.worker_id, stored, removed))

    def _heartbeat_loop(self) -> None:
        """Liveness on its own thread and socket (ZMQ sockets are not thread-safe): a long
        prefill step (seconds on a CPU core) must not look like a dead worker. A hung engine
        is caught by the per-stage deadlines instead."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.router_address)
        try:
            while not self._stop_heartbeat.wait(self.spec.heartbeat_interval_s):
                if self._stats is not None:
                    sock.send(m.encode(self._stats, self.secret))
        finally:
            sock.close()

    def _maybe_stats(self) -> None:
        """Refresh the load snapshot (at most every tenth of the heartbeat interval)."""
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + self.spec.heartbeat_interval_s / 10
        s, kv, handoff = self.engine.scheduler, self.engine.kv, self.engine.decode_handoff
        queued = sum(r.num_tokens - r.num_computed_tokens for r in [*s.waiting, *s.running])
        cache = self.engine.cache_stats()
        self._stats = (m.Stats(
            self.spec.worker_id, self.spec.role, s.num_waiting, s.num_running,
            kv.num_free_blocks, kv.num_blocks, queued,
            self.sender.stats()["bytes_sent"] if self.sender else 0,
            self.receiver.stats().get("bytes_received", 0) if self.receiver else 0,
            handoff.num_skipped_blocks if handoff else 0,
            cache["tiers"], cache["moved_bytes"], cache["cached_prompt_tokens"],
            cache["computed_prompt_tokens"], cache["num_pinned_blocks"],
        ))  # fmt: skip

    def close(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join()
        for endpoint in (self.sender, self.receiver):
            if endpoint is not None:
                endpoint.close()
        self.ctrl.close(0)
        self.out.close()
        self.ctx.term()


def _remaining(params: SamplingParams, num_done: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_tokens=max(1, params.max_tokens - num_done))
