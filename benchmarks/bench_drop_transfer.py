"""What dropping a prompt before the KV transfer saves on the channel, real model.

A prefill engine and a decode engine (same process, real SmolLM2 weights, tcp between them,
optionally capped) prefill one prompt of N tokens and hand its KV over, once per KV budget
(per request; "none" is the ordinary path, in each transfer mode). A prompt over its budget
is reserved and sent as only the blocks the decode worker keeps, in one send after the last
layer (engine/roles/prefill.py). Measured per run:

- blocks and bytes the sender moved for the request;
- transfer time: from the end of the prefill (its last layer of the last chunk) to the
  moment the decode side's receiver reports the KV landed. Layer-wise sending without a
  budget hides part of it behind the compute; a dropped prompt cannot (victims are known
  only after every layer), so compare its time with both `none` rows;
- prefill time: from the step's start to its last layer (includes the block scoring a
  dropped prompt needs).

    .venv/bin/python benchmarks/bench_drop_transfer.py [--tokens 1024] \\
        [--budgets 128 256 512] [--bandwidth 1Gbit] [--repeats 5]

Prints a markdown table of medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from handoff_clock import timed_handoff

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.roles.base import KVDestination
from pdserve.model.registry import resolve_model
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.layout import KVLayout

SECRET = b"bench-drop-transfer"


class Setup:
    """P and D engines joined by tcp; a fresh sender per run (mode and cap per run)."""

    def __init__(self, num_tokens: int) -> None:
        model_dir = resolve_model("smollm2-135m")
        kv_bytes = 2 * num_tokens * 46080 + (64 << 20)  # fp32: 46,080 bytes per token
        cfg = EngineConfig(
            cache=CacheConfig(kv_cache_bytes=kv_bytes, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=8192),
        )
        self.p = Engine(cfg, model_dir, "prefill")
        self.layout = KVLayout.from_tensor(self.p.runner.kv_cache)
        self.d = Engine(cfg, model_dir, "decode")
        self.rx = make_receiver("tcp", self.d.runner.kv_cache, self.layout, SECRET)
        self.d.switch_role(self.d.decode_role(self.rx))
        self.tx = None

    def close(self) -> None:
        for end in (self.tx, self.rx):
            if end is not None:
                end.close()

    def run(self, prompt: list[int], budget: int | None, mode: str, cap: str | None) -> dict:
        if self.tx is not None:
            self.tx.close()
        self.tx = make_sender("tcp", self.p.runner.kv_cache, self.layout, SECRET,
                              bandwidth_bps=cap)  # fmt: skip
        self.p.switch_role(self.p.prefill_role(self.tx, mode))
        rid = f"r{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=2, temperature=0, kv_budget_tokens=budget)
        r = self.d.reserve(rid, prompt, params)
        if r is None:
            raise RuntimeError("the decode engine has no room: raise kv_bytes")
        dest = KVDestination(self.rx.address(), r.block_ids, 0, r.drop)
        self.p.add_prefill(rid, prompt, params, dest)
        stamps = timed_handoff(self.p, self.d, self.rx, rid)
        sent = self.tx.stats()["requests"][rid]["bytes_sent"]
        return {
            "blocks": sent // (self.layout.block_bytes * self.layout.num_layers),
            "bytes": sent,
            "transfer_ms": (stamps["landed"] - stamps["last_layer"]) * 1e3,
            "prefill_ms": (stamps["last_layer"] - stamps["start"]) * 1e3,
        }


def cases(budgets: list[int]) -> list[tuple[int | None, str]]:
    """Without a budget in both modes; with one, the mode does not change the send."""
    return [(None, "full"), (None, "layerwise")] + [(b, "layerwise") for b in budgets]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--bandwidth", default=None, help='sender cap, e.g. "1Gbit" (default none)')
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    setup = Setup(args.tokens)
    prompt = torch.randint(1000, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    results = []
    try:
        for budget, mode in cases(args.budgets):
            runs = [setup.run(prompt.tolist(), budget, mode, args.bandwidth)
                    for _ in range(args.repeats)]  # fmt: skip
            row = {"budget": budget or "none", "mode": mode, "tokens": args.tokens,
                   "cap": args.bandwidth or "-"}  # fmt: skip
            for key in ("blocks", "bytes", "transfer_ms", "prefill_ms"):
                row[key] = statistics.median(r[key] for r in runs)
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        setup.close()
    base = next(r for r in results if r["budget"] == "none" and r["mode"] == "full")
    print(
        "\n| budget (tokens) | mode | cap | blocks sent | MB sent | transfer (ms) "
        "| vs none, full | prefill (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        share = r["transfer_ms"] / base["transfer_ms"] if base["transfer_ms"] > 0 else 0.0
        print(
            f"| {r['budget']} | {r['mode']} | {r['cap']} | {r['blocks']:.0f} "
            f"| {r['bytes'] / 1e6:.1f} | {r['transfer_ms']:.1f} | {share:.0%} "
            f"| {r['prefill_ms']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
