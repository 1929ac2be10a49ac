"""The commands' terminal output: colour and screen control on a terminal, plain text everywhere else.

Through ``rich`` (a well-kept library that every Python CLI user has met): it decides whether the output is a
terminal, honours ``NO_COLOR`` (no colour), ``FORCE_COLOR`` (colour into a pipe too) and ``TERM=dumb``, and knows
each terminal's codes, so no command writes an escape code by hand. Into a file or a pipe the text is written as
it is, byte for byte: scripts and ``--json`` never see a control code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TextIO

from rich.console import Console
from rich.text import Text

__all__ = ["Styles", "show"]

#: (regular expression, rich style): words the commands colour where they appear.
Styles = Iterable[tuple[str, str]]


def _console(out: TextIO) -> Console:
    return Console(file=out, highlight=False, soft_wrap=True, emoji=False, markup=False)


def show(out: TextIO, text: str, styles: Styles = (), *, clear: bool = False) -> None:
    """Write ``text`` (and a newline) to ``out``: coloured by ``styles`` and, with ``clear``, on a cleared screen,
    when ``out`` is a terminal (or colour is forced); else as plain text."""
    console = _console(out)
    if not console.is_terminal:
        out.write(text + "\n")
        out.flush()
        return
    if clear:
        console.clear()
    rich_text = Text(text)
    for pattern, style in styles:
        rich_text.highlight_regex(pattern, style)
    console.print(rich_text)
    out.flush()
