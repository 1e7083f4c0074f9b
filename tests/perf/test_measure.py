"""`pdserve profile` end to end on a tiny random model: real engine steps in, a profile
whose cost model predicts them out."""

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from torch import nn

from pdserve.costmodel.profile import load_profile
from pdserve.costmodel.step_cost import StepCostModel, fit_cost_model
from pdserve.envs import WORKER_SPINCOUNT
from pdserve.model import native
from pdserve.model.gguf_convert import BLOCKS
from pdserve.model.quant_linear import (
    AMX_FLOAT_GEMV_M_MAX,
    QUANT_GEMV_M_MAX,
    QuantLinear,
    QuantTensor,
)
from pdserve.perf.measure import (
    PROBE_GRID,
    ProfileConfig,
    build_profile,
    entry_ratios,
    measure_steps,
    regimes,
    row_kernel_rows,
    timing_env,
    wake_extra,
)


@pytest.mark.slow
def test_profile_of_a_tiny_model(tiny_served_model, tmp_path):
    cores = len(os.sched_getaffinity(0))
    threads = (1, cores) if cores > 1 else (1,)  # and every core's: a size of served steps
    cfg = ProfileConfig(
        str(tiny_served_model),
        threads,
        kv_cache_bytes=1 << 20,
        decode_steps=4,
        repeats=1,
        grid=((16, 1), (200, 1), (32, 4), *PROBE_GRID),
        served_requests=3,
        wake_pauses=(0.01, 0.02),
    )
    timings = measure_steps(cfg, 1)
    samples = timings.samples
    # the probe's baseline: the grid's own steps of the probe's entries, 4 steps each
    assert len(timings.probe) == 4 * len(PROBE_GRID)
    assert {s.prefill_tokens for s, _ in timings.probe} == {0, 128, 320, 256}
    assert all(sample in samples for sample in timings.probe)
    assert [p for p, _ in timings.wake] == [0.01, 0.02] and all(x >= 0 for _, x in timings.wake)
    assert any(s.prefill_tokens == 200 for s, _ in samples)
    assert any(s.decode_requests == 4 and not s.prefill_tokens for s, _ in samples)
    profile = build_profile(cfg, log=lambda line: None)
    profile.save(tmp_path / "cpu.json")
    loaded = load_profile(tmp_path / "cpu.json")
    assert loaded.kind == "measured" and loaded.size_unit == "threads"
    assert set(loaded.transfer) == {"tcp", "shm"}
    assert loaded.kv_capacity_tokens(1) == (1 << 20) // loaded.model.kv_bytes_per_token
    assert loaded.cost_model(1).predict(samples[0][0]) > 0
    # the speed probe's baseline, the grid's steps of its shapes: near the fit they are part of
    probes = loaded.machine["probe"]
    assert probes.keys() == {str(t) for t in threads}
    assert all(p["shapes"] == [list(entry) for entry in PROBE_GRID] for p in probes.values())
    assert all(
        0.3 < p[k] < 3 and p["decode_steps"] == 4
        for p in probes.values()
        for k in ("prefill", "decode")
    )
    # Through a real router and worker: both legs take time, and far less than a second.
    assert 0 < loaded.served.request_s < 1 and 0 < loaded.served.token_s < 1
    if cores > 1:  # a served 1p1d ran: its prefill worker's first token came back, in well
        # under 1 s
        assert 0 < loaded.served.remote_token_s < 1
        # its decode worker started after the router's first token: a hop, not a second
        assert 0 <= loaded.served.start_decode_s < 1
        # the router and the client spent CPU on each streamed token: some, far below a step
        assert 0 < loaded.served.token_cpu_s < 0.05
    # each size's workers stepped under a load: a line per phase, in the model's units (a
    # tiny model's sub-millisecond decode steps less the token CPU scatter far from 1)
    assert loaded.served_steps.keys() == set(threads)
    for steps in loaded.served_steps.values():
        assert 0.02 < steps.prefill_factor < 50 and 0.02 < steps.decode_factor < 50
        assert steps.prefill_s < 1 and steps.decode_s < 1
    with pytest.raises(ValueError, match=f"no cost model for {cores + 1} threads"):
        loaded.cost_model(cores + 1)
    # --update: one thread count again, the others kept as they were
    updated = build_profile(replace(cfg, threads=(1,)), log=lambda line: None, base=loaded)
    assert updated.models.keys() == loaded.models.keys()
    assert updated.models[1].coefficients != loaded.models[1].coefficients  # measured again
    if cores > 1:
        assert updated.models[cores].coefficients == loaded.models[cores].coefficients
        assert updated.machine["kept"]["threads"] == [cores]
        assert updated.machine["probe"][str(cores)] == probes[str(cores)]
    assert updated.kv_cache_bytes == loaded.kv_cache_bytes
    assert updated.served_steps.keys() == loaded.served_steps.keys()


