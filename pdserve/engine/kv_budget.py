"""Token dropping in the engine: what a request's KV budget means as a policy, the drop after
each step (collocated and decode roles), and the decode worker's drop before a transfer.

Which blocks go is decided in kvcache/dropping.py (torch-free); the scores they are ranked by
are the model runner's (`block_scores`, aligned with each request's `block_ids`).
"""

from __future__ import annotations

from pdserve.config import CacheConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.kvcache.dropping import DropPolicy, PromptDrop, blocks_to_drop
from pdserve.kvcache.manager import KVCacheManager, cdiv
from pdserve.request import Request


class KVBudget:
    def __init__(self, cache: CacheConfig, kv: KVCacheManager, runner: ModelRunner) -> None:
        self.cache, self.kv, self.runner = cache, kv, runner

    def policy(self, budget_tokens: int) -> DropPolicy:
        """The policy of a budget (ValueError when too small to honour: the caller's error)."""
        c, bs = self.cache, self.cache.block_size
        return DropPolicy(
            budget_tokens // bs, cdiv(c.kv_sink_tokens, bs), cdiv(c.kv_recent_tokens, bs)
        )

    def prompt_drop(self, request: Request) -> PromptDrop | None:
        """Decode role, at Reserve: what the prompt keeps when it lands over budget (the drop a
        collocated engine makes right after the prompt), or None when it fits."""
        if request.kv_budget_tokens is None:
            return None
        policy = self.policy(request.kv_budget_tokens)
        return policy.prompt_drop(request.num_prompt_tokens, self.kv.block_size)

    def enforce(self, running: list[Request]) -> None:
        """Free the least-attended blocks of requests over their budget, so the next step's
        token still fits. A prefill-only request never drops: it holds its prompt until sent."""
        bs = self.kv.block_size
        for request in running:
            if request.kv_budget_tokens is None or request.prefill_only:
                continue
            scores = self.runner.scores_of(request)
            next_needs_block = request.num_kv_tokens % bs == 0
            victims = blocks_to_drop(
                scores.tolist(), next_needs_block, self.policy(request.kv_budget_tokens)
            )
            if not victims:
                continue
            gone = set(victims)
            self.kv.pool.free([request.block_ids[i] for i in victims])
            keep = [i for i in range(len(request.block_ids)) if i not in gone]
            request.block_ids = [request.block_ids[i] for i in keep]
            self.runner.block_scores[request.request_id] = scores[keep]
            request.num_dropped_tokens += len(victims) * bs
