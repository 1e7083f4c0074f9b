"""The samples of the adaptive planner's online cost model: each engine step's shape,
thread count and duration, sent to the router in batches (`StepReport`); and the same per
step to a file for offline study when `PDSERVE_STEP_TRACE` names a folder (`StepTrace`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from pdserve import messages as m
from pdserve.costmodel.step_cost import StepShape

REPORT_INTERVAL_S = 0.25  # the planner re-plans every second or so: fresh enough
REPORT_ROWS = 64  # and frames stay small while steps are short
# A trace row's shape fields, read one by one: `asdict`'s recursive copy made a row cost twice
# as much (9.5 against 5 us warm; the row is written between two served steps).
SHAPE_FIELDS = tuple(f.name for f in fields(StepShape))


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
        self.rows.append(
            [
                shape.prefill_tokens,
                shape.decode_requests,
                shape.prefill_attention_pairs,
                shape.decode_context_tokens,
                shape.num_prefill_sequences,
                threads,
                seconds,
            ]
        )

    def due(self, now: float) -> m.StepReport | None:
        if not self.rows:
            return None
        if len(self.rows) < REPORT_ROWS and now - self._first_s < REPORT_INTERVAL_S:
            return None
        rows, self.rows = self.rows, []
        return m.StepReport(self.worker_id, rows)


class StepTrace:
    """Appends one JSON line per step to `<folder>/<worker_id>.steps.jsonl`: the step's
    `StepShape` fields, `threads`, `start` (Unix seconds), `seconds` and `cpu_seconds` (the
    stepping thread's CPU time: wall time less waits for a core, on one thread). Line-buffered,
    so a worker that dies keeps every step it finished; a restarted worker appends."""

    def __init__(self, folder: Path, worker_id: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{worker_id}.steps.jsonl"
        self._file = self.path.open("a", buffering=1)

    def record(
        self, shape: StepShape, threads: int, start: float, seconds: float, cpu_seconds: float
    ) -> None:
        if shape.is_empty:
            return
        row = {name: getattr(shape, name) for name in SHAPE_FIELDS}
        row.update(
            threads=threads,
            start=round(start, 6),
            seconds=round(seconds, 6),
            cpu_seconds=round(cpu_seconds, 6),
        )
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: str | Path) -> list[tuple[StepShape, int, float, float]]:
    """A `StepTrace` file's steps: (shape, threads, start, seconds)."""
    steps = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        threads, start, seconds = row.pop("threads"), row.pop("start"), row.pop("seconds")
        row.pop("cpu_seconds", None)
        steps.append((StepShape(**row), threads, start, seconds))
    return steps
