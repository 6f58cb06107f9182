"""The ``toma`` command line: one subcommand per module.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (a callable taking the parsed namespace and returning an
exit code). Modules are imported only when the CLI starts, so ``import toma`` stays light.
"""

from __future__ import annotations

import argparse
import difflib
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


def near_names(word: str, names: list[str]) -> str:
    """``"; did you mean X or Y?"`` for the names close to ``word``, or ``""`` when none is."""
    close = difflib.get_close_matches(word, names, n=3, cutoff=0.6)
    if not close:
        # a prefix of a longer name ("sdx" for "sdxl") is near too, where difflib's ratio is low
        close = [name for name in names if name.startswith(word) or word.startswith(name)][:3]
    return f"; did you mean {' or '.join(close)}?" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """A parser whose errors are one short message with the near names, not the whole usage.

    argparse prints every option's usage before an error (40 lines for ``toma bench``), and
    suggests nothing for a near miss such as ``--arch sdx``: the message here names the near
    choices, and points to ``--help`` for the rest.
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print the error with near names and a pointer to ``--help``, then exit with status 2."""
        match = re.match(r"argument (?P<option>[^:]+): invalid choice: '(?P<value>[^']*)'", message)
        hint = ""
        if match:
            for action in self._actions:
                if match.group("option") in (action.option_strings or [action.dest, str(action.metavar)]):
                    hint = near_names(match.group("value"), [str(c) for c in action.choices or ()])
            if hint:  # the near names replace the list of every choice
                message = message.split(" (choose from", 1)[0]
        self.exit(2, f"{self.prog}: error: {message}{hint}\n(`{self.prog} --help` lists what it takes)\n")

    def option_names(self) -> list[str]:
        """Every option string this parser takes."""
        return [name for action in self._actions for name in action.option_strings]


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available subcommand."""
    from toma import __version__

    parser = ArgumentParser(
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
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse knows the unknown options only at the top level; the near names are the
        # subcommand's
        sub = _subparser(parser, getattr(args, "command", None)) or parser
        unknown = [word for word in extra if word.startswith("-")]
        hint = near_names(unknown[0].split("=", 1)[0], sub.option_names()) if unknown else ""
        sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> ArgumentParser | None:
    """The parser of subcommand ``command``, if there is one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


if __name__ == "__main__":
    sys.exit(main())
