"""A router plus fake workers on a background event loop, for tests with sync HTTP clients.

Fake workers speak the real protocol (`pdserve.messages` over ZMQ) and play a fixed token
`script`: collocated workers emit it one token per step; a prefill worker answers a Prefill
with its first token; a decode worker reserves blocks and emits the rest after StartDecode;
a SwitchRole is answered, `switch_s` later, by Ready with the new role; a SetCores,
`core_switch_s` later, by CoresSet (work that arrives while it is parked is counted in
`parked_work`).
A warm-up (Generate with `pin`) is answered with one Tokens, an Unpin with Unpinned, both
counting full 16-token blocks (`refuse_pins` fails pinning warm-ups); `cache_stats` are
extra Stats fields every heartbeat carries.
Every message a fake receives is appended to `cluster.events` as (worker_id, type, request_id).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve import messages
from pdserve.router.config import RouterConfig, WorkerEndpoint
from pdserve.router.server import build_app, start_server

SECRET = b"router-test-secret"
EOS = 2  # <|im_end|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer with no merges (one token per byte) and ChatML specials."""
    directory.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


class FakeWorker:
    def __init__(self, cluster: Cluster, worker_id: str, role: str, **behaviour: Any) -> None:
        self.cluster = cluster
        self.worker_id = worker_id
        self.role = role
        self.step_s: float = behaviour.get("step_s", 0.002)
        self.prefill_s: float = behaviour.get("prefill_s", 0.0)
        self.reject_reserves: int = behaviour.get("reject_reserves", 0)  # -1: always
        self.fail_with: str | None = behaviour.get("fail_with")
        self.fail_times: int = behaviour.get("fail_times", -1)  # -1: every request
        self.die_after_tokens: int | None = behaviour.get("die_after_tokens")
        # Its engine loop hangs (tokens stop) while its heartbeat goes on.
        self.freeze_after_tokens: int | None = behaviour.get("freeze_after_tokens")
        # After that many tokens, one engine step of `long_step_s` (inf: a kernel that never
        # returns), its heartbeat saying how long the step has run.
        self.long_step_after_tokens: int | None = behaviour.get("long_step_after_tokens")
        self.long_step_s: float = behaviour.get("long_step_s", 0.0)
        self.step_started: float | None = None
        self.max_model_len: int = behaviour.get("max_model_len", 512)
        self.num_cached_blocks: int = behaviour.get("num_cached_blocks", 0)  # in Reserved
        self.num_keep_blocks: int | None = behaviour.get("num_keep_blocks")  # in Reserved
        self.refuse_pins: str | None = behaviour.get("refuse_pins")
        self.cache_stats: dict[str, Any] = behaviour.get("cache_stats", {})
        self.switch_s: float = behaviour.get("switch_s", 0.0)  # SwitchRole to Ready
        self.cpus: list[int] = list(behaviour.get("cpus", []))  # announced in Ready
        self.threads: int = behaviour.get("threads", 0)
        self.core_switch_s: float = behaviour.get("core_switch_s", 0.0)  # SetCores to CoresSet
        self.parked_work = 0  # Generate/Prefill/StartDecode received with no cores (adaptive)
        self.heartbeat = True
        self.num_tokens_sent = 0
        self.aborted: list[str] = []
        self.received: list[Any] = []  # every message, as decoded
        self.address = f"ipc://{cluster.dir}/{worker_id}"
        self._max_tokens: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.signer, self.verifier = messages.Signer(SECRET), messages.Verifier(SECRET)
        self.num_hellos = 0

    async def run(self) -> None:
        ctx = self.cluster.zmq_ctx
        pull = ctx.socket(zmq.PULL)
        pull.bind(self.address)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(self.cluster.router_address)
        self._announce()
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            while True:
                self._handle(self.verifier.decode(await pull.recv()))
        finally:
            for task in [heartbeat, *self._tasks.values()]:
                task.cancel()
            pull.close(linger=0)
            self.push.close(linger=0)

    def _announce(self, hello: bool = False) -> None:
        self.send(
            messages.Ready(
                self.worker_id,
                self.role,
                "tiny",
                64,
                16,
                self.max_model_len,
                self.cpus,
                self.threads,
                incarnation=self.signer.session.hex(),
                hello=hello,
            )
        )

    async def _set_cores(self, m: messages.SetCores) -> None:
        await asyncio.sleep(self.core_switch_s)
        self.cpus, self.threads = list(m.cpus), m.threads
        self.send(messages.CoresSet(self.worker_id, self.cpus, self.threads, self.core_switch_s))

    async def _switch(self, role: str) -> None:
        await asyncio.sleep(self.switch_s)
        self.role = role
        self._announce()

    def send(self, message: Any) -> None:
        self.push.send(self.signer.encode(message))

    async def _heartbeat(self) -> None:
        while True:
            if self.heartbeat:
                running, started = len(self._tasks), self.step_started
                self.send(
                    messages.Stats(
                        self.worker_id,
                        self.role,
                        num_waiting=0,
                        num_running=running,
                        num_free_blocks=60,
                        num_total_blocks=64,
                        num_queued_prefill_tokens=0,
                        kv_bytes_sent=7,
                        kv_bytes_received=9,
                        kv_blocks_skipped=3,
                        step_running_s=time.monotonic() - started if started else 0.0,
                        **self.cache_stats,
                    )
                )
            await asyncio.sleep(0.05)

    def _handle(self, m: Any) -> None:
        if isinstance(m, messages.Hello):  # the router's greeting, not part of any request
            self.num_hellos += 1
            self._announce(hello=True)
            return
        self.cluster.events.append((self.worker_id, type(m).__name__, getattr(m, "request_id", "")))
        self.received.append(m)
        script = self.cluster.script
        work = (messages.Generate, messages.Prefill, messages.StartDecode)
        if self.cluster.cpus and isinstance(m, work) and self.threads == 0:
            self.parked_work += 1
        if isinstance(m, messages.SetCores):
            self._core_task = asyncio.create_task(self._set_cores(m))
        elif isinstance(m, messages.Abort):
            self.aborted.append(m.request_id)
            task = self._tasks.pop(m.request_id, None)
            if task:
                task.cancel()
            self.send(messages.Released(self.worker_id, m.request_id))
        elif isinstance(m, messages.Generate) and m.pin is not None:
            self._warm(m)
        elif isinstance(m, messages.Generate):  # resumed: continue the script where it was
            done = m.output_token_ids
            assert done == script[: len(done)], "resumed with tokens the script never made"
            self._start(m.request_id, script[len(done) : m.sampling["max_tokens"]])
        elif isinstance(m, messages.Reserve):
            if self.reject_reserves:
                self.reject_reserves -= 1
                self.send(messages.Rejected(self.worker_id, m.request_id, "no free blocks", True))
            else:
                self._max_tokens[m.request_id] = m.sampling["max_tokens"]
                peer = {"backend": "fake", "address": "nowhere"}
                blocks, cached = [0, 1], self.num_cached_blocks
                keep = self.num_keep_blocks
                self.send(
                    messages.Reserved(
                        self.worker_id, m.request_id, peer, blocks, cached, keep, 1, 1
                    )
                )
        elif isinstance(m, messages.Prefill):
            self._tasks[m.request_id] = asyncio.create_task(self._prefill(m))
        elif isinstance(m, messages.Unpin):
            n, num_cached = len(m.prompt_token_ids), len(m.prompt_token_ids) // 16 * 16
            self.send(messages.Unpinned(self.worker_id, m.request_id, n, num_cached, num_cached))
        elif isinstance(m, messages.SwitchRole):
            self._tasks["switch"] = asyncio.create_task(self._switch(m.role))
        elif isinstance(m, messages.StartDecode):
            assert m.first_token_id == script[0]
            self._start(m.request_id, script[1 : self._max_tokens[m.request_id]])

    def _warm(self, m: messages.Generate) -> None:
        assert m.sampling["max_tokens"] == 1
        num_prompt = len(m.prompt_token_ids)
        num_cached = num_prompt // 16 * 16
        if m.pin and self.refuse_pins:
            self.send(messages.Failed(self.worker_id, m.request_id, self.refuse_pins))
            return
        self.send(
            messages.Tokens(
                self.worker_id,
                m.request_id,
                [self.cluster.script[0]],
                True,
                "length",
                num_prompt,
                num_cached,
                num_pinned_tokens=num_cached if m.pin else 0,
            )
        )

    async def _prefill(self, m: messages.Prefill) -> None:
        await asyncio.sleep(self.prefill_s)
        await self._freeze_if_due()
        if self._should_fail():
            self.send(messages.Failed(self.worker_id, m.request_id, self.fail_with))
            return
        first = self.cluster.script[0]
        reason = "stop" if first == EOS else None
        self._tokens(m.request_id, [first], True, reason)
        self._tasks.pop(m.request_id, None)

    def _start(self, request_id: str, token_ids: list[int]) -> None:
        self._tasks[request_id] = asyncio.create_task(self._emit(request_id, token_ids))

    async def _emit(self, request_id: str, token_ids: list[int]) -> None:
        for i, token_id in enumerate(token_ids):
            await asyncio.sleep(self.step_s)
            await self._freeze_if_due()
            if i == 1 and self._should_fail():
                self.send(messages.Failed(self.worker_id, request_id, self.fail_with))
                return
            if self.die_after_tokens is not None and self.num_tokens_sent >= self.die_after_tokens:
                self.cluster.kill(self.worker_id)
                return
            if token_id == EOS:
                self._tokens(request_id, [token_id], True, "stop")
                break
            last = i == len(token_ids) - 1
            self._tokens(request_id, [token_id], last, "length" if last else None)
        self._tasks.pop(request_id, None)

    async def _freeze_if_due(self) -> None:
        limit = self.freeze_after_tokens
        if limit is not None and self.num_tokens_sent >= limit:
            await asyncio.Event().wait()
        if self.long_step_after_tokens == self.num_tokens_sent:
            self.long_step_after_tokens = None  # once
            self.step_started = time.monotonic()
            try:
                await asyncio.sleep(self.long_step_s if self.long_step_s < float("inf") else 1e9)
            finally:
                self.step_started = None

    def _should_fail(self) -> bool:
        if not self.fail_with or self.fail_times == 0:
            return False
        self.fail_times -= 1
        return True

    def _tokens(self, request_id: str, ids: list[int], finished: bool, reason: str | None) -> None:
        self.num_tokens_sent += len(ids)
        self.send(messages.Tokens(self.worker_id, request_id, ids, finished, reason, 5))


