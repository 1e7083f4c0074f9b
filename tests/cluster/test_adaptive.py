"""An adaptive deployment's surface: Pipeline, flags, YAML, its refusals, and what the
launcher makes of it (worker specs, router config)."""

import json
import os

import pytest

from pdserve.cluster.config import Pipeline, WorkerGroup, load_pipeline
from pdserve.cluster.deployments import pipeline_for
from pdserve.cluster.launcher import router_settings, worker_specs
from pdserve.cluster.up import pipeline_from_args
from pdserve.planner.config import AdaptiveConfig
from pdserve.router.config import RouterConfig
from pdserve.schema import from_dict
from tests.cluster.conftest import KV_BYTES, role, start
from tests.cluster.test_cluster import complete_all
from tests.cluster.test_config import up_args

ON = AdaptiveConfig(enabled=True)


def test_flags_make_an_adaptive_pipeline_with_every_worker_flag_in_workers():
    args = up_args(
        "--adaptive",
        "--adaptive-slo-ttft-ms",
        "800",
        "--adaptive-min-dwell-s",
        "5",
        "--kv-cache-bytes",
        "1MiB",
    )
    p = pipeline_from_args(args)
    assert p.adaptive == AdaptiveConfig(enabled=True, slo_ttft_ms=800, min_dwell_s=5)
    assert p.roles == [] and p.workers == WorkerGroup(kv_cache_bytes=2**20)


def test_yaml_adaptive_section_and_workers(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(
        "adaptive: {enabled: true, workers: 2, slo_itl_ms: 50}\n"
        "workers: {cpus: [0, 1], block_size: 32}\n"
    )
    p = load_pipeline(path, {})
    assert p.adaptive.slo_itl_ms == 50 and p.workers.cpus == (0, 1)
    assert p.workers.block_size == 32 and p.adaptive_cpus() == (0, 1)
    path.write_text("adaptive: {enabled: true, slo_ttft_ms: 0}\n")
    with pytest.raises(ValueError, match=r"adaptive\.slo_ttft_ms must be > 0"):
        load_pipeline(path, {})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(collocated=WorkerGroup()), "collocated"),
        (dict(prefill=WorkerGroup(), decode=WorkerGroup()), "prefill"),
        (dict(workers=WorkerGroup(cpus=(0,))), "adaptive.workers"),
        (dict(workers=WorkerGroup(num=2)), "workers.num"),
        (dict(workers=WorkerGroup(threads=1)), "workers.threads"),
        (dict(workers=WorkerGroup(num=2, cpus=((0,), (1,)))), "workers.num"),
        (dict(workers=WorkerGroup(num=1, cpus=((0, 1),))), "workers.cpus"),
    ],
)
def test_adaptive_refusals_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        Pipeline(model="m", adaptive=ON, **kwargs)


def test_more_workers_than_cores_is_refused_at_start():
    num_cores = len(os.sched_getaffinity(0))
    many = AdaptiveConfig(enabled=True, workers=num_cores + 1)
    with pytest.raises(ValueError, match=rf"^adaptive\.workers: {num_cores + 1} workers need"):
        Pipeline(model="m", adaptive=many)
    with pytest.raises(ValueError, match=r"adaptive\.workers must be >= 2"):
        pipeline_from_args(up_args("--adaptive", "--adaptive-workers", "1"))


def test_workers_without_adaptive_and_adaptive_with_roles_or_pinning_are_refused():
    with pytest.raises(ValueError, match=r"^workers: only an adaptive pipeline"):
        Pipeline(model="m", collocated=WorkerGroup(), workers=WorkerGroup())
    with pytest.raises(ValueError, match=r"prefill: an adaptive pipeline"):
        pipeline_from_args(up_args("--adaptive", "--prefill", "1", "--decode", "1"))
    with pytest.raises(ValueError, match=r"^--pin-cpus"):
        pipeline_from_args(up_args("--adaptive", "--pin-cpus"))


def test_launcher_starts_one_prefill_and_decode_workers_on_the_whole_pool():
    adaptive = AdaptiveConfig(enabled=True, workers=3, slo_ttft_ms=500)
    p = Pipeline(model="m", adaptive=adaptive, workers=WorkerGroup(cpus=(4, 5, 6), block_size=32))
    specs = worker_specs(p, "tcp://127.0.0.1:1")
    assert [(s.worker_id, s.role) for s in specs] == [
        ("worker-0", "prefill"),
        ("worker-1", "decode"),
        ("worker-2", "decode"),
    ]
    for s in specs:
        assert s.adaptive and s.cpus == (4, 5, 6) and s.engine.device.threads == 3
        assert s.engine.cache.block_size == 32
    settings = json.loads(json.dumps(router_settings(p, specs, "tcp://127.0.0.1:1", "INFO")))
    router = from_dict(RouterConfig, settings)
    assert router.adaptive == adaptive
    assert [w.cpus for w in router.workers] == [(4, 5, 6)] * 3


def test_a_static_pipeline_plans_no_cores():
    p = Pipeline(model="m", collocated=WorkerGroup(cpus=(0,)))
    specs = worker_specs(p, "tcp://127.0.0.1:1")
    assert not specs[0].adaptive and specs[0].cpus == (0,)
    router = from_dict(RouterConfig, router_settings(p, specs, "tcp://127.0.0.1:1", "INFO"))
    assert not router.adaptive.enabled and router.workers[0].cpus == ()


def test_adaptive_deployment_uses_the_same_cores_as_collocated():
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        pytest.skip("an adaptive deployment needs two cores")
    adaptive, collocated = pipeline_for("adaptive", "m"), pipeline_for("collocated", "m")
    assert adaptive.adaptive.enabled and adaptive.adaptive_cpus() == cores
    assert collocated.collocated.cpus == cores


def test_adaptive_cluster_answers_like_collocated(tiny_served_model):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("an adaptive deployment needs two cores")
    model = str(tiny_served_model)
    with start(tiny_served_model, collocated=role()) as url:
        reference = complete_all(url, model)
    workers = WorkerGroup(kv_cache_bytes=KV_BYTES)
    with start(tiny_served_model, adaptive=ON, workers=workers) as url:
        assert complete_all(url, model) == reference


def test_the_router_prices_local_prefills_in_the_workers_chunks():
    adaptive = AdaptiveConfig(enabled=True)
    p = Pipeline(
        model="m",
        adaptive=adaptive,
        workers=WorkerGroup(cpus=(0, 1), long_prefill_token_threshold=64),
    )
    specs = worker_specs(p, "tcp://127.0.0.1:1")
    router = from_dict(RouterConfig, router_settings(p, specs, "tcp://127.0.0.1:1", "INFO"))
    assert router.adaptive.prefill_chunk_tokens == 64
