"""Serving benchmark for any OpenAI-compatible endpoint (``pdserve bench``).

Torch-free and transformers-free by design: workloads use the ``tokenizers`` package, the
client speaks HTTP/SSE, matplotlib is imported only for ``--plot``.

    workloads/trace -> sessions ─┐
    arrivals -> send times ──────┼─> runner -> client (SSE) -> RequestRecord -> metrics
                                 └─ search (find-goodput, SLO scale), compare, plots
"""
