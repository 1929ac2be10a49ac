"""The predictive restore's checks for the core's state machine (``test_core_properties``): what each step may do
with a plan (``GroupRecord.plan``) and a switch that brings a job back ahead of its ask (``SwitchRecord.ahead``)."""

from __future__ import annotations

from hypothesis import event
from timeslice_client.protocol import (
    Acquire,
    Cancel,
    Granted,
    GroupRecord,
    InputEvent,
    Prediction,
    Refused,
    Release,
    Released,
    SetPolicy,
)
from timeslice_orchestrator.core import Action

from .core_sim import notices


def _idle(rec: GroupRecord) -> bool:
    return rec.holder is None and rec.switch is None and rec.trailing is None and not rec.queue and rec.reserved is None


class PredictChecks:
    """A mixin: ``check_predict`` after every step; ``now`` is the machine's clock."""

    now: int

    def check_predict(self, old: GroupRecord, new: GroupRecord, ev: InputEvent, actions: list[Action]) -> None:
        released = notices(actions, Released)
        ahead = [r.ahead for r in released if r.ahead is not None]
        sw = new.switch
        started = sw is not None and sw.ahead is not None and (old.switch is None or old.switch.epoch != sw.epoch)
        planned = old.plan
        if ahead:
            # Planned only with the policy on, at a release nobody waited for, and the plan names that job (which
            # may have started at once: its time had come).
            assert new.predict and len(ahead) == 1 and all(r.pending_waiters == 0 for r in released if r.ahead)
            planned = Prediction(job=ahead[0], at_ms=self.now) if new.plan is None else new.plan
            # (its switch may even have ended at once: nothing to move, e.g. its nodes' agents lost)
            ran = started or (sw is None and new.epoch == old.epoch + 1)
            assert planned.job == ahead[0] and (new.plan is not None or ran), (planned, new)
            assert ahead[0] not in old.faulted and old.saved.get(ahead[0]), old
            event("predictive restore planned")
        if new.plan is not None:
            assert new.predict, "a plan with the policy off"
            if new.plan != old.plan:
                assert isinstance(ev, (Release, Cancel)) and ahead == [new.plan.job], ev
        if old.plan is not None and isinstance(ev, Acquire) and new.plan is not None:
            refused = [r for r in notices(actions, Refused) if r.request_id == ev.request_id]
            assert refused, "an acquire left a plan standing: any job that asks first drops it"
        if started:
            # A predictive restore starts only from its plan, at its time, on an idle group, never at a job's ask.
            assert sw is not None and planned is not None and planned.job == sw.ahead, (planned, sw)
            # (a snapshot that trailed may have ended in this very event)
            assert self.now >= planned.at_ms and not old.queue and old.reserved is None, old
            assert ahead or old.holder is None, old
            if isinstance(ev, Acquire):  # an acquire refused (out of range, faulted) is no ask: it carries time only
                assert [r for r in notices(actions, Refused) if r.request_id == ev.request_id], ev
            assert new.plan is None and sw.to is None and new.epoch == old.epoch + 1
            event("predictive restore started" if not ahead else "predictive restore started at the release")
        if old.plan is not None and new.plan is None and not (sw is not None and sw.ahead == old.plan.job):
            event("prediction dropped before it started")
        osw = old.switch
        adopted = osw is not None and osw.ahead is not None and osw.to is None and sw is not None and sw.to is not None
        if adopted and sw is not None and osw is not None and sw.epoch == osw.epoch:
            assert isinstance(ev, Acquire) and sw.to is not None and ev.job == sw.ahead == sw.to.job, (ev, sw)
            event("the predicted job asked during its restore")
        for g in notices(actions, Granted):
            if g.context_restored and old.switch is None and old.restored_ahead == g.job:
                event("granted at once after a predictive restore")
            if isinstance(ev, Acquire) and g.request_id == ev.request_id and old.switch is None and old.holder is None:
                # A grant at once (no switch): restored only if a predictive restore brought this job back.
                assert g.context_restored == (old.restored_ahead == g.job and old.active_job == g.job), (g, old)
        if isinstance(ev, SetPolicy) and ev.predict is False:
            assert new.plan is None
