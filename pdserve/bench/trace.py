"""Replay of JSONL traces, including the public Mooncake trace format.

Each line: ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``.
Mooncake hashes prompts in 512-token blocks; requests that list the same hash id shared that
block of tokens. We regenerate each hash id's block deterministically from (seed, hash id), so
the replayed prompts share prefixes exactly where the original traffic did:

    hash_ids [7, 8, 9], input_length 1100, block 512
    prompt = block(7)[0:512] + block(8)[0:512] + block(9)[0:76]

Scaling for a small machine: ``length_scale`` shrinks lengths *and* the block size together
(so the sharing structure survives), ``time_scale`` stretches (>1) or compresses (<1) time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.tokens import TokenSource, join_text
from pdserve.bench.workloads import Session, Turn

MOONCAKE_BLOCK_LEN = 512
_EXTRA_KEY = 1 << 40  # keys of the tokens past a line's hash ids: this plus the line's index
_DRAW_BLOCKS = 1024  # blocks per keyed draw: 4 MiB per uint64 temporary at 512 tokens


@dataclass(frozen=True)
class TraceConfig:
    path: str
    time_scale: float = 1.0
    length_scale: float = 1.0
    block_len: int = MOONCAKE_BLOCK_LEN
    max_requests: int | None = None
    text_prompts: bool = False
    seed: int = 0


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def read_trace(path: str) -> list[dict]:
    """Parsed trace lines, in file order; a bad line is reported with its line number."""
    entries = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--trace {path!r}: {exc.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            entry["timestamp"] = float(entry["timestamp"])
            entry["input_length"] = int(entry["input_length"])
            entry["output_length"] = int(entry["output_length"])
            entry["hash_ids"] = [int(h) for h in entry.get("hash_ids", [])]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--trace {path}:{lineno}: bad entry ({exc!s})") from None
        entries.append(entry)
    return entries


def load_trace(cfg: TraceConfig, tokens: TokenSource) -> list[Session]:
    """One single-turn session per trace line, with ``arrival_s`` relative to the first."""
    entries = read_trace(cfg.path)[: cfg.max_requests]
    if not entries:
        raise ValueError(f"--trace {cfg.path!r}: no requests")
    block_len = _scaled(cfg.block_len, cfg.length_scale)
    blocks: dict[int, tuple[list[int], str]] = {}
    if not cfg.text_prompts:  # every block in one keyed draw (text prompts need a Generator)
        used = list(dict.fromkeys(h for e in entries for h in e["hash_ids"]))
        for begin in range(0, len(used), _DRAW_BLOCKS):
            keys = used[begin : begin + _DRAW_BLOCKS]
            for key, row in zip(keys, tokens.keyed_ids(cfg.seed, keys, block_len), strict=True):
                blocks[key] = (row.tolist(), "")

    def block(hash_id: int) -> tuple[list[int], str]:
        if hash_id not in blocks:
            rng = np.random.default_rng([cfg.seed, hash_id])
            blocks[hash_id] = tokens.random_prompt(rng, block_len, cfg.text_prompts)
        return blocks[hash_id]

    start_ms = min(e["timestamp"] for e in entries)
    sessions = []
    for index, entry in enumerate(entries):
        input_len = _scaled(entry["input_length"], cfg.length_scale)
        ids: list[int] = []
        text = ""
        for hash_id in entry["hash_ids"]:
            remaining = input_len - len(ids)
            if remaining <= 0:
                break
            block_ids, block_text = block(hash_id)
            if remaining < len(block_ids):
                # A partial last block: a prefix of the full block, so sharing still holds.
                block_ids = block_ids[:remaining]
                if cfg.text_prompts:
                    rng = np.random.default_rng([cfg.seed, hash_id, remaining])
                    block_ids, block_text = tokens.fit_text(block_ids, rng)
            ids += block_ids
            text = join_text(text, block_text)
        if len(ids) < input_len:
            # Tokens beyond the listed hash ids are unique to this request.
            num_extra = input_len - len(ids)
            if cfg.text_prompts:
                rng = np.random.default_rng([cfg.seed, _EXTRA_KEY, index])
                extra, extra_text = tokens.random_prompt(rng, num_extra, text=True)
            else:
                extra = tokens.keyed_ids(cfg.seed, [_EXTRA_KEY + index], num_extra)[0].tolist()
                extra_text = ""
            ids, text = ids + extra, join_text(text, extra_text)
        arrival_s = (entry["timestamp"] - start_ms) / 1000.0 * cfg.time_scale
        output_len = _scaled(entry["output_length"], cfg.length_scale)
        turn = Turn(ids, output_len, text if cfg.text_prompts else None)
        sessions.append(Session(f"t{index}", [turn], arrival_s))
    sessions.sort(key=lambda s: s.arrival_s or 0.0)
    return sessions
