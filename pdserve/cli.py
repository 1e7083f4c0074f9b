"""`pdserve` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.bench.cli import add_bench_parser
from pdserve.cluster.up import add_up_parser
from pdserve.cluster.warmup_client import add_warmup_parser
from pdserve.config import EngineConfig
from pdserve.perf.cli import add_profile_parser
from pdserve.router.status_cli import add_status_parser
from pdserve.sampling_params import SamplingParams
from pdserve.schema import OneLineArgumentParser, add_flags, flag_values
from pdserve.sim.cli import add_plan_parser, add_simulate_parser

EXIT_BAD_INPUT = 2


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM

    params = SamplingParams(**flag_values(args, SamplingParams, "sampling."))
    llm = LLM(**flag_values(args, EngineConfig))
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
        for p in args.prompt
    ]
    if len(prompts) == 1:
        for chunk in llm.stream(prompts, params):
            print(chunk.text, end="", flush=True)
        print()
        return 0
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
        print(f"=== {prompt}\n{out.text}\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM

    params = SamplingParams(**flag_values(args, SamplingParams, "sampling."))
    llm = LLM(**flag_values(args, EngineConfig))
    history = [{"role": "system", "content": args.system}] if args.system else []
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
            print(chunk.text, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": answer})
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_flags(p, EngineConfig)
    add_flags(p, SamplingParams, "sampling.", max_tokens=64, temperature=0.0)
    p.add_argument("--prompt", action="append", required=True, help="repeatable")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.set_defaults(func=cmd_generate)


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    add_flags(p, EngineConfig)
    add_flags(p, SamplingParams, "sampling.", max_tokens=256, temperature=0.0)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)


def cmd_synth(args: argparse.Namespace) -> int:
    from pdserve.model.synthetic import SHAPES, file_bytes, write_synthetic_gguf

    size_gb = file_bytes(SHAPES[args.shape], args.type) / 1e9
    print(f"writing {args.output}: {args.shape} {args.type}, {size_gb:.2f} GB", file=sys.stderr)
    write_synthetic_gguf(args.output, args.shape, args.type, args.seed, args.rope_freqs)
    return 0


def add_synth_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.model.synthetic import FILE_TYPES, SHAPES

    p = sub.add_parser(
        "synth",
        help="write a random-weight GGUF of a real model's shape (for tests and benchmarks)",
    )
    p.add_argument("--shape", required=True, choices=list(SHAPES))
    p.add_argument("--type", default="q4_k_m", choices=list(FILE_TYPES), help="llama.cpp's mix")
    p.add_argument("--output", required=True, help="the .gguf file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rope-freqs",
        action="store_true",
        help="also write Llama 3's rope_freqs.weight (pdserve's GGUF converter refuses it)",
    )
    p.set_defaults(func=cmd_synth)


# Each adds its subcommand's parser, with `func` set to what runs it.
SUBCOMMANDS = [
    add_generate_parser,
    add_chat_parser,
    add_up_parser,
    add_warmup_parser,
    add_bench_parser,
    add_profile_parser,
    add_simulate_parser,
    add_plan_parser,
    add_status_parser,
    add_synth_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="pdserve", description=__doc__)
    log_help = "DEBUG, INFO, WARNING (default), ERROR; before or after the subcommand"
    parser.add_argument("--log-level", default="WARNING", help=log_help)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineArgumentParser)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    for subparser in sub.choices.values():  # `pdserve up --log-level INFO` as well
        subparser.add_argument("--log-level", default=argparse.SUPPRESS, help=log_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
