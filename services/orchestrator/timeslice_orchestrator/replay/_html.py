"""One self-contained HTML file with an interactive timeline of a replay (inline CSS and JS, no network).

The replay's intervals are embedded as JSON in a ``<script type="application/json">`` element, with
``<``, ``>`` and ``&`` written as ``\\u003c``/``\\u003e``/``\\u0026`` so that no payload (a job id, an error
text) can close the element. The page draws plain SVG: a lane per group (who held it, waits hatched
below), a lane per (node, job) (context state, snapshot/restore bars), phase bands per job, a time axis;
wheel zooms, drag pans, double-click resets, hovering shows details. Every drawn interval carries its
data in ``data-*`` attributes, which the tests read back from the DOM.
"""

from __future__ import annotations

import html
import json
from importlib.resources import files
from pathlib import Path

from ._model import Replay
from ._text import fmt_ms

__all__ = ["render_html", "write_html"]


def _embed(data: object) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _template() -> str:
    """The page (``_page.html`` beside this module): markup, CSS and the drawing code; ``__TITLE__`` and
    ``__DATA__`` are filled in."""
    return files(__package__).joinpath("_page.html").read_text(encoding="utf-8")


def render_html(replay: Replay, *, title: str = "timeslice replay") -> str:
    """The page of ``replay`` as a string."""
    data = replay.to_json()
    data["title"] = title
    data["fmt"] = {"window": fmt_ms(replay.until_ms - replay.since_ms)}
    return _template().replace("__TITLE__", html.escape(title)).replace("__DATA__", _embed(data))


def write_html(replay: Replay, path: Path) -> None:
    """Write the timeline page of ``replay`` to ``path`` (one file; opening it needs no network)."""
    Path(path).write_text(render_html(replay), encoding="utf-8")
