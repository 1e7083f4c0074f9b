"""Cache scopes at the router (router/scope.py): which salt each request's messages carry,
several API keys, `cache_salt` and the warm-up's `shared`, against fake workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from pdserve import messages
from pdserve.kvcache.hashing import SHARED_SCOPE
from pdserve.router.config import RouterConfig
from pdserve.router.scope import MAX_CACHE_SALT_CHARS, scope_salt, tenant_of
from tests.router.harness import Cluster

BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}


def salts(c: Cluster, kind: type) -> list[str]:
    return [m.cache_salt for w in c.workers.values() for m in w.received if isinstance(m, kind)]


def test_each_key_is_a_tenant_and_no_key_reaches_a_worker(tokenizer_dir: Path, script) -> None:
    roles = {"p0": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, script, roles, api_key="key-a,key-b") as c:
        url = f"{c.url}/v1/completions"
        for key in ("key-a", "key-b", "key-a"):
            r = requests.post(url, json=BODY, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        headers = {"Authorization": "Bearer key-a"}
        r = requests.post(url, json={**BODY, "cache_salt": "s"}, headers=headers)
        assert r.status_code == 200
        assert (
            requests.post(url, json=BODY, headers={"Authorization": "Bearer key-c"}).status_code
            == 401
        )
        a, b = scope_salt(tenant_of("key-a"), None), scope_salt(tenant_of("key-b"), None)
        a_salted = scope_salt(tenant_of("key-a"), "s")
        assert len({a, b, a_salted, ""}) == 4
        # D reserves and P prefills in the same scope, request by request.
        assert salts(c, messages.Reserve) == salts(c, messages.Prefill) == [a, b, a, a_salted]
        sent = repr([m for w in c.workers.values() for m in w.received])
        assert "key-a" not in sent and "key-b" not in sent


def test_default_scope_without_keys_and_shared_mode(tokenizer_dir: Path, script) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        url = f"{c.url}/v1/completions"
        assert requests.post(url, json=BODY).status_code == 200
        assert requests.post(url, json={**BODY, "cache_salt": "s"}).status_code == 200
        assert salts(c, messages.Generate) == ["", scope_salt("", "s")]
    with Cluster(
        tokenizer_dir, script, {"c0": "collocated"}, api_key="a,b", cache_scope="shared"
    ) as c:
        for key in ("a", "b"):
            requests.post(
                f"{c.url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}
            )
        assert salts(c, messages.Generate) == ["", ""]


@pytest.mark.parametrize("salt", ["", 7, ["x"], "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_cache_salt_is_a_400_naming_it(tokenizer_dir: Path, script, salt) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        r = requests.post(
            f"{c.url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "cache_salt": salt,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert salts(c, messages.Generate) == []


def test_warmups_are_made_in_the_default_or_the_shared_scope(tokenizer_dir: Path, script) -> None:
    admin = {"Authorization": "Bearer op"}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, admin_key="op") as c:
        url = f"{c.url}/v1/cache/warmup"
        assert (
            requests.post(url, json={"prompts": ["sys"]}, headers=admin).json()["shared"] is False
        )
        r = requests.post(url, json={"prompts": ["sys"], "shared": True}, headers=admin)
        assert r.json()["shared"] is True
        requests.delete(url, json={"prompts": ["sys"], "shared": True}, headers=admin)
        r = requests.post(url, json={"prompts": ["sys"], "shared": "yes"}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "shared"
        assert salts(c, messages.Generate) == ["", SHARED_SCOPE]
        assert salts(c, messages.Unpin) == [SHARED_SCOPE]


def test_api_key_lists_are_checked() -> None:
    assert RouterConfig(model="m", api_key="a,b").api_keys == ("a", "b")
    assert RouterConfig(model="m").api_keys == ()
    for bad in ("a,", ",", "a,,b"):
        with pytest.raises(ValueError, match="api_key"):
            RouterConfig(model="m", api_key=bad)
    with pytest.raises(ValueError, match="cache_scope"):
        RouterConfig(model="m", cache_scope="nobody")
