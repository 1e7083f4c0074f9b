"""The engine: one per worker process, whatever its role. Token ids in, token ids out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.manager import KVCacheManager
from pdserve.model.config import ModelConfig
from pdserve.request import FinishReason, Request
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class Engine:
    def __init__(self, config: EngineConfig, model_dir: Path | None = None) -> None:
        from pdserve.model.registry import resolve_model

        self.config = config
        self.model_dir = Path(model_dir) if model_dir else resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.runner = ModelRunner(
            self.model_dir, self.model_config, config.cache, config.device, seed=config.seed
        )
        block_size = config.cache.block_size
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            block_size,
            model_id=config.model,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.max_model_len = self._max_model_len()
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)

    def _max_model_len(self) -> int:
        """The model's context, capped by what the KV cache can hold, so that any admitted
        request fits on its own (preemption can always make room for it)."""
        limit = self.config.scheduler.max_model_len or self.model_config.max_position_embeddings
        if limit > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {limit} exceeds the model's context of "
                f"{self.model_config.max_position_embeddings} tokens"
            )
        capacity = self.runner.num_blocks * self.config.cache.block_size
        if capacity < limit:
            log.warning("KV cache holds %d tokens: max_model_len capped from %d", capacity, limit)
        return min(limit, capacity)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        self.validate_prompt(prompt_token_ids)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.scheduler.add_request(request)
        return request

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the context length is "
                f"{self.max_model_len} (prompt plus at least one new token)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.finish_request(request_id, FinishReason.ABORT) is not None

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request early (e.g. its text hit a stop string)."""
        self.scheduler.finish_request(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        outputs = []
        for request, token in self.scheduler.update_from_output(out, sampled):
            if token is None:
                continue
            outputs.append(
                RequestOutput(
                    request.request_id,
                    [token],
                    request.is_finished,
                    request.finish_reason,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                    len(request.output_token_ids),
                )
            )
        return outputs
