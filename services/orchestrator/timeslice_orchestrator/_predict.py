"""The predictive restore (``SetPolicy.predict``): while a group is idle, bring back the context of the job most
likely to ask next, so that its acquire finds it loaded.

What the core knows of each job's cycle (``GroupRecord.cycles``, ``Cycle``; kept only while the policy is on, so the
default path does no work for it and its records carry none): when it last released, how long it stayed away the last
two times (its release to its next ask), and how long its last switch in took. At a release that
nobody waited for (the context stays loaded: ``IDLE_YIELDED``), with the policy on, the core expects each other job
that is not faulted, has its context saved and does not wait already, to ask at its last release plus the longer of
its last two times away (at once if that time has passed); the releasing job to come back after the shorter of its own
(unknown: never expected). Cautious both ways: a wrong guess costs a switch back, a missed one only what FIFO
costs (in the simulation of the published sync run, the last time away alone gave 0.97x FIFO and made grant on restore
3 min slower; the cautious rule 0.92x, and as fast as grant on restore with pre-copy). The job expected first, if it
comes before the releasing job, is predicted (ties: the lowest job id, so the decision is deterministic): a
``Prediction`` at the time its switch should start, as long before its expected ask as twice its last switch in took
(at once when that is unknown), and the release answer names it (``Released.ahead``), so the releasing client does
not claim its next acquire (a claim assumes no decision before it; the prediction's switch may come first).

* **Cancelled at no cost**: any acquire before the plan's time drops it (nothing was moved); so does a policy turned
  off, or a predicted job found faulted or with nothing saved (or saved where its agent was lost) when the time comes.
* **At the plan's time**, if the group is still idle (nobody holds or waits, no switch, no snapshot trailing, nothing
  reserved), a switch starts with no waiter (``SwitchRecord.ahead``): every other loaded context is snapshotted, the
  predicted job's is restored, as in any switch, and the epoch rises. Its acquire during that switch makes it the
  switch's waiter (when nobody else waits: others keep their order), granted at the switch's end as usual. Ended
  with nobody to grant, the group is left idle with its context loaded (``active_job``; ``restored_ahead``), and its
  acquire then is granted at once, with ``context_restored``, as a holder's re-acquire is. Another job's acquire is
  served as it would be: one more switch (what a wrong prediction costs).

**Phase cues** (``note_phase``): jobs may publish phase events (``timeslice_client``'s ``phase(name)``: a ``Phase``
at the block's start and end). With the policy on, a phase *start* made while the job is away (it neither holds nor
waits for the group, and is registered in it) starts a measure of that phase's start -> the job's next ask, kept per
job and phase name (``Cycle.phases``, ``PhaseCue``: the last two measures; at most ``MAX_PHASE_CUES`` names a job, the
ones started last; within the ``Limits.max_cycles`` jobs, the one seen longest ago forgotten first). Such a start, of a
phase measured before, on a group idle as above, for a job that could be restored (as above) and is not the one
loaded, plans its restore at the start plus the longer of the phase's last two measures, less the same lead: a
``Prediction`` with ``phase`` set, replacing a plan only with an earlier one. Not while the loaded job is expected back
first by its cycle (its last release plus the shorter of its last two times away; late, at any moment). The cycle rule
is unchanged; the plan is dropped, started or refused as any. A phase *end* does nothing (the start said when it began;
the ask ends the measure); a phase published while holding or waiting teaches nothing (not away); with the policy off,
a phase event leaves no trace.

Pure and deterministic (the record, the event's time): ``timeslice replay`` and the checkers fold the same plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from timeslice_client.protocol import MAX_PHASE_CUES, Cycle, GroupRecord, PhaseCue, Prediction, SwitchRecord

if TYPE_CHECKING:
    from ._work import Work

__all__ = [
    "ahead_deadline",
    "ended_ahead",
    "note_ask",
    "note_phase",
    "note_release",
    "note_switched_in",
    "start_ahead_due",
    "switch_target",
]


def switch_target(sw: SwitchRecord) -> str | None:
    """The job whose context ``sw`` brings in: its waiter's, else the predicted job's (None: neither is left)."""
    return sw.to.job if sw.to is not None else sw.ahead


def _keep(w: Work, job: str, cycle: Cycle) -> None:
    """Store ``cycle`` for ``job``; past ``Limits.max_cycles`` jobs, the one seen longest ago (its last release or
    phase start) is forgotten."""
    w.cycles[job] = cycle
    while len(w.cycles) > w.limits.max_cycles:
        del w.cycles[min(w.cycles, key=lambda j: (_last_seen(w.cycles[j]), j))]


def _last_seen(c: Cycle) -> int:
    return max([c.released_ms, *(p.started_ms for p in c.phases.values())])


def note_ask(w: Work, job: str) -> None:
    """``job`` asks for the group (a valid acquire or claim): its time away is measured, and the time since each
    phase it started while away; a plan is dropped."""
    if not w.predict:
        return  # (no history is kept with the policy off: nothing on the default path)
    c = w.cycles.get(job)
    if c is not None and (not c.asked or any(not p.asked for p in c.phases.values())):
        if not c.asked:
            gap = max(0, w.now - c.released_ms)
            c = msgspec.structs.replace(c, asked=True, gap_ms=gap, prev_gap_ms=c.gap_ms)
        phases = {name: _asked(p, w.now) for name, p in c.phases.items()}
        _keep(w, job, msgspec.structs.replace(c, phases=phases))
        w.changed = True
    if w.plan is not None:
        w.touch(f"prediction of {w.plan.job} dropped: {job} asked first")
        w.plan = None


def _asked(p: PhaseCue, now: int) -> PhaseCue:
    """The cue of a phase whose job asks now: the time since its start, if it started while away."""
    if p.asked:
        return p
    return PhaseCue(started_ms=p.started_ms, asked=True, gap_ms=max(0, now - p.started_ms), prev_gap_ms=p.gap_ms)


def note_phase(w: Work, job: str, name: str, start: bool) -> None:
    """``job`` published a phase event (``Phase``): a start made while it holds nothing here and does not wait (away)
    starts the measure of that phase's start -> its next ask, and, when a measure of it is known and the group is
    idle, may plan (or move earlier) the predictive restore of ``job``. Ignored: an end (the start said when the
    phase began; its end adds nothing the ask does not), a start while the job holds or waits for the group (it is not
    away: its next ask is no answer to that phase), a job not registered in the group (nothing of it to restore), and
    everything with the policy off."""
    if not w.predict or not start or job not in w.placements or _present(w, job):
        return
    c = w.cycles.get(job, Cycle())
    cue = c.phases.get(name, PhaseCue())
    phases = {n: p for n, p in c.phases.items() if n != name}
    while len(phases) >= MAX_PHASE_CUES:  # the names started longest ago are forgotten first
        del phases[min(phases, key=lambda n: (phases[n].started_ms, n))]
    phases[name] = msgspec.structs.replace(cue, started_ms=w.now, asked=False)
    _keep(w, job, msgspec.structs.replace(c, phases=phases))
    w.changed = True
    if cue.gap_ms < 0 or not _quiet(w) or w.active_job == job or not _restorable(w, job):
        return
    # Cautious as the cycle rule: expected after the longer of the phase's last two measures; not when the job whose
    # context is loaded is expected back before that (by its own cycle).
    expected = w.now + max(cue.gap_ms, cue.prev_gap_ms)
    back = _back(w)
    if back is not None and back <= expected:
        return
    lead = 2 * w.cycles[job].switch_in_ms
    at = max(w.now, expected - lead) if lead >= 0 else w.now
    if w.plan is not None and w.plan.at_ms <= at:
        return  # (a plan that starts no later stays: a phase start only moves a plan earlier)
    w.plan = Prediction(job=job, at_ms=at, phase=name)
    w.touch(f"predicted: {job} asks next (its phase {name} started)")


def _present(w: Work, job: str) -> bool:
    """Whether ``job`` holds the group or waits for it (a switch's waiter included): not away."""
    return (
        (w.holder is not None and w.holder.job == job)
        or any(wr.job == job for wr in w.queue)
        or (w.switch is not None and w.switch.to is not None and w.switch.to.job == job)
    )


def _quiet(w: Work) -> bool:
    """Nobody holds or waits, no switch runs, no snapshot trails, nothing is reserved."""
    return w.holder is None and w.switch is None and w.trailing is None and not w.queue and w.reserved is None


def _back(w: Work) -> int | None:
    """When the job whose context is loaded (``active_job``) is expected back by its cycle: its last release plus the
    shorter of its last two times away, at once if that time has passed (None: no loaded job, it asked since, or
    nothing measured). Late, it is still expected at any moment: in the simulated sync run, a loaded job late on the
    trainer pool (it waited for the sampler pool) took it back from most restores the other job's phase start had
    planned there."""
    job = w.active_job
    c = w.cycles.get(job) if job is not None else None
    if c is None or c.asked or c.gap_ms < 0:
        return None
    return max(w.now, c.released_ms + min(_gaps(c)))


def note_switched_in(w: Work, job: str, started_at_ms: int) -> None:
    """A switch that started at ``started_at_ms`` grants ``job`` now: how long its switch in took."""
    if not w.predict:
        return
    c = w.cycles.get(job, Cycle())
    _keep(w, job, msgspec.structs.replace(c, switch_in_ms=max(0, w.now - started_at_ms)))


def note_release(w: Work, job: str) -> str | None:
    """``job`` released: its cycle notes it; with nobody waiting and the policy on, plan the predictive restore.
    Returns the job predicted (None: none)."""
    if not w.predict:
        return None
    c = w.cycles.get(job, Cycle())
    _keep(w, job, msgspec.structs.replace(c, released_ms=w.now, asked=False))
    w.plan = None
    if w.queue or w.reserved is not None:
        return None
    # Cautious both ways: the releasing job back after the shorter of its last two times away, each other job asking
    # after the longer of its own (one measured: that one).
    back = w.now + min(_gaps(c)) if c.gap_ms >= 0 else None
    best: tuple[int, str] | None = None
    for other, oc in w.cycles.items():
        if other == job or oc.asked or oc.gap_ms < 0 or not _restorable(w, other):
            continue
        candidate = (max(w.now, oc.released_ms + max(_gaps(oc))), other)
        if best is None or candidate < best:
            best = candidate
    if best is None or (back is not None and best[0] >= back):
        return None
    expected, ahead = best
    lead = 2 * w.cycles[ahead].switch_in_ms
    w.plan = Prediction(job=ahead, at_ms=max(w.now, expected - lead) if lead >= 0 else w.now)
    w.touch(f"predicted: {ahead} asks next")
    return ahead


def _gaps(c: Cycle) -> tuple[int, ...]:
    """The job's last two times away (one, if it was measured once; call with ``gap_ms`` measured)."""
    return (c.gap_ms, c.prev_gap_ms) if c.prev_gap_ms >= 0 else (c.gap_ms,)


def _restorable(w: Work, job: str) -> bool:
    """Whether a predictive restore of ``job`` can bring something back: not faulted, its context saved, and every
    node where it is saved has its agent (a switch to it would fault it otherwise: that is for its own ask)."""
    saved = w.saved.get(job, ())
    return job not in w.faulted and bool(saved) and not any(n in w.lost_nodes for n in saved)


def _idle(rec: GroupRecord | Work) -> bool:
    return (
        rec.holder is None
        and rec.switch is None
        and rec.trailing is None
        and not rec.queue
        and rec.reserved is None
        and rec.plan is not None
    )


def ahead_deadline(rec: GroupRecord) -> int | None:
    """When a planned predictive restore is due to start (None: no plan, or the group is not idle yet)."""
    return rec.plan.at_ms if rec.plan is not None and _idle(rec) else None


def start_ahead_due(w: Work) -> bool:
    """Start the planned predictive restore if it is due and the group is idle (or drop it if it can no longer
    run). Returns whether a switch started."""
    plan = w.plan
    if plan is None or not _idle(w) or w.now < plan.at_ms:
        return False
    w.plan = None
    if not w.predict or not _restorable(w, plan.job) or w.active_job == plan.job:
        w.touch(f"prediction of {plan.job} dropped: it cannot be restored now")
        return False
    w.start_switch(None, ahead=plan.job)
    return True


def ended_ahead(w: Work, sw: SwitchRecord) -> None:
    """A predictive restore's switch ended and its job has not asked: the group stays idle with its context."""
    job = sw.ahead
    assert job is not None and sw.to is None
    if sw.restored and job not in w.faulted and all(w.loaded.get(n) == job for n in w.placements.get(job, ())):
        w.active_job = job
        w.restored_ahead = job
        w.touch(f"restored {job} ahead of its ask")
    else:
        w.touch(f"the restore of {job} ahead of its ask did not complete")
