"""``python -m pdserve.bench --url ...``: the benchmark without the ``pdserve`` entry point."""

from __future__ import annotations

import sys

from pdserve.bench.cli import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
