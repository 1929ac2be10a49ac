"""The ``timeslice`` command: ``up``/``down``, ``demo``, ``status``, ``events``, ``replay``, ``check``, the agent's
and the operator's commands, over the services of ``timeslice_orchestrator`` and ``timeslice_agent``.

``python -m timeslice_cli ARGS`` is ``timeslice ARGS``.
"""

from timeslice_client import __version__

from ._app import build_parser, main

__all__ = ["__version__", "build_parser", "main"]