class Cluster:
    """`with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:` serves on c.url."""

    def __init__(
        self,
        tokenizer_dir: Path,
        script: list[int],
        roles: dict[str, str],
        behaviour: dict[str, dict[str, Any]] | None = None,
        start_workers: bool = True,
        cpus: tuple[int, ...] = (),  # every endpoint's core pool (adaptive deployments)
        **config: Any,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdr", dir="/tmp"))  # ipc paths must be short
        self.router_address = f"ipc://{self.dir}/router"
        self.script = script
        self.events: list[tuple[str, str, str]] = []
        self.cpus = cpus
        self.workers = {
            wid: FakeWorker(self, wid, role, **(behaviour or {}).get(wid, {}))
            for wid, role in roles.items()
        }
        endpoints = [
            WorkerEndpoint(w.worker_id, w.role, w.address, cpus) for w in self.workers.values()
        ]
        self.config = RouterConfig(
            host="127.0.0.1",
            port=0,
            model="tiny",
            model_path=str(tokenizer_dir),
            ctrl_address=self.router_address,
            workers=tuple(endpoints),
            secret=SECRET,
            **config,
        )
        self._start_workers = start_workers
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._worker_tasks: dict[str, asyncio.Task[None]] = {}

    def __enter__(self) -> Cluster:
        self._thread.start()
        self.call(self._setup())
        if self._start_workers:
            self.start_workers()
            # Every worker, not only one per role: a test that reads a worker's state (its
            # epoch, its role) must not race that worker's first Ready.
            plane = self.app_state.plane
            self.wait_until(lambda: all(plane.is_healthy(w) for w in self.workers))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.call(self._teardown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _setup(self) -> None:
        self.zmq_ctx = zmq.asyncio.Context()
        self.app = build_app(self.config)
        self.runner, port = await start_server(self.app)
        self.url = f"http://127.0.0.1:{port}"

    async def _teardown(self) -> None:
        for task in self._worker_tasks.values():
            task.cancel()
        await asyncio.gather(*self._worker_tasks.values(), return_exceptions=True)
        await self.runner.cleanup()
        self.zmq_ctx.term()

    def start_workers(self) -> None:
        self.start_workers_of(list(self.workers))

    def start_workers_of(self, worker_ids: list[str]) -> None:
        async def spawn() -> None:
            for worker_id in worker_ids:
                task = asyncio.create_task(self.workers[worker_id].run())
                self._worker_tasks[worker_id] = task

        self.call(spawn())

    def kill(self, worker_id: str) -> None:
        """The worker's process "dies": its sockets close, its tasks stop (thread-safe)."""
        task = self._worker_tasks[worker_id]
        self.events.append((worker_id, "killed", ""))
        self.loop.call_soon_threadsafe(task.cancel)

    @property
    def app_state(self) -> Any:
        from pdserve.router.completions import STATE

        return self.app[STATE]

    def call(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_until(self, predicate: Callable[[], Any], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting; events: {self.events}")
            time.sleep(0.01)

    def kinds(self, worker_id: str) -> list[str]:
        return [kind for wid, kind, _ in list(self.events) if wid == worker_id]