def test_a_grid_without_the_probes_entries_is_refused():
    with pytest.raises(ValueError, match=r"grid: lacks the speed probe's entries \[\(320, 1\)\]"):
        build_profile(ProfileConfig(grid=((128, 1), (64, 4))))


def test_update_refuses_a_profile_of_another_machine(tmp_path):
    from pdserve.costmodel.analytic import analytic_profile, model_shape

    with pytest.raises(ValueError, match="only a measured CPU profile rescales or updates"):
        build_profile(ProfileConfig(), base=analytic_profile(model_shape("llama-3-8b"), "H200"))


def test_profile_times_steps_under_a_workers_openmp_wait_policy():
    """Before torch loads, a worker's spin count; after, None (libgomp has read its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = (
        "import json, os; from pdserve.perf.measure import timing_env; "
        "print(json.dumps([timing_env(), os.environ.get('GOMP_SPINCOUNT')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [{"GOMP_SPINCOUNT": WORKER_SPINCOUNT}, WORKER_SPINCOUNT]
    operator = {**env, "OMP_WAIT_POLICY": "passive"}  # the operator's choice is kept
    out = subprocess.run(
        [sys.executable, "-c", code], env=operator, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [{"OMP_WAIT_POLICY": "passive"}, None]
    import torch  # noqa: F401  (loaded here already by the engine tests; now surely)

    assert timing_env() is None


def test_a_wake_point_counts_only_when_every_pair_was_slower_after_the_pause():
    assert wake_extra([0.020, 0.018, 0.025, 0.019, 0.030, 0.021, 0.022]) == pytest.approx(0.021)
    assert wake_extra([0.020, 0.018, 0.025, 0.019, 0.030, 0.021, -0.001]) == 0.0  # 6 of 7
    # Jitter larger than any effect: signs at random, and the median is not a cost.
    assert wake_extra([0.015, -0.010, 0.012, -0.004, 0.009, 0.014, -0.012]) == 0.0
    assert wake_extra([-0.002] * 7) == 0.0


def test_long_prompts_are_timed_past_the_grid_one_request_each(tmp_path):
    """`--long-prompt-lens`: a 1,200-token prompt prefills in 512-token chunks after prior
    context (the attention pairs a long-prompt workload reaches), then decodes at that
    context; the grid's own entries are timed as before."""
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(tmp_path, max_position_embeddings=2048)
    cfg = ProfileConfig(
        str(model),
        (1,),
        kv_cache_bytes=1 << 22,
        decode_steps=2,
        repeats=1,
        grid=PROBE_GRID,
        long_prompt_lens=(1200,),
        wake_pauses=(0.01,),
    )
    assert cfg.timed_grid == (*PROBE_GRID, (1200, 1))
    timings = measure_steps(cfg, 1)
    samples = timings.samples
    # the log's per-entry line: each entry's steps measured over the fit, the long prompt's too
    line = entry_ratios(fit_cost_model(samples), timings)
    assert [part.split(" x")[0] for part in line.split(", ")] == [
        "128x1",
        "320x1",
        "64x4",
        "1200x1",
    ]
    assert all(0.1 < float(part.split(" x")[1]) < 10 for part in line.split(", "))
    chunks = [s for s, _ in samples if s.prefill_tokens and s.prefill_attention_pairs > 512 * 512]
    assert chunks and all(s.prefill_tokens <= 512 for s in chunks)
    assert any(s.decode_requests == 1 and s.decode_context_tokens >= 1200 for s, _ in samples)


