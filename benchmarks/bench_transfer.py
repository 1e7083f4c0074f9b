"""KV transfer bandwidth: plain memcpy vs shm vs tcp (uncapped and capped), one run.

KV sizes match SmolLM2-135M (30 layers, 3 kv heads, head_dim 64, fp32, block 16: 46,080
bytes of K+V per token). Each cell is the median over repeats of the time from ``send`` to
the receiver reporting DONE, the number the engine waits on. Prints a markdown table and
one JSON line (prefixed ``JSON``) for scripts.

    .venv/bin/python benchmarks/bench_transfer.py [--tokens 256 1024] [--repeats 5]
    .venv/bin/python benchmarks/bench_transfer.py --layer-gap-ms 10 --tokens 256 --caps 1Gbit

With ``--layer-gap-ms`` each cell is instead the *tail* of a layer-wise send whose layers
are that far apart (the next layer's compute): from the last layer's send to DONE, the part
layer-wise transfer cannot hide. Under a cap it must not drop below one layer's time at the
cap less the bucket's burst (docs/transfer.md, "Bandwidth cap").

The engine-side "time added to TTFT" comparison reuses ``TransferPair`` and
``transfer_seconds`` (``mode="layerwise"`` sends one layer at a time, as prefill would).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.limits import parse_bandwidth
from pdserve.transfer.shm import create_shared_kv, unlink_shared_kv

SECRET = b"bench-secret"
SMOLLM2_135M = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}
DEFAULT_TOKENS = [256, 512, 1024, 2048, 4096]
DEFAULT_CAPS = ["1Gbit", "10Gbit", "100Gbit"]


def smollm_layout(num_tokens: int) -> KVLayout:
    return KVLayout(num_blocks=-(-num_tokens // 16), dtype="float32", **SMOLLM2_135M)


def memcpy_gbps(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's plain host memcpy bandwidth (GB/s) through torch, the ceiling for shm."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


class TransferPair:
    """A receiver and a sender in this process, over ``backend`` (shm or tcp)."""

    def __init__(self, backend: str, layout: KVLayout, **sender_opts: Any) -> None:
        self.layout, self.shm_name = layout, None
        if backend == "shm":
            rx_kv, self.shm_name = create_shared_kv(layout)
            rx_kv.zero_()  # fault pages in, as a long-running decode worker's pool would be
        else:
            rx_kv = torch.zeros(layout.shape)
        self.tx_kv = torch.randn(layout.shape)
        self.rx = make_receiver(backend, rx_kv, layout, SECRET)
        self.tx = make_sender(backend, self.tx_kv, layout, SECRET, **sender_opts)
        self.peer = self.rx.address()
        self._next_id = 0

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        if self.shm_name:
            unlink_shared_kv(self.shm_name)


def transfer_seconds(pair: TransferPair, num_blocks: int, mode: str = "full") -> float:
    """Seconds from the first ``send`` to DONE on the receiver for ``num_blocks`` blocks of
    every layer; ``mode`` is "full" (one send) or "layerwise" (one send per layer)."""
    pair._next_id += 1
    request_id = f"bench-{pair._next_id}"
    ids = list(range(num_blocks))
    layers = list(range(pair.layout.num_layers))
    pair.rx.expect(request_id, ids)
    start = time.perf_counter()
    if mode == "full":
        pair.tx.send(pair.peer, request_id, layers, ids, ids, last=True)
    elif mode == "layerwise":
        for layer in layers:
            pair.tx.send(pair.peer, request_id, [layer], ids, ids, last=layer == layers[-1])
    else:
        raise ValueError(f"mode must be 'full' or 'layerwise', got {mode!r}")
    return _finish(pair, request_id, start)


def tail_seconds(pair: TransferPair, num_blocks: int, gap_s: float) -> float:
    """Layer-wise sends ``gap_s`` apart; seconds from the last layer's send to DONE."""
    pair._next_id += 1
    request_id = f"bench-{pair._next_id}"
    ids = list(range(num_blocks))
    final = pair.layout.num_layers - 1
    pair.rx.expect(request_id, ids)
    for layer in range(final + 1):
        time.sleep(gap_s)
        start = time.perf_counter()
        pair.tx.send(pair.peer, request_id, [layer], ids, ids, last=layer == final)
    return _finish(pair, request_id, start)


