"""Scheduler tests with no model: token ids are made up, blocks are counted exactly."""

from pdserve.config import SchedulerConfig
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stall_guard import PROBE_TOKENS
from pdserve.kvcache.manager import KVCacheManager
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=1000)


def req(rid, n, max_tokens=100, **kw) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, **kw), (2,))


def run_step(s: Scheduler, token: int = 5):
    out = s.schedule()
    sampled = {r.request_id: token for r, n in out.scheduled if out.samples(r, n)}
    s.update_from_output(out, sampled)
    return out


def test_long_prompt_is_chunked_and_decodes_go_first():
    s = make(long_prefill_token_threshold=8, max_num_batched_tokens=10)
    s.add_request(req("short", 3))
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 3)]
    s.add_request(req("long", 20))
    out = run_step(s)
    # The running decode first (1 token), then a chunk of the long prompt.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 8)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 8)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 4)]
    assert s.requests["long"].output_token_ids == [5]  # sampled only at the last chunk


def capped(request: Request, num_tokens: int) -> Request:
    request.prefill_chunk_tokens = num_tokens
    return request


def scheduled(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def test_request_chunk_cap_bounds_its_own_chunks():
    s = make(long_prefill_token_threshold=8, max_num_batched_tokens=32)
    s.add_request(req("short", 3))
    run_step(s)
    s.add_request(capped(req("long", 10), 3))
    assert scheduled(run_step(s)) == [("short", 1), ("long", 3)]
    assert scheduled(run_step(s)) == [("short", 1), ("long", 3)]
    assert scheduled(run_step(s)) == [("short", 1), ("long", 3)]
    assert scheduled(run_step(s)) == [("short", 1), ("long", 1)]  # the last prompt token
    assert s.requests["long"].output_token_ids == [5]
    assert scheduled(run_step(s)) == [("short", 1), ("long", 1)]  # decodes are not capped


def test_request_chunk_cap_bounds_the_whole_step():
    # A capped prefill's decodes were promised a step of at most its cap of prefill tokens:
    # an uncapped prompt behind it waits; one ahead of it, running, makes it wait.
    s = make(num_blocks=64, long_prefill_token_threshold=8, max_num_batched_tokens=32)
    s.add_request(capped(req("capped", 10), 4))
    s.add_request(req("plain", 9))
    assert scheduled(run_step(s)) == [("capped", 4)]
    assert scheduled(run_step(s)) == [("capped", 4)]
    assert scheduled(run_step(s)) == [("capped", 2), ("plain", 2)]  # what the cap leaves
    assert scheduled(run_step(s)) == [("capped", 1), ("plain", 7)]  # its prefill is done
    s = make(num_blocks=64, long_prefill_token_threshold=8, max_num_batched_tokens=32)
    s.add_request(req("plain", 12))
    s.add_request(capped(req("capped", 9), 4))
    assert scheduled(run_step(s)) == [("plain", 8)]
    assert scheduled(run_step(s)) == [("plain", 4)]  # the cap's budget is used up
    assert scheduled(run_step(s)) == [("plain", 1), ("capped", 4)]


def test_budget_limits_admission():
    s = make(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6), ("b", 2)]


def test_max_num_seqs():
    s = make(max_num_seqs=1)
    s.add_request(req("a", 2))
    s.add_request(req("b", 2))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
    assert s.num_waiting == 1


def test_preemption_frees_blocks_and_requeues_front():
    s = make(num_blocks=4, block_size=4)
    s.add_request(req("a", 8))
    s.add_request(req("b", 8))
    run_step(s)  # a: blocks 0,1 (8 tokens, one sampled), b: 2,3
    assert s.kv.num_free_blocks == 0
    out = run_step(s)  # a needs a 3rd block for its 9th token: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    b = s.requests["b"]
    assert b.status is RequestStatus.WAITING and b.block_ids == [] and s.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.output_token_ids == [5]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]


def test_stop_conditions_and_blocks_return():
    s = make()
    s.add_request(req("len", 3, max_tokens=2, ignore_eos=True))
    s.add_request(req("eos", 3))
    s.add_request(req("eos-ignored", 3, max_tokens=2, ignore_eos=True))
    s.add_request(req("stop-id", 3, stop_token_ids=(2,)))
    run_step(s, token=2)
    assert set(s.requests) == {"len", "eos-ignored"}  # EOS and the stop id ended two
    run_step(s, token=2)
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 16


def test_context_length_stops():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(), kv, max_model_len=5)
    s.add_request(req("a", 4))
    run_step(s)
    assert s.requests == {}


def test_abort_waiting_and_running():
    s = make()
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    s.schedule()  # both admitted
    s.add_request(req("c", 3))
    assert s.finish_request("a", FinishReason.ABORT).finish_reason is FinishReason.ABORT
    assert s.finish_request("c", FinishReason.ABORT) is not None
    assert s.finish_request("missing", FinishReason.ABORT) is None
    s.finish_request("b", FinishReason.ABORT)
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()


def measured(s: Scheduler, decode_s: float, token_s: float) -> Scheduler:
    """Give the scheduler's stall guard steady steps: a decode step, a prompt token's time."""
    for _ in range(60):
        s.stall_guard.observe(1, 0, 1, decode_s)
        s.stall_guard.observe(1, 100, 1, decode_s + 100 * token_s)
    return s


def budgeted(request: Request, seconds: float) -> Request:
    request.stall_budget_s = seconds
    return request


def test_a_stall_budget_caps_a_prefill_beside_decodes_at_the_measured_rate():
    # 50 ms a decode step, 5.6 ms a prompt token: 0.45 x 1 s leaves room for 71 tokens.
    s = measured(make(num_blocks=256, long_prefill_token_threshold=128), 0.05, 0.0056)
    s.add_request(budgeted(req("alone", 200), 1.0))
    assert scheduled(run_step(s)) == [("alone", 128)]  # no decode beside it: full chunks
    assert scheduled(run_step(s)) == [("alone", 72)]
    s.add_request(budgeted(req("long", 200), 1.0))
    assert scheduled(run_step(s)) == [("alone", 1), ("long", 71)]
    # an unbudgeted prompt behind it takes only what the cap leaves, as under a chunk cap
    s.add_request(req("plain", 100))
    assert scheduled(run_step(s)) == [("alone", 1), ("long", 71)]
    assert scheduled(run_step(s)) == [("alone", 1), ("long", 58), ("plain", 13)]
    # a chunk cap and a stall budget: the smaller holds
    s.add_request(budgeted(capped(req("both", 100), 20), 1.0))
    run_step(s)
    assert ("both", 20) in scheduled(run_step(s))


def test_a_stall_budget_waits_for_a_measured_rate_in_probe_chunks():
    s = make(num_blocks=256, long_prefill_token_threshold=128)
    s.add_request(req("short", 3))
    run_step(s)
    s.add_request(budgeted(req("long", 200), 1.0))
    assert scheduled(run_step(s)) == [("short", 1), ("long", PROBE_TOKENS)]
