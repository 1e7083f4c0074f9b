"""The engine: one per worker process, whatever its role. Token ids in, token ids out.

What differs by role is one object (engine/roles/, docs/roles.md): `collocated` runs
requests end to end; `prefill` runs them to their first token and streams their KV to a
decode worker; `decode` reserves blocks, receives KV and continues from the first token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.costmodel.step_cost import StepShape
from pdserve.engine import pins
from pdserve.engine.heap import keep_freed_memory
from pdserve.engine.kv_budget import KVBudget
from pdserve.engine.kv_offload import KVOffload
from pdserve.engine.memory import activation_bytes
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.roles.base import KVDestination, KVReservation, Role
from pdserve.engine.roles.collocated import CollocatedRole
from pdserve.engine.roles.decode import LAND_TIMEOUT_S, RESERVE_TIMEOUT_S, DecodeRole
from pdserve.engine.roles.prefill import SEND_TIMEOUT_S, PrefillRole
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.wire_source import WireSource
from pdserve.kvcache.manager import KVCacheManager
from pdserve.model.config import ModelConfig
from pdserve.model.loader import torch_dtype
from pdserve.request import FinishReason, Request
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.receiver import SocketKVReceiver
from pdserve.transfer.sender import SocketKVSender

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # A finished warm-up (`Request.pin` set): `num_cached_tokens` then counts the prompt's
    # tokens the cache holds now (full blocks), this how many of them are pinned; `error`
    # when pinning was refused after the prefill (the prompt stays cached, unpinned).
    num_pinned_tokens: int | None = None
    error: str | None = None
    stamps: dict[str, float] | None = None  # Request.stamps taken since its last output
    prompt_logprobs: list[Any] | None = None  # Request.prompt_logprobs, with the first token


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path | None = None,
        kernels: str = "collocated",
        allocate_kv: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        """Starts in the collocated role (`switch_role` to another). `kernels`: the role
        whose CPU linear kernels to prepare (model_runner.py); `allocate_kv(shape, dtype)`:
        where the KV pool lives (e.g. shared memory a prefill worker writes into)."""
        from pdserve.model.registry import resolve_model

        self.config = config
        self.model_dir = Path(model_dir) if model_dir else None
        if self.model_dir is None:
            self.model_dir = resolve_model(config.model, None, config.gguf_fp32_max_bytes)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.runner = ModelRunner(
            self.model_dir,
            self.model_config,
            config.cache,
            config.device,
            config.seed,
            allocate_kv,
            kernels,
        )
        if self.runner.device.type == "cpu":  # after loading: the loader's frees go back
            keep_freed_memory(activation_bytes(self.model_config, config))
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.cache.block_size,
            model_id=config.model,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            max_pinned_fraction=config.cache.max_pinned_fraction,
        )
        self.budget = KVBudget(config.cache, self.kv, self.runner)  # token dropping
        self.max_model_len = self._max_model_len()
        self.runner.model.keep_rope_positions(self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.role: Role = CollocatedRole()
        self.offload = self._build_offload()
        self.loading: dict[str, tuple[Request, Future]] = {}  # waiting on a tier lookup
        self.last_shape = StepShape()  # what the last step computed (the cost model's units)

    def _build_offload(self) -> KVOffload | None:
        from pdserve.kvstore.base import EntryFormat
        from pdserve.kvstore.config import build_tiered_store
        from pdserve.transfer.layout import KVLayout

        if not self.config.kvstore.enabled or not self.config.cache.enable_prefix_caching:
            return None
        fmt = EntryFormat.from_layout(self.config.model, KVLayout.from_tensor(self.runner.kv_cache))
        store = build_tiered_store(self.config.kvstore, fmt)
        return KVOffload(store, self.kv, self.runner.kv_cache)

    def _max_model_len(self) -> int:
        """The model's context, capped by what the KV cache can hold, so that any admitted
        request fits on its own (preemption can always make room for it)."""
        limit = self.config.scheduler.max_model_len or self.model_config.max_position_embeddings
        if limit > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {limit} exceeds the model's context of "
                f"{self.model_config.max_position_embeddings} tokens"
            )
        capacity = self.runner.num_blocks * self.config.cache.block_size
        if capacity < limit:
            log.warning("KV cache holds %d tokens: max_model_len capped from %d", capacity, limit)
        return min(limit, capacity)

    # ---- roles ---------------------------------------------------------------------------

    def switch_role(self, role: Role) -> None:
        """Take `role` (built with this engine's scheduler and KV manager); only between
        requests, so no request ever sees two roles."""
        if self.has_unfinished_requests() or self.role.num_in_flight():
            raise RuntimeError(f"cannot switch from {self.role.name} to {role.name}: busy")
        self.role = role
        self.scheduler.preallocate_prompt = role.preallocate_prompt

    def prefill_role(
        self,
        sender: SocketKVSender,
        mode: str,
        wire: WireSource | None = None,
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> PrefillRole:
        """The prefill role on this engine's parts; `wire` when the decode side stores
        another KV dtype."""
        runner = self.runner
        return PrefillRole(
            sender,
            self.scheduler,
            self.kv,
            self.model_config.num_layers,
            mode,
            lambda request: runner.scores_of(request).tolist(),
            wire.convert if wire is not None else None,
            send_timeout_s,
        )

    def decode_role(
        self,
        receiver: SocketKVReceiver,
        reserve_timeout_s: float = RESERVE_TIMEOUT_S,
        land_timeout_s: float = LAND_TIMEOUT_S,
    ) -> DecodeRole:
        """The decode role on this engine's parts."""
        return DecodeRole(
            receiver,
            self.scheduler,
            self.kv,
            self.runner.install_scores,
            reserve_timeout_s,
            land_timeout_s,
        )

    def wire_source(self, kv_cache_dtype: str, dtype: str | None = None) -> WireSource | None:
        """A shadow pool in the decode side's KV format (its `kv_cache_dtype` and model
        `dtype`, None: this engine's), or None when that is this engine's own."""
        wire_dtype = torch_dtype(dtype) if dtype else self.runner.dtype
        if kv_cache_dtype == self.config.cache.kv_cache_dtype and wire_dtype == self.runner.dtype:
            return None
        return WireSource(self.runner.layer_caches, kv_cache_dtype, self.runner.dtype, wire_dtype)

    def add_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        destination: KVDestination,
        cache_salt: str = "",
    ) -> Request:
        """Prefill role: compute the prompt, send its KV to `destination` (all but the
        blocks the decode worker already holds; with a drop, only the blocks it keeps),
        sample the first token. `cache_salt`: its cache scope (`Request.cache_salt`)."""
        request = self._new_request(request_id, prompt_token_ids, params, True, cache_salt)
        self.role.add_prefill(request, destination)
        self._enqueue(request)
        return request

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> KVReservation | None:
        """Decode role: reserve blocks for a prompt's KV (taking the prefix this worker
        already caches); None when they do not fit now. A prompt over the request's KV
        budget gets only the blocks it keeps (`KVReservation.drop`): this worker decides
        what it holds, the prefill worker drops the rest before sending."""
        request = self._new_request(request_id, prompt_token_ids, params, cache_salt=cache_salt)
        reservation = self.role.reserve(request, self.budget.prompt_drop(request))
        if self.offload is not None:
            # The reservation may have evicted cached blocks: save what they hold now, since
            # a prefill may start writing into them as soon as this returns.
            self.offload.save_evicted()
        return reservation

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        num_prior_output_tokens: int = 0,
        pin: bool | None = None,
        prefill_chunk_tokens: int | None = None,
        cache_salt: str = "",
        stall_budget_s: float | None = None,
    ) -> Request:
        """`num_prior_output_tokens`: the prompt's last tokens were produced by an earlier
        attempt of this request (resumed after a worker died). `pin`: a cache warm-up
        (`Request.pin`, with `WARMUP_PARAMS`), refused up front (ValueError) when it cannot
        pin: decode role, caching off, pinned share full. `prefill_chunk_tokens`: the most
        prefill tokens of any step the request is in (`Request.prefill_chunk_tokens`).
        `cache_salt`: the cache scope its blocks are hashed in (`Request.cache_salt`).
        `stall_budget_s`: caps its prefill beside decodes (`Request.stall_budget_s`)."""
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, not {prefill_chunk_tokens}")
        if stall_budget_s is not None and not stall_budget_s > 0:
            raise ValueError(f"stall_budget_s must be > 0, not {stall_budget_s}")
        request = self._new_request(request_id, prompt_token_ids, params, cache_salt=cache_salt)
        if pin is not None:
            pins.check_pin(self.kv, self.role, prompt_token_ids, pin, cache_salt)
        request.num_prior_output_tokens, request.pin = num_prior_output_tokens, pin
        request.prefill_chunk_tokens = prefill_chunk_tokens
        request.stall_budget_s = stall_budget_s
        self._enqueue(request)
        return request

    def unpin(self, prompt_token_ids: list[int], cache_salt: str = "") -> tuple[int, int]:
        """Release a prompt's pinned blocks, warmed in cache scope `cache_salt`, to the LRU
        queue: (tokens unpinned, tokens still cached)."""
        return pins.unpin(self.kv, prompt_token_ids, cache_salt)

    def cache_stats(self) -> dict[str, Any]:
        """Cumulative prefix-cache counts per tier (engine/cache_stats.py), for metrics."""
        from pdserve.engine.cache_stats import cache_stats

        return cache_stats(self.kv, self.offload)

    def _enqueue(self, request: Request) -> None:
        """To the scheduler, after a lookup in the tiers below L1 when there are any."""
        rid = request.request_id
        if rid in self.scheduler.requests or rid in self.loading:
            raise ValueError(f"request id {rid!r} is already in use")
        if self.offload is None:
            self.scheduler.add_request(request)
        else:
            self.loading[rid] = (request, self.offload.lookup(request))

    def _admit_loaded(self) -> None:
        for rid, (request, lookup) in list(self.loading.items()):
            if lookup.done():
                del self.loading[rid]
                if lookup.exception() is None:
                    self.offload.install(request, lookup.result())
                self.scheduler.add_request(request)

    def _new_request(
        self, request_id, prompt_token_ids, params, prefill_only=False, cache_salt=""
    ) -> Request:
        self.validate_prompt(prompt_token_ids, cache_salt)
        budget = params.kv_budget_tokens or self.config.cache.kv_budget_tokens
        if prefill_only:  # never drops itself: the decode worker's reservation says what it keeps
            budget = None
        if budget is not None:
            self.budget.policy(budget)  # a budget too small to honour is the caller's error
        self.runner.check_sampling(params)
        grammar = params.grammar and self.runner.grammars.state(params.grammar)
        return Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.model_config.eos_token_ids,
            prefill_only=prefill_only,
            kv_budget_tokens=budget,
            grammar=grammar or None,
            cache_salt=cache_salt,
        )

    def validate_prompt(self, prompt_token_ids: list[int], cache_salt: str = "") -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the context length is "
                f"{self.max_model_len} (prompt plus at least one new token)"
            )
        # The context length ignores pins; a prompt that fits it but not the unpinned blocks
        # would wait at the head of the queue for room that never comes: refuse it now.
        room = self.kv.room_tokens(prompt_token_ids, cache_salt)
        if len(prompt_token_ids) >= room:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; with the pinned (warmed-up) "
                f"prompts this worker has room for {room - 1} (prompt plus one new token)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")

    def abort_request(self, request_id: str) -> bool:
        """End a request in any state; its blocks are freed now or, if a KV transfer may
        still read them, as soon as the transfer stops."""
        loaded = self.loading.pop(request_id, None) is not None
        request = self.scheduler.requests.get(request_id)
        # A prefill-only request's blocks may be under a send: its role frees them.
        keep = request is not None and request.prefill_only
        request = self.scheduler.finish_request(request_id, FinishReason.ABORT, not keep)
        if request is not None:
            self.role.on_finished(request)
        held = self.role.abort(request_id)
        return loaded or held or request is not None

    def abort_all(self) -> int:
        """Abort every request this engine holds, in any state; how many there were."""
        ids = {*self.scheduler.requests, *self.loading, *self.role.request_ids()}
        for request_id in ids:
            self.abort_request(request_id)
        return len(ids)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request early (e.g. its text hit a stop string)."""
        self.scheduler.finish_request(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.loading)

    def step(self) -> list[RequestOutput]:
        if self.loading:
            self._admit_loaded()
        started = time.time()
        guard = self.scheduler.stall_guard
        guard.threads = torch.get_num_threads()  # a core switch applies between steps
        out = self.scheduler.schedule()
        self.last_shape = shape = StepShape.of(out.scheduled)  # before the requests advance
        if self.offload is not None:
            self.offload.save_evicted()
        run_started = time.perf_counter()
        sampled = self.runner.execute(out, _stamp_layers(self.role.plan(out), layer_done := []))
        run_s = time.perf_counter() - run_started
        guard.observe(guard.threads, shape.prefill_tokens, shape.decode_requests, run_s)
        # The prefill's end: its last layer's KV in the cache when layers are handed over one
        # by one (the transfer tail starts there), else the step's end (sampling included).
        ended = layer_done[-1] if layer_done else time.time()
        self.role.after_step()
        for request, _ in out.scheduled:
            if request.num_computed_tokens < request.num_prompt_tokens:  # a prompt chunk
                request.stamps.setdefault("prefill_start", started)
        outputs = []
        for request in out.preempted:
            self.runner.block_scores.pop(request.request_id, None)
        for request, token in self.scheduler.update_from_output(out, sampled):
            if request.is_finished:
                self.runner.block_scores.pop(request.request_id, None)
                self.role.on_finished(request)
            if token is None:
                continue
            output = RequestOutput(
                request.request_id,
                [token],
                request.is_finished,
                request.finish_reason,
                request.num_prompt_tokens,
                request.num_cached_tokens,
            )
            if "prefill_start" in request.stamps:
                request.stamps.setdefault("prefill_end", ended)
            if request.stamps:  # sent once: later outputs carry none
                output.stamps, request.stamps = request.stamps, {}
            if request.prompt_logprobs is not None:  # the same
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if request.pin is not None and request.is_finished:
                warmed = pins.finish_warmup(self.kv, request)
                output.num_pinned_tokens, output.num_cached_tokens, output.error = warmed
            outputs.append(output)
        if any(r.kv_budget_tokens is not None for r, _ in out.scheduled):
            self.budget.enforce(self.scheduler.running)
        return outputs


def _stamp_layers(
    hook: Callable[[int], None] | None, done: list[float]
) -> Callable[[int], None] | None:
    """`hook`, also noting in `done` when each layer finished (none without a hook: a hook
    changes how the model runs)."""
    if hook is None:
        return None

    def stamped(layer: int) -> None:
        done.append(time.time())
        hook(layer)

    return stamped
