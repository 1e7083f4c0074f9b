"""A GGUF model read in place (gguf_weights.py) equals the same file converted to fp32, for
every family and type the kernels read, refuses types it does not run by name, and its mapped
pages are shared between processes; the loading rule picks which files are read in place."""

import json
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from pdserve.config import EngineConfig
from pdserve.model import gguf_convert, native, quant_linear
from pdserve.model.gguf_weights import load_gguf_model, weights_source
from pdserve.model.loader import load_model
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX, QuantLinear
from pdserve.model.registry import known_gguf_path, resolve_model, wants_in_place
from pdserve.model.synthetic import SHAPES, tensor_specs, write_synthetic_gguf
from tests.model.test_llama import assert_logits_on_each_path, our_logits


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
    """With fp32 activations (int8 and AMX tiles off) the kernels are the conversion up to
    summation order."""
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", 0)
    monkeypatch.setattr(quant_linear, "AMX_TILES", False)
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


TINY = SHAPES["tiny"]
# A tiny file of each family read in place, and a type its matrices are in.
FAMILY_FILES = {
    "llama-q8_0": (TINY, "q8_0"),
    "llama-q4_0": (TINY, "q4_0"),
    "llama-q4_1": (TINY, "q4_1"),
    "qwen2-q8_0": (replace(TINY, architecture="qwen2"), "q8_0"),
    "qwen3-q4_k_m": (replace(TINY, architecture="qwen3", key_length=128), "q4_k_m"),
    "phi3-q4_0": (replace(TINY, architecture="phi3", tie_word_embeddings=False), "q4_0"),
}


def greedy(model, ids: list[int], num_tokens: int = 4) -> list[int]:
    ids = list(ids)
    for _ in range(num_tokens):
        ids.append(int(our_logits(model, ids)[-1].argmax()))
    return ids[-num_tokens:]


