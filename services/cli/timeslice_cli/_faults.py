"""``timeslice clear-fault``: clear a job's fault in a group, and say whether the orchestrator did.

The request is an event in the stream (the orchestrator applies it like any other); the command then reads the
group's record until the fault is gone. An invalid id, an unknown group, a request the bus refuses (an identity
that may not clear faults), or a record that still shows the fault when ``--timeout`` ends: one line on stderr and
exit code 1. A job that is not faulted there: nothing to clear, said so, exit 0.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import CliError, add_nats_flag, publish_control, until_applied

__all__ = ["register"]


async def _faulted(nc: Any, group: str) -> dict[str, str] | None:
    """The group's faulted jobs (None: no such group)."""
    from ._status import read_view

    view = await read_view(nc, group)
    rec = view.groups.get(group)
    return None if rec is None else dict(rec.faulted)


async def _clear_fault(args: argparse.Namespace) -> int:
    from timeslice_client.bus import connect
    from timeslice_client.protocol import ClearFault, encode, subjects, validate_id

    group, job = validate_id("group", args.group), validate_id("job", args.job)
    nc = await connect(args.nats_url)
    try:
        faulted = await _faulted(nc, group)
        if faulted is None:
            raise CliError(f"no group {group!r} on this bus (`timeslice status` lists them): nothing to clear")
        what = f"the request to clear job {job!r}'s fault in group {group!r}"
        clear = encode(ClearFault(group=group, job=job))
        await publish_control(nc, subjects.ctl(group, "clear_fault"), clear, timeout=args.timeout, what=what)
        if job not in faulted:
            names = ", ".join(sorted(faulted)) or "none"
            _say(
                args,
                {"group": group, "job": job, "cleared": False, "was_faulted": False},
                f"job {job} is not faulted in group {group} (faulted there: {names}): nothing to clear",
            )
            return 0

        async def cleared() -> bool:
            now = await _faulted(nc, group)
            return now is None or job not in now

        await until_applied(cleared, timeout=args.timeout, what=f"clear job {job!r}'s fault in group {group!r}")
    finally:
        await nc.close()
    _say(
        args,
        {"group": group, "job": job, "cleared": True, "was_faulted": True},
        f"fault of job {job} in group {group} cleared",
    )
    return 0


def _say(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    print(json.dumps(doc) if args.json else text, flush=True)


def register(sub: Any) -> None:
    cf = sub.add_parser("clear-fault", help="clear a job's fault in a group so it can acquire again")
    cf.add_argument("--group", required=True, help="the group the job is faulted in")
    cf.add_argument("--job", required=True, help="the faulted job's id")
    add_nats_flag(cf)
    cf.add_argument("--json", action="store_true", help="the outcome as JSON on stdout")
    cf.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the orchestrator to clear it (default 10)"
    )
    cf.set_defaults(func=_clear_fault)
