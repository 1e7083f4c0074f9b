"""The client and CLI against a fake streaming OpenAI server on a loopback port."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from pdserve.bench.cli import build_parser, main
from pdserve.bench.compare import run_compare


def bench(tokenizer_dir, url: str, *flags: str):
    argv = ["--url", url, "--tokenizer", str(tokenizer_dir), "--no-progress", *flags]
    return build_parser().parse_args(argv)


def test_result_file_is_complete_and_rejections_stay_in_the_denominator(
    fake_server, tokenizer_dir, tmp_path, capsys
):
    fake_server.reject_every = 4
    out = tmp_path / "result.json"
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--num-requests",
        "12",
        "--input-len",
        "9",
        "--output-len",
        "uniform:2:6",
        "--rate",
        "200",
        "--slo-ttft-ms",
        "2000",
        "--slo-tpot-ms",
        "1000",
        "--slo-scale",
        "0.5,1",
        "--output",
        str(out),
        "--model",
        "m",
        "--api-key",
        "k",
    )
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"config", "records", "summary", "slo_scale"}
    records = result["records"]
    summary = result["summary"]
    assert len(records) == 12
    assert summary["num_rejected"] == 3 and summary["num_completed"] == 9
    assert summary["slo_attainment"] == pytest.approx(9 / 12)
    for record in records:
        if record["status"] == "ok":
            assert record["output_len"] == record["requested_output_len"]
            assert record["ttft_s"] > 0 and record["e2e_s"] >= record["ttft_s"]
            assert len(record["itl_s"]) == record["output_len"] - 1
            assert record["input_len"] == 9
        else:
            assert record["http_status"] == 503
    body = fake_server.bodies[0]
    assert len(body["prompt"]) == 9 and all(isinstance(i, int) for i in body["prompt"])
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] and body["temperature"] == 0 and body["model"] == "m"
    assert "goodput (req/s)" in capsys.readouterr().out


def test_temperature_is_sent_as_given(fake_server, tokenizer_dir):
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--num-requests",
        "2",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--temperature",
        "0.8",
    )
    assert main(args) == 0
    assert [b["temperature"] for b in fake_server.bodies] == [0.8, 0.8]


def test_a_token_whose_text_is_held_back_is_a_token_gap_but_no_text_gap(
    fake_server, tokenizer_dir, tmp_path
):
    # Every third token arrives as an empty chunk (its text with the next): the reader's
    # gaps (itl_s) skip it, the stream's token gaps count every token.
    fake_server.held_every = 3
    out = tmp_path / "r.json"
    flags = ("--input-len", "4", "--output-len", "10", "--num-requests", "2", "--output", str(out))
    assert main(bench(tokenizer_dir, fake_server.url, *flags)) == 0
    for record in json.loads(out.read_text())["records"]:
        assert len(record["token_gaps_s"]) == 9  # ten tokens
        assert len(record["itl_s"]) == 9 - 3  # tokens 3, 6 and 9 held back
        assert max(record["itl_s"]) >= max(record["token_gaps_s"])
    assert "logprobs" not in fake_server.bodies[0]
    assert main(bench(tokenizer_dir, fake_server.url, *flags, "--logprobs")) == 0
    assert fake_server.bodies[-1]["logprobs"] == 0  # completions: the sampled token's only


def test_conversation_history_carries_the_actual_answers(fake_server, tokenizer_dir):
    fake_server.usage = False  # count tokens from chunks instead
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--num-requests",
        "3",
        "--num-turns",
        "3",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--prompt-format",
        "text",
    )
    assert main(args) == 0
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert prompts[1].startswith(prompts[0] + " w0 w1")
    assert prompts[2].startswith(prompts[1] + " w0 w1")
    assert len(prompts[2].split()) == 3 * 4 + 2 * 2


def test_chat_endpoint_and_timeout(fake_server, tokenizer_dir, tmp_path):
    out = tmp_path / "chat.json"
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--endpoint",
        "chat",
        "--num-requests",
        "2",
        "--num-turns",
        "2",
        "--input-len",
        "3",
        "--output-len",
        "2",
        "--request-timeout-s",
        "0.3",
        "--output",
        str(out),
    )
    assert main(args) == 0
    messages = fake_server.bodies[1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == " w0 w1"

    fake_server.bodies.clear()
    fake_server.delay_s = 0.5
    assert main(args) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["status"] for r in records] == ["timeout", "failed"]  # turn 2 never ran


def test_compare_runs_each_deployment_and_derives_slos(fake_server, tokenizer_dir):
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--num-requests",
        "4",
        "--input-len",
        "5",
        "--output-len",
        "3",
    )
    out = io.StringIO()
    launched = []

    def launch(spec):
        launched.append(spec)
        return contextlib.nullcontext(spec)

    rows = run_compare({"a": fake_server.url, "b": fake_server.url + "/v1"}, args, launch, out)
    assert launched == [fake_server.url, fake_server.url + "/v1"]
    assert rows["a"]["slo_ttft_ms"] == rows["b"]["slo_ttft_ms"] > 0
    text = out.getvalue()
    assert "SLOs from a unloaded p50" in text and "p90 TTFT ms" in text
    assert text.splitlines()[-2].split()[2] == "1.00x"


def test_compare_derives_the_itl_and_gap_slos_from_the_unloaded_tpot(fake_server, tokenizer_dir):
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--num-requests",
        "3",
        "--input-len",
        "5",
        "--output-len",
        "4",
    )
    args.slo_itl_multiplier, args.slo_max_gap_multiplier = 2.0, 10.0
    out = io.StringIO()
    rows = run_compare({"a": fake_server.url}, args, contextlib.nullcontext, out)
    slo_tpot_ms, slo_itl_ms = rows["a"]["slo_tpot_ms"], rows["a"]["slo_itl_ms"]
    assert slo_itl_ms == pytest.approx(2.0 * slo_tpot_ms / 5.0)  # 5x is the TPOT multiplier
    assert "p99 ITL" in out.getvalue() and rows["a"]["summary"]["slo_itl_ms"] == slo_itl_ms
    max_gap_ms = rows["a"]["slo_max_gap_ms"]
    assert max_gap_ms == pytest.approx(10.0 * slo_tpot_ms / 5.0, abs=0.05)
    assert f"max gap {max_gap_ms:g} ms" in out.getvalue()
    assert rows["a"]["summary"]["slo_max_gap_ms"] == max_gap_ms


def test_plots_are_written(fake_server, tokenizer_dir, tmp_path):
    pytest.importorskip("matplotlib")
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--num-requests",
        "6",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--slo-ttft-ms",
        "1000",
        "--slo-tpot-ms",
        "1000",
        "--find-goodput",
        "--max-probes",
        "2",
        "--start-rate",
        "50",
        "--slo-scale",
        "0.5,1",
        "--plot",
        str(tmp_path / "plots"),
    )
    assert main(args) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["attainment_vs_rate.png", "attainment_vs_slo_scale.png", "latency_cdf.png"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--input-len", "uniform:9:1"], "--input-len"),
        (["--arrival", "concurrency"], "--concurrency"),
        (["--find-goodput"], "--slo-ttft-ms"),
        (["--tokenizer", "/nonexistent"], "--tokenizer"),
        (["--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(tokenizer_dir, capsys, flags, message):
    args = bench(tokenizer_dir, "http://127.0.0.1:9", *flags)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_argparse_errors_exit_2_with_one_line(capsys):
    for argv in (["--rate", "fast"], ["compare", "--endpoint", "grpc"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_closed_loop_stops_at_the_duration_bound(fake_server, tokenizer_dir, tmp_path):
    out = tmp_path / "loop.json"
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--arrival",
        "concurrency",
        "--concurrency",
        "2",
        "--num-requests",
        "1000",
        "--duration-s",
        "0.3",
        "--input-len",
        "3",
        "--output-len",
        "5",
        "--output",
        str(out),
    )
    assert main(args) == 0
    records = json.loads(out.read_text())["records"]
    assert 2 <= len(records) < 1000
    assert max(r["send_s"] for r in records) < 0.3


def test_trace_replay_keeps_its_timing_and_shared_blocks(fake_server, tokenizer_dir, tmp_path):
    trace = tmp_path / "mooncake.jsonl"
    lines = [(0, [1, 2]), (100, [1, 3]), (200, [4])]
    trace.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": 1024, "output_length": 200, "hash_ids": h})
            for t, h in lines
        )
    )
    out = tmp_path / "trace.json"
    args = bench(
        tokenizer_dir,
        fake_server.url,
        "--trace",
        str(trace),
        "--trace-time-scale",
        "0.5",
        "--trace-length-scale",
        "0.01",
        "--output",
        str(out),
    )
    assert main(args) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["requested_output_len"] for r in records] == [2, 2, 2]
    assert [r["send_s"] for r in records] == pytest.approx([0.0, 0.05, 0.1], abs=0.03)
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert [len(p) for p in prompts] == [10, 10, 10]  # 1024 * 0.01, block 512 -> 5
    assert prompts[0][:5] == prompts[1][:5] and prompts[0][5:] != prompts[1][5:]


def test_compare_bad_deployment_and_unreachable_server(tokenizer_dir, tmp_path, capsys):
    argv = ["compare", "--deployment", "pd=configs/pd.yaml", "--tokenizer", str(tokenizer_dir)]
    assert main(build_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "configs/pd.yaml" in err
    argv = ["compare", "--deployment", "x=9z9", "--tokenizer", str(tokenizer_dir)]
    assert main(build_parser().parse_args(argv)) == 2
    assert "unknown deployment '9z9'" in capsys.readouterr().err

    out = tmp_path / "down.json"
    args = bench(
        tokenizer_dir,
        "http://127.0.0.1:9",
        "--num-requests",
        "3",
        "--output",
        str(out),
        "--ready-timeout-s",
        "0",
    )
    assert main(args) == 0  # not waited for: every request failed, and the result says so
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_failed"] == 3 and summary["slo_attainment"] == 0.0
