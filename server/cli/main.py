"""The ``fuelline`` command line.

Subcommands, one module each: ``serve`` and ``sample`` (this package), ``stream`` (the client's,
``fuelline.client.command``), ``synth`` and ``convert`` (``ingest``), ``import`` (``tables``), ``inspect``,
``keygen`` and ``bench``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from fuelline.protocol import FuellineError
from fuelline.protocol.common.logs import LOG_FORMATS, configure_logging
from fuelline.protocol.common.stacks import dump_stacks_on_usr1
from fuelline.protocol.common.version import version_line

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

__all__ = ["main", "build_parser", "DefaultsHelpFormatter", "shown_default"]


def shown_default(action: argparse.Action) -> str | None:
    """An option's default as ``--help`` and the command-line reference show it; None where it has none worth
    showing (no value, a flag that is off unless given, an empty list)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, (argparse._StoreConstAction, argparse._HelpAction, argparse._VersionAction)):
        return None  # (store_true and store_false are store_const)
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return None
    return str(action.default)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with its default, unless the help already says what it is (for a
    default that is not a plain value: "default: fewer than half of --max-clients")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = shown_default(action)
        if shown is None or "default" in text or text == argparse.SUPPRESS:
            return action.help
        return f"{text} (default: {shown.replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuelline", description="Stream training batches from data servers.",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the installed version and exit")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="least severe log records shown")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="log lines for people (text) or one JSON object per line for log shippers (json)")
    sub = parser.add_subparsers(dest="command", required=True)

    # One module per command: each adds its parser and sets the function that runs it.
    from fuelline.client import command as stream
    from fuelline.server.cli import bench, ingest, inspect, keygen, sample, serve, tables

    for command in (serve, sample, stream, ingest, tables, inspect, keygen, bench):
        command.register(sub)
    # The logging options also after the subcommand (``fuelline serve DATA --log-format json``),
    # where unit files and manifests put every option.
    for subparser in sub.choices.values():
        subparser.formatter_class = DefaultsHelpFormatter
        subparser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help=argparse.SUPPRESS)
        subparser.add_argument("--log-format", default=argparse.SUPPRESS, choices=LOG_FORMATS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)  # (what serve --processes runs again)
    configure_logging(args.log_level, args.log_format)
    dump_stacks_on_usr1()  # (kill -USR1: where a stuck process's threads are, on its stderr)
    try:
        return args.func(args)
    except (FuellineError, FileExistsError) as exc:
        print(f"fuelline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C is how a person stops `fuelline stream`: one line, and the shell's 128 + SIGINT.
        print(f"fuelline {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Read by something that stopped reading (`fuelline inspect DATA | head`): what it did not
        # read is not an error. Point stdout at nothing, so that the flush at exit is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
