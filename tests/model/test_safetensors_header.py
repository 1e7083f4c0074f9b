"""A .safetensors header is read and mapped in place (safetensors_header.py); a header that does
not describe its file is refused naming the file; the rule picks bf16/fp16 checkpoints."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pdserve.model.safetensors_header import in_place_bytes, map_checkpoint, reads_in_place


def test_tensors_are_views_of_the_read_only_mapping(tmp_path):
    tensors = {
        "w": torch.randn(3, 8).bfloat16(),
        "n": torch.randn(8),
        "h": torch.randn(2, 4).half(),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    entries = map_checkpoint(tmp_path)
    assert {k: (e.dtype, e.shape) for k, e in entries.items()} == {
        "w": ("BF16", (3, 8)),
        "n": ("F32", (8,)),
        "h": ("F16", (2, 4)),
    }
    for name, t in tensors.items():
        data = entries[name].data
        assert isinstance(data.base, np.memmap) and not data.flags.writeable
        assert data.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()
    assert reads_in_place(entries)
    assert in_place_bytes(tmp_path) == 3 * 8 * 2 + 2 * 4 * 2  # the matrices, not the vector


def test_rule_keeps_fp32_and_other_types_off_the_kernels(tmp_path):
    save_file({"w": torch.randn(2, 4), "n": torch.randn(4).bfloat16()}, tmp_path / "a.safetensors")
    assert not reads_in_place(map_checkpoint(tmp_path))  # fp32 matrices: the fp32 path
    save_file({"v": torch.randn(2, 4).double()}, tmp_path / "b.safetensors")
    save_file({"x": torch.randn(2, 4).bfloat16()}, tmp_path / "c.safetensors")
    # An F64 matrix beside a BF16 one: read in place, the F64 one widened (not mapped).
    assert reads_in_place(map_checkpoint(tmp_path))
    assert in_place_bytes(tmp_path) == 2 * 4 * 4 + 2 * 4 * 2  # the F32 and BF16 matrices
    save_file({"i": torch.ones(2, 4, dtype=torch.int8)}, tmp_path / "d.safetensors")
    assert not reads_in_place(map_checkpoint(tmp_path))  # an I8 matrix: loader.py's fp32 path


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    for name in ("model-00001-of-00002", "model-00002-of-00002"):
        save_file({"w": torch.zeros(2, 2).bfloat16()}, tmp_path / f"{name}.safetensors")
    with pytest.raises(ValueError, match="tensor w is also in another weights file"):
        map_checkpoint(tmp_path)


def header_file(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "header, data",
    [
        ({"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}, b"\0" * 16),
        ({"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 16]}}, b"\0" * 32),
        ({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 0]}}, b"\0" * 8),
        ({"w": {"dtype": "BF16", "shape": [4]}}, b"\0" * 8),
        ({"w": {"dtype": "BF16", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}, b""),
        ({"w": [1, 2]}, b""),
        ([1, 2], b""),
    ],
    ids=[
        "past-end",
        "wrong-size",
        "reversed",
        "no-offsets",
        "overflow",
        "not-an-object",
        "list-header",
    ],
)
def test_hostile_headers_are_refused_by_file(tmp_path, header, data):
    header_file(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ValueError, match="corrupt weights file .*model.safetensors"):
        map_checkpoint(tmp_path)


def test_header_length_past_the_file_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="corrupt weights file"):
        map_checkpoint(tmp_path)


def write_sharded(model_dir, weight_map: dict[str, str]) -> None:
    for name, file in weight_map.items():
        save_file({name: torch.zeros(2, 2).bfloat16()}, model_dir / file)
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def test_the_index_names_the_shards(tmp_path):
    """Another format's file beside the shards (Mistral's consolidated.safetensors) is not
    part of the checkpoint."""
    write_sharded(
        tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    )
    save_file({"layers.0.wq": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    assert sorted(map_checkpoint(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize(
    "weight_map, message",
    [
        ({"a": "../model.safetensors"}, "names '../model.safetensors', not a file of"),
        (
            {"a": "model-00002-of-00002.safetensors"},
            "names model-00002-of-00002.safetensors, which .* lacks",
        ),
    ],
    ids=["outside", "missing"],
)
def test_a_bad_index_is_refused_by_name(tmp_path, weight_map, message):
    write_sharded(tmp_path, {"a": "model-00001-of-00002.safetensors"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=message):
        map_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="corrupt weights index"):
        map_checkpoint(tmp_path)
