"""Fixtures for the benchmark: a word-level tokenizer and a fake OpenAI streaming server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

NUM_WORDS = 300


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer: ids 0-1 special, decode joins words by spaces, so decode ->
    encode round trips exactly and lengths can be asserted to the token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(NUM_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<unk>"])
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@dataclass
class FakeServer:
    """Streams ``max_tokens`` words with ``delay_s`` between them; every ``reject_every``-th
    request (1-based) gets HTTP 503."""

    delay_s: float = 0.002
    reject_every: int = 0
    usage: bool = True
    status: dict | None = None  # what GET /v1/status answers (None: 404, as a peer server)
    # Every this-many-th token's text is held back (a lone byte of a multi-byte character):
    # an empty chunk, its text sent with the next token's (0: none).
    held_every: int = 0
    bodies: list[dict] = field(default_factory=list)
    url: str = ""

    async def handle_status(self, request: web.Request) -> web.Response:
        if self.status is None:
            raise web.HTTPNotFound()
        return web.json_response(self.status)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.reject_every and len(self.bodies) % self.reject_every == 0:
            return web.json_response({"error": "overloaded"}, status=503)
        prompt = body.get("prompt", body.get("messages"))
        headers = {"Content-Type": "text/event-stream", "X-Request-Id": f"r{len(self.bodies)}"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        chat = "messages" in body
        held = ""
        for i in range(body["max_tokens"]):
            await asyncio.sleep(self.delay_s)
            text, held = held + f" w{i % NUM_WORDS}", ""
            last = i == body["max_tokens"] - 1
            if self.held_every and i % self.held_every == self.held_every - 1 and not last:
                text, held = "", text
            choice = {"delta": {"content": text}} if chat else {"text": text}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.usage:
            num_prompt = len(prompt) if isinstance(prompt, list) and not chat else 0
            usage = {"prompt_tokens": num_prompt, "completion_tokens": body["max_tokens"]}
            event = {"choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """A FakeServer on a free loopback port, served from its own thread's event loop
    (the benchmark runs its own ``asyncio.run``)."""
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.handle)
    app.router.add_post("/v1/chat/completions", server.handle)
    app.router.add_get("/v1/status", server.handle_status)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(5)
    yield server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()
