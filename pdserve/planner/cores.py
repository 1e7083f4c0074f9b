"""Core groups on one host: how many of the pool's cores each worker gets (`plan_counts`),
which ones (`layout`), and the protocol that moves them (`CoreGroups`). Pure: callers pass
the time and send what `CoreGroups.sends()` returns.

Invariant: the cpus of workers that run steps never overlap, at any instant. A worker runs
on what it last acknowledged (CoresSet) or, once it has the message, on what it was last
sent; so a worker may hold `current` and `pending` both. A shrink (to a subset, or parked)
is sent at once; a grow only when the cpus it takes are held by no other running worker in
either state, i.e. after the CoresSet of every shrink it depends on. One SetCores in flight
per worker. A worker never heard from (no Ready) is taken to hold the whole pool and is
sent nothing; each worker gets a first SetCores after its Ready even when it already runs
on its target (the planner, not the launcher, owns the layout).

Hysteresis: giving cores to a parked worker (a request waits for them), growing a decode
group (its inter-token latency is at stake) and giving a decode group the cores its decodes
need within the stall budget (`Demand.stall_threads`; a merge back too) happen at once;
every other change (a merge back, a shrink of the decode group) only once the same counts
were wanted for `hold_s()`: `hold_gaps` times the mean of the last `NUM_GAPS` gaps between
the pool's remote requests (`on_remote`), at least `dwell_s`, at most `hold_max_s` (the
most, too, before `MIN_GAPS` gaps: no rate yet). A change that parks a worker (the merge
back) also waits `hold_s()` after the last remote request, which a plan may never have seen
busy (its prefill ended between two plans). So a steady stream of remote requests holds one
split however idle the prefill worker is between them, and only a lull long for that
stream's own rate merges.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

# Remote request gaps in the mean: a Poisson stream's gaps have a standard deviation of their
# mean, so a mean of 16 is within 25% of the rate; a shorter memory (a decayed mean weighing
# the newest by 0.25) reads a clump of arrivals as a rate twice the true one.
NUM_GAPS = 16
MIN_GAPS = 4  # fewer: the rate is not known (the first remote requests of a load)
# The longest a busy prefill worker is kept parked for the decodes' stall budget: then its
# queued prompts get a core until they are done, whatever the decodes need. A stream's gap
# is bounded by the budget, a queued prompt's wait by this (without it, decodes arriving
# locally could keep the pool from a remote prompt until its first-token timeout).
MAX_STALL_PARK_S = 30.0


@dataclass(frozen=True)
class CoreGrant:
    """The cores the planner gives a worker (what a SetCores carries)."""

    cpus: tuple[int, ...]
    threads: int  # 0: parked (takes messages and KV, runs no step)


@dataclass(frozen=True)
class Demand:
    """One worker as the core planner sees it: busy (has work that needs steps) and, for a
    decode worker, the threads its decodes need to meet the ITL budget (0: no estimate)."""

    worker_id: str
    role: str
    busy: bool
    need_threads: int = 0
    # Fewer threads take its decodes' step past 75% of the stall budget, freezing the
    # running streams (decision.stall_need; 0: none applies): a change towards them is not
    # held back.
    stall_threads: int = 0
    parked_s: float = 0.0  # busy while parked this long (`CoreGroups.parked_s`)


def stall_floors(demands: Sequence[Demand]) -> dict[str, int]:
    """Busy decode workers' `stall_threads`, for `CoreGroups.want()`."""
    return {
        d.worker_id: d.stall_threads
        for d in demands
        if d.busy and d.role != "prefill" and d.stall_threads
    }


