"""The ``toma`` command line: one subcommand per module.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (a callable taking the parsed namespace and returning an
exit code). Modules are imported only when the CLI starts, so ``import toma`` stays light.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

# subcommand name -> module that registers it
SUBCOMMANDS: dict[str, str] = {
    "bench": "toma.tools.bench",
    "generate": "toma.tools.generate",
    "eval": "toma.tools.eval",
    "tune": "toma.tools.tune",
    "doctor": "toma.tools.doctor",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that keeps descriptions as written and shows each option's default once.

    argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: ...)`` to every option,
    also to those whose help already says what the default is, and prints ``(default:
    None)`` for options whose default is worked out at run time. This appends the default
    only where the help does not mention one and there is a value to show.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            re.search(r"\bdefault\b", text)
            or action.default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
            or action.nargs == 0  # flags: their default is the flag's absence
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available subcommand."""
    from toma import __version__

    parser = argparse.ArgumentParser(
        prog="toma",
        description=(
            "ToMA token merging for diffusers: generate, benchmark, evaluate, tune, and check this machine (doctor)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"toma {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # subcommand not shipped in this build
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``toma`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
