"""The step-cost model and hardware profiles: what a step, a transfer and a served request
cost, stored as versioned JSON. A leaf: it imports nothing of pdserve's runtime (stdlib,
numpy and `pdserve.schema` only), so the engine, workers, router, planner and simulator all
depend on it and it on none of them (tests/test_layering.py). `pdserve profile`, which
measures a profile by running the runtime, is the tool above them, in pdserve/perf."""
