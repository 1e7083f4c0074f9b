import pytest

from pdserve.messages import (
    CodecError,
    Generate,
    Prefill,
    Reserved,
    Shutdown,
    StartDecode,
    Stats,
    Tokens,
    Unpin,
    Unpinned,
    decode,
    encode,
)

SECRET = b"s" * 32


@pytest.mark.parametrize(
    "msg",
    [
        Prefill(
            "r1", [1, 2, 3], {"max_tokens": 4, "stop": ["x"]}, {"host": "h", "port": 1}, [5, 6]
        ),
        Prefill("r1", [1, 2, 3], {}, {"host": "h", "port": 1}, [5, 6], num_cached_blocks=1),
        Reserved("w0", "r1", {"host": "h", "port": 1}, [5, 6], num_cached_blocks=1),
        Tokens("w0", "r1", [7], True, "stop", 3, 0),
        Reserved("w0", "r1", {}, [5, 6, 7], 0, num_keep_blocks=3, sink_blocks=1),
        Prefill("r1", [1] * 9, {}, {}, [5, 6, 7], 0, num_keep_blocks=3, recent_blocks=1),
        Tokens("w0", "r1", [7], False, None, 3, 0, num_pinned_tokens=16),
        StartDecode("r1", 7),
        Stats("w0", "decode", 1, 2, 3, 4, 5),
        Stats("w0", "decode", 1, 2, 3, 4, 5, 6, 7, kv_blocks_skipped=8),
        Stats(
            "w0",
            "collocated",
            0,
            0,
            3,
            4,
            0,
            kv_tiers={"L1": {"lookups": 3, "hits": 1}},
            kv_moved_bytes={"L1->L2": 64},
            num_cached_prompt_tokens=16,
        ),  # fmt: skip
        Shutdown(),
        Generate("warm-1", [1, 2, 3], {"max_tokens": 1}, pin=False),
        Unpin("warm-2", [1, 2, 3]),
        Unpinned("w0", "warm-2", 3, 0, 0),
    ],
)
def test_round_trip(msg):
    assert decode(encode(msg, SECRET), SECRET) == msg


def test_wrong_secret_and_tampering_are_rejected():
    frame = encode(Tokens("w", "r", [1], False), SECRET)
    with pytest.raises(CodecError, match="signature"):
        decode(frame, b"x" * 32)
    with pytest.raises(CodecError, match="signature"):
        decode(frame[:-1] + bytes([frame[-1] ^ 1]), SECRET)


def test_unknown_type_and_fields_are_rejected():
    import hashlib
    import hmac

    import msgpack

    def frame(obj):
        payload = msgpack.packb(obj)
        return hmac.new(SECRET, payload, hashlib.sha256).digest() + payload

    with pytest.raises(CodecError, match="malformed"):
        decode(frame(["os.system", {}]), SECRET)
    with pytest.raises(CodecError, match="malformed"):
        decode(frame(["Tokens", {"bogus": 1}]), SECRET)
    with pytest.raises(CodecError, match="malformed"):
        decode(frame("not a list"), SECRET)


def test_frames_without_the_prefix_skip_fields_decode_to_zero():
    """A peer that predates decode-side prefix reuse sends no skip: everything is sent."""
    import hashlib
    import hmac

    import msgpack

    def frame(obj):
        payload = msgpack.packb(obj)
        return hmac.new(SECRET, payload, hashlib.sha256).digest() + payload

    reserved = {"worker_id": "w0", "request_id": "r", "peer": {}, "block_ids": [3]}
    assert decode(frame(["Reserved", reserved]), SECRET).num_cached_blocks == 0
    prefill = {
        "request_id": "r", "prompt_token_ids": [1], "sampling": {}, "peer": {},
        "block_ids": [3],
    }  # fmt: skip
    assert decode(frame(["Prefill", prefill]), SECRET).num_cached_blocks == 0
