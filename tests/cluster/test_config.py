import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.cluster import config as cluster_config
from pdserve.cluster.config import Pipeline, WorkerGroup, load_pipeline
from pdserve.cluster.deployments import pipeline_for
from pdserve.cluster.launcher import worker_specs
from pdserve.cluster.up import pipeline_from_args
from pdserve.transfer import KVTransferConfig
from pdserve.workers.spec import WorkerSpec


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_default_is_adaptive_where_it_can_run_else_one_prefill_one_decode(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    p = pipeline_from_args(up_args())
    assert p.adaptive.enabled and p.adaptive.workers == 2 and not p.roles
    assert p.kv_transfer == KVTransferConfig()
    kv = pipeline_from_args(up_args("--kv-cache-bytes", "64MiB"))  # role flags: the workers'
    assert kv.adaptive.enabled and kv.workers.kv_cache_bytes == 64 << 20
    # No pool for two workers, cores or threads fixed per worker, or Ray: 1 prefill, 1 decode.
    for argv, cores in (
        ((), {0}),
        (("--pin-cpus",), {0, 1}),
        (("--threads", "1"), {0, 1}),
        (("--ray",), {0, 1}),
    ):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, cores=cores: cores)
        p = pipeline_from_args(up_args(*argv))
        assert not p.adaptive.enabled, argv
        assert [(n, r.num) for n, r in p.roles] == [("prefill", 1), ("decode", 1)], argv


def test_flags_and_pinning():
    p = pipeline_from_args(
        up_args(
            "--prefill",
            "2",
            "--decode",
            "1",
            "--transfer",
            "tcp",
            "--transfer-mode",
            "full",
            "--transfer-bandwidth",
            "1Gbit",
            "--pin-cpus",
            "--threads",
            "1",
        )
    )
    assert p.prefill.num == 2 and p.prefill.cpus == ((0,), (1,)) and p.prefill.threads == 1
    assert p.decode.cpus == ((0,),)  # wraps around on 2 cores
    assert p.kv_transfer == KVTransferConfig(backend="tcp", mode="full", bandwidth="1Gbit")
    collocated = pipeline_from_args(up_args("--collocated", "1"))
    assert [n for n, _ in collocated.roles] == ["collocated"]


