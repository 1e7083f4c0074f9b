"""Log-probabilities of sampled tokens and of their likeliest alternatives.

They are of the model's raw distribution: the log-softmax of the logits as the model
produced them, before penalties, logit_bias, min_tokens, a grammar's mask, temperature and
top-k/top-p (vLLM v1's default, "raw_logprobs"). So they describe the model, not the
sampler, and a token a penalty made unlikely still reports what the model thought of it.
"""

from __future__ import annotations

import torch

# Per sampled token: [its logprob, [[token id, logprob], ...] likeliest first].
TokenLogprobs = list


def raw_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """log_softmax of `rows` of `logits` [B, V], in a new tensor: the caller processes and
    samples the logits in place afterwards."""
    picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
    return torch.log_softmax(picked.float(), dim=-1)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[TokenLogprobs]:
    """For each row of `logprobs` [R, V]: the logprob of its sampled token and its
    `num_top` likeliest tokens (ties in token id order, as torch.topk leaves them)."""
    index = torch.tensor(token_ids, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0].tolist()
    k = max(num_top, default=0)
    if k == 0:
        return [[value, []] for value in chosen]
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        [chosen[j], [[ids[j][i], values[j][i]] for i in range(n)]] for j, n in enumerate(num_top)
    ]


# Prompt positions whose logits exist at once: 256 x 49,152 fp32 (SmolLM2) = 48 MiB, where a
# 4,096-token prompt's whole [T, V] would be 805 MB.
PROMPT_SLICE_ROWS = 256


def prompt_logprobs(
    compute_logits, hidden: torch.Tensor, next_ids: list[int], num_top: int
) -> list[TokenLogprobs]:
    """For row t of `hidden` [T, H] (a prompt position's last hidden state): the raw logprob
    of `next_ids[t]`, the prompt's next token, and the `num_top` likeliest tokens there. The
    logits are computed `PROMPT_SLICE_ROWS` positions at a time; only the selected values
    are kept."""
    found: list[TokenLogprobs] = []
    for i in range(0, len(next_ids), PROMPT_SLICE_ROWS):
        ids = next_ids[i : i + PROMPT_SLICE_ROWS]
        logprobs = torch.log_softmax(compute_logits(hidden[i : i + len(ids)]).float(), dim=-1)
        found += token_logprobs(logprobs, ids, [num_top] * len(ids))
    return found
