"""The command line: bad input is one line on stderr and exit code 2, never a traceback."""

import subprocess
import sys

import pytest


def pdserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True, text=True, timeout=120, input=stdin,
    )  # fmt: skip


def test_generate_and_chat_on_a_tiny_model(tiny_served_model):
    out = pdserve("generate", "--model", str(tiny_served_model), "--prompt", "hi",
                  "--max-tokens", "5", "--kv-cache-bytes", "1MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    chat = pdserve("chat", "--model", str(tiny_served_model), "--max-tokens", "4",
                   "--kv-cache-bytes", "1MiB", stdin="hello\n\n")  # fmt: skip
    assert chat.returncode == 0, chat.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "7"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_served_model, args, message):
    argv = ["generate", "--prompt", "hi", "--kv-cache-bytes", "1MiB"]
    if "--model" not in args:
        argv += ["--model", str(tiny_served_model)]
    out = pdserve(*argv, *args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_corrupt_gguf_and_too_long_prompt(tiny_served_model, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    out = pdserve("generate", "--model", str(bad), "--prompt", "hi")
    assert out.returncode == 2 and str(bad) in out.stderr and out.stderr.count("\n") == 1
    long = pdserve("generate", "--model", str(tiny_served_model), "--prompt", "x" * 600,
                   "--kv-cache-bytes", "1MiB")  # fmt: skip
    assert long.returncode == 2 and "context length" in long.stderr


def test_warmup_prints_per_worker_and_prompt(tmp_path):
    from tests.router.harness import Cluster, write_tiny_tokenizer

    tokenizer_dir = write_tiny_tokenizer(tmp_path / "tok")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("You are a helpful assistant who answers briefly.\n\nBe kind.\n")
    roles = {"p0": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, [5, 2], roles, api_key="k") as c:
        out = pdserve("warmup", "--url", c.url, "--api-key", "k", "--file", str(prompts))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("p0 [0] 48/48 tokens cached, 48 pinned")
        assert lines[1].startswith("p0 [1] 0/8 tokens cached, 0 pinned") and len(lines) == 2
        out = pdserve("warmup", "--url", c.url + "/v1", "--api-key", "k", "--prompt", "x", "--chat",
                      "--unpin")  # fmt: skip
        assert out.returncode == 0 and out.stdout.startswith("p0 [0]"), out.stderr
        out = pdserve("warmup", "--url", c.url, "--prompt", "x")  # no API key
        assert out.returncode == 2 and "HTTP 401" in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--url", "http://127.0.0.1:9"], "give --prompt"),
        (["--url", "http://127.0.0.1:9", "--prompt", "hi"], "cannot reach the router"),
        (["--url", "http://127.0.0.1:9", "--file", "/nonexistent/p.txt"], "cannot read prompts"),
    ],
)
def test_warmup_bad_input_is_one_line_and_exit_2(args, message):
    out = pdserve("warmup", *args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
