import json

import pytest

from pdserve.costmodel.analytic import MODELS, analytic_profile, model_shape
from pdserve.costmodel.profile import (
    PROFILE_VERSION,
    HardwareProfile,
    ServedOverhead,
    load_profile,
)
from pdserve.costmodel.step_cost import StepCostModel, StepShape


def test_profile_round_trips_through_json(tmp_path):
    profile = analytic_profile(MODELS["llama-3-8b"], "H100-SXM")
    profile.save(tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert loaded.to_dict() == profile.to_dict()
    assert sorted(loaded.models) == [1, 2, 4, 8]


def test_a_profile_keeps_each_models_decode_regimes(tmp_path):
    """A model's row-kernel threshold and tiled decode term travel with the profile; a model
    written without them (one decode regime, as version 7 profiles were first fitted) reads
    with its decode term pricing every decode row, as it was fitted."""
    profile = analytic_profile(MODELS["llama-3-8b"], "H100-SXM")
    profile.models[1] = StepCostModel([0.01, 2e-3, 5e-3, 0, 0, 0, 0, 0.2], row_kernel_rows=16)
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").models[1].row_kernel_rows == 16
    data = json.loads((tmp_path / "p.json").read_text())
    one = data["models"]["1"]
    del one["row_kernel_rows"], one["coefficients"]["tiled_step"]
    model = HardwareProfile.from_dict(data).models[1]
    assert model.predict(StepShape(64, 32)) == pytest.approx(0.01 + 64 * 2e-3 + 32 * 5e-3)


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_prefill():
    profile = analytic_profile(MODELS["llama-3-8b"], "H100-SXM")
    model = profile.cost_model(1)
    from pdserve.costmodel.step_cost import StepShape

    one = model.predict(StepShape(decode_requests=1, decode_context_tokens=512))
    eight = model.predict(StepShape(decode_requests=8, decode_context_tokens=8 * 512))
    assert eight < 1.2 * one  # weights read once for the batch
    p4k = model.predict(StepShape(prefill_tokens=4096))
    p8k = model.predict(StepShape(prefill_tokens=8192))
    assert p8k / p4k == pytest.approx(2, rel=0.1)  # FLOPs dominate
    # Tensor parallelism splits the work: TP2 decode is faster than TP1, not twice as fast.
    tp2 = profile.cost_model(2).predict(StepShape(decode_requests=1, decode_context_tokens=512))
    assert one / 2 < tp2 < one


def test_bad_input_is_refused_with_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="unknown device 'B300'"):
        analytic_profile(MODELS["llama-3-8b"], "B300")
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        model_shape("gpt-5")
    profile = analytic_profile(MODELS["llama-2-70b"], "A100-40GB")
    with pytest.raises(ValueError, match="leaves no room for KV on 1 x A100-40GB"):
        profile.kv_capacity_tokens(1)
    with pytest.raises(ValueError, match="profile is of model 'llama-2-70b', not 'smollm2-135m'"):
        profile.check_model("smollm2-135m")
    (tmp_path / "old.json").write_text('{"version": 0}')
    with pytest.raises(ValueError, match="profile version 0"):
        load_profile(tmp_path / "old.json")
    # Version 1 had no served-path figures: a simulation from it would leave them out.
    data = analytic_profile(MODELS["llama-3-8b"], "H100-SXM").to_dict() | {"version": 1}
    (tmp_path / "v1.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"profile version 1: .*\(measure again"):
        load_profile(tmp_path / "v1.json")
    data = analytic_profile(MODELS["llama-3-8b"], "H100-SXM").to_dict()
    data["served"] = {"request_s": -1.0, "token_s": 0.0}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"served.request_s must be >= 0"):
        load_profile(tmp_path / "bad.json")


def test_a_profile_of_an_older_format_is_refused_naming_its_version(tmp_path):
    """Version 6 priced a prefill worker's extra step time and a served step factor, which
    the serving stack no longer has: read with them dropped, its workers would be priced
    otherwise than measured."""
    data = analytic_profile(MODELS["llama-3-8b"], "H100-SXM").to_dict()
    assert data["version"] == PROFILE_VERSION == 7
    assert HardwareProfile.from_dict(data).served == ServedOverhead()
    (tmp_path / "v6.json").write_text(json.dumps(data | {"version": 6}))
    with pytest.raises(ValueError, match=r"profile version 6: this pdserve reads version 7 only"):
        load_profile(tmp_path / "v6.json")
    for removed in ("step_factor", "send_step_s", "send_token_s"):
        assert removed not in data["served"]
