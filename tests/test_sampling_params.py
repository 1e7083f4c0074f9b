import pytest

from pdserve.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(stop="x", stop_token_ids=[3])
    assert p.stop == ("x",) and p.stop_token_ids == (3,) and p.temperature == 1.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
