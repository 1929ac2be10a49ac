"""The command line every job process of the tests shares: the flags :func:`tests.workers.worker_command` writes."""

from __future__ import annotations

import argparse


def job_parser(
    prog: str | None, doc: str | None, *, node: bool = False, out_help: str | None = None
) -> argparse.ArgumentParser:
    """A parser that takes the bus (``--nats-url``), the group and the job the process runs as, with ``node`` the
    node its workloads register on (``--node-id``), and where it writes what it did (``--out``, ``out_help``): the
    process's own flags are added after. ``doc``: the module's docstring, whose first paragraph describes it."""
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])
    p.add_argument("--nats-url", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--job", required=True)
    if node:
        p.add_argument("--node-id", required=True)
    p.add_argument("--out", required=True, help=out_help)
    return p
