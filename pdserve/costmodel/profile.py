"""Hardware profiles: a cost model per worker size for one model on one kind of machine,
measured (`pdserve profile`) or analytic (costmodel/analytic.py), stored as versioned JSON.

A worker's *size* is the devices it spans: threads on a CPU (one per core), the
tensor-parallel degree on GPUs. The profile says which (`size_unit`).

One format, `PROFILE_VERSION`: a file of another version is refused with its version named
(measure again: `pdserve profile`). Older formats priced costs the serving stack no longer
has (a prefill worker's extra step time, a served step factor for profiles without served
steps), and reading them with those terms dropped would price their workers otherwise than
they were measured.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from pdserve.costmodel.step_cost import ServedCostModel, ServedSteps, StepCostModel, TransferModel
from pdserve.schema import check, knob

PROFILE_VERSION = 7


@dataclass(frozen=True)
class ServedOverhead:
    """What a served request costs outside the engine's steps, measured by `pdserve profile`
    through a real router and worker (idle, requests one at a time):

    - `request_s`: from the client's send until the worker's step starts on it: HTTP, the
      router's parsing and routing, the hop to the worker, its poll; also the first token's
      way back over HTTP (the client's clock sees only the sum of the two HTTP legs);
    - `token_s`: from a step's end until the router has its token (the hop back, the router's
      processing). A constant per token: it delays every token alike, so ITL and TPOT keep
      the engine's figures while TTFT and end-to-end latency carry it;
    - `token_cpu_s`: the CPU the router and the client spend per streamed token (SSE,
      detokenizing, parsing). It comes out of the workers' cores when no core is free: the
      simulator lengthens such a step by its tokens times this. On an AMD EPYC, 0.4 ms
      (router) + 0.5 ms (client) per token, 7 ms a step at batch 8; without it the
      simulator priced collocated chat TPOT 22-33% low there.

    And of a prefill worker (a served 1p1d, one core each; 0 where the host has one core),
    whose steps are its cost model's (it keeps the weights the profiled engine runs on):

    - `remote_token_s`: from its step's end until the router has the first token (`token_s`
      for a collocated worker's);
    - `start_decode_s`: from then until the decode worker runs the request: StartDecode's
      hop to it and its read between steps. The decode worker holds the KV by then (it
      streamed in layer by layer) but has no first token to continue from until the router
      forwards it, so its first step starts after both.

    Zero in analytic profiles: they model devices, not a serving stack."""

    request_s: float = knob(0.0, ge=0)
    token_s: float = knob(0.0, ge=0)
    remote_token_s: float = knob(0.0, ge=0)
    token_cpu_s: float = knob(0.0, ge=0)
    start_decode_s: float = knob(0.0, ge=0)

    def __post_init__(self) -> None:
        check(self, "served.")


@dataclass(frozen=True)
class ModelShape:
    """What the performance model needs of a model: its shape and the bytes of its weights
    and KV as the engine stores them."""

    name: str
    num_layers: int = knob(MISSING, gt=0)
    hidden_size: int = knob(MISSING, gt=0)
    intermediate_size: int = knob(MISSING, gt=0)
    num_heads: int = knob(MISSING, gt=0)
    num_kv_heads: int = knob(MISSING, gt=0)
    head_dim: int = knob(MISSING, gt=0)
    vocab_size: int = knob(MISSING, gt=0)
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    num_mlp_matrices: int = 3  # gated MLP (Llama); 2 for OPT/GPT
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        check(self, f"model {self.name!r}: ")

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        mlp = self.num_mlp_matrices * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


@dataclass
class HardwareProfile:
    """`models[size]`: the step-cost model of a worker of that size. `transfer[backend]`:
    KV transfer between two workers. `served`: the serving stack's own latency.
    `served_steps[size]`: how a served worker of that size steps against `models[size]`
    (measured; empty in analytic profiles and before version 5). KV capacity is
    `kv_cache_bytes` when measured (what the engine was given), else `memory_fraction` of
    the workers' device memory less weights."""

    kind: str  # "measured" | "analytic"
    device: str  # "cpu: <model name>" or a GPU class (A100-80GB, H100-SXM, H200)
    model: ModelShape
    size_unit: str  # "threads" | "tensor_parallel"
    models: dict[int, StepCostModel]
    transfer: dict[str, TransferModel]
    devices_per_node: int
    memory_bytes_per_device: float | None = None
    memory_fraction: float = 0.9
    kv_cache_bytes: float | None = None
    machine: dict[str, object] = field(default_factory=dict)
    served: ServedOverhead = ServedOverhead()
    served_steps: dict[int, ServedSteps] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def cost_model(self, size: int) -> StepCostModel:
        if size not in self.models:
            raise ValueError(
                f"the profile has no cost model for {size} {self.size_unit} "
                f"(it has {sorted(self.models)})"
            )
        return self.models[size]

    def served_cost_model(
        self, size: int, role: str = "collocated"
    ) -> StepCostModel | ServedCostModel:
        """The step time of a served worker of `size`: `cost_model(size)` through its
        `served_steps` lines where the profile has them (none: the model's). A prefill worker
        keeps the model: it runs the engine's weights alone on its cores, as profiled."""
        model = self.cost_model(size)
        steps = self.served_steps.get(size)
        return ServedCostModel(model, steps) if steps and role != "prefill" else model

    def transfer_model(self, backend: str | None = None) -> TransferModel:
        if backend is None:
            backend = next(iter(self.transfer), None)
        if backend not in self.transfer:
            raise ValueError(
                f"the profile has no transfer figures for backend {backend!r} "
                f"(it has {sorted(self.transfer)})"
            )
        return self.transfer[backend]

    def kv_capacity_tokens(self, size: int) -> int:
        """KV tokens a worker of `size` devices holds; ValueError if the weights leave none."""
        if self.kv_cache_bytes is not None:
            return int(self.kv_cache_bytes // self.model.kv_bytes_per_token)
        assert self.memory_bytes_per_device is not None
        usable = size * self.memory_bytes_per_device * self.memory_fraction
        free = usable - self.model.weight_bytes
        if free < self.model.kv_bytes_per_token * 2048:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB of weights) leaves "
                f"no room for KV on {size} x {self.device} "
                f"({usable / 1e9:.1f} GB usable); use more devices per worker"
            )
        return int(free // self.model.kv_bytes_per_token)

    def check_model(self, model_name: str | None) -> None:
        if model_name is not None and model_name != self.model.name:
            raise ValueError(
                f"the profile is of model {self.model.name!r}, not {model_name!r}: "
                "profile this model first (pdserve profile) or pick its analytic profile"
            )

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "model": asdict(self.model),
            "models": {str(k): m.to_dict() for k, m in self.models.items()},
            "transfer": {k: asdict(t) for k, t in self.transfer.items()},
            "served": asdict(self.served),
            "served_steps": {str(k): asdict(v) for k, v in self.served_steps.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {version!r}: this pdserve reads version {PROFILE_VERSION} "
                "only (measure again: pdserve profile)"
            )
        try:
            return cls(
                kind=data["kind"],
                device=data["device"],
                model=ModelShape(**data["model"]),
                size_unit=data["size_unit"],
                models={int(k): StepCostModel.from_dict(m) for k, m in data["models"].items()},
                transfer={k: TransferModel(**t) for k, t in data["transfer"].items()},
                devices_per_node=int(data["devices_per_node"]),
                memory_bytes_per_device=data.get("memory_bytes_per_device"),
                memory_fraction=float(data.get("memory_fraction", 0.9)),
                kv_cache_bytes=data.get("kv_cache_bytes"),
                machine=dict(data.get("machine", {})),
                served=ServedOverhead(**data["served"]),
                served_steps={
                    int(k): ServedSteps(**v) for k, v in data.get("served_steps", {}).items()
                },
            )
        except KeyError as exc:
            raise ValueError(f"profile lacks the field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"profile has a bad field: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def load_profile(path: str | Path) -> HardwareProfile:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"profile {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not JSON: {exc}") from None
    try:
        return HardwareProfile.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"profile {str(path)!r}: {exc}") from None
