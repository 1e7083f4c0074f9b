import hashlib
import hmac

import msgpack
import pytest

from pdserve.messages import (
    REPLAY_WINDOW_S,
    Abort,
    CodecError,
    Generate,
    Hello,
    Prefill,
    Reserved,
    Shutdown,
    Signer,
    StartDecode,
    Stats,
    Tokens,
    Unpin,
    Unpinned,
    Verifier,
    max_frame_bytes,
)

SECRET = b"s" * 32


def encode(message, secret):
    return Signer(secret).encode(message)


def decode(frame, secret):
    return Verifier(secret).decode(frame)


def signed(obj, secret=SECRET):
    payload = msgpack.packb(obj)
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def envelope(name, fields, session=b"s" * 8, seq=0, sent=None):
    import time

    return signed([name, fields, session, seq, time.time() if sent is None else sent])


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
        ),
        Shutdown(),
        Generate("warm-1", [1, 2, 3], {"max_tokens": 1}, pin=False),
        Generate("chunked", [1, 2, 3], {"max_tokens": 1}, prefill_chunk_tokens=32),
        Unpin("warm-2", [1, 2, 3]),
        Unpinned("w0", "warm-2", 3, 0, 0),
        Hello(),
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
    with pytest.raises(CodecError, match="malformed"):
        decode(envelope("os.system", {}), SECRET)
    with pytest.raises(CodecError, match="malformed"):
        decode(envelope("Tokens", {"bogus": 1}), SECRET)
    with pytest.raises(CodecError, match="malformed"):
        decode(signed("not a list"), SECRET)
    with pytest.raises(CodecError, match="malformed"):  # the old envelope: no session, no seq
        decode(signed(["Shutdown", {}]), SECRET)


def test_frames_without_the_prefix_skip_fields_decode_to_zero():
    """A peer that predates decode-side prefix reuse sends no skip: everything is sent."""
    reserved = {"worker_id": "w0", "request_id": "r", "peer": {}, "block_ids": [3]}
    assert decode(envelope("Reserved", reserved), SECRET).num_cached_blocks == 0
    prefill = {
        "request_id": "r",
        "prompt_token_ids": [1],
        "sampling": {},
        "peer": {},
        "block_ids": [3],
    }
    assert decode(envelope("Prefill", prefill), SECRET).num_cached_blocks == 0


def test_a_replayed_frame_is_dropped_in_its_session():
    signer, verifier = Signer(SECRET), Verifier(SECRET)
    frames = [signer.encode(Tokens("w", "r", [i], False)) for i in range(3)]
    assert verifier.decode(frames[0]).token_ids == [0]
    assert verifier.decode(frames[2]).token_ids == [2]  # a lost frame is no error
    for old in frames:  # the same frame again, or one overtaken: its seq is not above the last
        with pytest.raises(CodecError, match="replayed Tokens: seq"):
            verifier.decode(old)
    assert verifier.decode(signer.encode(Abort("r"))) == Abort("r")


def test_a_new_session_passes_and_an_old_sessions_frames_do_not():
    """A restarted peer signs with a new session from seq 0; frames recorded from a process
    that died are refused once older than the window, even by a receiver that never saw them."""
    now = [1000.0]
    old = Signer(SECRET, clock=lambda: now[0])
    recorded = [old.encode(Abort(f"r{i}")) for i in range(3)]
    verifier = Verifier(SECRET, clock=lambda: now[0])
    assert verifier.decode(recorded[2]) == Abort("r2")
    restarted = Signer(SECRET, clock=lambda: now[0])
    assert verifier.decode(restarted.encode(Abort("x"))) == Abort("x")  # seq 0 of a new session
    now[0] += REPLAY_WINDOW_S + 1
    fresh = Verifier(SECRET, clock=lambda: now[0])  # e.g. a restarted router
    for frame in recorded:
        with pytest.raises(CodecError, match="stale Abort of an unknown session"):
            fresh.decode(frame)
    # Known sessions are forgotten after the window, and their frames stay refused.
    verifier.decode(Signer(SECRET, clock=lambda: now[0]).encode(Shutdown()))  # prunes
    assert len(verifier._last) == 1
    with pytest.raises(CodecError, match="stale"):
        verifier.decode(recorded[0])


def test_max_frame_bytes_holds_a_whole_context():
    """The worker's ZMQ_MAXMSGSIZE: a Generate or Prefill of a full context, with the
    largest ids (5 msgpack bytes each) and the router's largest stop strings, fits."""
    n = 4096
    big = ["\U0010ffff" * 256] * 16  # 16 x 256 characters of 4 UTF-8 bytes: the router's limit
    sampling = {"max_tokens": 1, "stop": big, "stop_token_ids": [2**32 - 1] * 16}
    prefill = Prefill(
        "r" * 64,
        [2**32 - 1] * n,
        sampling,
        {"host": "h" * 255, "port": 65535},
        [2**32 - 1] * n,
        num_cached_blocks=n,
    )
    resumed = Generate("r" * 64, [2**32 - 1] * (n // 2), sampling, [2**32 - 1] * (n // 2))
    for message in (prefill, resumed):
        assert len(encode(message, SECRET)) <= max_frame_bytes(n)
    assert max_frame_bytes(n) < 2 * len(encode(prefill, SECRET))  # a bound, not a guess
