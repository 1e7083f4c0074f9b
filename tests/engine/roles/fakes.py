"""A KV receiver without sockets, for the decode role's tests: the test says when a transfer
lands (and what its last send carried); releases always succeed."""

from __future__ import annotations

from pdserve.transfer.base import TransferStatus


class FakeReceiver:
    backends = ("tcp",)

    def __init__(self) -> None:
        self.expected: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.finished: list[tuple[str, TransferStatus, str | None]] = []
        self.metas: dict[str, dict] = {}

    def land(self, request_id: str, num_dropped_tokens: int = 0, scores=None) -> None:
        """The transfer is DONE; its last send carried what the prefill dropped."""
        self.finished.append((request_id, TransferStatus.DONE, None))
        if num_dropped_tokens or scores is not None:
            meta = {"num_dropped_tokens": num_dropped_tokens, "kept_block_scores": scores}
            self.metas[request_id] = meta

    def meta(self, request_id: str) -> dict:
        return self.metas.get(request_id, {})

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        if request_id in self.expected:
            raise ValueError(f"request {request_id!r} already has a reservation")
        self.expected[request_id] = list(block_ids)

    def pop_finished(self) -> list[tuple[str, TransferStatus, str | None]]:
        finished, self.finished = self.finished, []
        return finished

    def release(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True

    def pop_unfenced(self) -> list[str]:
        return []
