"""The prefix-cache oracle is gone (router/scope.py): a caller learns from
`usage.prompt_tokens_details.cached_tokens` only about its own scope's prompts. Real workers
on the tiny model, a 1P1D pipeline so the prefill and decode workers must agree on the scope."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.cluster.conftest import role, start

PREFIX = [60 + i % 50 for i in range(96)]  # 6 full blocks of 16
PIPELINE = dict(prefill=role(), decode=role())


def cached(url: str, model: str, key: str | None = None, **extra) -> int:
    """The cached prompt tokens of a request with PREFIX and a different last token (or the
    `prompt` given)."""
    body = {"model": model, "prompt": PREFIX + [40], "max_tokens": 2, "temperature": 0, **extra}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        usage = json.loads(resp.read())["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_tenants_and_salts_do_not_see_each_others_prefixes(tiny_served_model):
    model = str(tiny_served_model)
    with start(tiny_served_model, api_key="key-a,key-b", **PIPELINE) as url:
        assert cached(url, model, "key-a") == 0  # A warms the prefix
        time.sleep(0.5)
        assert cached(url, model, "key-b") == 0  # B guesses it right: no hit, no oracle
        assert cached(url, model, "key-a") == 96  # A still hits its own
        assert cached(url, model, "key-b") == 96  # and B now its own copy
        assert cached(url, model, "key-a", cache_salt="s1") == 0  # a salt narrows A's scope
        assert cached(url, model, "key-a", cache_salt="s1") == 96


def test_cache_salt_scopes_callers_without_keys_and_shared_mode_shares(tiny_served_model):
    model = str(tiny_served_model)
    with start(tiny_served_model, **PIPELINE) as url:
        assert cached(url, model) == 0
        assert cached(url, model, cache_salt="tenant-1") == 0
        assert cached(url, model, cache_salt="tenant-2") == 0
        assert cached(url, model, cache_salt="tenant-1") == 96
        assert cached(url, model) == 96
    with start(tiny_served_model, api_key="key-a,key-b", cache_scope="shared", **PIPELINE) as url:
        assert cached(url, model, "key-a") == 0
        assert cached(url, model, "key-b") == 96  # shared: the keys share one scope


def test_shared_warmups_are_hit_by_every_tenant(tiny_served_model):
    """A warm-up in the default scope serves no keyed tenant; `"shared": true` serves all,
    and a tenant's continuation past it stays its own."""
    model = str(tiny_served_model)
    system = "".join(chr(c) for c in PREFIX)  # 96 byte tokens: 6 full blocks
    prompt = system + "Go."
    admin = {"Authorization": "Bearer op", "Content-Type": "application/json"}

    def warm(shared: bool) -> dict:
        body = json.dumps({"prompts": [system], "shared": shared}).encode()
        req = urllib.request.Request(url + "/v1/cache/warmup", body, admin)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    with start(tiny_served_model, api_key="key-a,key-b", admin_key="op", **PIPELINE) as url:
        assert warm(shared=False)["shared"] is False
        assert cached(url, model, "key-a", prompt=prompt) == 0
        answer = warm(shared=True)
        assert answer["shared"] is True
        assert answer["workers"]["prefill-0"][0]["num_pinned_tokens"] == 96
        assert cached(url, model, "key-b", prompt=prompt) == 96
        assert cached(url, model, "key-b", prompt=prompt, cache_salt="x") == 96


def test_warmup_prompts_no_tenant_could_hit_are_refused():
    from pdserve.cluster.config import Pipeline
    from pdserve.cluster.warmup_client import warmup_body

    keyed = dict(model="m", collocated=role(), api_key="a,b", warmup_prompts=["system"])
    with pytest.raises(ValueError, match="warmup_shared"):
        Pipeline(**keyed)
    assert Pipeline(**keyed, warmup_shared=True).warmup_shared
    assert Pipeline(**keyed, cache_scope="shared").warmup_prompts == ("system",)
    assert warmup_body(["s"], shared=True) == {"pin": True, "shared": True, "prompts": ["s"]}
