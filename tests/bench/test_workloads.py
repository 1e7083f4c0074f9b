"""Workload generators, trace replay and arrival schedules, from a seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench.arrivals import ArrivalSpec, arrival_times
from pdserve.bench.tokens import TokenSource
from pdserve.bench.trace import TraceConfig, load_trace
from pdserve.bench.workloads import LengthDist, Session, WorkloadConfig, build_sessions


@pytest.fixture(scope="module")
def tokens(tokenizer_dir) -> TokenSource:
    return TokenSource.load(str(tokenizer_dir))


def length_histogram(sessions: list[Session]) -> tuple[list[int], list[int]]:
    """All turns' (user input lengths, output lengths)."""
    turns = [t for s in sessions for t in s.turns]
    return [len(t.user_ids) for t in turns], [t.output_len for t in turns]


def test_length_distributions_have_the_requested_shape():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("7").sample(rng, 3) == [7, 7, 7]
    uniform = LengthDist.parse("uniform:10:20").sample(rng, 2000)
    assert min(uniform) == 10 and max(uniform) == 20
    lognormal = np.array(LengthDist.parse("lognormal:300:0.5").sample(rng, 20000))
    assert lognormal.mean() == pytest.approx(300, rel=0.03)
    assert np.log(lognormal).std() == pytest.approx(0.5, rel=0.05)
    assert lognormal.max() <= 2400 and lognormal.min() >= 1


@pytest.mark.parametrize("spec", ["0", "uniform:5", "uniform:9:3", "lognormal:x:1", "zipf:1:2"])
def test_bad_length_specs_name_the_flag(spec):
    with pytest.raises(ValueError, match="--input-len"):
        LengthDist.parse(spec, "--input-len")


def test_sessions_have_exact_lengths_are_seeded_and_avoid_special_tokens(tokens):
    cfg = WorkloadConfig(num_requests=50, input_len="uniform:5:40", output_len="lognormal:20:0.3")
    sessions = build_sessions(cfg, tokens)
    inputs, outputs = length_histogram(sessions)
    rng = np.random.default_rng(0)
    assert inputs == LengthDist.parse("uniform:5:40").sample(rng, 50)
    assert outputs == LengthDist.parse("lognormal:20:0.3").sample(rng, 50)
    assert all(i >= 3 for s in sessions for i in s.turns[0].user_ids)  # 0-2 are special
    again = build_sessions(cfg, tokens)
    assert [s.turns[0].user_ids for s in again] == [s.turns[0].user_ids for s in sessions]
    other = build_sessions(WorkloadConfig(num_requests=50, input_len="20", seed=1), tokens)
    assert other[0].turns[0].user_ids != sessions[0].turns[0].user_ids


def test_shared_prefix_groups_and_conversations(tokens):
    cfg = WorkloadConfig(
        num_requests=12,
        input_len="8",
        output_len="4",
        num_prefix_groups=2,
        prefix_len=30,
        num_turns=3,
    )
    sessions = build_sessions(cfg, tokens)
    assert len(sessions) == 4 and all(len(s.turns) == 3 for s in sessions)
    firsts = [s.turns[0].user_ids for s in sessions]
    assert all(len(ids) == 38 for ids in firsts)
    assert firsts[0][:30] == firsts[2][:30] != firsts[1][:30]
    assert all(len(t.user_ids) == 8 for s in sessions for t in s.turns[1:])


def test_text_prompts_round_trip_to_the_same_length(tokens):
    cfg = WorkloadConfig(num_requests=5, input_len="17", text_prompts=True)
    for session in build_sessions(cfg, tokens):
        turn = session.turns[0]
        assert len(tokens.encode(turn.user_text)) == 17 == len(turn.user_ids)


