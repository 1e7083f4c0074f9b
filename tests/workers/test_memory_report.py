"""A worker's Stats carry its memory: RSS and PSS of the process, its weights' and KV pool's
bytes; the launcher's estimate of the same worker is within a stated margin of its RSS."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve import messages as m
from pdserve.config import CacheConfig, DeviceConfig, EngineConfig
from pdserve.engine.memory import estimate_worker, read_checkpoint
from pdserve.model.cpu_linear import pack_linears
from pdserve.model.loader import load_model
from pdserve.workers.memory_report import held_weight_bytes, process_memory, resident_bytes
from tests.workers.conftest import KV_BYTES, WorkerProcess

# The estimate is the peak of a worker's start; the tiny model's RSS is mostly the
# interpreter and its libraries (BASE_RSS_BYTES), which vary by a few tens of MiB.
MARGIN = 0.25


def test_stats_report_memory_and_the_estimate_is_near_it(tiny_model_dir):
    core = sorted(os.sched_getaffinity(0))[:1]
    worker = WorkerProcess(tiny_model_dir, tuple(core))
    try:
        stats = worker.expect(m.Stats, timeout_s=30)
        status = open(f"/proc/{worker.popen.pid}/status").read()
        peak = next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmHWM"))
    finally:
        worker.close()
    assert stats.kv_pool_bytes == KV_BYTES
    assert 0 < stats.pss_bytes <= stats.rss_bytes <= peak
    fp32 = read_checkpoint(str(tiny_model_dir)).fp32_bytes
    assert stats.weight_bytes >= fp32  # the loaded weights, plus the kernels' packed copies
    engine = EngineConfig(
        model=str(tiny_model_dir),
        cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        device=DeviceConfig(threads=1),
    )
    ckpt = read_checkpoint(str(tiny_model_dir))
    amx = False  # the tiny HF checkpoint's panels are fp32: AMX changes nothing here
    estimate, _ = estimate_worker(ckpt, engine, "collocated", 1 << 30, amx)
    assert abs(estimate.total - peak) <= MARGIN * peak, (estimate, peak)


def test_process_memory_reads_smaps_rollup(tmp_path):
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("00400000-7fff [rollup]\nRss:    2048 kB\nPss:    1024 kB\n")
    assert process_memory(str(rollup)) == (2 << 20, 1 << 20)
    assert process_memory(str(tmp_path / "missing")) == (0, 0)
    rss, pss = process_memory()
    assert rss >= pss > 0


def test_fields_never_read_smaps_only_refresh_does(monkeypatch):
    """The step loop builds Stats from fields(); the heartbeat thread calls refresh(), which
    re-reads RSS from statm every REFRESH_S and walks smaps_rollup for PSS only every
    PSS_REFRESH_S (the walk took 13-30 ms of a core, a stalled step on a 2-core host)."""
    from pdserve.workers import memory_report

    walks = []
    monkeypatch.setattr(memory_report, "process_memory", lambda: walks.append(1) or (3, 2))
    monkeypatch.setattr(memory_report, "resident_bytes", lambda: 4)
    report = memory_report.MemoryReport(torch.nn.Linear(2, 2), torch.zeros(4))
    assert len(walks) == 1
    for _ in range(3):
        assert report.fields()["rss_bytes"] == 3
    report.refresh()  # REFRESH_S has not passed
    assert report.fields()["rss_bytes"] == 3
    report._read_at -= memory_report.REFRESH_S
    report.fields()
    assert report.fields()["rss_bytes"] == 3
    report.refresh()  # RSS from the counters, PSS kept
    assert len(walks) == 1
    assert (report.fields()["rss_bytes"], report.fields()["pss_bytes"]) == (4, 2)
    monkeypatch.setattr(memory_report, "process_memory", lambda: walks.append(1) or (5, 4))
    report._read_at -= memory_report.REFRESH_S
    report._pss_read_at -= memory_report.PSS_REFRESH_S
    report.refresh()
    assert len(walks) == 2
    assert (report.fields()["rss_bytes"], report.fields()["pss_bytes"]) == (5, 4)


def test_resident_bytes_reads_statm(tmp_path):
    statm = tmp_path / "statm"
    statm.write_text("1000 25 10 1 0 20 0\n")
    assert resident_bytes(str(statm)) == 25 * os.sysconf("SC_PAGE_SIZE")
    assert resident_bytes(str(tmp_path / "missing")) == 0
    rss, _ = process_memory()
    assert abs(resident_bytes() - rss) < 0.1 * rss  # counters against the walk


@pytest.mark.parametrize("tied", [False, True])
def test_held_weights_count_a_tied_tensor_once_and_packed_copies(tiny_model_dir, tmp_path, tied):
    from tests.conftest import make_tiny_llama

    model = load_model(make_tiny_llama(tmp_path, tie_word_embeddings=tied))
    unique = {p.data_ptr(): p.numel() * 4 for p in model.parameters()}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert held_weight_bytes(model) == sum(unique.values()) + buffers
    if torch.backends.mkldnn.is_available():
        linears = sum(
            mod.weight.numel() * 4 for mod in model.modules() if isinstance(mod, torch.nn.Linear)
        )
        pack_linears(model, panels=None, onednn=True)
        # The oneDNN copy replaces each linear's weight; the tied embedding stays.
        assert held_weight_bytes(model) >= linears


def test_held_weights_of_a_gguf_read_in_place_are_its_mapped_tensors(tmp_path):
    from pdserve.model.registry import resolve_model
    from pdserve.model.synthetic import SHAPES, file_bytes, write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    model = load_model(resolve_model(str(path), cache_dir=tmp_path / "cache"))
    rope = sum(b.numel() * b.element_size() for b in model.buffers())
    # The file's tensors once (the tied embedding serves the output too), its norms copied.
    norms = sum(p.numel() * 4 for p in model.parameters())
    held = held_weight_bytes(model)
    assert file_bytes(SHAPES["tiny"], "q4_k_m") + rope <= held
    assert held <= file_bytes(SHAPES["tiny"], "q4_k_m") + rope + norms
