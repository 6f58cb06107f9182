"""The ``toma`` command as users meet it: help texts and what the commands print."""

from __future__ import annotations

import argparse

from toma.tools.cli import build_parser


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_states_its_default_once():
    subs = subcommand_parsers()
    assert set(subs) == {"bench", "eval", "generate"}
    for name, sub in subs.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.help or not action.option_strings:
                continue
            text = formatter._expand_help(action)
            where = f"toma {name} {action.option_strings[-1]}: {text!r}"
            assert text.count("(default") <= 1 and "(default: None)" not in text, where
            if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
                assert "default" in text, where  # a value the user cannot see otherwise
        # and in the text argparse prints, wrapped lines joined
        printed = " ".join(sub.format_help().split())
        assert "(default: None)" not in printed, name
