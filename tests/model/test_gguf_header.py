"""The header reader agrees with gguf's GGUFReader, and names a file that is not GGUF."""

import numpy as np
import pytest
from gguf import GGUFReader

from pdserve.model.gguf_header import map_tensors, read_header
from pdserve.model.synthetic import write_synthetic_gguf


def test_same_tensors_and_scalars_as_the_gguf_package(tmp_path):
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    metadata, tensors = read_header(path)
    reader = GGUFReader(path)
    expected = [(t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in reader.tensors]
    assert [(t.name, t.shape, t.tensor_type) for t in tensors] == expected
    for key, field in reader.fields.items():
        if len(field.data) == 1 and not key.startswith("GGUF."):
            assert metadata[key] == pytest.approx(field.contents()), key
    assert "tokenizer.ggml.tokens" not in metadata  # arrays are skipped


def test_not_a_gguf_file_is_named(tmp_path):
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100_000])  # inside the tokenizer's arrays
    with pytest.raises(ValueError, match="cut.gguf: not a valid GGUF file"):
        read_header(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_header(other)


def test_mapped_tensors_are_the_bytes_gguf_reads(tmp_path):
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "q4_k_m")
    mapped = map_tensors(path)
    reader = GGUFReader(path)
    assert mapped.metadata["general.architecture"] == "llama"
    assert len(mapped.tensors) == len(reader.tensors)
    for ours, theirs in zip(mapped.tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.n_elements) == (
            theirs.name,
            theirs.tensor_type,
            int(theirs.n_elements),
        )
        assert np.array_equal(ours.data, theirs.data.view(np.uint8).reshape(-1)), ours.name
        assert not ours.data.flags.writeable  # a read-only view of the file, not a copy
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1])  # the last tensor's last byte
    with pytest.raises(ValueError, match="cut.gguf: not a valid GGUF file, tensor"):
        map_tensors(cut)
