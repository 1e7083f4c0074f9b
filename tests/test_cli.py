"""The command line: bad input is one line on stderr and exit code 2, never a traceback."""

import signal
import subprocess
import sys

import pytest


def pdserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def test_generate_and_chat_on_a_tiny_model(tiny_served_model):
    out = pdserve(
        "generate",
        "--model",
        str(tiny_served_model),
        "--prompt",
        "hi",
        "--max-tokens",
        "5",
        "--kv-cache-bytes",
        "1MiB",
    )
    assert out.returncode == 0, out.stderr
    chat = pdserve(
        "chat",
        "--model",
        str(tiny_served_model),
        "--max-tokens",
        "4",
        "--kv-cache-bytes",
        "1MiB",
        stdin="hello\n\n",
    )
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
    long = pdserve(
        "generate",
        "--model",
        str(tiny_served_model),
        "--prompt",
        "x" * 600,
        "--kv-cache-bytes",
        "1MiB",
    )
    assert long.returncode == 2 and "context length" in long.stderr


def test_warmup_prints_per_worker_and_prompt(tmp_path):
    from tests.router.harness import Cluster, write_tiny_tokenizer

    tokenizer_dir = write_tiny_tokenizer(tmp_path / "tok")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("You are a helpful assistant who answers briefly.\n\nBe kind.\n")
    roles = {"p0": "prefill", "d0": "decode"}
    with Cluster(tokenizer_dir, [5, 2], roles, admin_key="k") as c:
        out = pdserve("warmup", "--url", c.url, "--admin-key", "k", "--file", str(prompts))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("p0 [0] 48/48 tokens cached, 48 pinned")
        assert lines[1].startswith("p0 [1] 0/8 tokens cached, 0 pinned") and len(lines) == 2
        out = pdserve(
            "warmup",
            "--url",
            c.url + "/v1",
            "--admin-key",
            "k",
            "--prompt",
            "x",
            "--chat",
            "--unpin",
        )
        assert out.returncode == 0 and out.stdout.startswith("p0 [0]"), out.stderr
        out = pdserve("warmup", "--url", c.url, "--prompt", "x")  # no admin key
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


def test_up_help_lists_the_config_fields_with_their_defaults():
    out = pdserve("up", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in (
        "--transfer {auto,shm,tcp,mooncake}",
        "--transfer-mode {layerwise,full}",
        "--routing {round_robin,shortest_queue,prefix_cache}",
        "--kv-host-bytes",
        "--threads",
        "--no-prefix-caching",
        "--block-size BLOCK_SIZE",
    ):
        assert flag in text, flag
    assert "tokens per KV block (default: 16)" in text


@pytest.mark.parametrize(
    "yaml_text, argv, message",
    [
        ("prefil: {num: 1}\n", [], "unknown key 'prefil' in c.yaml (did you mean 'prefill'?)"),
        (
            "collocated: {threds: 1}\n",
            [],
            "unknown key 'collocated.threds' in c.yaml (did you mean 'collocated.threads'?)",
        ),
        (
            "collocated: {num: 1}\nkv_transfer: {mode: ful}\n",
            [],
            "kv_transfer.mode must be "
            "one of ('layerwise', 'full'), got 'ful' (did you mean 'full'?)",
        ),
        (
            "collocated: {num: 1}\n",
            ["--transfer", "shn"],
            "invalid choice 'shn' (choose from auto, shm, tcp, mooncake) (did you mean 'shm'?)",
        ),
        ("collocated: {num: 1}\n", ["--thred", "1"], "(did you mean '--threads'?)"),
        ("collocated: {num: 1}\n", ["--port", "99999"], "port must be <= 65535, got 99999"),
    ],
)
def test_up_bad_config_is_one_line_naming_the_closest_key(tmp_path, yaml_text, argv, message):
    (tmp_path / "c.yaml").write_text(yaml_text)
    out = pdserve("up", "--config", str(tmp_path / "c.yaml"), *argv)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_up_collocated_starts_and_answers_once(tiny_served_model):
    from pdserve.cluster.launcher import free_port

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--collocated",
            "1",
            "--model",
            str(tiny_served_model),
            "--port",
            str(free_port()),
            "--kv-cache-bytes",
            "2MiB",
            "--threads",
            "1",
            "--startup-timeout-s",
            "120",
            "--example-request",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert "serving the OpenAI API" in lines[0], lines
        assert lines[1].startswith("$ curl ") and lines[2].startswith("-> "), lines
        assert "tokens, " in lines[2]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    "argv, level",
    [
        (["status", "http://x"], "WARNING"),
        (["--log-level", "ERROR", "status", "http://x"], "ERROR"),
        (["status", "http://x", "--log-level", "DEBUG"], "DEBUG"),  # as vLLM/SGLang users type it
    ],
)
def test_log_level_is_taken_before_or_after_the_subcommand(argv, level):
    from pdserve.cli import build_parser

    assert build_parser().parse_args(argv).log_level == level
