"""Every message between processes: typed dataclasses, one msgpack codec, HMAC-signed.

Router -> worker:  Generate, Reserve, Prefill, StartDecode, Abort, Shutdown, Unpin,
                   SwitchRole, SetCores, Hello
Worker -> router:  Ready, Reserved, Rejected, Tokens, Failed, Released, Stats, KVEvents,
                   Unpinned, CoresSet, StepReport

Cache warm-up (prefill and collocated workers) is an ordinary request: Generate with `pin`
set and WARMUP_PARAMS ─▶ one finished Tokens counting the prompt's cached and pinned
tokens, or Rejected (refused up front) / Failed (pin refused after the prefill);
Unpin ─▶ Unpinned at once.

A disaggregated request (docs/ARCHITECTURE.md follows one through the code):

    router ──Reserve──▶ decode      (blocks for the prompt's KV; no room -> Rejected)
           ◀─Reserved──             (block ids + the receiver's transfer address; the
                                     leading ones may already hold a cached prefix)
           ──Prefill──▶ prefill     (computes, streams KV into the other blocks)
           ◀─Tokens────             (the first token: streamed to the client at once)
           ──StartDecode▶ decode    (decodes once the KV has landed)
           ◀─Tokens────  ...        (until finished)
           ──Abort─────▶ any        (client gone, stop string, re-drive after a failure)
           ◀─Released──             (acknowledged: the worker's blocks are free)

A frame is `hmac_sha256(secret, payload) || payload`, the payload msgpack of `[type name,
{field: value}, session, seq, time]` (no pickle: a peer can only make us build these types).
A `Verifier` drops a frame whose seq is not above its session's last (a replay), and one of an
unknown session older than `REPLAY_WINDOW_S`; a restarted peer is a new session.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass
from typing import Any

import msgpack

MAC_BYTES = 32
# Older, from an unknown session: a replay. Covers a queue behind a long step and host skew.
REPLAY_WINDOW_S = 120.0
ROLES = ("collocated", "prefill", "decode")


# ---- router -> worker ------------------------------------------------------------------


@dataclass
class Generate:
    """Run a whole request on this worker (collocated, or a decode worker prefilling
    locally). `output_token_ids` resumes a request whose earlier worker died: they are
    recomputed as part of the prompt and not produced again. `pin`: a cache warm-up;
    `prefill_chunk_tokens`: the adaptive planner's SLO-sized chunk; `cache_salt`: the cache
    scope its blocks are hashed in, never an API key; `stall_budget_s`: the planner's stall
    budget, capping its prefill beside running decodes (all four as on `Request`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    output_token_ids: list[int] = field(default_factory=list)
    pin: bool | None = None
    prefill_chunk_tokens: int | None = None
    cache_salt: str = ""
    stall_budget_s: float | None = None


@dataclass
class Reserve:
    """Decode worker: reserve KV blocks for the prompt and expect them from a prefill."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str = ""  # as on Generate: P and D must hash the prompt alike


@dataclass
class Prefill:
    """Prefill worker: compute the prompt, write its KV into `block_ids` at `peer` (a
    receiver address from Reserved), sample the first token. The first `num_cached_blocks`
    destination blocks already hold the prefix: not sent. With `num_keep_blocks` only that
    many prompt blocks are sent (sink, recent, highest-scored) into as many destinations."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    peer: dict[str, Any]
    block_ids: list[int]
    num_cached_blocks: int = 0
    num_keep_blocks: int | None = None
    sink_blocks: int = 0
    recent_blocks: int = 0
    cache_salt: str = ""  # as on Generate


@dataclass
class StartDecode:
    """Decode worker: the first token is known; decode once the KV has landed (a prompt
    dropped before the transfer: what went and the kept blocks' scores come with it)."""

    request_id: str
    first_token_id: int


@dataclass
class Abort:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class SwitchRole:
    """Take `role` once the requests this worker holds are done, refusing new ones meanwhile
    (Rejected, retryable); answered by Ready with the new role (docs/roles.md)."""

    role: str


@dataclass
class SetCores:
    """Run on `cpus` with `threads` intra-op threads from the next step boundary (adaptive
    core groups, pdserve/planner/). `threads` 0 parks the worker: it takes messages and KV,
    runs no step until given cores again. Answered by CoresSet."""

    cpus: list[int]
    threads: int


@dataclass
class Hello:
    """From a router that (re)started, to every worker (again to one heard from without a
    Ready): abort every request you hold (this router does not know them; those of a router
    that died are lost) and announce yourself (Ready)."""


@dataclass
class Unpin:
    """Release the pinned blocks of a prompt warmed earlier, in cache scope `cache_salt`
    (they stay cached until evicted)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str = ""


# ---- worker -> router ------------------------------------------------------------------


@dataclass
class Ready:
    worker_id: str
    role: str
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int
    cpus: list[int] = field(default_factory=list)  # the cores it may run on
    threads: int = 0  # torch intra-op threads
    kv_block_bytes: int = 0  # one block's KV over all layers, as this worker holds it
    # Random per process: a restarted worker has a new one.
    incarnation: str = ""
    hello: bool = False  # the answer to a Hello (not a start, nor a role switch)


@dataclass
class Reserved:
    """`block_ids` has one block per prompt block; the first `num_cached_blocks` are the
    decode worker's own prefix-cache hit, already holding their KV, so only the rest is
    expected from the prefill worker (and a write into the cached ones is rejected).

    A prompt over the request's KV budget: `num_keep_blocks` is set, `block_ids` has that
    many blocks (no cached ones), and the prefill worker drops the rest before sending,
    keeping `sink_blocks` first and `recent_blocks` last blocks (the decode policy)."""

    worker_id: str
    request_id: str
    peer: dict[str, Any]
    block_ids: list[int]
    num_cached_blocks: int = 0
    num_keep_blocks: int | None = None
    sink_blocks: int = 0
    recent_blocks: int = 0


@dataclass
class Rejected:
    """A request refused before any work: `retryable` when only capacity was lacking."""

    worker_id: str
    request_id: str
    reason: str
    retryable: bool


@dataclass
class Tokens:
    worker_id: str
    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # A warm-up's (Generate.pin set): num_cached_tokens counts the prompt's tokens the cache
    # holds now, this how many of them are pinned.
    num_pinned_tokens: int | None = None
    # With a request's first tokens from a worker: its time.time() stamps (prefill_start,
    # prefill_end; kv_landed on a decode worker), for the TTFT breakdown (router/timing.py).
    stamps: dict[str, float] | None = None
    # SamplingParams.logprobs set: one per token, [logprob, [[token id, logprob], ...]]
    # (pdserve/model/logprobs.py); a prefill worker's carries the first token's.
    logprobs: list[list[Any]] | None = None
    # SamplingParams.prompt_logprobs set, with the first token: one per prompt token, None
    # for the first, else as `logprobs` (computed where the prompt was prefilled).
    prompt_logprobs: list[Any] | None = None


@dataclass
class Failed:
    """A request that failed after it started (e.g. its KV transfer broke)."""

    worker_id: str
    request_id: str
    error: str


@dataclass
class Released:
    """The answer to an Abort: the worker ended the request and its blocks are free, or
    will be as soon as a KV send in flight confirms it stopped reading them (bounded by the
    send deadline). Sent for unknown ids too, so every abort is acknowledged."""

    worker_id: str
    request_id: str


@dataclass
class Unpinned:
    """The answer to Unpin: the prompt's tokens in the cache (full blocks) and how many of
    them were released."""

    worker_id: str
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_unpinned_tokens: int


@dataclass
class KVEvents:
    """Block hashes a worker's prefix cache gained and lost since its last KVEvents: the
    router's index of who holds which prefix (KV-aware routing)."""

    worker_id: str
    stored: list[int]
    removed: list[int]


@dataclass
class Stats:
    """Load report, sent every heartbeat interval; also the liveness signal."""

    worker_id: str
    role: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_prefill_tokens: int
    # Generate and Prefill messages taken in since its Ready (cumulative): the router counts
    # a prompt it sent as queued here only until Stats count it (ControlPlane.loads).
    num_prompts_received: int = 0
    kv_bytes_sent: int = 0
    kv_send_s: float = 0.0  # the seconds a prefill worker's sender spent writing them
    kv_bytes_received: int = 0
    kv_blocks_skipped: int = 0  # decode: prompt blocks found in its own cache, never sent
    # Cumulative prefix-cache counts (engine/cache_stats.py): tier ("L1".."L4") -> lookups,
    # hits, bytes_read, bytes_written; "L1->L2"-style paths -> bytes moved between tiers.
    kv_tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    kv_moved_bytes: dict[str, int] = field(default_factory=dict)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the cache (any tier)
    num_computed_prompt_tokens: int = 0
    num_pinned_blocks: int = 0
    # Cumulative failed KV transfers by reason (engine/roles/prefill.py and decode.py):
    # send_timeout, send_failed, reserve_timeout, land_timeout, receive_failed, bad_meta.
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)
    kv_transfer_fallbacks: dict[str, int] = field(default_factory=dict)  # shm_to_tcp
    # Memory (workers/memory_report.py): the process's RSS and PSS, what its weights (every
    # copy the loader and the CPU kernels keep) and its KV pool take, in bytes.
    rss_bytes: int = 0
    pss_bytes: int = 0
    weight_bytes: int = 0
    kv_pool_bytes: int = 0
    # Matrices the loader widened to fp32 as a fallback, by reason (dtype_F64: a type the
    # in-place kernels cannot read; no_native_kernels: the whole checkpoint): set at load.
    weights_widened: dict[str, int] = field(default_factory=dict)
    # A decode worker's StallGuard (engine/stall_guard.py): the stall budget and the cap in
    # prefill tokens a step of its last capped prefill, and the steps whose prefill reached
    # their cap (cumulative); None before any prefill was capped.
    stall_budget_s: float | None = None
    stall_cap_tokens: int | None = None
    num_stall_capped_steps: int = 0
    # How long the engine step in progress had run when the heartbeat sent this (0: between
    # steps): a worker in one long step (a large prefill chunk on a slow CPU) is working, not
    # silent; one past the router's `step_timeout_s` is frozen (router/driver.py).
    step_running_s: float = 0.0


