"""The engine on a CUDA device (skipped without one). The data plane takes its device from
config, so the same code must give the CPU reference's greedy output there: batched,
chunked, preempted and prefix-cached alike. Run on a GPU machine with
`pytest tests/engine/test_cuda.py`."""

import pytest
import torch

from pdserve.config import DeviceConfig
from pdserve.sampling_params import SamplingParams
from tests.engine.test_engine import GREEDY, make_engine, prompts, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def engine(model_dir, device: str, num_blocks=256, dtype="float32", kv="auto", **sched):
    # the CPU reference is PyTorch's plain path; on CUDA the default config applies
    kernels = "torch" if device == "cpu" else "native"
    config = DeviceConfig(device, dtype, cpu_kernels=kernels)
    return make_engine(model_dir, num_blocks, device=config, kv_cache_dtype=kv, **sched)


def test_engine_runs_on_the_gpu(tiny_model_dir):
    gpu = engine(tiny_model_dir, "cuda")
    assert gpu.runner.kv_cache.device.type == "cuda"
    assert next(gpu.runner.model.parameters()).device.type == "cuda"


@pytest.mark.parametrize(
    "sched",
    [{}, {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 8}],
    ids=["whole", "chunked"],
)
def test_cuda_greedy_equals_cpu(tiny_model_dir, sched):
    batch = prompts(8, seed=4, lo=3, hi=60)
    cpu, gpu = engine(tiny_model_dir, "cpu", **sched), engine(tiny_model_dir, "cuda", **sched)
    assert run(gpu, batch) == run(cpu, batch)
    again = [p + [5, 6, 7] for p in batch[:3]]  # prefix-cache hits
    assert run(gpu, again) == run(cpu, again)


def test_cuda_preemption_equals_cpu_and_frees_every_block(tiny_model_dir):
    batch = prompts(6)
    gpu = engine(tiny_model_dir, "cuda", num_blocks=24)  # too few blocks for all six
    reqs = [gpu.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(batch)]
    while gpu.has_unfinished_requests():
        gpu.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert gpu.kv.num_free_blocks == 24
    cpu = engine(tiny_model_dir, "cpu")
    assert [r.output_token_ids for r in reqs] == run(cpu, batch)


def test_cuda_seeded_sampling_is_reproducible(tiny_model_dir):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=42)
    batch = prompts(3, seed=7)
    first = run(engine(tiny_model_dir, "cuda"), batch, params)
    assert run(engine(tiny_model_dir, "cuda"), batch, params) == first


@pytest.mark.parametrize(
    "dtype,kv", [("bfloat16", "auto"), ("float32", "fp8"), ("float32", "int8")]
)
def test_cuda_reduced_precision_runs(tiny_model_dir, dtype, kv):
    out = run(engine(tiny_model_dir, "cuda", dtype=dtype, kv=kv), prompts(4, seed=2))
    assert all(len(tokens) == GREEDY.max_tokens for tokens in out)