def test_long_prompt_lens_flag_and_bad_lengths():
    from pdserve.perf.cli import add_profile_parser

    parser = argparse.ArgumentParser()
    add_profile_parser(parser.add_subparsers())
    args = parser.parse_args(["profile", "--output", "p.json", "--long-prompt-lens", "4096,8192"])
    assert args.long_prompt_lens == (4096, 8192)
    with pytest.raises(ValueError, match="long_prompt_lens must be positive"):
        ProfileConfig(long_prompt_lens=(0,))


def test_max_entry_tokens_leaves_out_the_largest_entries_but_the_probes():
    cfg = ProfileConfig(max_entry_tokens=4096, long_prompt_lens=(8192,))
    assert (1024, 16) not in cfg.timed_grid and (256, 32) not in cfg.timed_grid
    assert (512, 8) in cfg.timed_grid and (128, 32) in cfg.timed_grid
    assert cfg.timed_grid[-1] == (8192, 1)  # a long prompt is not an entry the cap drops
    assert all(entry in cfg.timed_grid for entry in PROBE_GRID)
    tiny = ProfileConfig(max_entry_tokens=100)
    assert all(entry in tiny.timed_grid for entry in PROBE_GRID)
    assert (80, 1) in tiny.timed_grid and (128, 1) in tiny.timed_grid
    assert (192, 1) not in tiny.timed_grid


@pytest.mark.parametrize("isa", list(native.ISA_FLAGS))
def test_row_kernel_rows_is_the_gemv_m_max_of_most_weight_bytes(isa):
    """The cost model's split: where the linears holding most weight bytes leave the row
    kernels. On the amx kernels Q4_0 (no integer dot product) takes tiles above
    AMX_FLOAT_GEMV_M_MAX rows and Q4_K above QUANT_GEMV_M_MAX; other builds both above 16."""
    lib = native.load(isa)
    if lib is None:
        pytest.skip(f"the {isa} native kernels cannot run on this machine")

    def linear(qtype: int, rows: int) -> QuantLinear:
        values, nbytes = BLOCKS[qtype]
        return QuantLinear(
            lib, [QuantTensor(np.zeros((rows, 256 // values * nbytes), np.uint8), qtype, rows, 256)]
        )

    q4_0, q4_k = int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_K)
    amx = isa == "amx"
    mostly_q4_0 = nn.ModuleList([linear(q4_0, 64), linear(q4_k, 8)])
    mostly_q4_k = nn.ModuleList([linear(q4_0, 8), linear(q4_k, 64)])
    assert row_kernel_rows(mostly_q4_0) == (AMX_FLOAT_GEMV_M_MAX if amx else QUANT_GEMV_M_MAX)
    assert row_kernel_rows(mostly_q4_k) == QUANT_GEMV_M_MAX
    assert math.isinf(row_kernel_rows(nn.Linear(4, 4)))  # no row kernels: one regime


def test_the_profile_log_says_why_a_fit_kept_one_kernel_regime():
    split = StepCostModel([0.01] * 8, row_kernel_rows=16)
    one = StepCostModel([0.01] * 7)
    assert regimes(split, 16) == "rows in row kernels up to 16 a step, in tiles above"
    assert "no decode-only step over the engine's 16 row-kernel rows" in regimes(one, 16)
    assert regimes(one, math.inf) == "one kernel regime"
