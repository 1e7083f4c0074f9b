"""A GGUF model read in place (gguf_weights.py) equals the same file converted to fp32, refuses
types it does not run by name, and its mapped pages are shared between processes."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from pdserve.model import gguf_convert, quant_linear
from pdserve.model.gguf_weights import load_gguf_model, weights_source
from pdserve.model.loader import load_model
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX, QuantLinear
from pdserve.model.registry import resolve_model
from pdserve.model.synthetic import SHAPES, tensor_specs, write_synthetic_gguf
from tests.model.test_llama import our_logits


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """The tiny shape in llama.cpp's Q4_K_M mix (Q4_K, Q6_K attn_v/ffn_down and output)."""
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.q4_k_m.gguf", "tiny")


@pytest.fixture(scope="module")
def fp32_dir(q4_k_m, tmp_path_factory):
    """The old conversion of the same file: every tensor dequantized to fp32 safetensors
    (Q/K rows un-permuted by transformers' code)."""
    reader = gguf_convert._open_reader(q4_k_m)
    config = gguf_convert.build_config(
        gguf_convert._read_metadata(reader, q4_k_m), reader.tensors, q4_k_m
    )
    out_dir = tmp_path_factory.mktemp("fp32")
    gguf_convert._write_weights(reader, config, q4_k_m, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def test_resolved_directory_holds_no_weights(q4_k_m, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = resolve_model(str(q4_k_m))
    assert weights_source(model_dir) == q4_k_m.resolve()
    assert not list(model_dir.glob("*.safetensors"))  # no fp32 copy on disk
    assert resolve_model(str(q4_k_m)) == model_dir  # and the directory is reused


def test_in_place_model_matches_fp32_conversion(lib, q4_k_m, fp32_dir, monkeypatch):
    """With fp32 activations (int8 off) the kernels are the conversion up to summation order."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", 0)
    reference = load_model(fp32_dir)
    model = load_gguf_model(q4_k_m, reference.config)
    types = {p.qtype for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts}
    assert types == {int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q6_K)}
    for n in (9, QUANT_GEMV_M_MAX + 5):  # the fused kernel, then dequantized tiles
        ids = [(i * 7919) % 49152 for i in range(1, n + 1)]
        ours, theirs = our_logits(model, ids), our_logits(reference, ids)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_int8_activations_stay_near_the_fp32_conversion(lib, q4_k_m, fp32_dir, monkeypatch):
    """Int8 activations (the batch-1 default; here on for 9 prompt rows, each quantized as a
    decode row is) round each linear's input to 1/254 of its block's largest value: through
    2 layers and the head the tiny model's logits move by 1.2% of their spread on average
    (3e-2 at most, measured); a wrong block decode moves them by the spread itself. The
    greedy token may differ only where the fp32 top two nearly tie."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", QUANT_GEMV_M_MAX)
    reference = load_model(fp32_dir)
    model = load_gguf_model(q4_k_m, reference.config)
    ids = [(i * 7919) % 49152 for i in range(1, 10)]
    ours, theirs = our_logits(model, ids), our_logits(reference, ids)
    diff = (ours - theirs).abs()
    assert 0 < diff.mean() < 0.03 * theirs.std() and diff.max() < 0.25 * theirs.std()
    chosen = theirs.gather(-1, ours.argmax(-1, keepdim=True))[:, 0]
    assert torch.all(chosen >= theirs.max(-1).values - 2 * diff.max(-1).values)


@pytest.mark.parametrize("file_type", ["q8_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k", "f16"])
def test_panel_types_keep_the_converted_path(file_type):
    """Files of Q4_0/Q4_1/Q8_0/F32 only (the default model) stay on the lossless compact
    panels; llama.cpp's Q4_1 files hold a Q6_K output matrix, so they are read in place."""
    specs = tensor_specs(SHAPES["tiny"], file_type)
    tensors = [SimpleNamespace(tensor_type=s.qtype) for s in specs]
    assert gguf_convert.reads_in_place(tensors) == (file_type != "q8_0")


def test_unsupported_type_is_refused_by_name(tmp_path):
    path = tmp_path / "q2k.gguf"
    writer = GGUFWriter(path, "llama")
    blocks = np.zeros((4, 84), np.uint8)  # 4 rows of one Q2_K block (256 values, 84 bytes)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFReader(path).tensors
    assert gguf_convert.reads_in_place(tensors)  # never widened to fp32 either
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has type Q2_K"):
        gguf_convert.check_types(tensors, path)


def test_non_cpu_device_is_refused(q4_k_m):
    from pdserve.model.config import ModelConfig

    with pytest.raises(ValueError, match="run on the CPU"):
        load_gguf_model(q4_k_m, ModelConfig(1, 1, 1, 1, 1, 1, 1), device="meta")


READER = """
import sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
print(sum(int(t.data.view('uint8').sum()) for t in r.tensors) > 0, flush=True)
sys.stdin.readline()
"""


def mapping(pid: int, path) -> dict[str, int]:
    """Rss and Pss (kB) of the mappings of `path` in process `pid`."""
    totals, inside = {"Rss": 0, "Pss": 0}, False
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0].rstrip(":") in totals:
            totals[fields[0].rstrip(":")] += int(fields[1])
    return totals


def test_two_processes_share_the_mapped_weights(tmp_path):
    q4_k_m = tmp_path / "weights.gguf"  # 4 MiB of Q4_K blocks
    writer = GGUFWriter(q4_k_m, "llama")
    blocks = np.random.default_rng(0).integers(0, 256, (1024, 144 * 28), np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(q4_k_m)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        assert all(p.stdout.readline().strip() == "True" for p in procs)
        time.sleep(0.1)
        usage = [mapping(p.pid, q4_k_m.resolve()) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)
    size_kb = q4_k_m.stat().st_size // 1024
    for u in usage:
        assert u["Rss"] > 0.9 * size_kb  # each maps the whole file...
        assert u["Pss"] < 0.6 * u["Rss"]  # ...and owns about half of it: the pages are shared
