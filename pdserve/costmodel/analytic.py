"""Analytic GPU profiles: a roofline per phase from datasheet figures and a model's shape.

For tensor parallelism `t` within a node (weights, FLOPs and KV split `t` ways; two
all-reduces of the hidden state per layer over NVLink):

    weights_s   = weight_bytes / t / (hbm_bw * eff_memory)
    token_s     = 2 * num_params / t / (peak_flops * eff_compute)     per token through the linears
    knee_tokens = weights_s / token_s                               the ridge point, in tokens
    c_step      = step_overhead_s + weights_s + 2 * layers * allreduce_latency_s   (t > 1)
    c_prefill   = c_decode = 2 * layers * 2 (t-1)/t * hidden * act_bytes / (nvlink_bw * eff_link)
    c_knee      = token_s
    c_pairs     = 4 * heads * head_dim * layers / t / (peak_flops * eff_attention)
    c_context   = kv_bytes_per_token / t / (hbm_bw * eff_memory)

so a step costs max(weights read, linear FLOPs) plus attention plus communication: the
StepCostModel of costmodel/step_cost.py with these coefficients. Efficiencies are assumptions
(named in `Efficiency`), not measurements: calibrate them against one measured run when one
exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.costmodel.profile import HardwareProfile, ModelShape
from pdserve.costmodel.step_cost import StepCostModel, TransferModel
from pdserve.schema import check, knob


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures: dense BF16 tensor FLOP/s, HBM bandwidth and capacity, NVLink
    bandwidth per direction, and the per-GPU network bandwidth between nodes."""

    name: str
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    devices_per_node: int = 8


DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("A100-40GB", 312e12, 1.555e12, 40e9, 300e9, 25e9),
        DeviceSpec("A100-80GB", 312e12, 2.039e12, 80e9, 300e9, 25e9),
        DeviceSpec("H100-SXM", 989e12, 3.35e12, 80e9, 450e9, 50e9),
        DeviceSpec("H200", 989e12, 4.8e12, 141e9, 450e9, 50e9),
    )
}

# Architectures from the models' published configs (bf16 weights and KV).
_OPT = dict(num_mlp_matrices=2, tie_word_embeddings=True)  # OPT's MLP is ungated
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000),
        ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000),
        ModelShape("llama-2-70b", 80, 8192, 28672, 64, 8, 128, 32000),
        ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256),
        ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256),
        ModelShape("opt-13b", 40, 5120, 20480, 40, 40, 128, 50272, **_OPT),
        ModelShape("opt-66b", 64, 9216, 36864, 72, 72, 128, 50272, **_OPT),
        ModelShape("opt-175b", 96, 12288, 49152, 96, 96, 128, 50272, **_OPT),
    )
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a serving engine reaches (assumed; see docs/simulator.md)."""

    compute: float = knob(0.6, gt=0, le=1)
    attention: float = knob(0.4, gt=0, le=1)
    memory: float = knob(0.8, gt=0, le=1)
    link: float = knob(0.7, gt=0, le=1)
    step_overhead_s: float = knob(0.003, ge=0)
    allreduce_latency_s: float = knob(10e-6, ge=0)
    transfer_latency_s: float = knob(1e-3, ge=0)

    def __post_init__(self) -> None:
        check(self, "efficiency ")


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose from {', '.join(DEVICES)}")
    return DEVICES[name]


def model_shape(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r} for an analytic profile; choose from {', '.join(MODELS)}"
        )
    return MODELS[name]


def roofline_model(
    model: ModelShape, device: DeviceSpec, tp: int, eff: Efficiency = Efficiency()
) -> StepCostModel:
    weights_s = model.weight_bytes / tp / (device.memory_bandwidth_bytes_per_s * eff.memory)
    token_s = 2 * model.num_params / tp / (device.peak_flops * eff.compute)
    comm = 0.0
    step_s = eff.step_overhead_s + weights_s
    if tp > 1:
        act_bytes = model.hidden_size * model.weight_bytes_per_param
        per_allreduce = 2 * (tp - 1) / tp * act_bytes / (device.nvlink_bytes_per_s * eff.link)
        comm = 2 * model.num_layers * per_allreduce
        step_s += 2 * model.num_layers * eff.allreduce_latency_s
    attention_flops = 4 * model.num_heads * model.head_dim * model.num_layers
    pairs = attention_flops / tp / (device.peak_flops * eff.attention)
    context = model.kv_bytes_per_token / tp / (device.memory_bandwidth_bytes_per_s * eff.memory)
    # A GPU batches every prefill row into one varlen attention kernel: no per-row cost. A
    # roofline has one kernel regime (row_kernel_rows infinite): no tiled step to price.
    coefficients = [step_s, comm, comm, token_s, pairs, context, 0.0, 0.0]
    return StepCostModel(coefficients, knee_tokens=weights_s / token_s, prior=coefficients)


def analytic_profile(
    model: ModelShape,
    device_name: str,
    sizes: tuple[int, ...] = (1, 2, 4, 8),
    eff: Efficiency = Efficiency(),
) -> HardwareProfile:
    """A profile for tensor-parallel sizes that split the model's heads evenly."""
    device = device_spec(device_name)
    usable = [t for t in sizes if model.num_kv_heads % t == 0 and model.num_heads % t == 0]
    if not usable:
        raise ValueError(f"{model.name}'s heads split evenly over none of {sizes} devices")
    transfer = {
        "nvlink": TransferModel(device.nvlink_bytes_per_s * eff.link, eff.transfer_latency_s),
        "rdma": TransferModel(device.network_bytes_per_s * eff.link, eff.transfer_latency_s),
    }
    return HardwareProfile(
        kind="analytic",
        device=device.name,
        model=model,
        size_unit="tensor_parallel",
        models={t: roofline_model(model, device, t, eff) for t in usable},
        transfer=transfer,
        devices_per_node=device.devices_per_node,
        memory_bytes_per_device=device.memory_bytes,
        machine={"device": vars(device), "efficiency": vars(eff)},
    )
