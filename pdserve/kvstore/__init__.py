"""Storage tiers below a worker's own KV pool: L2 host DRAM, L3 local disk, L4 Redis.

Torch-free: payloads are bytes. See base.py for the contract, tiered.py for how the tiers
stack, config.py for building a store from settings.
"""
