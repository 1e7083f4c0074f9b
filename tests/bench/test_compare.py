"""`pdserve bench compare`: the stall budget travels with the derived SLOs, and the table
shows each deployment's longest freeze beside its p99 ITL."""

from __future__ import annotations

import contextlib
import io

from pdserve.bench.cli import build_parser
from pdserve.bench.compare import format_table, run_compare


def three_requests(url: str, tokenizer_dir, *extra: str, command: str | None = None):
    """Parsed `pdserve bench [compare]` arguments: three 5-token prompts, 4 tokens out."""
    common = ["--url", url, "--tokenizer", str(tokenizer_dir), "--no-progress"]
    shape = ["--num-requests", "3", "--input-len", "5", "--output-len", "4"]
    return build_parser().parse_args([*([command] if command else []), *common, *shape, *extra])


def test_the_table_shows_the_longest_freeze_that_the_p99_itl_hides():
    rows = {
        "collocated": {"goodput": 0.2, "p99_itl_ms": 60.0, "max_gap_ms": 5000.0},
        "adaptive": {"goodput": 0.4, "p99_itl_ms": 62.0, "max_gap_ms": 250.0},
    }
    header, collocated, adaptive = format_table(rows).splitlines()
    assert "p99 ITL ms" in header and header.index("max gap ms") > header.index("p99 ITL ms")
    assert collocated.split()[-3:-1] == ["5000.00", "1.00x"]
    assert adaptive.split()[-3:-1] == ["250.00", "0.05x"]


def test_compare_keeps_the_stall_budget_with_derived_slos(fake_server, tokenizer_dir):
    args = three_requests(fake_server.url, tokenizer_dir, "--slo-max-gap-ms", "1000")
    fake_server.delay_s = 0.02
    out = io.StringIO()
    rows = run_compare({"a": fake_server.url}, args, contextlib.nullcontext, out)
    row = rows["a"]
    assert row["slo_max_gap_ms"] == row["summary"]["slo_max_gap_ms"] == 1000
    assert row["slo_ttft_ms"] > 0  # derived from the unloaded run; the budget stays as given
    assert 20 <= row["max_gap_ms"] < 1000  # 20 ms between the fake server's tokens
    assert row["max_gap_ms"] == max(max(r["itl_s"]) for r in row["records"]) * 1000
    assert "max gap 1000 ms" in out.getvalue() and "max gap ms" in out.getvalue()


def test_each_deployment_answers_its_warmups_before_the_workload(fake_server, tokenizer_dir):
    extra = ("--slo-ttft-ms", "1000", "--warmup-requests", "2")
    args = three_requests(fake_server.url, tokenizer_dir, *extra, command="compare")
    rows = run_compare(
        {"a": fake_server.url, "b": fake_server.url}, args, contextlib.nullcontext, io.StringIO()
    )
    assert len(fake_server.bodies) == 2 * (2 + 3)  # each: 2 warm-ups, then the 3 measured
    assert all(len(row["records"]) == 3 for row in rows.values())  # warm-ups are not measured


def test_each_row_keeps_the_servers_status_and_each_record_its_request_id(
    fake_server, tokenizer_dir
):
    """An adaptive router's decisions (in /v1/status) join the records by X-Request-Id; a
    server without /v1/status leaves the row's status None rather than failing the run."""
    args = three_requests(
        fake_server.url, tokenizer_dir, "--slo-ttft-ms", "1000", command="compare"
    )
    rows = run_compare({"a": fake_server.url}, args, contextlib.nullcontext, io.StringIO())
    assert rows["a"]["status"] is None
    assert sorted(r["server_id"] for r in rows["a"]["records"]) == ["r2", "r3", "r4"]  # r1: warm-up
    fake_server.status = {"recent_decisions": [{"request": "r2", "kind": "remote"}]}
    rows = run_compare({"a": fake_server.url}, args, contextlib.nullcontext, io.StringIO())
    assert rows["a"]["status"] == fake_server.status
