"""The command line: one module per subcommand (:data:`COMMAND_MODULES`), each with
``add_parser(subparsers) -> ArgumentParser`` and ``run(args) -> int``:

- :mod:`hybridkv.cli.plan`: ``hybridkv plan`` (capacity and waste of a model in one block pool);
- :mod:`hybridkv.cli.simulate`: ``hybridkv simulate`` (preemption and swap simulation, reports).

Every user error is one line on stderr starting with ``hybridkv: error:`` (or ``hybridkv COMMAND:
error:`` for a bad option) and exit code 2; never a traceback. Ctrl-C (SIGINT) ends a command with
the one line ``hybridkv: interrupted`` and exit code 130 (128 + SIGINT), as a shell reports it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from hybridkv.cli.common import UserError, _Parser
from hybridkv.cli.plan import EXAMPLES
from hybridkv.errors import HybridKVError

__all__ = ["COMMAND_MODULES", "UserError", "build_parser", "main"]

# One module per subcommand; a package plugs a command in by adding its module here.
COMMAND_MODULES: tuple[str, ...] = ("hybridkv.cli.plan", "hybridkv.cli.simulate")


def _add_commands(sub: Any) -> None:
    for name in COMMAND_MODULES:
        mod = importlib.import_module(name)
        mod.add_parser(sub)
        for p in sub.choices.values():  # the command(s) it added run through its run(args)
            if p.get_default("func") is None:
                p.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    from hybridkv import __version__

    parser = _Parser(
        prog="hybridkv",
        description="One paged memory manager for attention KV cache and recurrent (linear-attention / SSM) "
        "state. Commands below; 'hybridkv COMMAND --help' for each.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_commands(sub)
    return parser


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (HybridKVError, ValueError) as e:  # HybridKVError: every error hybridkv raises on purpose
        print(f"hybridkv: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


EXIT_INTERRUPTED = 130  # 128 + SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridkv`` console script and ``python -m hybridkv``; returns the exit code."""
    try:
        code = _run(argv)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (a command cleans up on its way out)
        lead = "\n" if sys.stderr.isatty() else ""  # past a progress bar's half line
        print(f"{lead}hybridkv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `hybridkv plan --json | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1

