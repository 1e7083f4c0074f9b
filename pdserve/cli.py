"""`pdserve` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.bench.cli import add_bench_parser
from pdserve.cluster.up import add_up_parser
from pdserve.cluster.warmup import add_warmup_parser
from pdserve.config import CPU_KERNELS
from pdserve.model.registry import DEFAULT_MODEL
from pdserve.perf.cli import add_profile_parser
from pdserve.router.status_cli import add_status_parser
from pdserve.sim.cli import add_plan_parser, add_simulate_parser

EXIT_BAD_INPUT = 2


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    try:
        return int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB)") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="known name, .gguf file or HF dir")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--cpu-kernels",
        choices=CPU_KERNELS,
        default="native",
        help="CPU paths: native C kernels (default), oneDNN, or plain PyTorch",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=None)
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        cpu_kernels=args.cpu_kernels,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from pdserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
        for p in args.prompt
    ]
    if len(prompts) == 1:
        for chunk in llm.stream(prompts, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
        print(f"=== {prompt}\n{out.text}\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pdserve chat — an empty line or Ctrl-D ends the session.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(history)
        answer = ""
        for chunk in llm.stream([prompt], params):
            answer += chunk.text
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": answer})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=64)
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=256)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)

    add_up_parser(sub)
    add_warmup_parser(sub)
    add_bench_parser(sub)
    add_profile_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    add_status_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
