"""KV transfer between prefill and decode workers (DESIGN.md section 4).

Torch-free names are exported here; backends load lazily through ``registry``.
"""

from pdserve.transfer.bandwidth import parse_bandwidth
from pdserve.transfer.base import KVReceiver, KVSender, TransferStatus
from pdserve.transfer.layout import KVLayout, coalesce_runs
from pdserve.transfer.registry import BACKENDS, make_receiver, make_sender

__all__ = [
    "BACKENDS",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "TransferStatus",
    "coalesce_runs",
    "make_receiver",
    "make_sender",
    "parse_bandwidth",
]
