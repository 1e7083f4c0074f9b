"""The samples of the adaptive planner's online cost model: each engine step's shape,
thread count and duration, sent to the router in batches (`StepReport`)."""

from __future__ import annotations

from pdserve import messages as m
from pdserve.perf.cost_model import StepShape

REPORT_INTERVAL_S = 0.25  # the planner re-plans every second or so: fresh enough
REPORT_ROWS = 64  # and frames stay small while steps are short


class StepLog:
    """Rows since the last report; `due()` hands them out as a StepReport once the oldest is
    REPORT_INTERVAL_S old or there are REPORT_ROWS of them."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.rows: list[list[float]] = []
        self._first_s = 0.0

    def record(self, shape: StepShape, threads: int, seconds: float, now: float) -> None:
        if shape.is_empty:  # nothing was admitted: no sample of the model
            return
        if not self.rows:
            self._first_s = now
        self.rows.append([
            shape.prefill_tokens, shape.decode_requests, shape.prefill_attention_pairs,
            shape.decode_context_tokens, shape.num_prefill_sequences, threads, seconds,
        ])  # fmt: skip

    def due(self, now: float) -> m.StepReport | None:
        if not self.rows:
            return None
        if len(self.rows) < REPORT_ROWS and now - self._first_s < REPORT_INTERVAL_S:
            return None
        rows, self.rows = self.rows, []
        return m.StepReport(self.worker_id, rows)
