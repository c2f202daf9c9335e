"""The `kvxfer` command line: inspect, demo, bench, serve, generate, status.

The application layer: it sits above `kvxfer.disagg` and nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvxfer import __version__
from kvxfer.errors import KvxferError
from kvxfer.ops.logs import LEVELS, configure_logging


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from kvxfer.cli import inspect as inspect_layout

    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvxfer {__version__}")
    parser.add_argument("--log-level", choices=LEVELS, default="warning", help="kvxfer's log level on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    from kvxfer.cli import demo as worker_demo
    from kvxfer.cli import serve as worker_cli
    commands = [   # name, help, the function adding its options, the function running it
        ("inspect", "show the cache layout a model shape produces", inspect_layout.add_arguments, inspect_layout.main),
        ("serve", "run a prefill or decode worker until stopped", worker_cli.add_serve_arguments, worker_cli.serve),
        ("generate", "ask a decode worker for one completion", worker_cli.add_generate_arguments,
         worker_cli.generate),
        ("status", "a running worker's slot accounting and counters", worker_cli.add_status_arguments,
         worker_cli.status),
        ("demo", "prefill + decode processes on 127.0.0.1, tokens checked end to end", worker_demo.add_demo_arguments,
         worker_demo.demo),
    ]
    for name, help_text, add_arguments, run in commands:
        command = sub.add_parser(name, help=help_text)
        add_arguments(command)
        command.set_defaults(func=run)
    p_bench = sub.add_parser("bench", help="benchmarks: transport | e2e (options after the name: --help)")
    p_bench.add_argument("which", choices=("transport", "e2e"))
    p_bench.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark")
    p_bench.set_defaults(func=_bench)
    return parser


def _bench(args: argparse.Namespace) -> int:
    """Run ``kvxfer bench transport|e2e`` with the remaining options."""
    if args.which == "transport":
        from kvxfer.cli.bench_transport import main as bench_transport
        return bench_transport(list(args.args))
    from kvxfer.cli.bench_e2e import main as bench_e2e
    return bench_e2e(list(args.args))


def wants_json(args: argparse.Namespace) -> bool:
    """Whether the command was asked for JSON output (``--json``, also among a benchmark's options)."""
    return bool(getattr(args, "json", False)) or "--json" in getattr(args, "args", ())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvxfer` console script."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    configure_logging(args.log_level)
    from kvxfer.cli.output import stdout_for_json_only
    try:
        if wants_json(args):
            with stdout_for_json_only():
                return int(args.func(args))
        return int(args.func(args))
    except KvxferError as exc:
        print(f"kvxfer {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
