"""The `kvxfer` command line: inspect, demo, bench, serve, generate."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvxfer.errors import KvxferError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from kvxfer import inspect_layout

    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="show the cache layout a model shape produces")
    inspect_layout.add_arguments(p_inspect)
    p_inspect.set_defaults(func=inspect_layout.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvxfer` console script."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return int(args.func(args))
    except KvxferError as exc:
        print(f"kvxfer {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
