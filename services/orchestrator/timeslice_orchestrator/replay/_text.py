"""The terminal summary of a replay."""

from __future__ import annotations

import datetime as dt

from ._model import Replay

__all__ = ["fmt_ms", "render_summary"]


def fmt_ms(ms: float | None) -> str:
    """A duration for people: ``-``, ``840 µs``, ``12.3 ms``, ``4.20 s``, ``3m05s``, ``2h03m``."""
    if ms is None:
        return "-"
    if ms < 1:
        return f"{ms * 1000:.0f} µs"
    if ms < 1000:
        return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.2f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def render_summary(replay: Replay) -> str:
    """Per group: duty cycle, switches, handoffs, waits, snapshot/restore times and GB/s, faults, lease
    expiries; per job: held, waited and phase time. Ends with a newline."""
    s = replay.summary
    lines = [
        f"replay {_when(s.since_ms)} .. {_when(s.until_ms)} ({fmt_ms(s.until_ms - s.since_ms)}), "
        f"stream seq {replay.first_seq}..{replay.last_seq}",
        "",
    ]
    if not s.groups:
        lines.append("no group had any event in this window")
    else:
        rows = [
            [
                g,
                f"{gs.duty_cycle * 100:.1f}%",
                str(gs.grants),
                str(gs.switches),
                str(gs.handoffs),
                fmt_ms(gs.wait_p50_ms),
                fmt_ms(gs.wait_p95_ms),
                fmt_ms(gs.snapshot_p50_ms),
                _gbps(gs.snapshot_gbps),
                fmt_ms(gs.restore_p50_ms),
                _gbps(gs.restore_gbps),
                str(gs.faults),
                str(gs.lease_expiries),
            ]
            for g, gs in sorted(s.groups.items())
        ]
        lines += _table(
            [
                "GROUP",
                "DUTY",
                "GRANTS",
                "SWITCHES",
                "HANDOFFS",
                "WAIT p50",
                "WAIT p95",
                "SNAPSHOT p50",
                "GB/s",
                "RESTORE p50",
                "GB/s",
                "FAULTS",
                "LEASE EXP",
            ],
            rows,
            set(range(1, 13)),
        )
    if s.jobs:
        phases = sorted({p for js in s.jobs.values() for p in js.phase_ms})
        rows = [
            [
                j,
                str(js.grants),
                fmt_ms(js.held_ms),
                fmt_ms(js.waited_ms),
                *(fmt_ms(js.phase_ms[p]) if p in js.phase_ms else "-" for p in phases),
            ]
            for j, js in s.jobs.items()
        ]
        lines += [
            "",
            *_table(
                ["JOB", "GRANTS", "HELD", "WAITED", *(p.upper() for p in phases)], rows, set(range(1, 4 + len(phases)))
            ),
        ]
    asked = [(g, h) for g, tl in sorted(replay.groups.items()) for h in tl.holds if h.yield_requested_ms is not None]
    if asked:
        lines += ["", "asked to yield (held past the group's quantum while others waited):"]
        lines += [
            f"  {_when(h.yield_requested_ms or 0)} {g}/{h.job} at epoch {h.epoch}, released "
            f"{fmt_ms((h.end_ms - (h.yield_requested_ms or 0)) if h.end_ms else None)} later"
            for g, h in asked
        ]
    kept = [(g, m) for g, tl in sorted(replay.groups.items()) for m in tl.min_holds]
    if kept:
        how = {"reacquired": "taken back without a switch", "expired": "window ended, passed on", "ended": "ended"}
        lines += ["", "kept for a job within the minimum hold (released early while others waited):"]
        lines += [
            f"  {_when(m.start_ms)} {g}/{m.job} after its hold at epoch {m.epoch}: "
            f"kept {fmt_ms(m.until_ms - m.start_ms)} at most, "
            + (
                f"{how.get(m.outcome, m.outcome)} after {fmt_ms(m.end_ms - m.start_ms)}"
                if m.end_ms is not None
                else "still kept where the window read ends"
            )
            for g, m in kept
        ]
    chosen = [(g, c) for g, tl in sorted(replay.groups.items()) for c in tl.fair_shares]
    if chosen:
        lines += ["", "put first by fair share (least recent held time per share, among equal priorities):"]
        lines += [f"  {_when(c.ts_ms)} {g}: {c.why}" for g, c in chosen]
    predicted = [(g, p) for g, tl in sorted(replay.groups.items()) for p in tl.predictions]
    if predicted:
        said = {
            "hit": "its job granted next",
            "missed": "another job granted next",
            "dropped": "dropped: a job asked",
            "replaced": "replaced by an earlier plan",
        }
        lines += ["", "predictive restores (the job expected to ask next, its context brought back while idle):"]
        lines += [
            f"  {_when(p.ts_ms)} {g}/{p.job}: "
            + ("started" if p.started_ms is not None else "planned")
            + (f", {said[p.outcome]}" if p.outcome else ", still open")
            + (f" (planned at its phase {p.phase}'s start)" if p.phase is not None else "")
            for g, p in predicted
        ]
    faults = [(g, f) for g, tl in sorted(replay.groups.items()) for f in tl.faults]
    if faults:
        lines += ["", "faults:"] + [f"  {_when(f.ts_ms)} {g}/{f.job}: {f.reason}" for g, f in faults]
    if replay.violations:
        lines += ["", f"INVARIANT VIOLATIONS ({len(replay.violations)}), first ones:"]
        lines += [f"  {v.splitlines()[0]}" for v in replay.violations[:5]]
    return "\n".join(lines) + "\n"