def plan_counts(pool_size: int, demands: Sequence[Demand]) -> dict[str, int]:
    """Threads per worker (0: parked). Nothing busy: the first decode worker takes every core
    (collocated's layout); one busy worker takes every core; busy decode and prefill workers
    split: decode workers get their `need_threads` (an even split without an estimate), the
    prefill workers the rest, each busy worker at least one, except where the decode workers'
    `stall_threads` leave no core: then those first, and the prefill workers the rest, if
    any (id order; a parked one's prompts wait in its queue rather than freeze the decodes)."""
    counts = {d.worker_id: 0 for d in demands}
    ordered = sorted(demands, key=lambda d: (d.role == "prefill", d.worker_id))
    busy = [d for d in ordered if d.busy][:pool_size]  # more busy workers than cores: id order
    if len(busy) <= 1:
        if ordered:
            counts[(busy or ordered)[0].worker_id] = pool_size
        return counts
    decode = [d for d in busy if d.role != "prefill"]
    prefill = [d for d in busy if d.role == "prefill"]
    if not decode or not prefill:
        weights = [max(1, d.need_threads) if d.role != "prefill" else 1 for d in busy]
        counts.update(zip([d.worker_id for d in busy], _share(pool_size, weights), strict=True))
        return counts
    even = max(1, pool_size // len(busy))
    needs = [max(1, d.need_threads) if d.need_threads else even for d in decode]
    # Prefill workers parked past MAX_STALL_PARK_S come first and keep a core.
    prefill.sort(key=lambda d: d.parked_s < MAX_STALL_PARK_S)
    starved = sum(d.parked_s >= MAX_STALL_PARK_S for d in prefill)
    floors = min(pool_size - starved, sum(min(d.stall_threads, pool_size) for d in decode))
    room = max(pool_size - len(prefill), floors)
    decode_counts = _share(min(room, sum(needs)), needs) if sum(needs) > room else needs
    counts.update(zip([d.worker_id for d in decode], decode_counts, strict=True))
    rest = pool_size - sum(decode_counts)
    if rest >= len(prefill):
        prefill_counts = _share(rest, [1] * len(prefill))
    else:  # the decodes' stall budget took the cores: the first prefill workers get one
        prefill_counts = [1] * rest + [0] * (len(prefill) - rest)
    counts.update(zip([d.worker_id for d in prefill], prefill_counts, strict=True))
    return counts


def _share(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights`, at least 1 each (largest remainders get
    the rest). Needs total >= len(weights)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [max(1, int(r)) for r in raw]
    while sum(out) > total:  # raised to 1 above: taken back from the largest
        out[out.index(max(out))] -= 1
    by_remainder = sorted(range(len(raw)), key=lambda i: (int(raw[i]) - raw[i], i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


def layout(
    pool: Sequence[int], counts: dict[str, int], roles: dict[str, str], parked: dict[str, CoreGrant]
) -> dict[str, CoreGrant]:
    """The cpus of each count: decode workers (id order) from the pool's start, prefill
    workers from its end, so a resize moves only the cores at the boundary. A parked worker
    keeps the cpus it had (its idle threads' affinity; it runs no step)."""
    out: dict[str, CoreGrant] = {}
    start, end = 0, len(pool)
    for worker_id in sorted(counts, key=lambda w: (roles[w] == "prefill", w)):
        n = counts[worker_id]
        if n == 0:
            out[worker_id] = CoreGrant(parked.get(worker_id, CoreGrant(tuple(pool), 0)).cpus, 0)
        elif roles[worker_id] == "prefill":
            out[worker_id], end = CoreGrant(tuple(pool[end - n : end]), n), end - n
        else:
            out[worker_id], start = CoreGrant(tuple(pool[start : start + n]), n), start + n
    return out


class CoreGroups:
    """One host's pool and the SetCores protocol (module docstring)."""

    def __init__(
        self,
        pool: Sequence[int],
        worker_ids: Sequence[str],
        dwell_s: float,
        hold_gaps: float = 0.0,
        hold_max_s: float = 0.0,
    ) -> None:
        self.pool = tuple(pool)
        self.dwell_s, self.hold_gaps, self.hold_max_s = dwell_s, hold_gaps, hold_max_s
        self.gaps_s: collections.deque[float] = collections.deque(maxlen=NUM_GAPS)
        self._last_remote: float | None = None
        self.current: dict[str, CoreGrant | None] = {w: None for w in worker_ids}
        self.pending: dict[str, tuple[CoreGrant, float]] = {}  # sent, not acknowledged: (to, sent)
        self.counts: dict[str, int] = {}  # the counts being moved to
        self.target: dict[str, CoreGrant] = {}
        self._proposal: tuple[dict[str, int], float] | None = None
        self.num_switches = 0
        # Acknowledged a SetCores since its Ready: the planner, not the launcher, set its cores.
        self.confirmed: set[str] = set()
        self._busy_parked: dict[str, float] = {}  # worker -> since when busy while parked

    # ---- what the workers said -----------------------------------------------------------

    def on_ready(self, worker_id: str, cpus: Sequence[int], threads: int, restarted: bool) -> None:
        """A Ready: a restarted process runs on what it says and its old SetCores is void."""
        self.current[worker_id] = CoreGrant(tuple(cpus), threads)
        if restarted:
            self.pending.pop(worker_id, None)
            self.confirmed.discard(worker_id)

    def on_ack(self, worker_id: str, cpus: Sequence[int], threads: int, now: float) -> float | None:
        """A CoresSet; returns the router-side round trip of the SetCores it answers."""
        before = self.current.get(worker_id)
        self.current[worker_id] = CoreGrant(tuple(cpus), threads)
        if before != self.current[worker_id]:
            self.num_switches += 1
        self.confirmed.add(worker_id)
        sent = self.pending.pop(worker_id, None)
        return None if sent is None else now - sent[1]

    def on_remote(self, now: float) -> None:
        """A request prefills remotely on a worker of this pool. A gap is capped at
        `hold_max_s`: one long lull weighs no more than the longest hold it can cause."""
        if self._last_remote is not None:
            self.gaps_s.append(min(now - self._last_remote, self.hold_max_s))
        self._last_remote = now

    @property
    def mean_gap_s(self) -> float | None:
        """The mean of the last `NUM_GAPS` gaps between remote requests; None before two."""
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None

    def hold_s(self) -> float:
        """How long a change that is not made at once must stay wanted before it is made."""
        if self._last_remote is None:
            return self.dwell_s
        if len(self.gaps_s) < MIN_GAPS:  # a stream of a rate not known yet
            return max(self.dwell_s, self.hold_max_s)
        return max(self.dwell_s, min(self.hold_max_s, self.hold_gaps * self.mean_gap_s))

    # ---- planning -----------------------------------------------------------------------

    def parked_s(self, worker_id: str, busy: bool, now: float) -> float:
        """How long `worker_id` has been busy and parked (0: not busy). A worker given cores
        within MAX_STALL_PARK_S starts from 0 when parked again; one given them for its wait
        keeps counting while busy, so it keeps them until its queue is done."""
        since = self._busy_parked.get(worker_id)
        if not busy:
            self._busy_parked.pop(worker_id, None)
            return 0.0
        if self.counts.get(worker_id, 0) == 0:
            since = self._busy_parked.setdefault(worker_id, now)
        elif since is not None and now - since < MAX_STALL_PARK_S:
            del self._busy_parked[worker_id]  # given cores before it waited long
            return 0.0
        return 0.0 if since is None else now - since

    def want(
        self,
        counts: dict[str, int],
        roles: dict[str, str],
        now: float,
        floors: dict[str, int] | None = None,
    ) -> bool:
        """Move towards `counts` (plan_counts); True when they became the target now.
        `floors`: decode workers' threads within the stall budget (`stall_floors()`)."""
        if counts == self.counts:
            self._proposal = None
            return False
        old = self.counts
        grant = any(n > 0 and old.get(w, 0) == 0 for w, n in counts.items())
        same = {w for w, n in counts.items() if n} == {w for w, n in old.items() if n}
        decode_grows = same and any(
            roles[w] != "prefill" and n > old.get(w, 0) for w, n in counts.items()
        )
        # Short of what its decodes need within the stall budget: every step of the hold
        # would freeze its streams (a held split's one core under a 1B batch), so at once.
        stalled = any(
            old.get(w, 0) < floor and counts.get(w, 0) > old.get(w, 0)
            for w, floor in (floors or {}).items()
        )
        if not (grant or decode_grows or stalled) and old:
            if self._proposal is None or self._proposal[0] != counts:
                self._proposal = (counts, now)
            since = self._proposal[1]
            if self._last_remote is not None and any(
                n == 0 and old.get(w, 0) > 0 for w, n in counts.items()
            ):
                # A remote prefill shorter than an interval is seen by no plan: the lull
                # counts from the request too, not only from the plan that saw the worker idle.
                since = max(since, self._last_remote)
            if now - since < self.hold_s():
                return False
        self._proposal = None
        self.counts = dict(counts)
        known = {w: c for w, c in self.current.items() if c is not None}
        self.target = layout(self.pool, self.counts, roles, known)
        return True

    def sends(self, now: float) -> list[tuple[str, CoreGrant]]:
        """The SetCores to send now (recorded as pending): shrinks at once, grows once safe."""
        out = []
        for worker_id, target in sorted(self.target.items()):
            current = self.current.get(worker_id)
            if current is None or worker_id in self.pending:
                continue  # not ready yet (it announces what it runs on), or one in flight
            if target == current and worker_id in self.confirmed:
                continue
            shrink = target.threads == 0 or (
                current is not None
                and current.threads > 0  # a parked worker's cpus are not its to keep
                and set(target.cpus) <= set(current.cpus)
            )
            if shrink or not set(target.cpus) & self.held(exclude=worker_id):
                self.pending[worker_id] = (target, now)
                out.append((worker_id, target))
        return out

    def held(self, exclude: str = "") -> set[int]:
        """Cpus a running worker other than `exclude` may be on now."""
        cpus: set[int] = set()
        for worker_id, current in self.current.items():
            if worker_id == exclude:
                continue
            if current is None:
                cpus.update(self.pool)  # never heard from
                continue
            pending = self.pending.get(worker_id)
            for state in (current, pending[0] if pending else None):
                if state is not None and state.threads > 0:
                    cpus.update(state.cpus)
        return cpus

    def threads(self, worker_id: str) -> int:
        """Threads the worker runs with now (acknowledged), 0 when parked or unknown."""
        current = self.current.get(worker_id)
        return current.threads if current is not None else 0

    def runs(self, worker_id: str) -> bool:
        """The worker runs steps now and is not being parked: work sent to it now is not
        held up behind a SetCores that parks it (wait for a grant instead)."""
        pending = self.pending.get(worker_id)
        parking = self.counts.get(worker_id) == 0 or (
            pending is not None and not pending[0].threads
        )
        return self.threads(worker_id) > 0 and not parking

    def state(self) -> dict[str, object]:
        return {
            "pool": list(self.pool),
            "workers": {
                w: {
                    "cpus": list(c.cpus) if c else None,
                    "threads": c.threads if c else None,
                    "pending": list(self.pending[w][0].cpus) if w in self.pending else None,
                    "target_threads": self.counts.get(w),
                }
                for w, c in sorted(self.current.items())
            },
            "num_switches": self.num_switches,
            "hold_s": self.hold_s(),
            "mean_remote_gap_s": self.mean_gap_s,
        }


def pools_of(endpoints: Any) -> dict[tuple[str, tuple[int, ...]], list[str]]:
    """Workers by host pool: the same cpus on the same host (ipc addresses: this host)."""
    pools: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for e in endpoints:
        host = urlparse(e.address).hostname or "" if e.address.startswith("tcp") else ""
        pools.setdefault((host, tuple(e.cpus)), []).append(e.worker_id)
    return pools


def check_deployment(endpoints: Any) -> None:
    """Refuse at start, naming the field: an adaptive deployment needs each worker's core
    pool, a prefill and a decode worker, and a pool with a core for each of its workers."""
    roles = {e.role for e in endpoints}
    if not {"prefill", "decode"} <= roles:
        raise ValueError(f"adaptive: workers need a prefill and a decode role, got {sorted(roles)}")
    for e in endpoints:
        if not e.cpus:
            raise ValueError(f"workers: {e.worker_id} has no cpus (the core pool adaptive plans)")
    for (_, pool), ids in pools_of(endpoints).items():
        if len(pool) < len(ids):
            raise ValueError(
                f"adaptive.workers: {len(ids)} workers cannot share {len(pool)} cores {list(pool)}"
            )
