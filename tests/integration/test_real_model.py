"""The real default model (SmolLM2-135M-Instruct from its GGUF): our greedy continuations
equal Hugging Face transformers' `generate` on the same fp32 weights, token for token."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.cpu_flags import has_fast_bf16

pytestmark = pytest.mark.integration

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Describe the water cycle for a child.",
    "Give me three tips for a job interview.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    from pdserve.llm import LLM

    return LLM("smollm2-135m", kv_cache_bytes=256 * 2**20)


def test_greedy_matches_transformers(llm):
    """With the default native kernels (the widest variant this CPU runs), whose decode GEMMs
    read the GGUF weights in their lossless compact form (asserted, so this is the
    end-to-end check of that path)."""
    from transformers import LlamaForCausalLM

    from pdserve.model import native, panel_codec
    from pdserve.sampling_params import SamplingParams

    if (lib := native.load()) is not None:
        mlp = llm.engine.runner.model.layers[0].mlp
        assert mlp.down_proj.panel_weight.panel == lib.panel_width  # the default variant's
        assert mlp.down_proj.panel_weight.codec == panel_codec.Q4A
        assert llm.engine.runner.model.lm_head.panel_weight.codec == panel_codec.Q8S

    chat = llm.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    # Both stop at EOS (HF's min_new_tokens would mask EOS, which is a different model).
    ours = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    hf = LlamaForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, llm.tokenizer.decode(prompt)
    assert "Paris" in ours[0].text
    assert sum(len(o.token_ids) == NEW_TOKENS for o in ours) >= 5  # most run the full 32


def test_stop_string_and_streaming(llm):
    from pdserve.sampling_params import SamplingParams

    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in full.text
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=["Paris"]))[0]
    assert cut.finish_reason == "stop" and full.text.startswith(cut.text)
    assert "Paris" not in cut.text
    chunks = llm.stream([prompt], SamplingParams(max_tokens=24, temperature=0))
    streamed = "".join(c.text for c in chunks)
    assert streamed == full.text


def test_bad_input_is_a_value_error(llm):
    from pdserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * 9000])
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])


@pytest.mark.skipif(
    not has_fast_bf16(),
    reason="bf16 prefill is a speed path for CPUs with AMX or AVX512_BF16; this one has neither",
)
def test_bf16_prefill_agrees_with_fp32(llm):
    """The lossy bf16 prefill role (docs/cpu-kernels.md, "A bf16 prefill role"): its first
    tokens, what a prefill worker samples, agree with fp32's on at least 6 of the 7 questions."""
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    bf16 = LLM("smollm2-135m", dtype="bfloat16", kv_cache_bytes=64 * 2**20)
    chat = llm.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=1, temperature=0)
    ours, ref = (m.generate(prompts, params) for m in (bf16, llm))
    assert sum(a.token_ids == b.token_ids for a, b in zip(ours, ref)) >= 6
