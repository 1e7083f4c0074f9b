"""A worker's step samples: the `StepTrace` file `PDSERVE_STEP_TRACE` asks for holds the
same steps, shape for shape and second for second, as the StepReports it sends the planner."""

from __future__ import annotations

import json
import os

import pytest

from pdserve import envs
from pdserve import messages as m
from pdserve.costmodel.step_cost import StepShape
from pdserve.workers.step_report import StepTrace, read_trace
from tests.workers.conftest import WorkerProcess


def test_a_trace_keeps_each_step_and_skips_empty_ones(tmp_path):
    trace = StepTrace(tmp_path / "steps", "w0")
    trace.record(StepShape(12, 0, 78.0, 0, 1), 2, 1000.5, 0.25, 0.2)
    trace.record(StepShape(), 2, 1001.0, 0.001, 0.001)  # nothing admitted: no sample
    trace.record(StepShape(0, 3, 0.0, 40), 1, 1001.5, 0.02, 0.02)
    trace.close()
    again = StepTrace(tmp_path / "steps", "w0")  # a restarted worker appends
    again.record(StepShape(0, 1, 0.0, 9), 1, 1002.0, 0.01, 0.01)
    again.close()
    steps = read_trace(tmp_path / "steps" / "w0.steps.jsonl")
    assert steps == [
        (StepShape(12, 0, 78.0, 0, 1), 2, 1000.5, 0.25),
        (StepShape(0, 3, 0.0, 40), 1, 1001.5, 0.02),
        (StepShape(0, 1, 0.0, 9), 1, 1002.0, 0.01),
    ]


def test_a_served_workers_trace_matches_its_step_reports(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(envs.STEP_TRACE, str(tmp_path))
    worker = WorkerProcess(tiny_model_dir, tuple(sorted(os.sched_getaffinity(0)))[:1])
    try:
        worker.send(
            m.Generate(
                "r1", list(range(3, 40)), {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
            )
        )
        worker.expect(m.Tokens, timeout_s=30, request_id="r1", finished=True)
        worker.received(m.StepReport, timeout_s=1.0)  # the last report, 0.25 s after its step
        rows = [row for r in worker.seen if isinstance(r, m.StepReport) for row in r.steps]
    finally:
        worker.close()
    traced = read_trace(tmp_path / "w.steps.jsonl")
    assert len(traced) == 6 and traced[0][0].prefill_tokens == 37  # a prefill, 5 decodes
    assert len(rows) == len(traced)
    for (shape, threads, start, seconds), row in zip(traced, rows, strict=True):
        fields = [
            shape.prefill_tokens,
            shape.decode_requests,
            shape.prefill_attention_pairs,
            shape.decode_context_tokens,
            shape.num_prefill_sequences,
            threads,
        ]
        assert fields == row[:6]
        assert seconds == pytest.approx(row[6], abs=1e-5)
        assert start > 0
    assert all(a[2] < b[2] for a, b in zip(traced, traced[1:]))  # in the order they ran
    lines = (tmp_path / "w.steps.jsonl").read_text().splitlines()
    for line, (_, _, _, seconds) in zip(lines, traced, strict=True):  # one JSON per line
        cpu_s = json.loads(line)["cpu_seconds"]  # the stepping thread's CPU time
        assert 0 < cpu_s <= seconds + 2e-3
