"""One streaming request against an OpenAI-compatible endpoint, measured into a RequestRecord.

Timing follows vLLM's benchmark_serving so numbers are comparable across tools:
TTFT = first non-empty content chunk - send; ITL = gaps between non-empty chunks;
TPOT = (e2e - TTFT) / (output tokens - 1), with output tokens taken from the final usage
chunk when the server sends one (a chunk may carry several tokens), else the chunk count.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.metrics import FAILED, OK, REJECTED, TIMEOUT, RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REJECT_STATUSES = (429, 503)

Prompt = list[int] | str | list[dict[str, str]]


@dataclass(frozen=True)
class ClientConfig:
    url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    # Each token's logprob asked: a server streams every token in a chunk then, also one whose
    # text it holds back (a lone byte of a multi-byte character), so `token_gaps_s` are the
    # stream's steps.
    logprobs: bool = False
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r}: expected http://HOST:PORT")

    @property
    def endpoint_url(self) -> str:
        """Accepts a base URL with or without ``/v1``, or the full endpoint URL."""
        base = self.url.rstrip("/")
        if base.endswith(("/completions", "/chat/completions")):
            return base
        return base.removesuffix("/v1") + ENDPOINTS[self.endpoint]

    def payload(self, prompt: Prompt, output_len: int) -> dict[str, object]:
        body: dict[str, object] = {
            "model": self.model,
            "max_tokens": output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.logprobs:  # chat: a boolean; completions: how many alternatives besides
            body["logprobs"] = True if self.endpoint == "chat" else 0
        body["messages" if self.endpoint == "chat" else "prompt"] = prompt
        return body


def _carries_token(choice: dict) -> bool:
    """An empty chunk that still stands for a token (its text held back): one with its
    logprob, or empty content not ending the stream (a chunk of a finish reason alone)."""
    if choice.get("logprobs"):
        return True
    content = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
    return content is not None and not choice.get("finish_reason")


def _chunk_text(choice: dict) -> str:
    """A completions chunk's text, or a chat chunk's delta content."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _sse_events(response: aiohttp.ClientResponse):
    """Yields each ``data:`` payload (aiohttp reassembles lines split across reads)."""
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[len(b"data:") :].strip()


async def send_request(
    http: aiohttp.ClientSession,
    cfg: ClientConfig,
    prompt: Prompt,
    record: RequestRecord,
    run_start: float,
) -> str:
    """Sends one request, fills ``record`` in place and returns the generated text.

    Never raises for server or network trouble: those become the record's status, because
    a benchmark must count every request it sent.
    """
    start = time.perf_counter()
    record.send_s = start - run_start
    stream = _Stream(start)
    try:
        await asyncio.wait_for(_exchange(http, cfg, prompt, record, stream), cfg.request_timeout_s)
    except asyncio.TimeoutError:
        record.status, record.error = TIMEOUT, f"no answer within {cfg.request_timeout_s}s"
    except (aiohttp.ClientError, OSError, ValueError, RuntimeError) as exc:
        record.status, record.error = FAILED, f"{type(exc).__name__}: {exc}"[:300]
    else:
        if record.status == OK and record.ttft_s is None:
            record.status, record.error = FAILED, "stream ended without any token"
    record.e2e_s = (stream.last if record.status == OK else time.perf_counter()) - start
    usage_tokens = stream.usage_tokens
    record.output_len = usage_tokens if usage_tokens is not None else stream.chunks
    return "".join(stream.pieces)


@dataclass
class _Stream:
    """What has arrived so far; survives a timeout so partial progress is recorded."""

    last: float
    last_token: float = 0.0  # the last chunk that carried a token, text or not
    chunks: int = 0
    usage_tokens: int | None = None
    pieces: list[str] = field(default_factory=list)


async def _exchange(
    http: aiohttp.ClientSession,
    cfg: ClientConfig,
    prompt: Prompt,
    record: RequestRecord,
    stream: _Stream,
) -> None:
    start = stream.last
    body = cfg.payload(prompt, record.requested_output_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with http.post(cfg.endpoint_url, json=body, headers=headers) as resp:
        record.http_status = resp.status
        record.server_id = resp.headers.get("X-Request-Id", "")
        if resp.status != 200:
            detail = (await resp.text())[:200]
            record.status = REJECTED if resp.status in REJECT_STATUSES else FAILED
            record.error = f"HTTP {resp.status}: {detail}"
            return
        async for data in _sse_events(resp):
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                raise RuntimeError(f"stream error: {event['error']}")
            usage = event.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                stream.usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens"):
                record.input_len = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                record.cached_tokens = int(details["cached_tokens"])
            choices = event.get("choices") or []
            text = "".join(_chunk_text(c) for c in choices)
            now = time.perf_counter()
            if not text:
                if record.ttft_s is not None and any(_carries_token(c) for c in choices):
                    record.token_gaps_s.append(now - stream.last_token)
                    stream.last_token = now
                continue
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - stream.last)
                record.token_gaps_s.append(now - stream.last_token)
            stream.last = stream.last_token = now
            stream.chunks += 1
            stream.pieces.append(text)


def wait_until_ready(cfg: ClientConfig, poll_s: float = 0.5) -> None:
    """Return once the server's GET /health answers 200 (pdserve, vLLM, SGLang and llama-server
    answer 503 while their workers or model load), so that a run started beside `pdserve up`
    does not count start-up refusals. A server without /health (404) counts as ready; a
    refused key, or no 200 within `ready_timeout_s`, is an error naming the flag."""
    if cfg.ready_timeout_s <= 0:
        return
    root = cfg.endpoint_url
    for suffix in ENDPOINTS.values():
        root = root.removesuffix(suffix)
    url, headers = f"{root}/health", {}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    deadline, last, told = time.monotonic() + cfg.ready_timeout_s, "no answer", False
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5):
                return
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return
            if exc.code in (401, 403):
                raise ValueError(f"--api-key: GET {url} answered {exc.code}") from None
            last = f"{exc.code}: {exc.read(300).decode(errors='replace')}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(getattr(exc, "reason", exc))
        if time.monotonic() >= deadline:
            raise ValueError(f"--ready-timeout-s {cfg.ready_timeout_s:g}: {url} not ready ({last})")
        if not told:
            print(f"pdserve bench: waiting for {url} ({last})", file=sys.stderr, flush=True)
            told = True
        time.sleep(poll_s)
