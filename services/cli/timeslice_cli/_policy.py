"""``timeslice set-policy``: set a group's scheduling policy (its quantum, its minimum hold, its jobs' fair shares,
the predictive restore), and say once the orchestrator applied it. What is not given stays as it is.

The request is an event in the stream (``SetPolicy`` on ``ts.v1.ctl.<group>.set_policy``, which only the operator's
identity may publish), applied by the orchestrator like any other, so ``timeslice replay`` folds the same decisions;
the command then reads the group's record until it shows the policy. An unknown group, a request the bus refuses, or a
record that does not show it when ``--timeout`` ends: one line on stderr and exit code 1. :func:`apply_policy` is that
request and wait, for a program that sets a policy the same way (``bench/_trace_pool_real.py``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._common import CliError, add_nats_flag, publish_control, until_applied

if TYPE_CHECKING:
    from timeslice_client.protocol import SetPolicy

__all__ = ["apply_policy", "register"]


async def _policy(nc: Any, group: str) -> dict[str, Any] | None:
    """The group's policy as its record says (None: no such group)."""
    from ._status import read_view

    rec = (await read_view(nc, group)).groups.get(group)
    if rec is None:
        return None
    return {"quantum_ms": rec.quantum_ms, "min_hold_ms": rec.min_hold_ms, "shares": rec.shares, "predict": rec.predict}


def _ms(seconds: float | None, flag: str, most: int) -> int | None:
    if seconds is None:
        return None
    ms = round(seconds * 1000)
    if not 0 <= ms <= most:
        raise CliError(f"{flag} must lie between 0 (none) and {most // 1000} s, not {seconds:g}")
    return ms


def _shares(given: list[str] | None, off: bool) -> dict[str, int] | None:
    """The shares ``--share JOB=WEIGHT`` (repeated) give, ``{}`` for ``--no-shares``, None for neither."""
    from timeslice_client.errors import InvalidId
    from timeslice_client.protocol import MAX_SHARE, MAX_SHARES, validate_id

    if off:
        if given:
            raise CliError("give --share or --no-shares, not both")
        return {}
    if not given:
        return None
    shares: dict[str, int] = {}
    for item in given:
        job, eq, weight = item.partition("=")
        if not eq:
            raise CliError(f"--share wants JOB=WEIGHT, not {item!r}")
        try:
            validate_id("job", job)
        except InvalidId as e:
            raise CliError(f"--share {item!r}: {e}") from e
        if not weight.isdigit() or not 1 <= int(weight) <= MAX_SHARE:
            raise CliError(f"--share {item!r}: the weight must be a whole number from 1 to {MAX_SHARE}")
        if job in shares:
            raise CliError(f"--share names job {job!r} twice")
        shares[job] = int(weight)
    if len(shares) > MAX_SHARES:
        raise CliError(f"at most {MAX_SHARES} jobs may have a share, not {len(shares)} (the others weigh 1)")
    return dict(sorted(shares.items()))


# What each part of the policy does once set (from its value), and once turned off.
_ON: dict[str, Callable[[Any], str]] = {
    "quantum_ms": lambda q: f"a holder is asked to yield after {q / 1000:g} s while another job waits",
    "min_hold_ms": lambda m: (
        f"a job switched in that releases within {m / 1000:g} s while others wait keeps the "
        "group until then (its next acquire is granted without a switch)"
    ),
    "shares": lambda shares: (
        f"fair share {', '.join(f'{j}={n}' for j, n in shares.items())} (others 1): among "
        "waiters of equal priority, the least recent held time per share goes first"
    ),
    "predict": lambda _: (
        "predictive restore: at a release nobody waits for, the job expected to ask next (from each job's recent "
        "cycle) has its context brought back while the group is idle"
    ),
}
_OFF: dict[str, str] = {
    "quantum_ms": "no quantum (a holder is never asked to yield)",
    "min_hold_ms": "no minimum hold (a release passes the group on at once)",
    "shares": "no fair share (first come, first served within a priority class)",
    "predict": "no predictive restore (a context comes back when its job asks)",
}


def _said(group: str, wanted: dict[str, Any]) -> str:
    return "\n".join(f"group {group}: {_ON[k](v) if v else _OFF[k]}" for k, v in wanted.items())


