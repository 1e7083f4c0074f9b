"""Cache warm-up over HTTP and the prefix-cache metrics, against fake workers."""

from __future__ import annotations

from pathlib import Path

import requests

from tests.router.harness import Cluster

SYSTEM = "You are a helpful assistant who answers briefly."  # 48 bytes: 3 full blocks
ADMIN = {"Authorization": "Bearer a"}


def test_warmup_goes_to_every_prefill_capable_worker(tokenizer_dir: Path, script) -> None:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, script, roles, admin_key="a") as c:
        body = {"prompts": [SYSTEM], "messages": [[{"role": "system", "content": "Be brief."}]]}
        r = requests.post(f"{c.url}/v1/cache/warmup", json=body, headers=ADMIN)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "cache.warmup" and answer["pin"] is True
        assert sorted(answer["workers"]) == ["p0", "p1"]  # never the decode worker
        first, chat = answer["workers"]["p0"]
        assert first == {
            "index": 0,
            "num_prompt_tokens": 48,
            "num_cached_tokens": 48,
            "num_pinned_tokens": 48,
        }
        assert chat["index"] == 1 and chat["num_prompt_tokens"] > len("Be brief.")
        assert "Generate" not in c.kinds("d0")

        r = requests.delete(f"{c.url}/v1/cache/warmup", json={"prompts": [SYSTEM]}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["pin"] is False
        assert r.json()["workers"]["p1"][0]["num_pinned_tokens"] == 48  # released
        assert "Unpin" in c.kinds("p1")


def test_warmup_without_pin_and_a_worker_that_refuses(tokenizer_dir: Path, script) -> None:
    behaviour = {"c1": {"refuse_pins": "cannot pin 3 more blocks: 32 of at most 32 pinned"}}
    roles = {"c0": "collocated", "c1": "collocated"}
    with Cluster(tokenizer_dir, script, roles, behaviour, admin_key="a") as c:
        url = f"{c.url}/v1/cache/warmup"
        r = requests.post(url, json={"prompts": [SYSTEM], "pin": False}, headers=ADMIN)
        assert r.json()["workers"]["c1"][0]["num_pinned_tokens"] == 0
        r = requests.post(url, json={"prompts": [SYSTEM]}, headers=ADMIN)
        assert r.status_code == 200
        assert r.json()["workers"]["c0"][0]["num_pinned_tokens"] == 48
        assert r.json()["workers"]["c1"][0] == {"index": 0, "error": behaviour["c1"]["refuse_pins"]}


def test_bad_warmup_bodies_are_400_naming_the_field(tokenizer_dir: Path, script) -> None:
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, admin_key="k") as c:
        url, auth = f"{c.url}/v1/cache/warmup", {"Authorization": "Bearer k"}
        assert requests.post(url, json={"prompts": [SYSTEM]}).status_code == 401
        for body, param in (
            ({}, "prompts"),
            ({"prompts": "one string"}, "prompts"),
            ({"prompts": [""]}, "prompts"),
            ({"prompts": [SYSTEM], "pin": "yes"}, "pin"),
            ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
            ({"messages": [[{"role": "robot", "content": "x"}]]}, "messages[0]"),
            ({"prompts": ["x" * 600]}, "prompts[0]"),  # over the fake's 512-token context
        ):
            r = requests.post(url, json=body, headers=auth)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())
        r = requests.post(url, json={"model": "other", "prompts": [SYSTEM]}, headers=auth)
        assert r.status_code == 404
        assert requests.post(url, data=b"{", headers=auth).status_code == 400
        assert not [k for k in c.kinds("c0") if k in ("Generate", "Unpin")]


def test_unhealthy_workers_are_named_and_none_healthy_is_503(tokenizer_dir: Path, script) -> None:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, script, roles, admin_key="a") as c:
        c.workers["p1"].heartbeat = False
        c.wait_until(lambda: not c.app_state.plane.is_healthy("p1"), timeout=10)
        r = requests.post(f"{c.url}/v1/cache/warmup", json={"prompts": [SYSTEM]}, headers=ADMIN)
        assert r.status_code == 200
        assert r.json()["workers"]["p0"][0]["num_pinned_tokens"] == 48
        assert "not healthy" in r.json()["workers"]["p1"][0]["error"]
        c.workers["p0"].heartbeat = False
        c.wait_until(lambda: not c.app_state.plane.is_healthy("p0"), timeout=10)
        r = requests.post(f"{c.url}/v1/cache/warmup", json={"prompts": [SYSTEM]}, headers=ADMIN)
        assert r.status_code == 503


