"""The router's configuration: one frozen dataclass, validated on construction.

The launcher writes it as JSON (`--config-json`); the cluster secret never travels in the JSON
(it would show in `ps`), it arrives hex-encoded in the environment (`pdserve.envs`).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field

from pdserve.config import EngineConfig
from pdserve.costmodel.profile import load_profile
from pdserve.messages import FIELDS_BYTES, ROLES
from pdserve.planner.config import AdaptiveConfig
from pdserve.planner.cores import check_deployment
from pdserve.router.policies import POLICIES
from pdserve.schema import check, knob, same_as

POLICY_NAMES = tuple(POLICIES)
CACHE_SCOPES = ("tenant", "shared")  # router/scope.py


@dataclass(frozen=True)
class WorkerEndpoint:
    """A worker the router sends to: its id (as in its Ready), role and PULL address."""

    worker_id: str = knob(MISSING, pattern=(r".+", "a non-empty string"))
    role: str = knob(MISSING, choices=ROLES)
    address: str = knob(MISSING, pattern=(r".+", "a ZMQ address"))
    # The cores the adaptive planner may give this worker (its host's pool); () = not planned.
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = knob(8000, ge=0, le=65535)
    model: str = same_as(EngineConfig, "model")  # the served name: what clients pass as `model`
    # tokenizer source (known name, .gguf, HF or tokenizer dir); "" = model
    model_path: str = ""
    ctrl_address: str = "tcp://127.0.0.1:5600"  # the router's PULL socket (bound here)
    workers: tuple[WorkerEndpoint, ...] = ()
    secret: bytes = field(default=b"", repr=False)
    policy: str = knob("prefix_cache", "picks prefill / collocated workers", choices=POLICY_NAMES)
    load_balancer: str = knob("shortest_queue", "picks decode workers", choices=POLICY_NAMES)
    # One key, or several separated by commas: each key is a tenant (`api_keys`).
    api_key: str | None = field(default=None, repr=False)
    # Whose prefix-cache hits a request may take (router/scope.py): its API key's only, or
    # every caller's. A request's `cache_salt` narrows its scope further in both.
    cache_scope: str = knob(
        "tenant", "prefix-cache hits shared per API key (tenant) or by all", choices=CACHE_SCOPES
    )
    # `/v1/cache/warmup` pins and unpins every prefill worker's cache: an operator's action,
    # behind its own key (never the users'); without one, warm-up is refused.
    admin_key: str | None = field(default=None, repr=False)
    max_warmup_prompts: int = knob(64, "prompts in one warm-up call", ge=1)
    max_warmup_tokens: int = knob(65536, "prompt tokens in one warm-up call, all prompts", ge=1)
    heartbeat_timeout_s: float = knob(3.0, gt=0)
    admission_timeout_s: float = knob(10.0, gt=0)
    warmup_timeout_s: float = knob(600.0, "one warm-up prefill (a long prompt on a CPU core)", gt=0)
    max_recoveries: int = knob(3, "re-drives of one request after worker failures, then 502", ge=0)
    # A frozen worker that still heartbeats (router/driver.py). First token: a long prompt
    # queued behind others on a CPU worker, as for warm-up. Between tokens: a decode step takes
    # well under a second, and a preempted request resumes behind a prefill chunk; a false alarm
    # costs a re-drive (the stream goes on elsewhere), never the request.
    first_token_timeout_s: float = knob(600.0, "dispatch to a worker's first token", gt=0)
    token_timeout_s: float = knob(60.0, "longest silence of a worker between tokens", gt=0)
    # A silence spent inside one engine step (the heartbeat's `step_running_s`) is the step's,
    # not a frozen loop's: 2,048 prompt tokens of a 3B model on two AVX2 cores take ~80 s.
    step_timeout_s: float = knob(
        600.0, "longest one engine step may run before its worker counts as frozen", gt=0
    )
    max_pending: int = knob(256, ge=1)
    max_body_bytes: int = knob(8 * 1024 * 1024, ge=1)
    # ZMQ_MAXMSGSIZE of the router's control socket. Workers send block ids, hashes and
    # counters, never a prompt: Reserved for a 1M-token context at block size 1 is ~5 MiB.
    max_message_bytes: int = knob(16 * 2**20, "largest control frame from a worker", ge=1024)
    max_tokens_limit: int = knob(1 << 20, "larger max_tokens are rejected as a typo", ge=1)
    # What one request may ask of the router's event loop (README "Security model"). Every
    # stop string is searched for after every token, so their count and length bound that work.
    max_num_stop: int = knob(16, "entries in `stop` and in `stop_token_ids` (OpenAI: 4)", ge=1)
    max_stop_len: int = knob(256, "characters in one stop string", ge=1)
    # A chat body's messages are walked and rendered one by one: their number bounds that work
    # before it starts (a 240k-message body held the event loop for seconds). OpenAI: 2048.
    max_messages: int = knob(2048, "messages in one chat request", ge=1)
    max_logit_bias: int = knob(300, "token ids in one request's `logit_bias`", ge=0)
    max_logprobs: int = knob(20, "most `top_logprobs` (chat) or `logprobs` (completions)", ge=0)
    max_n: int = knob(16, "most choices (`n`) or samples (`best_of`) of one request", ge=1)
    # Slow clients. aiohttp's keep-alive timer runs from connect (and from each response) to
    # the next complete request head, so it bounds idle and dribbled heads alike.
    head_timeout_s: float = knob(30.0, gt=0)
    body_timeout_s: float = knob(30.0, "complete head -> complete body (a slot waits)", gt=0)
    write_timeout_s: float = knob(30.0, "longest a client may leave a chunk unread", gt=0)
    adaptive: AdaptiveConfig = AdaptiveConfig()
    protect_health_metrics: bool = knob(False, "/health and /metrics need api_key too")
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        check(self)
        if not self.model:
            raise ValueError("model must be a non-empty served model name")
        if self.admin_key is not None and not self.admin_key:
            raise ValueError("admin_key must be non-empty (or None: warm-up refused)")
        if self.api_key is not None and not all(self.api_keys):
            raise ValueError("api_key: every comma-separated key must be non-empty")
        if self.protect_health_metrics and not self.api_key:
            raise ValueError("protect_health_metrics needs api_key: there is nothing to check")
        stop_bytes = self.max_num_stop * (self.max_stop_len * 4 + 5)  # UTF-8, msgpack headers
        if stop_bytes > FIELDS_BYTES // 2:
            raise ValueError(
                f"max_num_stop x max_stop_len ({self.max_num_stop} x {self.max_stop_len}) "
                f"exceeds what a worker's message size bound allows ({FIELDS_BYTES // 2} bytes)"
            )
        if self.max_logit_bias * 15 > FIELDS_BYTES // 4:  # [uint32, float64] in msgpack
            limit = FIELDS_BYTES // 4 // 15
            raise ValueError(f"max_logit_bias must be <= {limit} (a worker's message size bound)")
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workers: duplicate worker_id in {ids}")
        if self.adaptive.enabled and self.workers:
            check_deployment(self.workers)
        if self.adaptive.enabled and self.adaptive.profile:
            try:  # refused with the config, not when the planner starts
                load_profile(self.adaptive.profile)
            except ValueError as exc:
                raise ValueError(f"adaptive.profile: {exc}") from None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key (`api_key` split at its commas), each its own tenant."""
        return tuple(self.api_key.split(",")) if self.api_key is not None else ()

    @property
    def tokenizer_source(self) -> str:
        return self.model_path or self.model
