"""`--help` formatting shared by the subcommands."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` only where it tells something: not when the help already says
    its default, and not for an empty default (None, [], False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        if isinstance(action.default, list) and not action.default:
            return text
        return super()._get_help_string(action)