def test_metrics_show_cache_hits_per_tier_and_tokens(tokenizer_dir: Path, script) -> None:
    stats = {
        "kv_tiers": {
            "L1": {"lookups": 10, "hits": 4, "bytes_read": 512, "bytes_written": 1024},
            "L2": {"lookups": 6, "hits": 2, "bytes_read": 1030, "bytes_written": 520},
        },
        "kv_moved_bytes": {"L2->L3": 300},
        "num_cached_prompt_tokens": 96,
        "num_computed_prompt_tokens": 70,
        "num_pinned_blocks": 3,
    }
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, {"c0": {"cache_stats": stats}}) as c:
        c.wait_until(lambda: c.app_state.plane.workers["c0"].stats is not None)
        text = requests.get(f"{c.url}/metrics").text
        for line in (
            "# TYPE pdserve_kv_cache_hits_total counter",
            'pdserve_kv_cache_lookups_total{tier="L1",worker="c0"} 10',
            'pdserve_kv_cache_hits_total{tier="L1",worker="c0"} 4',
            'pdserve_kv_cache_lookups_total{tier="L2",worker="c0"} 6',
            'pdserve_kv_cache_hits_total{tier="L2",worker="c0"} 2',
            'pdserve_kv_tier_bytes_total{direction="read",tier="L2",worker="c0"} 1030',
            'pdserve_kv_tier_bytes_total{direction="written",tier="L1",worker="c0"} 1024',
            'pdserve_kv_tier_moved_bytes_total{dst="L3",src="L2",worker="c0"} 300',
            'pdserve_worker_prompt_tokens_total{source="cached",worker="c0"} 96',
            'pdserve_worker_prompt_tokens_total{source="computed",worker="c0"} 70',
            'pdserve_kv_blocks_pinned{worker="c0"} 3',
        ):
            assert line in text, line


def test_warmup_needs_the_admin_key_never_the_api_key(tokenizer_dir: Path, script) -> None:
    url_of = lambda c: f"{c.url}/v1/cache/warmup"  # noqa: E731
    body = {"prompts": [SYSTEM]}
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:  # no key at all
        for method in (requests.post, requests.delete):
            r = method(url_of(c), json=body)
            assert r.status_code == 403 and "no admin key" in r.json()["error"]["message"]
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, api_key="u", admin_key="a") as c:
        user = {"Authorization": "Bearer u"}
        r = requests.post(url_of(c), json=body, headers=user)
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
        assert requests.delete(url_of(c), json=body, headers=user).status_code == 401
        assert requests.post(url_of(c), json=body, headers=ADMIN).status_code == 200
        assert not [k for k in c.kinds("c0") if k == "Unpin"]


def test_warmup_is_budgeted_counted_and_takes_a_slot(tokenizer_dir: Path, script) -> None:
    config = dict(admin_key="a", max_warmup_prompts=2, max_warmup_tokens=60)
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}, **config) as c:
        url = f"{c.url}/v1/cache/warmup"
        r = requests.post(url, json={"prompts": ["a", "b", "c"]}, headers=ADMIN)
        assert r.status_code == 400 and "max_warmup_prompts" in r.json()["error"]["message"]
        r = requests.post(url, json={"prompts": [SYSTEM, SYSTEM]}, headers=ADMIN)  # 96 tokens
        assert r.status_code == 400 and "max_warmup_tokens" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompts"
        assert not [k for k in c.kinds("c0") if k == "Generate"]
        r = requests.post(url, json={"prompts": [SYSTEM]}, headers=ADMIN)
        assert r.status_code == 200
        text = requests.get(f"{c.url}/metrics").text
        assert 'pdserve_warmup_calls_total{action="pin"} 1.0' in text
        assert "pdserve_warmup_pinned_tokens_total 48.0" in text
        c.app_state.num_pending = c.config.max_pending  # every slot taken by requests
        r = requests.post(url, json={"prompts": [SYSTEM]}, headers=ADMIN)
        assert r.status_code == 429
        c.app_state.num_pending = 0
