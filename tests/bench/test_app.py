import json
import math

from pdserve.bench.app import json_safe


def test_json_safe_turns_inf_and_nan_into_null_at_any_depth():
    document = {
        "gaps": [0.5, math.inf, 2],  # numbers with a non-finite one
        "finite": [0.25, 3],
        "records": [{"ttft": math.nan, "name": "r0", "gaps": (1.0, -math.inf)}],
        "mixed": [1.0, "x", None, [math.nan]],
    }
    safe = json_safe(document)
    assert safe == {
        "gaps": [0.5, None, 2],
        "finite": [0.25, 3],
        "records": [{"ttft": None, "name": "r0", "gaps": [1.0, None]}],
        "mixed": [1.0, "x", None, [None]],
    }
    assert safe["finite"] is not document["finite"]  # a copy: the caller's lists stay theirs
    json.dumps(safe, allow_nan=False)  # strict JSON
