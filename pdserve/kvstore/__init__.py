"""Storage tiers below a worker's own KV pool: L2 host DRAM, L3 local disk, L4 Redis
(docs/tiers.md). Torch-free: payloads are bytes."""
