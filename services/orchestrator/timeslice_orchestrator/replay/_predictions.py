"""What ``timeslice replay`` shows of the predictive restore (``SetPolicy.predict``, ``_predict``): each plan (and the
phase whose start planned it, if one did), whether it started, and whether the job it brought back was the next one
granted."""

from __future__ import annotations

from timeslice_client.protocol import Granted, GroupRecord, Notice

from ._model import PredictedRestore

__all__ = ["observe_predictions"]


def observe_predictions(
    out: list[PredictedRestore], ts: int, before: GroupRecord | None, after: GroupRecord, notices: list[Notice]
) -> None:
    """Fold one event's change of a group's record (``before`` -> ``after``) and its notices into ``out``."""
    sw, old_plan = after.switch, before.plan if before is not None else None
    started = (
        sw is not None
        and sw.ahead is not None
        and (before is None or before.switch is None or before.switch.epoch != sw.epoch)
    )
    if after.plan is not None and after.plan != old_plan:
        last = out[-1] if out else None
        if old_plan is not None and last is not None and not last.outcome and last.started_ms is None:
            last.end_ms, last.outcome = ts, "replaced"  # (a phase start moved the plan earlier)
        out.append(PredictedRestore(job=after.plan.job, ts_ms=ts, phase=after.plan.phase))
    elif started and sw is not None and (old_plan is None or old_plan.job != sw.ahead):
        out.append(PredictedRestore(job=str(sw.ahead), ts_ms=ts))  # planned and started in the same event
    last = out[-1] if out else None
    if last is None or last.outcome:
        return
    if started:
        last.started_ms = ts
    elif last.started_ms is None and old_plan is not None and after.plan is None:
        last.end_ms, last.outcome = ts, "dropped"
        return
    if last.started_ms is not None:
        for n in notices:
            if isinstance(n, Granted):
                last.end_ms, last.outcome = ts, "hit" if n.job == last.job else "missed"
                return