def fp32_conversion(path, out_dir):
    """The file's fp32 conversion, weights and config only (no tokenizer: seconds saved)."""
    reader = gguf_convert._open_reader(path)
    metadata = gguf_convert._read_metadata(reader, path)
    config = gguf_convert.build_config(metadata, reader.tensors, path)
    out_dir.mkdir()
    gguf_convert._write_weights(reader, config, path, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


@pytest.mark.parametrize("name", FAMILY_FILES)
def test_family_read_in_place_matches_its_fp32_conversion(name, tmp_path, monkeypatch):
    """Llama's permuted Q/K rows, Qwen2's biases, Qwen3's Q/K norms, Phi-3's fused QKV and
    gate|up, in Q8_0/Q4_0/Q4_1 (and the Q6_K output of llama.cpp's Q4 files) or K-quants:
    with fp32 activations the logits are the conversion's up to summation order, and so are
    the greedy tokens; where the 9 prompt rows take AMX tiles (int8 off: every type here but
    Q4_K/Q6_K's), the logits are within bf16's bound too. (This machine's kernels; the ISA
    variants are tested above.)"""
    if native.load() is None:
        pytest.skip("GGUF weights read in place need the native CPU kernels")
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", 0)
    shape, file_type = FAMILY_FILES[name]
    path = write_synthetic_gguf(tmp_path / f"{name}.gguf", shape, file_type)
    reference = load_model(fp32_conversion(path, tmp_path / "fp32"))
    assert not any(isinstance(m, QuantLinear) for m in reference.modules())
    model = load_gguf_model(path, reference.config)
    down = next(s for s in tensor_specs(shape, file_type) if s.name == "blk.1.ffn_down.weight")
    assert {p.qtype for p in model.layers[1].mlp.down_proj.parts} == {int(down.qtype)}
    ids = [(i * 7919) % 49152 for i in range(1, 10)]
    assert_logits_on_each_path(model, ids, our_logits(reference, ids))
    monkeypatch.setattr(quant_linear, "AMX_FLOAT_GEMV_M_MAX", QUANT_GEMV_M_MAX)  # fp32 rows
    assert greedy(model, ids) == greedy(reference, ids)


@pytest.mark.parametrize("name", ["qwen2-q8_0", "qwen3-q4_k_m", "phi3-q4_0"])
def test_family_in_place_engine_generates_the_conversions_tokens(name, tmp_path, monkeypatch):
    """Served: the engine's native one-call decode step (two requests a step) on the file
    read in place gives the greedy tokens of its fp32 conversion (int8 activations off)."""
    from tests.model.test_families import generate

    if native.load() is None:
        pytest.skip("GGUF weights read in place need the native CPU kernels")
    monkeypatch.setattr(quant_linear, "INT8_M_MAX", 0)
    shape, file_type = FAMILY_FILES[name]
    path = write_synthetic_gguf(tmp_path / f"{name}.gguf", shape, file_type)
    in_place_dir = gguf_convert.convert_gguf(path, tmp_path / "in_place", in_place=True)
    ours, engine = generate(in_place_dir, "native")
    assert engine.runner.model.layers.one_call
    assert ours == generate(fp32_conversion(path, tmp_path / "fp32"), "native")[0]


def test_family_tensors_are_views_of_the_mapped_file(tmp_path):
    """Phi-3's fused matrices are read where they lie (no weight byte copied), through the
    directory the registry makes for a file read in place."""
    if native.load() is None:
        pytest.skip("GGUF weights read in place need the native CPU kernels")
    shape, file_type = FAMILY_FILES["phi3-q4_0"]
    path = write_synthetic_gguf(tmp_path / "phi3.gguf", shape, file_type)
    model_dir = gguf_convert.convert_gguf(path, tmp_path / "phi3", in_place=True)
    assert weights_source(model_dir) == path.resolve()
    model = load_model(model_dir)
    mapped = model.gguf_reader.data
    start, end = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    parts = [p for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts]
    assert {p.name for p in model.layers[0].self_attn.qkv_proj.parts} == {"blk.0.attn_qkv.weight"}
    assert all(start <= p.ptr and p.ptr + p.nbytes <= end for p in parts)


def specs_of(shape: str, file_type: str) -> list[SimpleNamespace]:
    specs = tensor_specs(SHAPES[shape], file_type)
    return [SimpleNamespace(tensor_type=s.qtype, shape=s.shape) for s in specs]


def test_loading_rule_converts_only_small_files_of_panel_types():
    """Q4_0/Q4_1/Q8_0/F32 files whose fp32 copy is at most the knob are converted (the default
    model among them); past it, and any other type at any size, are read in place."""
    knob = EngineConfig.gguf_fp32_max_bytes
    assert not gguf_convert.reads_in_place(specs_of("tiny", "q8_0"), knob)
    assert gguf_convert.reads_in_place(specs_of("tiny", "q8_0"), 0)
    assert gguf_convert.reads_in_place(specs_of("tiny", "q4_k_m"), 2**62)
    assert gguf_convert.reads_in_place(specs_of("tiny", "q4_1"), knob)  # its Q6_K output
    for file_type in ("q8_0", "q4_0", "f32"):  # 4.9 GB as fp32
        assert gguf_convert.reads_in_place(specs_of("llama-1b", file_type), knob)
    assert not wants_in_place(known_gguf_path("smollm2-135m"), knob)  # 0.54 GB as fp32


def test_knob_picks_the_kind_of_cached_conversion(tmp_path):
    """The cache holds the kind the knob picks; a caller wanting the tokenizer takes either."""
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q8_0")
    cache = tmp_path / "cache"
    converted = resolve_model(str(path), cache)
    assert weights_source(converted) is None and list(converted.glob("*.safetensors"))
    assert resolve_model(str(path), cache, gguf_fp32_max_bytes=None) == converted
    in_place = resolve_model(str(path), cache, gguf_fp32_max_bytes=0)
    assert in_place == converted and weights_source(in_place) == path.resolve()
    assert not list(in_place.glob("*.safetensors"))
    assert weights_source(resolve_model(str(path), cache, gguf_fp32_max_bytes=None)) is not None


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
    assert gguf_convert.reads_in_place(tensors, 2**62)  # never widened to fp32 either
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


def two_processes(code: str, path) -> list[subprocess.Popen]:
    """Two Python processes running `code` with `path` as their argument, pipes on stdin/out."""
    cmd = [sys.executable, "-c", code, str(path)]
    return [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]


def test_two_processes_share_the_mapped_weights(tmp_path):
    q4_k_m = tmp_path / "weights.gguf"  # 4 MiB of Q4_K blocks
    writer = GGUFWriter(q4_k_m, "llama")
    blocks = np.random.default_rng(0).integers(0, 256, (1024, 144 * 28), np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    procs = two_processes(READER, q4_k_m)
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
