"""Offline API: `LLM(model).generate(prompts, params)` and its streaming form."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.config import EngineConfig
from pdserve.output_processor import OutputProcessor
from pdserve.request import WARMUP_PARAMS, FinishReason
from pdserve.sampling_params import SamplingParams
from pdserve.schema import from_flat

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class StreamChunk:
    index: int  # position of the prompt in the call's list
    text: str  # new text since the last chunk of this prompt
    token_ids: list[int]  # new token ids
    finished: bool
    finish_reason: str | None


class LLM:
    """A single-process engine with a tokenizer in front.

    >>> llm = LLM("smollm2-135m")
    >>> llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = EngineConfig.model, **engine: Any) -> None:
        """`engine`: any `EngineConfig` field by its flat name (block_size, kv_cache_bytes,
        threads, cpu_kernels, ...; see docs/configuration.md)."""
        from pdserve.engine.engine import Engine
        from pdserve.model.registry import resolve_model
        from pdserve.model.tokenizer import Tokenizer

        config = from_flat(EngineConfig, {"model": model, **engine})
        model_dir = resolve_model(config.model, None, config.gguf_fp32_max_bytes)
        self.tokenizer = Tokenizer(model_dir)
        self.engine = Engine(config, model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run prompts (text or token ids) to completion, batched; results in input order."""
        prompt_ids, params_list = self._normalize(prompts, params)
        outputs = [CompletionOutput(ids, "", [], None) for ids in prompt_ids]
        for chunk in self._run(prompt_ids, params_list):
            out = outputs[chunk.index]
            out.text += chunk.text
            out.token_ids += chunk.token_ids
            out.finish_reason = chunk.finish_reason
        return outputs

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamChunk]:
        """Like `generate`, but yields text as it is produced, one chunk per new token."""
        prompt_ids, params_list = self._normalize(prompts, params)
        yield from self._run(prompt_ids, params_list)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> CompletionOutput:
        """One chat turn: the model's chat template applied to `messages`."""
        return self.generate([self.tokenizer.apply_chat_template(messages)], params)[0]

    def warmup(self, prompts: Sequence[Prompt | list[dict]], pin: bool = True) -> list[int]:
        """Prefill prompts into the prefix cache (and with `pin`, keep their full blocks
        resident) so later requests starting with them hit; nothing is generated. A prompt is
        text, token ids or a chat message list (rendered with the chat template, like `chat`).
        Returns each prompt's tokens now cached; ValueError when pinning is refused."""
        prompt_ids = self._prompt_ids(prompts, chat=True)
        request_ids = [f"warmup-{next(self._ids)}" for _ in prompt_ids]
        results = {}
        try:
            for request_id, ids in zip(request_ids, prompt_ids):
                self.engine.add_request(request_id, ids, WARMUP_PARAMS, pin=pin)
            while self.engine.has_unfinished_requests():
                results.update({o.request_id: o for o in self.engine.step() if o.finished})
        finally:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
        errors = [r.error for r in results.values() if r.error]
        if errors:
            raise ValueError(errors[0])
        return [results[request_id].num_cached_tokens for request_id in request_ids]

    def unpin(self, prompts: Sequence[Prompt | list[dict]]) -> list[int]:
        """Release the pins of warmed prompts (their blocks stay cached until evicted);
        returns each prompt's tokens that were pinned."""
        return [self.engine.unpin(ids)[0] for ids in self._prompt_ids(prompts, chat=True)]

    def _prompt_ids(self, prompts, chat: bool = False) -> list[list[int]]:
        """Token ids of one prompt or a list of them (with `chat`, message lists are
        rendered with the chat template), all checked before any request starts."""
        single = (int, dict) if chat else (int,)
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], single)
        ):
            prompts = [prompts]
        prompt_ids = []
        for prompt in prompts:
            if chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                prompt = self.tokenizer.apply_chat_template(prompt)
            elif isinstance(prompt, str):
                prompt = self.tokenizer.encode(prompt)
            elif not isinstance(prompt, list):
                raise ValueError(
                    f"a prompt must be a string or a list of token ids, got {prompt!r}"
                )
            prompt_ids.append(prompt)
        for ids in prompt_ids:
            self.engine.validate_prompt(ids)
        return prompt_ids

    def _normalize(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        prompt_ids = self._prompt_ids(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_ids)
        params = list(params)
        if len(params) != len(prompt_ids):
            raise ValueError(f"got {len(params)} sampling params for {len(prompt_ids)} prompts")
        return prompt_ids, params

    def _run(self, prompt_ids: list[list[int]], params_list: list[SamplingParams]):
        processor = OutputProcessor(self.tokenizer)
        index: dict[str, int] = {}
        try:
            for i, (ids, params) in enumerate(zip(prompt_ids, params_list)):
                request_id = f"llm-{next(self._ids)}"
                index[request_id] = i
                processor.add_request(request_id, params.stop, params.min_tokens)
                self.engine.add_request(request_id, ids, params)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    delta = processor.process(out.request_id, out.new_token_ids, out.finished)
                    reason = out.finish_reason
                    if delta.stopped and not out.finished:
                        self.engine.finish_request(out.request_id, FinishReason.STOP)
                        reason = FinishReason.STOP
                    done = out.finished or delta.stopped
                    finish = reason.value if done and reason else None
                    yield StreamChunk(
                        index[out.request_id], delta.text, out.new_token_ids, done, finish
                    )
        finally:
            for request_id in index:  # a caller that stops iterating aborts what is left
                self.engine.abort_request(request_id)
