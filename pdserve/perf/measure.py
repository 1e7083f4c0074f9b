"""`pdserve profile`: time the real engine on this machine over a grid of step shapes, fit
the step-cost model per thread count, measure KV transfer bandwidth, write the profile.

The only perf module that loads torch (through the engine); the CLI imports it lazily.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from pdserve.config import CacheConfig, EngineConfig
from pdserve.perf.cost_model import StepShape, TransferModel, fit_cost_model
from pdserve.perf.profile import HardwareProfile, ModelShape
from pdserve.schema import check, knob, same_as

# (prompt tokens, concurrent requests): single prompts of growing length give prefill steps
# (chunked past the threshold, so with prior context too); batches give decode steps.
GRID = [(32, 1), (128, 1), (512, 1), (1024, 1), (2048, 1),
        (64, 4), (256, 4), (64, 16), (512, 8), (128, 32), (256, 32), (1024, 16)]  # fmt: skip
KNEES = (16, 32, 64, 128, 256)


def thread_counts(text: str) -> tuple[int, ...]:
    """'1,4' -> (1, 4)."""
    return tuple(int(t) for t in text.split(","))


@dataclass(frozen=True)
class ProfileConfig:
    """What `pdserve profile` measures; one flag per field (`schema.add_flags`)."""

    model: str = same_as(EngineConfig, "model")
    threads: tuple[int, ...] = knob(
        tuple(sorted({1, len(os.sched_getaffinity(0))})),
        "comma-separated thread counts to profile (one cost model each)", parse=thread_counts,
    )  # fmt: skip
    # None: the engine's default share of free memory
    kv_cache_bytes: int | None = same_as(CacheConfig, "kv_cache_bytes")
    decode_steps: int = knob(12, "tokens each grid request generates", ge=2)
    repeats: int = knob(2, "measured passes over the grid, after one warm-up pass", ge=1)
    grid: tuple[tuple[int, int], ...] = knob(tuple(GRID), cli=False)

    def __post_init__(self) -> None:
        check(self)
        if not self.threads or min(self.threads) < 1:
            raise ValueError(f"threads must be positive integers, got {self.threads}")


def measure_steps(cfg: ProfileConfig, threads: int) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of every engine step over the grid, after one warm-up pass."""
    from pdserve.config import DeviceConfig
    from pdserve.engine.engine import Engine
    from pdserve.sampling_params import SamplingParams

    config = EngineConfig(
        model=cfg.model,
        cache=CacheConfig(kv_cache_bytes=cfg.kv_cache_bytes, enable_prefix_caching=False),
        device=DeviceConfig(threads=threads),
    )
    engine = Engine(config)
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    samples: list[tuple[StepShape, float]] = []
    params = SamplingParams(max_tokens=cfg.decode_steps, ignore_eos=True)
    for rep in range(cfg.repeats + 1):
        for index, (prompt_len, num_requests) in enumerate(cfg.grid):
            for i in range(num_requests):
                prompt = rng.integers(0, vocab, size=prompt_len).tolist()
                engine.add_request(f"{rep}-{index}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
                if rep > 0:  # the first pass warms caches and kernels
                    samples.append((engine.last_shape, elapsed))
    return samples


def tcp_bandwidth(num_bytes: int = 64 * 2**20) -> TransferModel:
    """Loopback TCP: what the tcp backend's bytes pay in the kernel, one stream."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = b"\0" * (4 * 2**20)

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(4 * 2**20):
                pass

    thread = threading.Thread(target=sink)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        t = time.perf_counter()
        client.sendall(b"\0")
        latency = time.perf_counter() - t
        start = time.perf_counter()
        for _ in range(num_bytes // len(payload)):
            client.sendall(payload)
    thread.join()
    server.close()
    return TransferModel(num_bytes / (time.perf_counter() - start), latency)


def shm_bandwidth(num_bytes: int = 64 * 2**20) -> TransferModel:
    """Shared memory: the shm backend copies into the segment and out of it (two copies)."""
    src, mid, dst = (np.ones(num_bytes, np.uint8) for _ in range(3))
    start = time.perf_counter()
    np.copyto(mid, src)
    np.copyto(dst, mid)
    return TransferModel(num_bytes / (time.perf_counter() - start), 0.0)


def model_shape(name: str) -> ModelShape:
    from pdserve.model.config import ModelConfig
    from pdserve.model.registry import resolve_model

    cfg = ModelConfig.from_dir(resolve_model(name))
    return ModelShape(
        name, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
        cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, weight_bytes_per_param=4.0,
        kv_bytes_per_element=4.0, tie_word_embeddings=cfg.tie_word_embeddings,
    )  # fmt: skip


def default_kv_cache_bytes() -> int:
    """What a CPU worker gets without --kv-cache-bytes (model_runner's default share)."""
    import torch

    from pdserve.engine.model_runner import DEFAULT_CPU_KV_FRACTION, available_memory_bytes

    return int(available_memory_bytes(torch.device("cpu")) * DEFAULT_CPU_KV_FRACTION)


def build_profile(cfg: ProfileConfig, log=print) -> HardwareProfile:
    if cfg.kv_cache_bytes is None:
        cfg = replace(cfg, kv_cache_bytes=default_kv_cache_bytes())
    models = {}
    for threads in cfg.threads:
        samples = measure_steps(cfg, threads)
        models[threads] = fit_cost_model(samples, KNEES)
        errors = [abs(models[threads].predict(s) / t - 1) for s, t in samples]
        log(f"threads {threads}: {len(samples)} steps, fit error median "
            f"{np.median(errors):.1%}, p90 {np.percentile(errors, 90):.1%}")  # fmt: skip
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return HardwareProfile(
        kind="measured",
        device=f"cpu: {cpu}",
        model=model_shape(cfg.model),
        size_unit="threads",
        models=models,
        transfer={"tcp": tcp_bandwidth(), "shm": shm_bandwidth()},
        devices_per_node=len(os.sched_getaffinity(0)),
        kv_cache_bytes=cfg.kv_cache_bytes,
        machine={
            "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)),
            "host": platform.node(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },  # fmt: skip
    )
