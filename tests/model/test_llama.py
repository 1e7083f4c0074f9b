"""Our Llama equals Hugging Face transformers' LlamaForCausalLM on the same weights."""

import pytest
import torch

from pdserve.model import quant_linear
from pdserve.model.attention import AttentionMetadata, PrefillSpan
from pdserve.model.kv_cache import layer_caches
from pdserve.model.loader import load_model
from pdserve.model.quant_linear import QUANT_GEMV_M_MAX, QuantLinear
from tests.conftest import make_tiny_llama


def our_logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    bs, n = 4, len(ids)
    num_blocks = -(-n // bs)
    kv = torch.zeros(cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, bs, cfg.head_dim)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        pos // bs, pos % bs, prefills=[PrefillSpan(0, n, 0, torch.arange(num_blocks))]
    )
    return model.compute_logits(model(torch.tensor(ids), pos, layer_caches(kv, "auto"), meta))


# Through a tiny model's 2 layers and head, AMX bf16 tiles (x and a block type's w each rounded
# by at most 2^-8 of their value, docs/cpu-kernels.md) move the logits by at most this much of
# their norm (measured 0.3-0.5%); the bound the tests of prompts above 16 rows hold.
AMX_LOGITS_BOUND = 2**-6


def takes_amx_tiles(model, rows: int) -> bool:
    """Whether a call of `rows` rows takes AMX bf16 tiles in some linear of `model`."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return any(m.amx_tiles and rows > m.gemv_m_max for m in linears)


def assert_logits_on_each_path(model, ids: list[int], theirs: torch.Tensor) -> None:
    """`model`'s logits for `ids` against fp32 reference logits `theirs`, at the bound of each
    path the prompt takes: on AMX tiles (Q4_0, Q4_1, Q5_*, BF16, F16 above
    AMX_FLOAT_GEMV_M_MAX rows) within AMX_LOGITS_BOUND, the greedy token differing only where
    the reference's top two are nearer than twice the row's error; then, the tiles pinned to
    above QUANT_GEMV_M_MAX rows as before, the fp32 row kernel up to summation order with the
    same greedy tokens."""
    if takes_amx_tiles(model, len(ids)):
        tiles = our_logits(model, ids)
        diff = (tiles - theirs).abs()
        assert (tiles - theirs).norm() <= AMX_LOGITS_BOUND * theirs.norm()
        chosen = theirs.gather(-1, tiles.argmax(-1, keepdim=True))[:, 0]
        assert torch.all(chosen >= theirs.max(-1).values - 2 * diff.max(-1).values)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_linear, "AMX_FLOAT_GEMV_M_MAX", QUANT_GEMV_M_MAX)
        ours = our_logits(model, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["untied", "tied", "rope-linear", "rope-llama3"],
)
def test_logits_match_transformers(tmp_path, overrides):
    model_dir = make_tiny_llama(tmp_path, **overrides)
    ids = [3, 17, 99, 4, 56, 2, 81, 33, 7, 120, 64, 5, 9]
    torch.testing.assert_close(
        our_logits(load_model(model_dir), ids), hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4
    )


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_llama(tmp_path)
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(model_dir)


def test_corrupt_weights_file(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    next(model_dir.glob("*.safetensors")).write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="corrupt weights file"):
        load_model(model_dir)
