"""The entry header: round trip, and every way an entry must turn into a miss."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.kvstore.base import HEADER, EntryError, EntryFormat
from pdserve.kvstore.config import KVStoreConfig
from pdserve.transfer.layout import KVLayout
from tests.kvstore.conftest import payload


def test_round_trip_and_header_fields(fmt):
    data = fmt.encode(0xDEAD_BEEF_0123_4567, payload(1))
    magic, version, desc_len, block_hash, payload_len, _ = HEADER.unpack_from(data)
    assert (magic, version, block_hash, payload_len) == (b"PDKV", 2, 0xDEAD_BEEF_0123_4567, 1024)
    assert data[HEADER.size : HEADER.size + desc_len] == fmt.descriptor
    assert fmt.decode(0xDEAD_BEEF_0123_4567, data) == payload(1)
    assert fmt.decode(0xDEAD_BEEF_0123_4567, memoryview(data)) == payload(1)


def test_header_is_written_separately_from_payload(fmt):
    view = memoryview(bytearray(payload(2)))
    assert fmt.encode_header(7, view) + bytes(view) == fmt.encode(7, payload(2))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: d[:-1], id="truncated-payload"),
        pytest.param(lambda d: d[:10], id="truncated-header"),
        pytest.param(lambda d: d[:-5] + bytes([d[-5] ^ 1]) + d[-4:], id="flipped-payload-bit"),
        pytest.param(lambda d: b"XXXX" + d[4:], id="bad-magic"),
        pytest.param(lambda d: d + b"\0", id="trailing-garbage"),
    ],
)
def test_damage_is_corrupt(fmt, damage):
    with pytest.raises(EntryError) as e:
        fmt.decode(5, damage(fmt.encode(5, payload(5))))
    assert e.value.kind == "corrupt"


def test_entry_under_wrong_hash_is_corrupt(fmt):
    with pytest.raises(EntryError, match="under") as e:
        fmt.decode(6, fmt.encode(5, payload(5)))
    assert e.value.kind == "corrupt"


@pytest.mark.parametrize(
    "change", [{"model_id": "other"}, {"num_layers": 3}, {"dtype": "bfloat16"}, {"head_dim": 12}]
)
def test_other_format_is_foreign(fmt, change):
    with pytest.raises(EntryError) as e:
        fmt.decode(5, replace(fmt, **change).encode(5, payload(5)))
    assert e.value.kind == "foreign"


def test_format_from_layout_ignores_pool_size():
    a = EntryFormat.from_layout("m", KVLayout(2, 100, 16, 4, 64, "bfloat16"))
    b = EntryFormat.from_layout("m", KVLayout(2, 900, 16, 4, 64, "bfloat16"))
    assert a == b and a.namespace == b.namespace
    assert a.namespace != EntryFormat.from_layout("m", KVLayout(2, 9, 16, 4, 64)).namespace


def test_namespace_is_path_safe():
    ns = EntryFormat("org/Model name:v1", 1, 1, 1, 1, "float32").namespace
    assert ns.startswith("org_Model_name_v1-") and "/" not in ns


def test_kvstore_imports_without_torch():
    code = (
        "import sys, pdserve.kvstore, pdserve.kvstore.host, "
        "pdserve.kvstore.redis; print('torch' in sys.modules)"
    )
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


@pytest.mark.parametrize(
    "writer, reader", [("fp8", "auto"), ("auto", "fp8"), ("int8", "fp8"), ("fp8", "int8")]
)
def test_8bit_and_full_precision_pools_refuse_each_others_entries(
    tiny_model_dir, tmp_path, writer, reader
):
    """The formats the engine derives from its pool: an FP8 pool's (uint8 rows of values and
    a scale), an int8 pool's (int8 rows of the same width) and a full-precision pool's
    differ, so even in one place none takes another's entries."""
    fmts = {}
    for kv_cache_dtype in ("auto", "fp8", "int8"):
        config = EngineConfig(
            model="tiny",
            cache=CacheConfig(block_size=4, kv_cache_bytes=1 << 16, kv_cache_dtype=kv_cache_dtype),
            kvstore=KVStoreConfig(disk_dir=str(tmp_path / kv_cache_dtype), disk_bytes=1 << 20),
        )
        engine = Engine(config, tiny_model_dir)
        fmts[kv_cache_dtype] = engine.offload.store.tiers[0].fmt
        engine.offload.close()
    assert (fmts["fp8"].dtype, fmts["fp8"].head_dim) == ("uint8", fmts["auto"].head_dim + 4)
    assert (fmts["int8"].dtype, fmts["int8"].head_dim) == ("int8", fmts["fp8"].head_dim)
    assert len({f.namespace for f in fmts.values()}) == 3
    with pytest.raises(EntryError) as e:
        fmts[reader].decode(5, fmts[writer].encode(5, payload(5)))
    assert e.value.kind == "foreign"
