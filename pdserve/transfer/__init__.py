"""KV transfer between prefill and decode workers (docs/transfer.md).

The contract is `SocketKVSender` and `SocketKVReceiver` (base.py draws the flow); backends
load lazily through ``registry``, so the control plane (which only validates names) never
imports torch.
"""
