"""The launcher's memory plan: each worker's estimate (engine/memory.py) against what this host
has available, printed before anything starts. A layout that does not fit is refused, naming
the numbers and what to change, instead of starting workers the kernel's OOM killer takes
halfway through loading (`Pipeline.memory_check`: off, warn or enforce).

Workers load at the same time, so the plan adds their peaks; a decode worker's pool fills as
it is used, so its share is the most it can reach, not what it holds at start. A model not yet
converted is first converted in the launcher, alone: that step is checked on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.cluster.config import Pipeline
from pdserve.engine.memory import (
    Checkpoint,
    WorkerMemory,
    estimate_worker,
    meminfo_available_bytes,
    read_checkpoint,
)
from pdserve.model.cpu_flags import cpu_flags
from pdserve.workers.spec import WorkerSpec

log = logging.getLogger(__name__)
ROUTER_RSS_BYTES = 160 * 2**20  # the router: aiohttp, the tokenizer, no torch (137 MiB seen)
# The GGUF conversion's peak: every tensor in fp32 at once, plus transformers (1.30 x the
# fp32 bytes with its imports, Llama 3.2 1B shape).
CONVERT_FACTOR = 1.25
CONVERT_BASE_BYTES = 300 * 2**20


CGROUP_V1 = "/sys/fs/cgroup/memory"


class MemoryPlanError(ValueError):
    """The layout does not fit this host's memory (the CLI's exit code 2)."""


@dataclass(frozen=True)
class PlannedWorker:
    worker_id: str
    role: str
    memory: WorkerMemory


@dataclass(frozen=True)
class MemoryPlan:
    workers: list[PlannedWorker]
    shared_bytes: int  # weights mapped once per host
    convert_bytes: int  # the conversion before the workers (0: already converted)
    available_bytes: int
    router_bytes: int = ROUTER_RSS_BYTES

    @property
    def total_bytes(self) -> int:
        return sum(w.memory.total for w in self.workers) + self.shared_bytes + self.router_bytes

    @property
    def fits(self) -> bool:
        return max(self.total_bytes, self.convert_bytes) <= self.available_bytes

    def lines(self) -> list[str]:
        out = [
            f"{w.worker_id}: weights {gib(w.memory.weights)}, KV pool {gib(w.memory.kv_pool)}, "
            f"activations {gib(w.memory.activations)}, base {gib(w.memory.base)}: "
            f"{gib(w.memory.total)}"
            for w in self.workers
        ]
        if self.shared_bytes:
            out.append(f"shared weights (once per host): {gib(self.shared_bytes)}")
        if self.convert_bytes:
            out.append(f"converting the model first: {gib(self.convert_bytes)} (once, alone)")
        out.append(
            f"host: {gib(self.total_bytes)} with the router's {gib(self.router_bytes)}, "
            f"{gib(self.available_bytes)} available"
        )
        return out

    def refusal(self) -> str:
        """One line: the numbers, and what to change."""
        if self.convert_bytes > self.available_bytes:
            return (
                f"converting the model to fp32 needs ~{gib(self.convert_bytes)}, this host has "
                f"{gib(self.available_bytes)} available: use a smaller model, or convert it on "
                "a larger host (`memory_check: warn` or `--memory-check off` to try anyway)"
            )
        largest = max(self.workers, key=lambda w: w.memory.total)
        shared = f", shared weights {gib(self.shared_bytes)}" if self.shared_bytes else ""
        return (
            f"{len(self.workers)} workers need ~{gib(self.total_bytes)} "
            f"({largest.worker_id}: {gib(largest.memory.total)}, of which weights "
            f"{gib(largest.memory.weights)} and KV pool {gib(largest.memory.kv_pool)}{shared}), "
            f"this host has {gib(self.available_bytes)} available: use fewer workers, a smaller "
            "kv_cache_bytes or a smaller model or quant (`--memory-check warn` or `off` to "
            "start anyway)"
        )


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def host_available_bytes() -> int:
    """What this host can still give: MemAvailable, or less where this process's cgroup has
    a lower limit (v2 memory.max, v1 memory.limit_in_bytes) less its usage;
    `PDSERVE_MEMORY_AVAILABLE` replaces it."""
    if (override := envs.memory_available_bytes()) is not None:
        return override
    available = meminfo_available_bytes()
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (f"{CGROUP_V1}/memory.limit_in_bytes", f"{CGROUP_V1}/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None:
            available = min(available, max(0, limit - usage))
    return available


def _read_int(path: str) -> int | None:
    """An integer file's value; None where it is missing or "max" (no limit)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def plan_memory(
    ckpt: Checkpoint,
    specs: list[WorkerSpec],
    available_bytes: int,
    needs_conversion: bool = False,
) -> MemoryPlan:
    """Every worker's estimate on a host with `available_bytes` (the workers' specs: their
    roles and engine settings)."""
    amx = "amx_tile" in cpu_flags() and envs.cpu_isa() in ("auto", "amx")
    workers, shared = [], 0
    for spec in specs:
        kernels = "collocated" if spec.adaptive else spec.role
        memory, holding = estimate_worker(ckpt, spec.engine, kernels, available_bytes, amx)
        workers.append(PlannedWorker(spec.worker_id, spec.role, memory))
        shared = max(shared, holding.shared_bytes)
    convert = 0
    if needs_conversion:  # a file read in place converts no weights
        weights = 0 if ckpt.in_place_bytes else int(ckpt.fp32_bytes * CONVERT_FACTOR)
        convert = weights + CONVERT_BASE_BYTES
    return MemoryPlan(workers, shared, convert, available_bytes)


def needs_conversion(model: str, gguf_fp32_max_bytes: int) -> bool:
    """Whether resolving `model` converts a GGUF file first (no valid cached conversion of
    the kind the loading rule picks)."""
    from pdserve.model import registry

    try:
        source = registry.gguf_source(model, registry.default_cache_dir())
        if source is None:
            return False
        in_place = registry.wants_in_place(source[0], gguf_fp32_max_bytes)
    except ValueError:
        return False
    return not registry.is_valid_cache(source[1], source[0], in_place)


def check_memory(
    pipeline: Pipeline, specs: list[WorkerSpec], report: Callable[[str], None]
) -> MemoryPlan | None:
    """Report the plan of `pipeline` (its workers' `specs`); one that does not fit raises
    MemoryPlanError (`memory_check: enforce`) or is reported as a warning (`warn`). None
    when not checked: `off`, or a model that cannot be read (resolving it says why)."""
    knob = pipeline.gguf_fp32_max_bytes
    if pipeline.memory_check == "off" or (ckpt := read_checkpoint(pipeline.model, knob)) is None:
        return None
    conversion = needs_conversion(pipeline.model, knob)
    plan = plan_memory(ckpt, specs, host_available_bytes(), conversion)
    for line in plan.lines():
        report(f"memory: {line}")
    if plan.fits:
        return plan
    if pipeline.memory_check == "enforce":
        raise MemoryPlanError(f"memory: {plan.refusal()}")
    report(f"memory: warning: {plan.refusal()}")
    return plan
