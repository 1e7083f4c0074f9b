import pytest

from pdserve.messages import (
    CodecError,
    Prefill,
    Shutdown,
    Stats,
    Tokens,
    Unpin,
    WarmedUp,
    Warmup,
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
        Tokens("w0", "r1", [7], True, "stop", 3, 0),
        Stats("w0", "decode", 1, 2, 3, 4, 5),
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
        Warmup("warm-1", [1, 2, 3], pin=False),
        Unpin("warm-2", [1, 2, 3]),
        WarmedUp("w0", "warm-1", 3, 0, 0),
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
