"""The config mechanism: checks, dict and flag conversion derived from dataclass fields."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pdserve.router.config import RouterConfig
from pdserve.schema import (
    OneLineArgumentParser,
    add_flags,
    check,
    flag_values,
    flat_fields,
    from_dict,
    from_flat,
    knob,
    parse_bytes,
    with_fields_of,
)


@dataclass(frozen=True)
class Inner:
    size: int = knob(4, "a size", ge=1)
    kind: str = knob("fast", "a kind", choices=("fast", "slow"))

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    ratio: float | None = knob(None, "a share", gt=0, lt=1)
    ids: tuple[int, ...] = ()
    on: bool = knob(True, "a switch", flag="switch")
    inner: Inner = knob(Inner(), prefix="in_")

    def __post_init__(self) -> None:
        check(self)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name=3), "name must be a string, got 3"),
        (dict(ratio=1), "ratio must be < 1, got 1"),
        (dict(ratio=True), "ratio must be a number, got True"),
        (dict(ids=[1, "2"]), r"ids\[1\] must be an integer, got '2'"),
        (dict(on=1), "on must be true or false, got 1"),
        (dict(inner={"size": 0}), r"inner.size must be >= 1, got 0"),
        (dict(inner={"kind": "fsat"}), r"one of \('fast', 'slow'\), got 'fsat' \(did you mean"),
    ],
)
def test_check_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Outer(**kwargs)


def test_lists_become_tuples_and_mappings_configs():
    outer = Outer(ids=[1, 2], ratio=0.5, inner={"size": 2})
    assert outer.ids == (1, 2) and outer.inner == Inner(size=2) and outer.ratio == 0.5


def test_from_dict_round_trip_and_unknown_keys():
    outer = from_dict(Outer, {"ids": [3], "inner": {"kind": "slow"}}, "o.yaml")
    assert outer == Outer(ids=(3,), inner=Inner(kind="slow"))
    assert from_dict(Outer, dataclasses.asdict(outer)) == outer
    with pytest.raises(
        ValueError, match=r"^unknown key 'inner.sise' in o.yaml \(did you mean 'inner.size'\?\)$"
    ):
        from_dict(Outer, {"inner": {"sise": 1}}, "o.yaml")
    with pytest.raises(ValueError, match=r"^unknown key 'zzz' in o.yaml$"):
        from_dict(Outer, {"zzz": 1}, "o.yaml")
    with pytest.raises(ValueError, match=r"^o.yaml: inner.size must be >= 1, got 0$"):
        from_dict(Outer, {"inner": {"size": 0}}, "o.yaml")
    with pytest.raises(ValueError, match=r"^o.yaml: inner must be a mapping, got 3$"):
        from_dict(Outer, {"inner": 3}, "o.yaml")


def test_flat_view():
    assert list(flat_fields(Outer)) == ["name", "ratio", "ids", "on", "in_size", "in_kind"]
    assert from_flat(Outer, {"in_size": 9}) == Outer(inner=Inner(size=9))
    with pytest.raises(
        ValueError, match=r"unknown argument 'in_sise' \(did you mean 'in_size'\?\)"
    ):
        from_flat(Outer, {"in_sise": 9})
    engine = from_flat(EngineConfig, {"block_size": 32, "threads": 2, "kv_host_bytes": 5})
    assert engine.cache.block_size == 32 and engine.device.threads == 2
    assert engine.kvstore.host_bytes == 5


def test_with_fields_of_repeats_fields_defaults_and_checks():
    @with_fields_of(Inner, skip=("kind",))
    class Group:
        num: int = 1

    assert [f for f in Group.__dataclass_fields__] == ["num", "size"]
    assert Group().size == 4
    names = ("block_size", "max_num_seqs", "cpu_kernels")
    role_defaults = {n: getattr(WorkerGroup(), n) for n in names}
    assert role_defaults == {
        "block_size": CacheConfig().block_size,
        "max_num_seqs": SchedulerConfig().max_num_seqs,
        "cpu_kernels": DeviceConfig().cpu_kernels,
    }
    # skipped: not DeviceConfig's dtype (Pipeline-wide); WorkerGroup declares its own override
    assert WorkerGroup.__dataclass_fields__["dtype"].default is None
    with pytest.raises(ValueError, match="max_num_batched_tokens must be > 0"):
        WorkerGroup(max_num_batched_tokens=0)


def test_flags_from_fields():
    parser = OneLineArgumentParser(prog="t")
    add_flags(parser, Outer)
    args = parser.parse_args(
        ["--in-size", "7", "--no-switch", "--ratio", "0.25", "--ids", "3", "--ids", "4"]
    )
    assert flag_values(args, Outer) == {"in_size": 7, "on": False, "ratio": 0.25, "ids": [3, 4]}
    assert from_flat(Outer, flag_values(args, Outer)).ids == (3, 4)
    assert flag_values(parser.parse_args([]), Outer) == {}  # defaults stay the dataclass's
    assert "(default: 4)" in parser.format_help()
    other = OneLineArgumentParser(prog="t")
    add_flags(other, Outer, "o.", in_size=8)  # a default of this command's own
    assert flag_values(other.parse_args([]), Outer, "o.") == {"in_size": 8}
    assert "(default: 8)" in other.format_help()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--in-kind", "slwo"],
            "t: error: argument --in-kind: invalid choice 'slwo' "
            "(choose from fast, slow) (did you mean 'slow'?)\n",
        ),
        (
            ["--in-sizee", "1"],
            "t: error: unrecognized arguments: --in-sizee 1 (did you mean '--in-size'?)\n",
        ),
        (["--in-size", "x"], "t: error: argument --in-size: invalid int value: 'x'\n"),
    ],
)
def test_bad_flags_are_one_line_with_the_closest(capsys, argv, message):
    parser = OneLineArgumentParser(prog="t")
    add_flags(parser, Outer)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err == message


def test_parse_bytes():
    assert [parse_bytes(t) for t in ("512MiB", "2GB", "1048576", "1.5KiB")] == [
        512 * 2**20,
        2 * 10**9,
        2**20,
        1536,
    ]
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: 'lots'"):
        parse_bytes("lots")


def test_nested_lists_of_configs_and_choices_from_registries():
    config = from_dict(
        RouterConfig, {"workers": [{"worker_id": "a", "role": "decode", "address": "x"}]}
    )
    assert config.workers[0].role == "decode"
    with pytest.raises(
        ValueError, match=r"workers\[0\].role must be one of .* \(did you mean 'prefill'\?\)"
    ):
        RouterConfig(workers=[{"worker_id": "a", "role": "prefil", "address": "x"}])
    with pytest.raises(ValueError, match=r"load_balancer must be one of .*'round_robin'"):
        Pipeline(collocated=WorkerGroup(), load_balancer="round_robin_")


# Flat names that mean a different thing in different configs, so may default differently.
_OWN_DEFAULTS = {
    "ctrl_address": "the router's socket vs a worker's, given by the launcher",
    "dtype": "a WorkerGroup's None reads as its pipeline's",
    "model": "a benchmark's None asks the server",
    "threads": "a profile's is the list of thread counts it measures",
    "transfer_backend": "the simulator's names a measured backend, None the profile's first",
    "url": "a benchmark's target",
    "workers": "a count in AdaptiveConfig, a WorkerGroup in Pipeline",
}


_CONFIG_MODULES = (
    "pdserve.bench.app",
    "pdserve.bench.compare",
    "pdserve.cluster.config",
    "pdserve.config",
    "pdserve.kvstore.config",
    "pdserve.perf.measure",
    "pdserve.planner.config",
    "pdserve.router.config",
    "pdserve.sim.deployment",
    "pdserve.transfer",
    "pdserve.workers.spec",
)


def _config_classes() -> list[type]:
    import importlib

    found = []
    for name in _CONFIG_MODULES:
        classes = [v for v in vars(importlib.import_module(name)).values() if isinstance(v, type)]
        found += [c for c in classes if dataclasses.is_dataclass(c) and c.__module__ == name]
    return found


def test_a_knob_has_one_default_wherever_it_appears():
    """A second declaration of a knob with its own default (the simulator routing by
    shortest_queue while `pdserve up` routed by prefix_cache) fails here."""
    defaults: dict[str, dict[str, object]] = {}
    for cls in _config_classes():
        for name, flat in flat_fields(cls).items():
            f = flat.field
            if f.default is not dataclasses.MISSING and name not in _OWN_DEFAULTS:
                defaults.setdefault(name, {})[cls.__name__] = f.default
    split = {n: d for n, d in defaults.items() if len({repr(v) for v in d.values()}) > 1}
    assert split == {}
    assert len(defaults) > 100  # the walk found the configs


def test_routing_is_one_knob_for_up_the_router_and_simulate():
    from pdserve.sim.deployment import SimConfig

    policy = flat_fields(RouterConfig)["policy"].field
    for cls in (Pipeline, SimConfig):
        assert dict(flat_fields(cls)["routing"].field.metadata) == dict(policy.metadata)
    pipeline = Pipeline(collocated=WorkerGroup())
    assert pipeline.routing == RouterConfig().policy == SimConfig().routing
    assert pipeline.load_balancer == SimConfig().load_balancer
