"""Time the KV transfer adds to the critical path of a disaggregated request, real model.

A prefill engine and a decode engine (same process, real SmolLM2 weights) prefill one prompt
of N tokens and hand its KV over. Measured per run: from the moment the prefill's last layer
finished (its `on_layer_done` of the last layer, last chunk) to the moment the decode side's
receiver reports the KV landed. In `full` mode that is the whole transfer; in `layerwise`
mode earlier layers moved while later ones computed, so only the tail remains.

    .venv/bin/python benchmarks/bench_transfer_ttft.py [--tokens 256 1024 2048 4096]

Prints a markdown table (median over repeats) and the share of `full`'s added time that
`layerwise` hides, per backend/cap.
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
from pdserve.workers.worker import shared_kv

SECRET = b"bench-ttft"
KV_BYTES = 4096 * 46080 + (64 << 20)


class Setup:
    """P and D engines joined by one backend; the cap is set per run on a fresh sender."""

    def __init__(self, backend: str) -> None:
        model_dir = resolve_model("smollm2-135m")
        cfg = EngineConfig(
            cache=CacheConfig(kv_cache_bytes=KV_BYTES, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=8192),
        )
        self.p = Engine(cfg, model_dir, "prefill")
        layout = KVLayout.from_tensor(self.p.runner.kv_cache)
        self.d = Engine(cfg, model_dir, "decode", shared_kv if backend == "shm" else None)
        self.rx = make_receiver(backend, self.d.runner.kv_cache, layout, SECRET)
        self.d.switch_role(self.d.decode_role(self.rx))
        self.backend, self.layout = backend, layout
        self.tx = None

    def run(self, num_tokens: int, mode: str, cap: str | None) -> float:
        if self.tx is not None:
            self.tx.close()
        self.tx = make_sender(self.backend, self.p.runner.kv_cache, self.layout, SECRET,
                              bandwidth_bps=cap)  # fmt: skip
        self.p.switch_role(self.p.prefill_role(self.tx, mode))
        rid = f"r{time.monotonic_ns()}"
        prompt = torch.randint(1000, 40000, (num_tokens,)).tolist()
        params = SamplingParams(max_tokens=2, temperature=0)
        blocks = self.d.reserve(rid, prompt, params).block_ids  # prefix caching is off
        self.p.add_prefill(rid, prompt, params, KVDestination(self.rx.address(), blocks))
        stamps = timed_handoff(self.p, self.d, self.rx, rid)
        return stamps["landed"] - stamps["last_layer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = [("shm", None), ("tcp", None), ("tcp", "100Gbit"), ("tcp", "10Gbit"), ("tcp", "1Gbit")]
    results = []
    setups = {b: Setup(b) for b in ("shm", "tcp")}
    for backend, cap in cases:
        for n in args.tokens:
            row = {"backend": backend, "cap": cap or "-", "tokens": n}
            for mode in ("full", "layerwise"):
                times = [setups[backend].run(n, mode, cap) for _ in range(args.repeats)]
                row[mode] = statistics.median(times) * 1e3
            row["hidden"] = 1 - row["layerwise"] / row["full"] if row["full"] > 0 else 0.0
            results.append(row)
            print(json.dumps(row), flush=True)
    print(
        "\n| backend | cap | tokens | KV MB | added by full (ms) | added by layerwise (ms) "
        "| hidden by layerwise |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['backend']} | {r['cap']} | {r['tokens']} | {r['tokens'] * 46080 / 1e6:.1f} "
            f"| {r['full']:.1f} | {r['layerwise']:.1f} | {r['hidden']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
