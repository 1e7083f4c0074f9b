"""The request-field table (router/fields.py): every refused field is a 400 naming it at a
value that would change the answer and passes at the values that change nothing; metadata is
taken when well typed; unknown fields and fields of the other endpoint are refused by name;
and a chat body of more messages than max_messages is refused before it is walked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests

from pdserve.router.fields import BOTH, CHAT, FIELDS, METADATA, REFUSED
from tests.router.harness import Cluster

DOCS = Path(__file__).parents[2] / "docs" / "configuration.md"
NOT_ACCEPTED = {"pdserve-test": "a value no field takes"}
BODIES = {
    CHAT: (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    ),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
}


@pytest.fixture(scope="module")
def cluster(tokenizer_dir: Path, script):
    with Cluster(tokenizer_dir, script, {"c0": "collocated"}) as c:
        yield c


def post(cluster: Cluster, where: str, **fields) -> requests.Response:
    path, body = BODIES["completions" if where == BOTH else where]
    return requests.post(f"{cluster.url}{path}", json={**body, **fields}, timeout=30)


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.how == REFUSED])
def test_a_refused_field_is_a_400_naming_it_and_its_no_op_values_pass(cluster, name) -> None:
    spec = FIELDS[name]
    r = post(cluster, spec.where, **{name: NOT_ACCEPTED})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert name in r.json()["error"]["message"]
    for value in spec.accepted:
        r = post(cluster, spec.where, **{name: value})
        assert r.status_code == 200, (name, value, r.text)


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.how == METADATA])
def test_metadata_is_taken_when_well_typed(cluster, name) -> None:
    spec = FIELDS[name]
    value = "x" if spec.kind is str else {"k": "v"}
    assert post(cluster, spec.where, **{name: value}).status_code == 200
    r = post(cluster, spec.where, **{name: 12345})
    assert r.status_code == 400 and r.json()["error"]["param"] == name


def test_unknown_and_other_endpoint_fields_are_refused_by_name(cluster) -> None:
    r = post(cluster, CHAT, temprature=0.5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature"
    assert "did you mean 'temperature'" in r.json()["error"]["message"]
    r = post(cluster, CHAT, prompt="hi")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "/v1/completions" in r.json()["error"]["message"]
    r = post(cluster, "completions", messages=[])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(cluster, CHAT, **{"x" * 10_000: 1})  # a huge name: no quadratic suggestion
    assert r.status_code == 400 and len(r.json()["error"]["param"]) == 64


def test_many_messages_and_non_object_messages_are_400s_naming_messages(cluster) -> None:
    """Issue 41: a 240k-message body is refused by count (max_messages, 2048 by default)
    before the template renders any, and a message that is not an object is a 400, not a 500."""
    many = [{"role": "user", "content": ""}] * 240_000
    r = post(cluster, CHAT, messages=many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "at most 2048" in r.json()["error"]["message"]
    for bad in ([1], ["hi"], [{"role": "user", "content": "hi"}, None]):
        r = post(cluster, CHAT, messages=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_every_field_has_a_row_in_the_docs_table() -> None:
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text(), re.MULTILINE))
    assert set(FIELDS) <= rows, sorted(set(FIELDS) - rows)
