"""`flashflow ...` entry point. Each subcommand lives in the module that owns it and exposes
``add_parser(subparsers)``, which registers its arguments and sets ``func``."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, in the order `flashflow --help` lists them
_SUBCOMMANDS = (
    "flashflow.bench.cli",        # bench
    "flashflow.bench.info",       # info
    "flashflow.bench.tune",       # tune
    "flashflow.dataflow.cli",     # dataflow
    "flashflow.viz.server",       # viz
)

DESCRIPTION = ("flashflow: Triton kernels for transformer inference that move as few bytes as the "
               "hardware allows. Each subcommand has its own --help.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashflow", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):  # subcommand not shipped yet
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