def test_mooncake_trace_preserves_prefix_sharing_and_scales(tokens, tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 40, "hash_ids": [7, 8, 9]},
        {"timestamp": 3000, "input_length": 700, "output_length": 10, "hash_ids": [7, 10]},
        {"timestamp": 2000, "input_length": 200, "output_length": 8, "hash_ids": []},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    full = load_trace(TraceConfig(str(path)), tokens)
    by_id = {s.session_id: s.turns[0] for s in full}
    a, b = by_id["t0"].user_ids, by_id["t1"].user_ids
    assert (len(a), len(b), len(by_id["t2"].user_ids)) == (1100, 700, 200)
    assert a[:512] == b[:512] and a[512:700] != b[512:700]
    assert [s.arrival_s for s in full] == [0.0, 1.0, 2.0]  # sorted by time

    small = load_trace(TraceConfig(str(path), time_scale=0.5, length_scale=0.25), tokens)
    a, b = small[0].turns[0].user_ids, small[2].turns[0].user_ids
    assert (len(a), len(b), small[0].turns[0].output_len) == (275, 175, 10)
    assert a[:128] == b[:128] and a[128:175] != b[128:175]  # block 512 -> 128 tokens
    assert [s.arrival_s for s in small] == [0.0, 0.5, 1.0]


def test_keyed_ids_depend_only_on_seed_key_and_position(tokens):
    rows = tokens.keyed_ids(0, [7, 8, 9], 64)
    assert rows.shape == (3, 64)
    assert (tokens.keyed_ids(0, [9, 7], 64) == rows[[2, 0]]).all()  # whatever the company
    assert (tokens.keyed_ids(0, [7], 16)[0] == rows[0, :16]).all()  # a prefix of a longer draw
    assert not (tokens.keyed_ids(1, [7], 64)[0] == rows[0]).all()  # the seed matters
    assert len({tuple(r) for r in rows}) == 3
    assert tokens.keyed_ids(-1, [-5, 2**70], 4).shape == (2, 4)  # any int: a trace's ids
    assert set(rows.ravel().tolist()) <= set(tokens.vocab_ids.tolist())  # no special tokens
    # Uniform over the vocabulary: 300 words, 30,000 draws, each word's count near 100.
    counts = np.bincount(tokens.keyed_ids(3, range(100), 300).ravel(), minlength=303)[3:]
    assert counts.min() > 50 and counts.max() < 150


def test_bad_trace_line_is_reported_with_its_number(tokens, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(TraceConfig(str(path)), tokens)


def test_arrival_schedules():
    rng = np.random.default_rng(0)
    poisson = np.diff(arrival_times(ArrivalSpec("poisson", rate=4.0), 4000, rng))
    assert poisson.mean() == pytest.approx(0.25, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    bursty = np.diff(arrival_times(ArrivalSpec("gamma", rate=4.0, burstiness=0.25), 4000, rng))
    assert bursty.mean() == pytest.approx(0.25, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(shape)
    assert arrival_times(ArrivalSpec("poisson"), 3, rng) == [0.0, 0.0, 0.0]
    assert arrival_times(ArrivalSpec("concurrency", concurrency=2), 3, rng) is None
    with pytest.raises(ValueError, match="--rate"):
        ArrivalSpec("gamma", rate=0)


def test_text_prompts_keep_their_length_with_byte_level_bpe():
    """Byte-level BPE (SmolLM2's kind) has partial-character tokens; text prompts avoid them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rng = np.random.default_rng(0)
    words = "prefill decode serving 日本語 café naïve def return 模型 cache".split()
    corpus = [" ".join(rng.choice(words, 40)) for _ in range(200)]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokens = TokenSource(tokenizer)
    assert 0 < tokens.text_vocab_ids.size < tokens.vocab_ids.size
    cfg = WorkloadConfig(num_requests=20, input_len="uniform:5:300", text_prompts=True)
    for session in build_sessions(cfg, tokens):
        turn = session.turns[0]
        assert len(tokens.encode(turn.user_text)) == len(turn.user_ids)
    inputs, _ = length_histogram(build_sessions(cfg, tokens))
    assert inputs == LengthDist.parse("uniform:5:300").sample(np.random.default_rng(0), 20)
