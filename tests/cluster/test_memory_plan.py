"""The launcher's memory plan: every worker's line, the host's total against what is
available, and a layout that cannot fit refused before anything starts (exit code 2), warned
about or not checked, as `memory_check` says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import envs
from pdserve.cluster.config import Pipeline
from pdserve.cluster.launcher import worker_specs
from pdserve.cluster.memory_plan import (
    MemoryPlanError,
    check_memory,
    host_available_bytes,
    plan_memory,
)
from pdserve.engine.memory import read_checkpoint
from tests.cluster.conftest import role


def pipeline(model, **kw) -> Pipeline:
    return Pipeline(model=str(model), prefill=role(), decode=role(num=2), **kw)


def test_plan_has_a_line_per_worker_and_the_host_total(tiny_served_model):
    p = pipeline(tiny_served_model)
    plan = plan_memory(read_checkpoint(p.model), worker_specs(p, ""), available_bytes=64 << 30)
    lines = plan.lines()
    assert [line.split(":")[0] for line in lines[:3]] == ["prefill-0", "decode-0", "decode-1"]
    assert "KV pool 0.00 GiB" in lines[0] and "host:" in lines[-1]
    kv = [w.memory.kv_pool for w in plan.workers]
    assert kv == [p.prefill.kv_cache_bytes] * 3
    assert plan.total_bytes == sum(w.memory.total for w in plan.workers) + plan.router_bytes
    assert plan.fits and plan.convert_bytes == 0  # an HF directory: nothing to convert


@pytest.mark.parametrize("mode", ["enforce", "warn", "off"])
def test_a_layout_that_does_not_fit(tiny_served_model, monkeypatch, mode):
    monkeypatch.setenv(envs.MEMORY_AVAILABLE, "100MiB")
    p = pipeline(tiny_served_model, memory_check=mode)
    lines: list[str] = []
    if mode == "enforce":
        with pytest.raises(MemoryPlanError) as refused:
            check_memory(p, worker_specs(p, ""), lines.append)
        message = str(refused.value)
        assert "3 workers need ~0.95 GiB" in message and "0.10 GiB available" in message
        assert "fewer workers" in message and "kv_cache_bytes" in message
    elif mode == "warn":
        plan = check_memory(p, worker_specs(p, ""), lines.append)
        assert not plan.fits and lines[-1].startswith("memory: warning: 3 workers need")
    else:
        assert check_memory(p, worker_specs(p, ""), lines.append) is None
    assert len(lines) == (0 if mode == "off" else 4 + (mode == "warn"))


def test_available_memory_is_meminfo_or_the_override(monkeypatch):
    monkeypatch.delenv(envs.MEMORY_AVAILABLE, raising=False)
    with open("/proc/meminfo") as f:
        total = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemTotal:"))
    assert 0 < host_available_bytes() <= total
    monkeypatch.setenv(envs.MEMORY_AVAILABLE, "3GiB")
    assert host_available_bytes() == 3 << 30
    monkeypatch.setenv(envs.MEMORY_AVAILABLE, "lots")
    with pytest.raises(ValueError, match="PDSERVE_MEMORY_AVAILABLE='lots' is not a size"):
        host_available_bytes()


def test_up_refuses_with_exit_2_naming_the_numbers(tiny_served_model):
    env = {**envs.child_env(b"x"), envs.MEMORY_AVAILABLE: "200MiB"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--model",
            str(tiny_served_model),
            "--kv-cache-bytes",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[1].startswith("pdserve: memory: prefill-0: weights ")
    assert "KV pool 0.06 GiB" in lines[1]
    assert lines[-1].startswith("pdserve: error: memory: 2 workers need ~")
    assert "0.20 GiB available" in lines[-1]
    assert "Traceback" not in out.stderr


def test_weights_read_in_place_count_once_per_host(tmp_path):
    from pdserve.model.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    p = Pipeline(model=str(path), prefill=role(num=2), decode=role(num=2))
    ckpt = read_checkpoint(p.model)
    plan = plan_memory(ckpt, worker_specs(p, ""), 64 << 30, needs_conversion=True)
    assert plan.shared_bytes == ckpt.in_place_bytes > 0
    assert plan.total_bytes == sum(w.memory.total for w in plan.workers) + (
        ckpt.in_place_bytes + plan.router_bytes
    )
    assert "shared weights (once per host)" in "\n".join(plan.lines())
    tight = plan_memory(ckpt, worker_specs(p, ""), 1 << 20)
    assert f"shared weights {ckpt.in_place_bytes / 2**30:.2f} GiB), this host" in tight.refusal()
    assert plan.convert_bytes < 1 << 30  # no fp32 weights are written for it
