"""Drives sessions against an endpoint under an arrival process and collects the records.

Open loop: session i starts at its scheduled offset whether or not earlier requests finished.
Closed loop: ``concurrency`` users each run one session at a time. Within a session, turns are
sequential (turn k's prompt contains turn k-1's actual answer) with an optional think time.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from pdserve.bench.arrivals import ArrivalSpec, arrival_times
from pdserve.bench.client import ClientConfig, Prompt, send_request
from pdserve.bench.metrics import FAILED, SLO, RequestRecord, summarize
from pdserve.bench.tokens import TokenSource, join_text
from pdserve.bench.workloads import Session, Turn


@dataclass(frozen=True)
class RunConfig:
    client: ClientConfig
    arrival: ArrivalSpec
    text_prompts: bool = False
    think_time_s: float = 0.0
    duration_s: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float

    def summary(self, slo: SLO) -> dict[str, object]:
        return summarize(self.records, slo, self.duration_s)


@dataclass
class _History:
    """A conversation so far, in every form an endpoint may need."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)


def _prompt(cfg: RunConfig, tokens: TokenSource, history: _History, turn: Turn) -> Prompt:
    if cfg.client.endpoint == "chat":
        text = turn.user_text if turn.user_text is not None else tokens.decode(turn.user_ids)
        return [*history.messages, {"role": "user", "content": text}]
    if cfg.text_prompts:
        return join_text(history.text, turn.user_text or tokens.decode(turn.user_ids))
    return history.ids + turn.user_ids


def _extend(history: _History, prompt: Prompt, turn: Turn, answer: str, tokens: TokenSource):
    history.ids = history.ids + turn.user_ids + tokens.encode(answer)
    if isinstance(prompt, str):
        history.text = join_text(prompt, answer)
    elif prompt and isinstance(prompt[0], dict):
        history.messages = [*prompt, {"role": "assistant", "content": answer}]


def _record(session: Session, index: int, **values: Any) -> RequestRecord:
    """The record of turn `index` (`values` sets its other fields; by default the input is
    the turn's own tokens)."""
    turn = session.turns[index]
    values.setdefault("input_len", len(turn.user_ids))
    request_id = f"{session.session_id}-{index}"
    return RequestRecord(
        request_id,
        requested_output_len=turn.output_len,
        session_id=session.session_id,
        turn=index,
        **values,
    )


class _Run:
    def __init__(self, cfg: RunConfig, tokens: TokenSource, total: int) -> None:
        self.cfg = cfg
        self.tokens = tokens
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()
        self.deadline = None if cfg.duration_s is None else self.start + cfg.duration_s
        limit = cfg.max_concurrency
        self.slots = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        self.bar = tqdm(total=total, disable=not cfg.progress, file=sys.stderr, unit="req")

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    async def session(self, http: aiohttp.ClientSession, session: Session) -> None:
        history = _History()
        for index, turn in enumerate(session.turns):
            if self.expired():
                return
            if index > 0 and self.cfg.think_time_s > 0:
                await asyncio.sleep(self.cfg.think_time_s)
            prompt = _prompt(self.cfg, self.tokens, history, turn)
            record = _record(session, index, input_len=len(history.ids) + len(turn.user_ids))
            async with self.slots:
                answer = await send_request(http, self.cfg.client, prompt, record, self.start)
            self._add(record)
            if not record.ok:
                self._abandon(session, index + 1)
                return
            _extend(history, prompt, turn, answer, self.tokens)

    def _abandon(self, session: Session, first: int) -> None:
        """Later turns of a broken conversation count as failed, never silently dropped."""
        now = time.perf_counter() - self.start
        error = "an earlier turn of this conversation failed"
        for index in range(first, len(session.turns)):
            self._add(_record(session, index, send_s=now, status=FAILED, e2e_s=0.0, error=error))

    def _add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.bar.update(1)


async def run_sessions(sessions: list[Session], cfg: RunConfig, tokens: TokenSource) -> RunResult:
    """Runs every session (or until ``duration_s``) and returns the records in send order."""
    total = sum(len(s.turns) for s in sessions)
    run = _Run(cfg, tokens, total)
    connector, timeout = aiohttp.TCPConnector(limit=0), aiohttp.ClientTimeout(total=None)
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, trust_env=False
        ) as http:
            if cfg.arrival.kind == "concurrency":
                queue = iter(sessions)

                async def user() -> None:
                    for session in queue:
                        if run.expired():
                            return
                        await run.session(http, session)

                await asyncio.gather(*(user() for _ in range(cfg.arrival.concurrency)))
            else:
                await _open_loop(run, http, sessions)
    finally:
        run.bar.close()
    duration = time.perf_counter() - run.start
    records = sorted(run.records, key=lambda r: r.send_s)
    return RunResult(records, duration)


async def _open_loop(run: _Run, http: aiohttp.ClientSession, sessions: list[Session]) -> None:
    rng = np.random.default_rng(run.cfg.seed)
    times = arrival_times(run.cfg.arrival, len(sessions), rng)
    if times is None:
        times = [s.arrival_s or 0.0 for s in sessions]
    tasks = []
    for offset, session in zip(times, sessions, strict=True):
        delay = run.start + offset - time.perf_counter()
        if run.deadline is not None and run.start + offset >= run.deadline:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run.session(http, session)))
    await asyncio.gather(*tasks)


def run_benchmark(sessions: list[Session], cfg: RunConfig, tokens: TokenSource) -> RunResult:
    """Synchronous entry point: one event loop per run keeps probe runs independent."""
    return asyncio.run(run_sessions(sessions, cfg, tokens))