def test_yaml_with_overrides_and_unknown_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prefill: {num: 1, cpus: [0]}\ndecode: {num: 1}\nkv_transfer: {mode: full}\n")
    p = pipeline_from_args(up_args("--config", str(path), "--port", "9001", "--transfer", "shm"))
    assert p.port == 9001 and p.kv_transfer.mode == "full" and p.kv_transfer.backend == "shm"
    assert p.prefill.cpus == (0,)
    path.write_text("prefill: {num: 1, cpu: [0]}\ndecode: {num: 1}\n")
    typo = r"unknown key 'prefill.cpu' in c.yaml \(did you mean 'prefill.cpus'\?\)"
    with pytest.raises(ValueError, match=typo):
        load_pipeline(path, {})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prefill=WorkerGroup()), "both prefill and decode"),
        (dict(collocated=WorkerGroup(), prefill=WorkerGroup(), decode=WorkerGroup()), "either"),
        (dict(collocated=WorkerGroup(), routing="random"), "routing"),
    ],
)
def test_invalid_pipelines(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(**kwargs)


def test_bad_bandwidth_names_it():
    with pytest.raises(ValueError, match="invalid bandwidth 'fast'"):
        KVTransferConfig(bandwidth="fast")


def test_role_cpus_shapes():
    assert WorkerGroup(num=2, cpus=[[0], [1]]).cpus_of(1) == (1,)
    assert WorkerGroup(num=2, cpus=[0, 1]).cpus_of(1) == (0, 1)
    with pytest.raises(ValueError, match="cpus"):
        WorkerGroup(num=2, cpus=[[0]])


def test_role_dtype_overrides_the_pipeline_and_auto_follows_the_cpu(monkeypatch, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prefill: {dtype: bfloat16}\ndecode: {}\n")
    specs = worker_specs(load_pipeline(path, {}), "tcp://127.0.0.1:1")
    assert [s.engine.device.dtype for s in specs] == ["bfloat16", "float32"]
    assert specs[0].wire_dtype == "float32"  # the prefill worker converts to the decode's
    for fast, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(cluster_config, "has_fast_bf16", lambda fast=fast: fast)
        assert WorkerGroup(dtype="auto").dtype_of("float32") == dtype
    assert WorkerGroup().dtype_of("float16") == "float16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        WorkerGroup(dtype="bf16")


def test_worker_specs_round_trip_through_json():
    p = pipeline_for("1p1d", "smollm2-135m")
    specs = worker_specs(p, "tcp://127.0.0.1:1")
    assert [s.worker_id for s in specs] == ["prefill-0", "decode-0"]
    assert specs[0].cpus == (0,) and specs[1].cpus == (1,)
    assert all(WorkerSpec.from_json(s.to_json()) == s for s in specs)
    with pytest.raises(ValueError, match="unknown deployment"):
        pipeline_for("2x", "m")


def test_transfer_deadlines_from_yaml_and_flags_reach_every_worker_spec(tmp_path):
    path = tmp_path / "c.yaml"
    transfer = "kv_transfer: {send_timeout_s: 2.5, reserve_timeout_s: 30}\n"
    path.write_text("prefill: {num: 1}\ndecode: {num: 1}\n" + transfer)
    p = pipeline_from_args(up_args("--config", str(path), "--transfer-land-timeout-s", "7"))
    deadlines = (2.5, 30, 7)
    for spec in worker_specs(p, "tcp://127.0.0.1:1"):
        t = WorkerSpec.from_json(spec.to_json()).kv_transfer
        assert (t.send_timeout_s, t.reserve_timeout_s, t.land_timeout_s) == deadlines
    with pytest.raises(SystemExit):
        up_args("--transfer-send-timeout-s", "soon")
    with pytest.raises(ValueError, match="kv_transfer.land_timeout_s must be > 0, got 0"):
        load_pipeline(path, {"kv_transfer": {"land_timeout_s": 0}})


def test_warmup_prompts_from_yaml_and_from_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "collocated: {num: 1}\nwarmup_prompts:\n  - You are terse.\n"
        "  - [{role: system, content: Be kind.}]\n"
    )
    p = pipeline_from_args(up_args("--config", str(path)))
    assert p.warmup_prompts == ("You are terse.", ({"role": "system", "content": "Be kind."},))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"one"\n\n{"messages": [{"role": "system", "content": "two"}]}\n')
    p = pipeline_from_args(up_args("--collocated", "1", "--warmup-file", str(prompts)))
    assert p.warmup_prompts == ("one", ({"role": "system", "content": "two"},))
    prompts.write_text('"one"\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: a prompt must be"):
        pipeline_from_args(up_args("--collocated", "1", "--warmup-file", str(prompts)))
    p = pipeline_from_args(up_args("--collocated", "1"))
    assert worker_specs(p, "tcp://x:1")[0].engine.cache.max_pinned_fraction == 0.5
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        WorkerGroup(max_pinned_fraction=2)
    with pytest.raises(ValueError, match=r"warmup_prompts\[1\]"):
        Pipeline(collocated=WorkerGroup(), warmup_prompts=["ok", [{"content": "no role"}]])


def test_admin_key_from_the_flag_the_environment_or_made_per_cluster(monkeypatch):
    from pdserve import envs
    from pdserve.cluster.launcher import Cluster

    monkeypatch.delenv(envs.ADMIN_KEY, raising=False)
    given = pipeline_from_args(up_args("--collocated", "1", "--admin-key", "operator"))
    assert given.admin_key == "operator" and "operator" not in repr(given)
    assert Cluster(given).admin_key == "operator"
    monkeypatch.setenv(envs.ADMIN_KEY, "from-env")
    assert pipeline_from_args(up_args("--collocated", "1")).admin_key == "from-env"
    monkeypatch.delenv(envs.ADMIN_KEY)
    none = pipeline_from_args(up_args("--collocated", "1"))
    keys = {Cluster(none).admin_key for _ in range(2)}
    assert none.admin_key is None and len(keys) == 2 and all(len(k) >= 32 for k in keys)
    assert envs.child_env(b"s", admin_key="a")[envs.ADMIN_KEY] == "a"


def test_ray_flag_sets_the_placement(tmp_path):
    assert pipeline_from_args(up_args()).placement == "local"
    local_ray = pipeline_from_args(up_args("--ray"))
    assert (local_ray.placement, local_ray.ray_address) == ("ray", None)
    remote = pipeline_from_args(up_args("--ray", "10.0.0.1:6379", "--ray-timeout-s", "5"))
    assert (remote.placement, remote.ray_address, remote.ray_timeout_s) == (
        "ray",
        "10.0.0.1:6379",
        5.0,
    )
    path = tmp_path / "c.yaml"
    path.write_text(
        "prefill: {ray_resources: {prefill_pool: 1}, ray_num_gpus: 1}\n"
        "decode: {ray_resources: {decode_pool: 0.5}}\nplacement: ray\n"
    )
    p = pipeline_from_args(up_args("--config", str(path)))
    assert p.placement == "ray" and p.prefill.ray_resources == {"prefill_pool": 1}
    assert p.prefill.ray_num_gpus == 1 and p.decode.ray_resources == {"decode_pool": 0.5}
    with pytest.raises(ValueError, match="ray_resources must map names to amounts >= 0"):
        WorkerGroup(ray_resources={"pool": -1})
    with pytest.raises(ValueError, match="placement must be one of"):
        Pipeline(collocated=WorkerGroup(), placement="k8s")
