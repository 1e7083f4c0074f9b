"""Time the KV transfer adds to a disaggregated request's first token, prefill and decode engines
in one process (BENCHMARKS.md, "Hosts and links"): from the prefill's last layer to the KV landed;
`full` sends after the prefill, `layerwise` each layer as it finishes, `--budgets` a dropped
prompt's kept blocks (docs/token-dropping.md). One JSON line per case.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.roles.base import KVDestination
from pdserve.model.registry import resolve_model
from pdserve.sampling_params import SamplingParams
from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.workers.worker import shared_kv

SECRET = b"bench-transfer-ttft"
KV_TOKEN_BYTES = 46080  # SmolLM2-135M, fp32 K+V


def timed_handoff(p: Engine, d: Engine, rx, rid: str) -> dict[str, float]:
    """`start`, `last_layer` and `landed` (perf_counter s) of `rid`, reserved on `d` and added
    to `p`; afterwards neither engine holds its blocks."""
    last_layer = p.model_config.num_layers - 1
    stamps: dict[str, float] = {}
    model = p.runner.model
    original = model.forward

    def forward(*args, **kwargs):
        hook = args[4] if len(args) > 4 else kwargs.get("on_layer_done")

        def timed(i):
            if hook:
                hook(i)
            if i == last_layer:
                stamps["last_layer"] = time.perf_counter()

        return original(*args[:4], timed)

    model.forward = forward
    landed = threading.Event()

    def watch():
        while not landed.is_set():
            for request_id, status, _ in rx.pop_finished():
                if request_id == rid and status is TransferStatus.DONE:
                    stamps["landed"] = time.perf_counter()
                    landed.set()
            time.sleep(0.0002)

    threading.Thread(target=watch, daemon=True).start()
    try:
        stamps["start"] = time.perf_counter()
        while p.has_unfinished_requests():
            p.step()
        if not landed.wait(120):
            raise RuntimeError("KV never landed")
    finally:
        model.forward = original
    d.role.awaiting[rid].landed = True  # consumed by the watcher: release the blocks
    d.abort_request(rid)
    while p.role.num_in_flight():
        p.role.poll()
        time.sleep(0.001)
    return stamps


class Setup:
    """P and D engines joined by one backend; a fresh sender per run (mode and cap)."""

    def __init__(self, backend: str, max_tokens: int) -> None:
        model_dir = resolve_model("smollm2-135m")
        kv_bytes = 2 * max_tokens * KV_TOKEN_BYTES + (64 << 20)
        cache = CacheConfig(kv_cache_bytes=kv_bytes, enable_prefix_caching=False)
        cfg = EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=8192))
        self.p = Engine(cfg, model_dir, "prefill")
        self.layout = KVLayout.from_tensor(self.p.runner.kv_cache)
        self.d = Engine(cfg, model_dir, "decode", shared_kv if backend == "shm" else None)
        self.rx = make_receiver(backend, self.d.runner.kv_cache, self.layout, SECRET)
        self.d.switch_role(self.d.decode_role(self.rx))
        self.backend, self.tx = backend, None

    def close(self) -> None:
        for end in filter(None, (self.tx, self.rx)):
            end.close()

    def run(self, prompt: list[int], mode: str, cap: str | None, budget: int | None) -> dict:
        if self.tx is not None:
            self.tx.close()
        self.tx = make_sender(
            self.backend, self.p.runner.kv_cache, self.layout, SECRET, bandwidth_bps=cap
        )
        self.p.switch_role(self.p.prefill_role(self.tx, mode))
        rid = f"r{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=2, temperature=0, kv_budget_tokens=budget)
        r = self.d.reserve(rid, prompt, params)
        if r is None:
            raise RuntimeError("the decode engine has no room for the prompt")
        self.p.add_prefill(
            rid, prompt, params, KVDestination(self.rx.address(), r.block_ids, 0, r.drop)
        )
        stamps = timed_handoff(self.p, self.d, self.rx, rid)
        sent = self.tx.stats()["requests"][rid]["bytes_sent"]
        ms = (stamps["landed"] - stamps["last_layer"]) * 1e3
        blocks = sent // (self.layout.block_bytes * self.layout.num_layers)
        return {"blocks": blocks, "mb": sent / 1e6, "ms": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--backends", nargs="+", default=["shm", "tcp"])
    caps = ["-", "100Gbit", "10Gbit", "1Gbit"]
    ap.add_argument("--caps", nargs="+", default=caps, help='tcp sender caps ("-": none)')
    ap.add_argument("--budgets", type=int, nargs="*", default=[], help="KV budgets (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(1000, 40000, (n,), generator=gen).tolist() for n in args.tokens}
    cases = [(None, "full"), (None, "layerwise")] + [(b, "layerwise") for b in args.budgets]
    for backend in args.backends:
        setup = Setup(backend, max(args.tokens))
        try:
            for cap, (n, prompt) in itertools.product(
                args.caps if backend == "tcp" else ["-"], prompts.items()
            ):
                full_ms = None
                for budget, mode in cases:
                    runs = [
                        setup.run(prompt, mode, None if cap == "-" else cap, budget)
                        for _ in range(args.repeats)
                    ]
                    row = dict(backend=backend, cap=cap, tokens=n, mode=mode, budget=budget)
                    row |= {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    full_ms = full_ms or row["ms"]
                    print(json.dumps(row | {"of_full": row["ms"] / full_ms}), flush=True)
        finally:
            setup.close()


if __name__ == "__main__":
    main()
