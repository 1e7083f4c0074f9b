"""The discrete-event loop: sessions arrive, the router places each request with pdserve's
routing policy, workers step (real scheduler, modelled step time), KV moves between prefill
and decode workers, and every token's time lands in a `RequestRecord` as `pdserve bench`
would have measured it.

Events, in simulated seconds (ties broken by insertion order):
    send(session, turn)      a request leaves the client
    arrive(request)          `served.request_s` later (the profile's serving stack: HTTP,
                             router, the hop to the worker): routed and queued at once
    step_done(worker)        the worker's step ends: tokens out, next step starts; the
                             client sees each token `served.token_s` later (a prefill
                             worker's first token `served.remote_token_s`, when measured)
    kv_landed(request)       a prefill's KV reached its decode worker: the prefill worker
                             frees the blocks it kept for the send
    start_decode(request)    the decode worker has the KV and the first token (the router
                             forwards it `served.start_decode_s` after it has it): it runs

A step that starts while the busy workers' threads fill every core of the host costs
`served.token_cpu_s` per token it streams more: the router and the client have no free core
and run on its.

Every `heartbeat_interval_s` each worker reports its load (`SimWorker.report`, as of its
last Stats refresh: after a step, without requests not yet read), checked before each event
rather than queued as one. The router routes by that report plus what it counts itself
(requests it placed, prompt tokens sent whose first token is not back), as the real router
does with Stats: an exact view placed multi-turn sessions differently.

Disaggregated requests follow the router's order: reserve on a decode worker (a prefix it
caches is taken by reference; no room: the request waits at the router, retried after each
decode step), then prefill on a prefill worker, whose first token is the client's TTFT.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.arrivals import ArrivalSpec, arrival_times
from pdserve.bench.metrics import FAILED, RequestRecord, run_duration_s
from pdserve.bench.runner import RunResult
from pdserve.bench.workloads import Session
from pdserve.costmodel.profile import HardwareProfile
from pdserve.kvcache.hashing import hash_blocks
from pdserve.request import Request
from pdserve.router.policies import RouteRequest, make_policy
from pdserve.sampling_params import SamplingParams
from pdserve.sim.deployment import Deployment, SimConfig
from pdserve.sim.worker import SimWorker
from pdserve.workers.spec import STATS_PER_HEARTBEAT

_SEND, _ARRIVE, _STEP, _LANDED, _START = 0, 1, 2, 3, 4  # event kinds


@dataclass
class _Flight:
    """One request in flight: its record, its session, and its worker-side requests."""

    record: RequestRecord
    session: Session
    turn: int
    history: list[int]
    prefill: Request | None = None
    decode: Request | None = None
    decode_worker: SimWorker | None = None
    last_token_s: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the prompt's full blocks
    charged: SimWorker | None = None  # its prompt counts in this worker's sent tokens
    start_s: float = 0.0  # disaggregated: when its decode worker has its first token


class Simulation:
    def __init__(
        self, profile: HardwareProfile, deployment: Deployment, config: SimConfig | None = None
    ) -> None:
        config = config or SimConfig()
        self.profile, self.deployment, self.config = profile, deployment, config
        self.policy = make_policy(config.routing, config.load_balancer)
        self.transfer = profile.transfer_model(config.transfer_backend)
        self.kv_bytes_per_token = profile.model.kv_bytes_per_token
        self.served = profile.served
        self.workers: list[SimWorker] = []
        for worker_id, role, size in deployment.workers():
            self.workers.append(self._worker(worker_id, role, size))
        self.by_role: dict[str, list[SimWorker]] = {}
        for w in self.workers:
            self.by_role.setdefault(w.role, []).append(w)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.flights: dict[str, _Flight] = {}
        self.backlog: deque[_Flight] = deque()  # waiting for a decode worker with room
        self.params: dict[int, SamplingParams] = {}  # by max_tokens (see _request)
        self.max_model_len = min(w.scheduler.max_model_len for w in self.workers)
        self.think_time_s = 0.0
        self.deadline_s = math.inf  # no new turn is sent after it (--duration-s)
        self.next_report_s = 0.0  # the next heartbeat
        # CPU workers share a host's cores with the router and the client (`_contended`).
        self.shares_cores = profile.size_unit == "threads"

    def _worker(self, worker_id: str, role: str, size: int) -> SimWorker:
        cfg = self.config
        if cfg.kv_cache_bytes is not None:
            capacity = int(cfg.kv_cache_bytes // self.kv_bytes_per_token)
        else:
            capacity = self.profile.kv_capacity_tokens(size)
        num_blocks = capacity // cfg.block_size
        if num_blocks < 1:
            raise ValueError(f"worker {worker_id}: the KV cache holds less than one block")
        max_model_len = min(cfg.scheduler.max_model_len or capacity, num_blocks * cfg.block_size)
        return SimWorker(
            worker_id,
            role,
            size,
            self.profile.served_cost_model(size, role),
            num_blocks,
            cfg.block_size,
            cfg.scheduler,
            max_model_len,
            cfg.enable_prefix_caching,
            self.profile.model.name,
            self.served.token_cpu_s,
            cfg.heartbeat_interval_s / STATS_PER_HEARTBEAT,
        )

    # ---- the loop --------------------------------------------------------------------

    def _push(self, when: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, payload))

    def run(
        self,
        sessions: list[Session],
        arrival: ArrivalSpec,
        seed: int = 0,
        think_time_s: float = 0.0,
        duration_s: float | None = None,
    ) -> RunResult:
        """Simulates the sessions as `pdserve bench` would send them; open loop only (the
        schedule of first turns is fixed in advance, later turns follow their answers)."""
        if arrival.kind == "concurrency":
            raise ValueError("the simulator replays open-loop arrivals (poisson, gamma, trace)")
        self.think_time_s = think_time_s
        self.deadline_s = math.inf if duration_s is None else duration_s
        times = arrival_times(arrival, len(sessions), np.random.default_rng(seed))
        if times is None:
            times = [s.arrival_s or 0.0 for s in sessions]
        # First turns wait in their own time-ordered list, not in the heap: a trace's 12,000
        # sends made every push and pop of the steps' events climb a 12,000-entry heap.
        sends = []
        for offset, session in zip(times, sessions, strict=True):
            if offset < self.deadline_s:
                self.seq += 1
                sends.append((offset, self.seq, _SEND, (session, 0, [], [])))
        sends.sort()  # by time, then seq: the order the heap would pop them in
        sends.append((math.inf, 0, _SEND, None))  # a sentinel, never sent
        next_send, events = 0, self.events
        while next_send < len(sends) - 1 or events:
            if not events or sends[next_send] < events[0]:
                self.now, _, kind, payload = sends[next_send]
                next_send += 1
            else:
                self.now, _, kind, payload = heapq.heappop(events)
            if self.now >= self.next_report_s:  # heartbeats since the last event
                self._report()
            if kind == _STEP:  # most events by far
                self._step_done(payload)
            elif kind == _SEND:
                self._send(*payload)
            elif kind == _ARRIVE:
                self._arrive(payload)
            elif kind == _LANDED:
                self._landed(payload)
            else:
                self._start_decode(payload)
        unfinished = [f.record.request_id for f in self.flights.values()]
        if unfinished:
            raise RuntimeError(f"simulation ended with requests unfinished: {unfinished[:5]}")
        records = sorted(self.records, key=lambda r: r.send_s)
        return RunResult(records, run_duration_s(records))

    def _report(self) -> None:
        """Every worker's Stats as of the last heartbeat (nothing changed since it)."""
        for w in self.workers:
            w.report()
        interval = self.config.heartbeat_interval_s
        self.next_report_s = (math.floor(self.now / interval) + 1) * interval

    def _contended(self, worker: SimWorker) -> bool:
        """Whether `worker`'s step would start with no core of the host free for the router
        and the client: the busy workers' threads (its own included) fill them."""
        if not self.shares_cores:  # GPU workers: the router and client run elsewhere
            return False
        busy = sum(w.size for w in self.workers if w.is_busy or w is worker)
        return busy >= self.profile.devices_per_node

    def _kick(self, worker: SimWorker) -> None:
        if not worker.is_busy:
            step = worker.start_step(self.now, self._contended(worker))
            if step is not None:
                self._push(self.now + step.duration_s, _STEP, worker)

    # ---- requests --------------------------------------------------------------------

    def _send(
        self, session: Session, turn: int, history: list[int], history_hashes: list[int]
    ) -> None:
        """`history_hashes`: block hashes of a prefix of `history` (the last turn's), so
        that a conversation hashes only its new tokens, not its whole history every turn."""
        if turn > 0 and self.now >= self.deadline_s:
            return
        user = session.turns[turn]
        prompt = history + user.user_ids
        record = RequestRecord(
            request_id=f"{session.session_id}-{turn}",
            input_len=len(prompt),
            requested_output_len=user.output_len,
            send_s=self.now,
            session_id=session.session_id,
            turn=turn,
        )
        if len(prompt) >= self.max_model_len:
            # The engine refuses it (validate_prompt): a 400 the client records as failed.
            record.status, record.e2e_s = FAILED, 0.0
            record.error = f"prompt of {len(prompt)} tokens; the context is {self.max_model_len}"
            self.records.append(record)
            return
        parent = history_hashes[-1] if history_hashes else self._root
        new_hashes = hash_blocks(prompt, self.config.block_size, parent, len(history_hashes))
        hashes = history_hashes + new_hashes
        flight = _Flight(record, session, turn, history, prompt_ids=prompt, block_hashes=hashes)
        self.flights[record.request_id] = flight
        if self.served.request_s:
            self._push(self.now + self.served.request_s, _ARRIVE, flight)
        else:
            self._arrive(flight)

    def _arrive(self, flight: _Flight) -> None:
        if self.deployment.is_disaggregated:
            self._admit_disaggregated(flight)
        else:
            worker = self._choose("collocated", flight)
            worker.num_active_requests += 1
            self._charge(flight, worker)
            flight.decode, flight.decode_worker = self._request(flight), worker
            worker.add(flight.decode)
            self._kick(worker)

    def _request(self, flight: _Flight, prefill_only: bool = False) -> Request:
        # A copy each: a request extends its own hashes in place as its tokens grow.
        hashes = list(flight.block_hashes)
        max_tokens = flight.record.requested_output_len
        params = self.params.get(max_tokens)
        if params is None:  # frozen, so shared: validating one per request was 2% of a replay
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self.params[max_tokens] = params
        return Request(
            flight.record.request_id,
            list(flight.prompt_ids),
            params,
            arrival_time=self.now,
            block_hashes=hashes,
            prefill_only=prefill_only,
        )

    def _charge(self, flight: _Flight, worker: SimWorker) -> None:
        """The router counts the prompt as queued on `worker` until its first token (in its
        load until the worker's Stats count it: `SimWorker.report`)."""
        worker.charge(flight.record.request_id, len(flight.prompt_ids))
        flight.charged = worker

    def _uncharge(self, flight: _Flight) -> None:
        if flight.charged is not None:
            flight.charged.release(flight.record.request_id, len(flight.prompt_ids))
            flight.charged = None

    @property
    def _root(self) -> int:
        return self.workers[0].kv.root_hash

    def _choose(self, role: str, flight: _Flight) -> SimWorker:
        candidates = self.by_role[role]
        if len(candidates) == 1:
            return candidates[0]
        hashes = None
        if self.policy.needs_block_hashes and role != "decode":
            hashes = flight.block_hashes
        route = RouteRequest(len(flight.prompt_ids), self.config.block_size, hashes or ())
        load = self.policy.choose(role, [w.load(hashes) for w in candidates], route)
        assert load is not None
        return next(w for w in candidates if w.worker_id == load.worker_id)

    def _admit_disaggregated(self, flight: _Flight) -> None:
        if self.backlog or not self._reserve(flight):
            self.backlog.append(flight)

    def _reserve(self, flight: _Flight) -> bool:
        """Decode reservation (DecodeHandoff.reserve), then the prefill placement."""
        decode = self._choose("decode", flight)
        request = self._request(flight)
        hits = decode.kv.find_cached_prefix(request)
        num_new = request.num_prompt_tokens - len(hits) * decode.kv.block_size
        if not decode.kv.allocate(request, num_new, hits):
            return False
        decode.num_active_requests += 1
        flight.decode, flight.decode_worker = request, decode
        prefill_worker = self._choose("prefill", flight)
        prefill_worker.num_active_requests += 1
        self._charge(flight, prefill_worker)
        flight.prefill = self._request(flight, prefill_only=True)
        prefill_worker.add(flight.prefill)
        self._kick(prefill_worker)
        return True

    def _retry_backlog(self) -> None:
        while self.backlog and self._reserve(self.backlog[0]):
            self.backlog.popleft()

    # ---- steps -----------------------------------------------------------------------

    def _step_done(self, worker: SimWorker) -> None:
        duration = worker.step.duration_s if worker.step else 0.0
        prefill, flights = worker.role == "prefill", self.flights
        for request, token in worker.finish_step(self.now):
            if token is None:
                continue
            flight = flights[request.request_id]
            if prefill:
                self._prefilled(worker, flight, request, duration)
            else:
                self._token(flight)
                if request.is_finished:
                    worker.num_active_requests -= 1
                    self._finish(flight)
        self._kick(worker)
        if worker.role == "decode" and self.backlog:
            self._retry_backlog()

    @property
    def _client_now(self) -> float:
        """When the client sees a token produced now."""
        return self.now + self.served.token_s

    def _token(self, flight: _Flight, hop_s: float | None = None) -> None:
        """A token produced now reaches the client `hop_s` later (`served.token_s`)."""
        record = flight.record
        seen = self.now + (self.served.token_s if hop_s is None else hop_s)
        if record.ttft_s is None:
            self._uncharge(flight)  # the router's charge ends with the first token
            record.ttft_s = seen - record.send_s
            record.cached_tokens = flight.decode.num_cached_tokens if flight.decode else 0
        else:
            record.itl_s.append(seen - flight.last_token_s)
        record.output_len += 1
        flight.last_token_s = seen

    def _prefilled(self, worker: SimWorker, flight: _Flight, request: Request, step_s: float):
        worker.num_active_requests -= 1
        hop_s = self.served.remote_token_s or self.served.token_s  # 0: not measured
        self._token(flight, hop_s)  # then the router forwards it to D (StartDecode)
        flight.start_s = self.now + hop_s + self.served.start_decode_s
        flight.record.cached_tokens = request.num_cached_tokens
        decode = flight.decode
        assert decode is not None and flight.decode_worker is not None
        if flight.record.requested_output_len <= 1:
            flight.decode_worker.kv.free(decode)
            flight.decode_worker.num_active_requests -= 1
            worker.kv.free(request)
            self._finish(flight)
            self._retry_backlog()
            return
        num_sent = decode.num_prompt_tokens - decode.num_computed_tokens  # D's hit not sent
        num_bytes = num_sent * self.kv_bytes_per_token
        size = min(worker.size, flight.decode_worker.size)  # shards send in parallel
        wire_s = self.transfer.seconds(num_bytes / size) - self.transfer.latency_s
        # Layer-wise streaming overlaps the send with the prefill's last step; what is left
        # after it is at least one layer's share.
        exposed_s = max(wire_s - step_s, wire_s / self.profile.model.num_layers)
        decode.output_token_ids.append(request.output_token_ids[0])
        self._push(self.now + self.transfer.latency_s + exposed_s, _LANDED, (worker, flight))

    def _landed(self, payload: tuple[SimWorker, _Flight]) -> None:
        prefill_worker, flight = payload
        prefill_worker.kv.free(flight.prefill)
        self._kick(prefill_worker)  # blocks came back: a waiting prefill may now fit
        self._push(max(self.now, flight.start_s), _START, flight)  # and the first token

    def _start_decode(self, flight: _Flight) -> None:
        request, worker = flight.decode, flight.decode_worker
        request.num_computed_tokens = request.num_prompt_tokens
        worker.kv.cache_computed_blocks(request)
        worker.scheduler.add_running(request)
        self._kick(worker)

    def _finish(self, flight: _Flight) -> None:
        record = flight.record
        record.e2e_s = max(self._client_now, flight.last_token_s) - record.send_s
        del self.flights[record.request_id]
        self.records.append(record)
        session, turn = flight.session, flight.turn
        if turn + 1 < len(session.turns):
            answer = flight.decode.output_token_ids if flight.decode else []
            history = flight.prompt_ids + list(answer)
            # The decode request's hashes cover its full blocks of prompt and answer so far.
            known = flight.decode.block_hashes if flight.decode else flight.block_hashes
            when = self._client_now + self.think_time_s
            self._push(when, _SEND, (session, turn + 1, history, list(known)))
