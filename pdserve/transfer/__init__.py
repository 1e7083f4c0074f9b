"""KV transfer between prefill and decode workers (docs/transfer.md).

Torch-free names are exported here; backends load lazily through ``registry``.
"""

from pdserve.transfer.bandwidth import parse_bandwidth
from pdserve.transfer.base import KVReceiver, KVSender, TransferStatus
from pdserve.transfer.layout import KVLayout, coalesce_runs
from pdserve.transfer.registry import BACKENDS, TRANSFER_MODES, make_receiver, make_sender

__all__ = [
    "BACKENDS",
    "TRANSFER_MODES",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "TransferStatus",
    "coalesce_runs",
    "make_receiver",
    "make_sender",
    "parse_bandwidth",
]