async def apply_policy(nc: Any, ev: SetPolicy, *, timeout: float) -> dict[str, Any]:
    """Publish ``ev`` on its group's control subject, as the operator, and wait until the group's record shows every
    part it sets; those parts (what ``ev`` leaves out stays as it is). A CliError when the bus does not take it or the
    record does not show it within ``timeout`` seconds. The group need not exist: the orchestrator creates its record
    on the event (the command checks first, so that a mistyped group is not created)."""
    from timeslice_client.protocol import encode, subjects

    wanted: dict[str, Any] = {k: v for k in _ON if (v := getattr(ev, k)) is not None}
    what = f"the policy for group {ev.group!r}"
    await publish_control(nc, subjects.ctl(ev.group, "set_policy"), encode(ev), timeout=timeout, what=what)

    async def applied() -> bool:
        now = await _policy(nc, ev.group)
        return now is not None and all(now[k] == v for k, v in wanted.items())

    await until_applied(applied, timeout=timeout, what=f"apply the policy of group {ev.group!r}")
    return wanted


async def _set_policy(args: argparse.Namespace) -> int:
    from timeslice_client.bus import connect
    from timeslice_client.protocol import MAX_MIN_HOLD_MS, MAX_QUANTUM_MS, SetPolicy, validate_id

    group = validate_id("group", args.group)
    quantum_ms = _ms(args.quantum_s, "--quantum-s", MAX_QUANTUM_MS)
    min_hold_ms = _ms(args.min_hold_s, "--min-hold-s", MAX_MIN_HOLD_MS)
    shares = _shares(args.share, args.no_shares)
    predict: bool | None = args.predict
    if quantum_ms is None and min_hold_ms is None and shares is None and predict is None:
        raise CliError("give --quantum-s, --min-hold-s, --share, --no-shares, --predict or --no-predict (or several)")
    ev = SetPolicy(group=group, quantum_ms=quantum_ms, min_hold_ms=min_hold_ms, shares=shares, predict=predict)
    nc = await connect(args.nats_url)
    try:
        if await _policy(nc, group) is None:
            raise CliError(
                f"no group {group!r} on this bus (`timeslice status` lists them); a group exists once a "
                "job asked for it"
            )
        wanted = await apply_policy(nc, ev, timeout=args.timeout)
    finally:
        await nc.close()
    print(json.dumps({"group": group, **wanted}) if args.json else _said(group, wanted), flush=True)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "set-policy",
        help="set a group's quantum, minimum hold, fair shares and predictive restore (operator)",
        description="Set a group's scheduling policy; what is not given stays as it is. --quantum-s S: a job "
        "that has held the group for S seconds while another waits is asked, once per hold, to release at its next "
        "phase boundary (the client's yield_requested). --min-hold-s S: a job switched in that releases sooner "
        "than S seconds after its grant while others wait keeps the group until then, and its next acquire "
        "within that window is granted without a switch. 0 turns either off. --share JOB=WEIGHT (repeated): "
        "weighted fair share, among waiters of equal priority the one with the least recent held time per share "
        "goes first (a job not named weighs 1; the shares given replace the group's); --no-shares turns it off. "
        "--predict: the predictive restore, at a release nobody waits for the job expected to ask next has its "
        "context brought back while the group is idle (--no-predict turns it off). "
        "Priority classes need no setting: each job asks at its own (docs/scheduling.md).",
    )
    p.add_argument("--group", required=True, help="the group")
    p.add_argument(
        "--quantum-s",
        type=float,
        metavar="S",
        help="seconds a holder holds while others wait before it is asked to yield (0: never)",
    )
    p.add_argument(
        "--min-hold-s",
        type=float,
        metavar="S",
        help="seconds after a switch's grant that the group stays kept for its job if it releases sooner "
        "while others wait (0: never; at most an hour)",
    )
    p.add_argument(
        "--share",
        action="append",
        metavar="JOB=WEIGHT",
        help="a job's fair share, a whole number from 1 to 1000 (repeat for each job; the others weigh 1)",
    )
    p.add_argument(
        "--no-shares", action="store_true", help="turn fair share off (first come, first served within a class)"
    )
    p.add_argument(
        "--predict",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the predictive restore: bring back, while the group is idle, the context of the job expected to ask "
        "next (--no-predict: off)",
    )
    add_nats_flag(p)
    p.add_argument("--json", action="store_true", help="the outcome as JSON on stdout")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the orchestrator to apply it (default 10)"
    )
    p.set_defaults(func=_set_policy)