def _finish(pair: TransferPair, request_id: str, start: float) -> float:
    """Seconds from ``start`` to the receiver's DONE; then release and wait for the sender."""
    while True:
        finished = {rid: (status, error) for rid, status, error in pair.rx.pop_finished()}
        if request_id in finished:
            break
        time.sleep(0.0002)
    elapsed = time.perf_counter() - start
    status, error = finished[request_id]
    if status != TransferStatus.DONE:
        raise RuntimeError(f"transfer failed: {error}")
    pair.rx.release(request_id)
    while request_id not in {rid for rid, _, _ in pair.tx.pop_finished()}:
        time.sleep(0.0002)
    return elapsed


def bench_cell(
    backend: str, num_tokens: int, repeats: int, gap_s: float | None = None, **opts: Any
) -> float:
    layout = smollm_layout(num_tokens)
    pair = TransferPair(backend, layout, **opts)

    def measure() -> float:
        if gap_s is None:
            return transfer_seconds(pair, layout.num_blocks)
        return tail_seconds(pair, layout.num_blocks, gap_s)

    try:
        measure()  # warm-up: connect, map, fault pages
        times = [measure() for _ in range(repeats)]
    finally:
        pair.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caps", nargs="*", default=DEFAULT_CAPS, help="tcp bandwidth caps")
    parser.add_argument("--layer-gap-ms", type=float, default=None, help="measure tails")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.layer_gap_ms is not None:
        print_tails(args)
        return

    columns = [("shm", "shm", {}), ("tcp", "tcp", {})]
    columns += [(f"tcp@{cap}", "tcp", {"bandwidth_bps": cap}) for cap in args.caps]
    copy_gbps = memcpy_gbps()
    rows = []
    for num_tokens in args.tokens:
        nbytes = smollm_layout(num_tokens).total_bytes
        row = {"tokens": num_tokens, "bytes": nbytes, "memcpy_ms": nbytes / copy_gbps / 1e6}
        for name, backend, opts in columns:
            row[f"{name}_ms"] = 1e3 * bench_cell(backend, num_tokens, args.repeats, **opts)
        rows.append(row)

    print(f"memcpy (torch, 256 MiB): {copy_gbps:.2f} GB/s\n")
    names = [name for name, _, _ in columns]
    print("| tokens | KV MB | memcpy ms | " + " | ".join(f"{n} ms (GB/s)" for n in names) + " |")
    print("|---" * (3 + len(names)) + "|")
    for row in rows:
        cells = [f"{row[f'{n}_ms']:.1f} ({row['bytes'] / row[f'{n}_ms'] / 1e6:.2f})" for n in names]
        head = f"| {row['tokens']} | {row['bytes'] / 1e6:.1f} | {row['memcpy_ms']:.1f} | "
        print(head + " | ".join(cells) + " |")
    print("JSON " + json.dumps({"memcpy_gbps": copy_gbps, "repeats": args.repeats, "rows": rows}))


def print_tails(args: argparse.Namespace) -> None:
    gap_s = args.layer_gap_ms / 1e3
    print(
        "| tokens | layer KB | cap | layer ms at cap | tcp tail ms | shm tail ms |\n"
        + "|---" * 6
        + "|"
    )
    for num_tokens in args.tokens:
        layout = smollm_layout(num_tokens)
        layer_bytes = layout.num_blocks * layout.block_bytes
        for cap in args.caps or [None]:
            tails = [
                1e3 * bench_cell(b, num_tokens, args.repeats, gap_s, bandwidth_bps=cap)
                for b in ("tcp", "shm")
            ]
            ideal = f"{8e3 * layer_bytes / parse_bandwidth(cap):.2f}" if cap else "-"
            print(f"| {num_tokens} | {layer_bytes / 1e3:.0f} | {cap or '-'} | {ideal} | "
                  f"{tails[0]:.2f} | {tails[1]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