@dataclass
class CoresSet:
    """SetCores applied (or refused: the state unchanged): the worker now runs on `cpus` with
    `threads` (0: parked). `switch_s`: from SetCores taken off the socket, between steps, to
    applied; the step in progress when it arrived shows in the sender's round trip only."""

    worker_id: str
    cpus: list[int]
    threads: int
    switch_s: float


@dataclass
class StepReport:
    """The engine steps a worker ran since its last report: samples for the online cost
    model (pdserve.costmodel.step_cost). One row per step: prefill_tokens, decode_requests,
    prefill_attention_pairs, decode_context_tokens, prefill_sequences (StepShape's fields),
    threads, seconds."""

    worker_id: str
    steps: list[list[float]]


# Every dataclass defined above, by name: the only types a frame can make us build.
_TYPES = {n: t for n, t in list(globals().items()) if is_dataclass(t) and t.__module__ == __name__}


class CodecError(ValueError):
    pass


class Signer:
    """Signs the frames of one sending socket: its session id, then 0, 1, 2, ... in order.
    One per socket (a receiver sees one socket's frames in order; two sockets of one process
    to one receiver interleave, so they must not share a counter)."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        self.secret, self.clock = secret, clock
        self.session = os.urandom(8)
        self._seq = itertools.count()

    def encode(self, message: Any) -> bytes:
        # Fields hold plain values, never a nested dataclass: a shallow dict is what asdict's
        # deep copy would give, at a tenth of the cost (per token message, on the hot path).
        fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        name = type(message).__name__
        payload = msgpack.packb([name, fields, self.session, next(self._seq), self.clock()])
        return hmac.new(self.secret, payload, hashlib.sha256).digest() + payload


class Verifier:
    """Checks the frames of one receiving socket: signature, then freshness (module
    docstring). One dict lookup per frame; sessions silent for the window are forgotten."""

    def __init__(
        self,
        secret: bytes,
        window_s: float = REPLAY_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.secret, self.window_s, self.clock = secret, window_s, clock
        self._last: dict[bytes, tuple[int, float]] = {}  # session -> (seq, its sent time)
        self._next_prune = 0.0

    def decode(self, frame: bytes) -> Any:
        """The message in a frame; CodecError for a bad signature, a replayed or stale
        frame, an unknown type or fields."""
        mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self.secret, payload, hashlib.sha256).digest()):
            raise CodecError("bad message signature (wrong cluster secret?)")
        try:
            name, fields, session, seq, sent = msgpack.unpackb(payload)
            message = _TYPES[name](**fields)
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
            raise CodecError(f"malformed message: {e!r}") from None
        now = self.clock()
        last = self._last.get(session)
        if last is None and now - sent > self.window_s:
            raise CodecError(f"stale {name} of an unknown session, sent {now - sent:.0f} s ago")
        if last is not None and seq <= last[0]:
            raise CodecError(f"replayed {name}: seq {seq} after {last[0]} in its session")
        self._last[session] = (seq, sent)
        if now >= self._next_prune:
            # A forgotten session's frames are all older than the window: refused as stale.
            self._next_prune = now + self.window_s
            self._last = {k: v for k, v in self._last.items() if now - v[1] <= self.window_s}
        return message


def max_frame_bytes(num_tokens: int) -> int:
    """The largest frame of a message with `num_tokens` token ids: each id, and each block id
    (at most one per token), is at most 5 bytes of msgpack (a uint32); FIELDS_BYTES the rest."""
    return MAC_BYTES + FIELDS_BYTES + 2 * 5 * num_tokens


# The non-token part of a message: the sampling dict (RouterConfig checks that its stop limits
# take at most half of this, 16 KiB by default), other fields, names, the envelope (~200 B).
FIELDS_BYTES = 64 * 1024
