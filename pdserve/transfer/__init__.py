"""KV transfer between prefill and decode workers (docs/transfer.md): the backend and mode
names, the transfer's settings (`KVTransferConfig`), and the factories that build a receiver or
sender by backend name. The contract is `SocketKVSender` and `SocketKVReceiver` (base.py
draws the flow); backends load lazily here, so the control plane (which only validates
names) never imports torch. How ``auto`` chooses: docs/transfer.md, "Two backends".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.schema import check, knob, parse_bytes
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.limits import parse_bandwidth

if TYPE_CHECKING:  # torch-free at run time
    from pdserve.transfer.receiver import SocketKVReceiver
    from pdserve.transfer.sender import SocketKVSender

# mooncake: Mooncake's Transfer Engine moves the bytes (an optional package); auto never
# picks it.
BACKENDS = ("auto", "shm", "tcp", "mooncake")
# layerwise: one send per layer as the prefill computes it (transfer overlaps compute);
# full: one send of every layer after the prefill's last chunk.
TRANSFER_MODES = ("layerwise", "full")


@dataclass(frozen=True)
class KVTransferConfig:
    """The KV transfer channel. `bandwidth` caps the sender with a token bucket, to emulate a
    cluster network on one host; `buffer_pool_size` bounds staging memory."""

    backend: str = knob("auto", "how KV moves", choices=BACKENDS, flag="transfer")
    mode: str = knob(
        "layerwise", "send each layer as it is computed, or all at the end", choices=TRANSFER_MODES
    )
    buffer_pool_size: int = knob(64 * 2**20, "staging memory (bytes)", gt=0, parse=parse_bytes)
    bandwidth: str | None = knob(None, "e.g. 10Gbit (an emulated link)")
    # Deadlines on waits for a peer (engine/roles/ says which wait each bounds). Reserve
    # covers a saturated CPU prefill worker's whole queue; a dead one is noticed by the
    # router from its heartbeats long before.
    send_timeout_s: float = knob(5.0, "a prefill worker's wait for a send's acknowledgement", gt=0)
    reserve_timeout_s: float = knob(
        600.0, "a decode worker's wait for a reserved prompt's first KV", gt=0
    )
    land_timeout_s: float = knob(
        5.0, "a decode worker's wait for the KV after the first token", gt=0
    )

    def __post_init__(self) -> None:
        check(self)
        if self.bandwidth is not None:
            parse_bandwidth(self.bandwidth)


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {BACKENDS}")


def make_receiver(
    backend: str, kv: Any, layout: KVLayout, secret: bytes, **opts: Any
) -> SocketKVReceiver:
    """A receiver offering ``backend``; ``opts`` go to ``SocketKVReceiver`` (host, port,
    pool_bytes, buffer_bytes, shm_name). With shm the receiver unlinks the segment on close;
    with mooncake it starts an engine on ``host`` (MooncakeUnavailable without the library)."""
    _check(backend)
    from pdserve.transfer.receiver import SocketKVReceiver
    from pdserve.transfer.shm import shared_kv_name

    if backend == "mooncake":
        from pdserve.transfer.mooncake import MooncakeTarget

        target = MooncakeTarget(kv, layout, opts.get("host", "127.0.0.1"))
        return SocketKVReceiver(kv, layout, secret, backends=("mooncake",), mooncake=target, **opts)

    shm_name = opts.pop("shm_name", None)
    if backend in ("auto", "shm") and shm_name is None:
        shm_name = shared_kv_name(kv)
    if backend == "shm" and shm_name is None:
        raise ValueError("backend 'shm' needs kv allocated with create_shared_kv(layout)")
    if backend == "tcp":
        backends, shm_name = ("tcp",), None
    elif backend == "shm":
        backends = ("shm",)
    else:
        backends = ("tcp", "shm") if shm_name else ("tcp",)
    return SocketKVReceiver(kv, layout, secret, backends=backends, shm_name=shm_name, **opts)


def make_sender(
    backend: str, kv: Any, layout: KVLayout, secret: bytes, **opts: Any
) -> SocketKVSender:
    """A sender using ``backend``; ``opts`` go to ``SocketKVSender`` (bandwidth_bps,
    pool_bytes, buffer_bytes, checksum, stage, make_writer). With mooncake, the library must
    load (MooncakeUnavailable, a ValueError, says why not)."""
    _check(backend)
    from pdserve.transfer.mooncake import MooncakeUnavailable, unavailable
    from pdserve.transfer.sender import SocketKVSender

    if backend == "mooncake" and (why := unavailable()):
        raise MooncakeUnavailable(why)

    return SocketKVSender(kv, layout, secret, backend=backend, **opts)
