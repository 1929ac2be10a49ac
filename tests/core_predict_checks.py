"""The predictive restore's checks for the core's state machine (``test_core_properties``): what each step may do
with a plan (``GroupRecord.plan``), made at a release or at a phase start, the phase cues it learns from
(``Cycle.phases``), and a switch that brings a job back ahead of its ask (``SwitchRecord.ahead``)."""

from __future__ import annotations

from hypothesis import event
from timeslice_client.protocol import (
    MAX_PHASE_CUES,
    Acquire,
    Cancel,
    Cycle,
    Granted,
    GroupRecord,
    InputEvent,
    Phase,
    Prediction,
    Refused,
    Release,
    Released,
    SetPolicy,
)
from timeslice_orchestrator.core import LIMITS, Action, Work

from .core_sim import notices


def _idle(rec: GroupRecord) -> bool:
    return rec.holder is None and rec.switch is None and rec.trailing is None and not rec.queue and rec.reserved is None


class PredictChecks:
    """A mixin: ``check_predict`` after every step; ``now`` is the machine's clock."""

    now: int

    def _met(self, old: GroupRecord, new: GroupRecord) -> GroupRecord:
        """The record an event's handler met: ``old`` after this instant's expiries, which ``core.apply`` runs first
        (a waiter whose deadline is now has left the queue; one whose wait lapsed has left the switch)."""
        w = Work.of(old, self.now, LIMITS)
        w.seq = new.last_seq
        w.expire()
        return w.finish(old, new.last_seq)[0]

    def check_predict(self, old: GroupRecord, new: GroupRecord, ev: InputEvent, actions: list[Action]) -> None:
        released = notices(actions, Released)
        ahead = [r.ahead for r in released if r.ahead is not None]
        sw = new.switch
        started = sw is not None and sw.ahead is not None and (old.switch is None or old.switch.epoch != sw.epoch)
        planned = old.plan
        by_phase = self._check_phase(old, new, ev)
        if by_phase is not None and started and sw is not None and sw.ahead == by_phase.job:
            planned = by_phase  # (planned at the phase start and due at once)
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
            if new.plan != old.plan and not isinstance(ev, Phase):
                assert isinstance(ev, (Release, Cancel)) and ahead == [new.plan.job], ev
        if old.plan is not None and isinstance(ev, Acquire) and new.plan is not None:
            refused = [r for r in notices(actions, Refused) if r.request_id == ev.request_id]
            assert refused, "an acquire left a plan standing: any job that asks first drops it"
        if started:
            # A predictive restore starts only from its plan, at its time, on an idle group, never at a job's ask.
            assert sw is not None and planned is not None and planned.job == sw.ahead, (planned, sw)
            # (a snapshot that trailed may have ended in this very event; a waiter whose deadline is now has left)
            met = self._met(old, new)
            assert self.now >= planned.at_ms and not met.queue and met.reserved is None, (old, met)
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
        assert len(new.cycles) <= LIMITS.max_cycles
        assert all(len(c.phases) <= MAX_PHASE_CUES for c in new.cycles.values())
        assert new.predict or not new.cycles, "a history with the policy off"

    def _check_phase(self, old: GroupRecord, new: GroupRecord, ev: InputEvent) -> Prediction | None:
        """A phase event: what it may learn and plan. Returns the plan it made (None: none)."""
        if not isinstance(ev, Phase):
            return None
        was, now = old.cycles.get(ev.job, Cycle()).phases, new.cycles.get(ev.job, Cycle()).phases
        met = self._met(old, new)  # (a wait that lapsed at this instant: the job is away when its phase starts)
        present = (
            (met.holder is not None and met.holder.job == ev.job)
            or any(w.job == ev.job for w in met.queue)
            or (met.switch is not None and met.switch.to is not None and met.switch.to.job == ev.job)
        )
        if not old.predict or ev.edge == "end" or present or ev.job not in old.placements:
            # Nothing learned: the policy is off, an end, a job holding or waiting (not away), or not registered.
            assert now == was, (ev, old, new)
            assert new.plan == old.plan or new.plan is None, "only a plan that came due may go"
            return None
        cue = now[ev.name]
        assert cue.started_ms == self.now and not cue.asked, cue
        event("a phase start learned while away")
        plan = new.plan
        if plan is None or plan == old.plan:
            # (or a plan it made started at once: then the switch is the plan's, checked by the caller)
            sw = new.switch
            started = sw is not None and sw.ahead == ev.job and (old.switch is None or old.switch.epoch != sw.epoch)
            if started and (old.plan is None or old.plan.job != ev.job or old.plan.at_ms > self.now):
                return Prediction(job=ev.job, at_ms=self.now, phase=ev.name)
            return None
        # Planned (or moved earlier) only from a measured cue, on an idle group, for a job whose context is saved, is
        # not faulted and not loaded.
        before = was.get(ev.name)
        assert plan.job == ev.job and plan.phase == ev.name and before is not None and before.gap_ms >= 0, (plan, was)
        assert _idle(met) and ev.job not in old.faulted and old.saved.get(ev.job) and old.active_job != ev.job, met
        assert old.plan is None or plan.at_ms < old.plan.at_ms, (old.plan, plan)
        assert self.now <= plan.at_ms <= self.now + max(before.gap_ms, before.prev_gap_ms), plan
        event("predictive restore planned at a phase start")
        return plan
