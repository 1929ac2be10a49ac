"""``timeslice set-policy``: set a group's scheduling policy (its quantum), and say once the orchestrator applied it.

The request is an event in the stream (``SetPolicy`` on ``ts.v1.ctl.<group>.set_policy``, which only the operator's
identity may publish), applied by the orchestrator like any other, so ``timeslice replay`` folds the same decisions;
the command then reads the group's record until it shows the policy. An unknown group, a request the bus refuses, or a
record that does not show it when ``--timeout`` ends: one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import CliError, add_nats_flag, publish_control, until_applied

__all__ = ["register"]


async def _quantum_ms(nc: Any, group: str) -> int | None:
    """The group's quantum as its record says (None: no such group)."""
    from ._status import read_view

    rec = (await read_view(nc, group)).groups.get(group)
    return None if rec is None else rec.quantum_ms


async def _set_policy(args: argparse.Namespace) -> int:
    from timeslice_client.bus import connect
    from timeslice_client.protocol import MAX_QUANTUM_MS, SetPolicy, encode, subjects, validate_id

    group = validate_id("group", args.group)
    quantum_ms: int = round(args.quantum_s * 1000)
    if not 0 <= quantum_ms <= MAX_QUANTUM_MS:
        raise CliError(f"--quantum-s must lie between 0 (none) and {MAX_QUANTUM_MS // 1000} s, not {args.quantum_s:g}")
    nc = await connect(args.nats_url)
    try:
        if await _quantum_ms(nc, group) is None:
            raise CliError(
                f"no group {group!r} on this bus (`timeslice status` lists them); a group exists once a "
                "job asked for it"
            )
        policy = encode(SetPolicy(group=group, quantum_ms=quantum_ms))
        what = f"the policy for group {group!r}"
        await publish_control(nc, subjects.ctl(group, "set_policy"), policy, timeout=args.timeout, what=what)

        async def applied() -> bool:
            return await _quantum_ms(nc, group) == quantum_ms

        await until_applied(applied, timeout=args.timeout, what=f"apply the policy of group {group!r}")
    finally:
        await nc.close()
    text = (
        f"group {group}: a holder is asked to yield after {args.quantum_s:g} s while another job waits"
        if quantum_ms
        else f"group {group}: no quantum (a holder is never asked to yield)"
    )
    print(json.dumps({"group": group, "quantum_ms": quantum_ms}) if args.json else text, flush=True)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "set-policy",
        help="set a group's quantum: when a holder is asked to yield (operator)",
        description="Set a group's scheduling policy. --quantum-s S: a job that has held the group for "
        "S seconds while another waits is asked, once per hold, to release at its next "
        "phase boundary (the client's yield_requested); 0 turns it off. Priority classes "
        "need no setting: each job asks at its own (docs/scheduling.md).",
    )
    p.add_argument("--group", required=True, help="the group")
    p.add_argument(
        "--quantum-s",
        type=float,
        required=True,
        metavar="S",
        help="seconds a holder holds while others wait before it is asked to yield (0: never)",
    )
    add_nats_flag(p)
    p.add_argument("--json", action="store_true", help="the outcome as JSON on stdout")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the orchestrator to apply it (default 10)"
    )
    p.set_defaults(func=_set_policy)
