"""``timeslice replay``: rebuild any window of the ``TIMESLICE`` stream by folding it through the
orchestrator's pure core, then summarise it (terminal), draw it (one self-contained HTML file) or export it
(JSON).

>>> events = await read_window(url, group="gpus-0")      # the stream, in order
>>> replay = fold_events(events, group="gpus-0")        # the same core as the orchestrator
>>> print(render_summary(replay)); write_html(replay, Path("replay.html"))
"""

from . import _model
from ._fold import fold_events
from ._html import render_html, write_html
from ._model import *  # noqa: F403 - the model's types are this package's vocabulary: its __all__ is theirs
from ._read import ReplayError, read_window
from ._text import render_summary

__all__ = ["ReplayError", "fold_events", "read_window", "render_html", "render_summary", "write_html"]
__all__ += _model.__all__
