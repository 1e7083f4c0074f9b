"""Turns a scheduled step into tensors, runs the model, samples. The data plane's one entry.

Everything device-specific lives here: where the KV cache is allocated and how big it is,
threads, the device of each input tensor. On CUDA the same code runs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pdserve.config import CacheConfig, DeviceConfig
from pdserve.engine.grammar import Grammars
from pdserve.engine.memory import (
    DEFAULT_CPU_KV_FRACTION,
    DEFAULT_CUDA_KV_FRACTION,
    meminfo_available_bytes,
)
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvcache.dropping import over_budget
from pdserve.model import native
from pdserve.model.attention import AttentionMetadata, PrefillSpan, decode_tables
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_fused import can_fuse, fuse_layers
from pdserve.model.cpu_linear import can_pack, log_panel_formats, pack_linears
from pdserve.model.kv_cache import layer_caches, row_size, storage_dtype
from pdserve.model.loader import load_model, torch_dtype
from pdserve.model.logprobs import TokenLogprobs, prompt_logprobs, raw_logprobs, token_logprobs
from pdserve.model.penalties import apply_penalties, penalty_row
from pdserve.model.sampler import SamplingRow, sample
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def kv_cache_shape(
    cfg: ModelConfig, num_blocks: int, block_size: int, kv_cache_dtype: str
) -> tuple[int, ...]:
    row = row_size(cfg.head_dim, kv_cache_dtype)
    return (cfg.num_layers, num_blocks, 2, cfg.num_kv_heads, block_size, row)


def kv_block_bytes(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str
) -> int:
    """Bytes of one block over all layers (8-bit blocks are ~1/4 of fp32: more of them fit)."""
    elem = torch.tensor([], dtype=storage_dtype(kv_cache_dtype, dtype)).element_size()
    shape = kv_cache_shape(cfg, 1, block_size, kv_cache_dtype)
    return elem * shape[0] * shape[2] * shape[3] * shape[4] * shape[5]


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return meminfo_available_bytes()


def num_kv_blocks(cfg: ModelConfig, cache: CacheConfig, device: torch.device, dtype) -> int:
    """How many KV blocks the budget buys: `kv_cache_bytes`, else a share of free memory."""
    block_bytes = kv_block_bytes(cfg, cache.block_size, dtype, cache.kv_cache_dtype)
    budget = cache.kv_cache_bytes
    if budget is None:
        fraction = cache.kv_cache_memory_fraction or (
            DEFAULT_CUDA_KV_FRACTION if device.type == "cuda" else DEFAULT_CPU_KV_FRACTION
        )
        budget = int(available_memory_bytes(device) * fraction)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is smaller than one block ({block_bytes} bytes)"
        )
    return num_blocks


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        cache: CacheConfig,
        device: DeviceConfig,
        seed: int = 0,
        allocate_kv: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        kernels: str = "collocated",
    ) -> None:
        """`kernels` (a role name) picks the CPU linear kernels' weight copies: a decode
        worker runs only decode batches (native panels), a collocated one and a prefill one
        both (a prefill worker's panels only where compact: cpu_linear.py).
        `allocate_kv(shape, dtype)` places the KV pool (zeroed, on this device, by default);
        its size is computed here, once."""
        if device.threads:
            torch.set_num_threads(device.threads)
        self.device = torch.device(device.device)
        self.dtype = torch_dtype(device.dtype)
        self.block_size = cache.block_size
        self.model = load_model(model_dir, device=device.device, dtype=device.dtype)
        on_cpu = self.device.type == "cpu"
        self.kernels = native.load() if device.cpu_kernels == "native" and on_cpu else None
        if device.cpu_kernels in ("native", "onednn") and can_pack(self.model):
            # A prefill worker's panels: compact ones only (PackedLinear decides).
            panels = self.kernels
            onednn = kernels != "decode" or panels is None
            pack_linears(self.model, panels, onednn, decode=kernels != "prefill")
            log_panel_formats(self.model)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        num_blocks = num_kv_blocks(model_config, cache, self.device, self.dtype)
        shape = kv_cache_shape(model_config, num_blocks, cache.block_size, cache.kv_cache_dtype)
        dtype = storage_dtype(cache.kv_cache_dtype, self.dtype)
        if allocate_kv is None:
            kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            kv_cache = allocate_kv(shape, dtype)
        self.kv_cache = kv_cache
        if self.kernels is not None and can_fuse(self.model, kv_cache):
            fuse_layers(self.model, self.kernels)
        self.layer_caches = layer_caches(kv_cache, cache.kv_cache_dtype)
        self._argmax = None
        if self.kernels is not None and self.dtype == torch.float32:  # kernels: CPU only
            self._argmax = partial(native.argmax_rows, self.kernels)
        self.block_scores: dict[str, torch.Tensor] = {}  # token dropping, per request
        self.logprobs: dict[str, TokenLogprobs] = {}  # the last step's, by request id
        self.grammars = Grammars(model_dir, model_config.vocab_size)  # structured outputs
        self.num_blocks = kv_cache.shape[1]
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            kv_cache.numel() * kv_cache.element_size() / 2**20,
        )

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None
    ) -> dict[str, int]:
        """Run one step; returns the sampled token of each request that reached its end."""
        if not out.scheduled:
            return {}
        input_ids, positions, meta, sample_rows, sample_ids = self._prepare(out)
        hidden = self.model(input_ids, positions, self.layer_caches, meta, on_layer_done)
        self._keep_scores(out, meta)
        if any(r.sampling_params.prompt_logprobs is not None for r, _ in out.scheduled):
            self._prompt_logprobs(out, hidden)
        if not sample_ids:
            return {}
        if len(sample_rows) < hidden.shape[0]:  # rows ascend: as many as rows means all
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        rows = [
            SamplingRow(
                p.temperature,
                p.top_k,
                p.top_p,
                p.seed,
                r.num_prior_output_tokens + len(r.output_token_ids),
            )
            for r in sample_ids
            for p in (r.sampling_params,)
        ]
        wanted = [i for i, r in enumerate(sample_ids) if r.sampling_params.logprobs is not None]
        raw = raw_logprobs(logits, wanted) if wanted else None  # before anything changes them
        penalized = [i for i, r in enumerate(sample_ids) if r.sampling_params.penalized]
        if penalized:  # before the grammar's mask and the temperature (docs/sampling.md)
            apply_penalties(logits, [penalty_row(i, sample_ids[i]) for i in penalized])
        masks = self.grammars.begin(sample_ids)  # structured outputs (engine/grammar.py)
        if masks is not None:
            masks.apply(logits)
        tokens = sample(logits, rows, self.generator, self._argmax)
        if masks is not None:
            masks.accept(tokens)
        self.logprobs = {}
        if raw is not None:
            num_top = [sample_ids[i].sampling_params.logprobs for i in wanted]
            found = token_logprobs(raw, [tokens[i] for i in wanted], num_top)
            self.logprobs = {sample_ids[i].request_id: lp for i, lp in zip(wanted, found)}
        return {r.request_id: t for r, t in zip(sample_ids, tokens)}

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError naming a `logit_bias` token id past the vocabulary (the flat index
        into the step's logits would land in another row)."""
        vocab = self.model.config.vocab_size
        if any(token_id >= vocab for token_id, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be < vocab size {vocab}")

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """The prompt logprobs of this step's chunk of each request that asks: position p's
        logits score prompt token p + 1 (the last position's give the first output token,
        scored as any sampled one). Only before the first output token: a request resumed
        or recomputed after it already sent them."""
        row = 0
        for request, num_new in out.scheduled:
            start, num_top = request.num_computed_tokens, request.sampling_params.prompt_logprobs
            end = min(start + num_new, request.num_prompt_tokens - 1)
            first = not request.output_token_ids and not request.num_prior_output_tokens
            if num_top is not None and end > start and first:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None] * request.num_prompt_tokens
                next_ids = request.token_slice(start + 1, end + 1)
                rows = hidden[row : row + len(next_ids)]
                found = prompt_logprobs(self.model.compute_logits, rows, next_ids, num_top)
                request.prompt_logprobs[start + 1 : end + 1] = found
            row += num_new

    def _keep_scores(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Accumulate each budgeted request's per-block attention (aligned with its
        `block_ids`); the engine drops the lowest-scored blocks when over budget."""
        if meta.decode_scores is not None:
            for i in range(meta.num_decode_tokens):
                request = out.scheduled[i][0]
                if self._scores_wanted(request):
                    n = len(request.block_ids)
                    self.scores_of(request)[:n] += meta.decode_scores[i, :n].cpu()
        for span, (request, _) in zip(meta.prefills, out.scheduled[meta.num_decode_tokens :]):
            if span.scores is not None:
                self.block_scores[request.request_id] = span.scores.cpu()

    def _scores_wanted(self, request: Request) -> bool:
        return request.kv_budget_tokens is not None or request.num_keep_blocks is not None

    def _scores_prompt(self, request: Request) -> bool:
        """Whether a prompt's last chunk ranks its blocks: when the drop right after it
        frees some, or when it is dropped before the transfer (the same test: a decode
        worker drops before the transfer exactly when a collocated engine would drop here)."""
        budget = request.kv_budget_tokens
        over = budget is not None and over_budget(request.num_tokens, budget, self.block_size)
        return over or request.num_keep_blocks is not None

    def install_scores(self, request: Request, scores: list[float]) -> None:
        """A decode worker's request whose prompt was dropped before the transfer: its kept
        blocks' scores, so later drops rank them as the collocated engine would."""
        self.block_scores[request.request_id] = torch.tensor(scores, dtype=torch.float32)

    def scores_of(self, request: Request) -> torch.Tensor:
        """The request's block scores, grown with zeros to its current number of blocks."""
        scores = self.block_scores.get(request.request_id, torch.zeros(0))
        if scores.shape[0] < len(request.block_ids):
            scores = torch.cat([scores, torch.zeros(len(request.block_ids) - scores.shape[0])])
        self.block_scores[request.request_id] = scores
        return scores

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_block_ids, decode_lens, prefills = [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for request, num_new in out.scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            row = len(input_ids)
            input_ids += request.token_slice(start, end)
            positions += range(start, end)  # RoPE: original positions, dropped tokens or not
            dropped = request.num_dropped_tokens
            kv_index = range(start - dropped, end - dropped)  # where the KV goes
            slot_blocks += [request.block_ids[i // bs] for i in kv_index]
            slot_offsets += [i % bs for i in kv_index]
            if num_new == 1:
                assert not prefills, "one-token rows must come before prefill chunks"
                decode_block_ids.append(request.block_ids)
                decode_lens.append(end - dropped)
            else:
                prefills.append((row, row + num_new, start - dropped, request.block_ids))
            if out.samples(request, num_new):
                sample_rows.append(row + num_new - 1)
                sample_requests.append(request)
        dev = self.device
        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, device=dev),
            slot_offsets=torch.tensor(slot_offsets, device=dev),
            num_decode_tokens=len(decode_block_ids),
            prefills=[PrefillSpan(s, e, c, torch.tensor(b, device=dev)) for s, e, c, b in prefills],
        )
        if decode_block_ids:
            meta.decode_block_tables, _ = decode_tables(
                decode_block_ids, decode_lens, bs, dev, with_mask=False
            )
            meta.decode_context_lens = torch.tensor(decode_lens, device=dev)
            meta.kernels = self.kernels
            decodes = out.scheduled[: len(decode_block_ids)]
            if any(self._scores_wanted(r) for r, _ in decodes):
                meta.decode_scores = torch.zeros(meta.decode_block_tables.shape, device=dev)
        scheduled_prefills = out.scheduled[len(decode_block_ids) :]
        for span, (request, num_new) in zip(meta.prefills, scheduled_prefills):
            if out.samples(request, num_new) and self._scores_prompt(request):
                span.scores = torch.zeros(len(request.block_ids), device=dev)
        return (
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            sample_rows,
            sample_requests,
        )
