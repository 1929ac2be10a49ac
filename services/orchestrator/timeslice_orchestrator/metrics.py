"""The orchestrator's Prometheus metrics, derived from what the pure core already decided.

Everything here is computed from an applied event's record before and after and the actions the core
returned (the notices the shell publishes anyway): no I/O, no await. The hot path only adds to plain
integers and bucket lists (~2 µs per event); the Prometheus metric families are built when somebody scrapes
(this class is a registry *collector*), because prometheus_client's own Counter/Histogram objects take a
lock per update and cost 2-5 µs each, about as much as ``apply`` itself for the handful an event touches.
A scrape runs on the HTTP server's thread and reads the numbers without a lock: each value is read whole
(the GIL), a histogram's ``_sum`` may be one observation ahead of its buckets, never torn.

Label values are group ids (bounded by the deployment: every group is a pool of accelerators somebody
configured), event types (a closed set) and a few fixed reasons. Job ids are never labels: they are
unbounded, and ``timeslice events`` / ``timeslice replay`` answer per-job questions.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Final, NamedTuple

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from timeslice_client._internal.duration_buckets import DURATION_BUCKETS
from timeslice_client.protocol import (
    DequeueCode,
    Dequeued,
    Granted,
    GroupRecord,
    InputEvent,
    Released,
    RevokeCode,
    Revoked,
    YieldRequested,
)

from ._agents_watch import AgentLiveness
from ._min_hold import OUTCOMES, reservation_change
from ._work import Action, Notify

__all__ = ["APPLY_BUCKETS", "DURATION_BUCKETS", "OrchestratorMetrics"]

# DURATION_BUCKETS (``_internal.duration_buckets``: 1-2.5-5 per decade, 100 µs to 60 s) fit the orchestrator: 100 µs
# is below one NATS round trip (~150 µs on loopback), so the first bucket holds "as fast as the bus allows"; a
# handoff with nothing to copy is 0.5-2 ms; snapshots and restores of tens of GB at host-memory bandwidth take
# 1-10 s; an acquire that waits for another job's phase takes seconds to a minute. Longer waits land in +Inf and
# still count in _sum, which keeps the mean honest.

# Seconds. ``apply`` is pure Python at ~20-40 µs per event (measured on a 2-core VM), so its histogram starts at
# 5 µs; 100 ms would mean the event loop stalled (GC, a huge queue), which is what this histogram is for.
APPLY_BUCKETS: Final = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.1)

_DEQUEUE_REASONS: Final = ("cancelled", "timeout", "lost", "faulted")
_EXPIRY_REASONS: Final = ("lease_expired", "grant_unconfirmed")


class _InstanceFamily(NamedTuple):
    """One of the instance's own numbers (one sample, not per group): its family, the attribute of
    ``OrchestratorMetrics`` that holds the value, and its help."""

    kind: type[CounterMetricFamily | GaugeMetricFamily]
    name: str
    attr: str  # dotted: an attribute of an attribute
    doc: str


# In the order a scrape shows them, after the per-group families.
_INSTANCE_FAMILIES: Final = (
    _InstanceFamily(
        CounterMetricFamily,
        "timeslice_events_rejected",
        "rejected",
        "Events refused before the core (malformed or on an unknown subject).",
    ),
    _InstanceFamily(
        GaugeMetricFamily,
        "timeslice_groups_quarantined",
        "quarantined",
        "Groups not served because their record cannot be loaded, decoded or stored (alarm on > 0; "
        "`timeslice status` shows which and why).",
    ),
    _InstanceFamily(
        GaugeMetricFamily,
        "timeslice_orchestrator_leading",
        "leading",
        "1 while this orchestrator leads, 0 while it stands by (exactly one instance should show 1).",
    ),
    _InstanceFamily(
        GaugeMetricFamily,
        "timeslice_orchestrator_term",
        "term",
        "The leadership term of this instance's latest election (terms only grow).",
    ),
    _InstanceFamily(
        CounterMetricFamily,
        "timeslice_orchestrator_elections",
        "elections",
        "Times this instance was elected leader.",
    ),
    _InstanceFamily(
        CounterMetricFamily,
        "timeslice_orchestrator_leadership_losses",
        "leader_losses",
        "Times this instance lost or gave up the leadership.",
    ),
    _InstanceFamily(
        CounterMetricFamily,
        "timeslice_agent_keys_gone_while_answering",
        "agents.answered_without_key",
        "Agents whose key in KV agents expired or was deleted while the agent still answered (not declared lost; "
        "its heartbeats failed, e.g. through a NATS election).",
    ),
    _InstanceFamily(
        CounterMetricFamily,
        "timeslice_agents_lost",
        "agents.lost",
        "Agents declared lost: their key gone and no answer to the orchestrator's probe.",
    ),
)

_DEQUEUE_LABELS: Final = {DequeueCode.TIMEOUT: "timeout", DequeueCode.LOST: "lost", DequeueCode.FAULTED: "faulted"}


def _dequeue_reason(code: DequeueCode | None) -> str | None:
    """A bounded label for a waiter's exit, from its code (the reason's words can be the client's own)."""
    if code is DequeueCode.NOT_WAITING:
        return None  # a renew or cancel from a job that was not waiting: nobody left the queue
    return _DEQUEUE_LABELS.get(code, "cancelled") if code is not None else "cancelled"


class _Hist:
    """Bucket counts (non-cumulative, the last one is +Inf) and the sum of the observed values."""

    __slots__ = ("counts", "edges", "sum")

    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1  # first edge >= value: Prometheus buckets are le
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        counts, total, out = list(self.counts), 0, []
        for edge, n in zip((*map(str, self.edges), "+Inf"), counts, strict=True):
            total += n
            out.append((edge, float(total)))
        return out


@dataclass(slots=True)
class _Group:
    acquire_wait: _Hist = field(default_factory=lambda: _Hist(DURATION_BUCKETS))
    handoff: _Hist = field(default_factory=lambda: _Hist(DURATION_BUCKETS))
    queue_depth: int = 0
    epoch: int = 0
    grants: int = 0
    releases: int = 0
    yield_requests: int = 0
    min_holds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    faults: int = 0
    expiries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_EXPIRY_REASONS, 0))
    dequeued: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DEQUEUE_REASONS, 0))
    last_epoch: int = 0
    vacated_ms: int | None = None  # stream time the holder left while a waiter was due (a handoff began)


class OrchestratorMetrics(Collector):
    """The orchestrator's metrics, collected into ``registry``; feed it with :meth:`applied` after every event."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._groups: dict[str, _Group] = {}
        self._events: dict[type[msgspec.Struct], int] = {}
        self._tags: dict[type[msgspec.Struct], str] = {}
        self.rejected = 0
        self.quarantined = 0  # groups whose record is unusable (not served; every other group is)
        self.leading = 0  # 1 while this instance leads
        self.term = 0  # the term of this instance's latest election
        self.elections = 0
        self.leader_losses = 0
        self.agents = AgentLiveness()  # what the agents' watch counts (_agents_watch)
        self.takeover_s: float | None = None  # the latest takeover: from the old lease gone to this one's election
        self.apply_latency = _Hist(APPLY_BUCKETS)
        self.registry.register(self)

    # ------------------------------------------------------------------ the hot path

    def leadership(self, name: str, value: float) -> None:
        """The leader election's hook (``_leadership.Leadership(metrics=...)``)."""
        if name == "elected":
            self.elections += 1
            self.term = int(value)
        elif name == "lost":
            self.leader_losses += 1
        elif name == "takeover_s":
            self.takeover_s = value

    def loaded(self, rec: GroupRecord) -> None:
        """A record read back at startup: the group's gauges start from it."""
        s = self._group(rec.group)
        s.last_epoch = s.epoch = rec.epoch
        s.queue_depth = _depth(rec)

    def applied(
        self, ev: InputEvent, old: GroupRecord, new: GroupRecord, actions: list[Action], now_ms: int, seconds: float
    ) -> None:
        """One event went through ``apply`` in ``seconds``, turning ``old`` into ``new`` with ``actions``."""
        t = type(ev)
        self._events[t] = self._events.get(t, 0) + 1
        self.apply_latency.observe(seconds)
        if new is old:
            return
        s = self._groups.get(new.group) or self._group(new.group)
        kept = reservation_change(old, new, now_ms)
        if kept is not None:
            s.min_holds[kept] += 1
            if kept in ("expired", "ended"):
                s.vacated_ms = now_ms  # the handoff to the next waiter begins now
        for a in actions:
            if not isinstance(a, Notify):
                continue
            n = a.notice
            if isinstance(n, Granted):
                if n.epoch > s.last_epoch:  # not the holder's re-acquire (same epoch)
                    s.last_epoch = n.epoch
                    s.grants += 1
                    s.acquire_wait.observe(n.waited_ms / 1000)
                    if s.vacated_ms is not None:
                        s.handoff.observe(max(0, now_ms - s.vacated_ms) / 1000)
                        s.vacated_ms = None
            elif isinstance(n, YieldRequested):
                s.yield_requests += 1
            elif isinstance(n, Released):
                s.releases += 1
                s.vacated_ms = now_ms
            elif isinstance(n, Revoked):
                if n.code is not RevokeCode.CLAIM_REFUSED:  # a refused claim ends no lease
                    s.expiries["lease_expired" if n.code is RevokeCode.LEASE_EXPIRED else "grant_unconfirmed"] += 1
                s.vacated_ms = now_ms
            elif isinstance(n, Dequeued):
                why = _dequeue_reason(n.code)
                if why is not None:
                    s.dequeued[why] += 1
        if s.vacated_ms is not None and new.holder is None and new.switch is None and not (new.trailing and new.queue):
            s.vacated_ms = None  # nobody was due: the group went idle, no handoff is under way
        if new.faulted:
            s.faults += len(new.faulted.keys() - old.faulted.keys())
        s.epoch = new.epoch
        s.queue_depth = _depth(new)

    def _group(self, group: str) -> _Group:
        s = self._groups.get(group)
        if s is None:
            s = self._groups[group] = _Group()
        return s

    # ------------------------------------------------------------------ scrapes

    def describe(self) -> Iterator[Metric]:
        return self._families([], {})

    def collect(self) -> Iterator[Metric]:
        events = list(self._events.items())
        for t, _ in events:
            if t not in self._tags:
                self._tags[t] = str(t.__struct_config__.tag)
        return self._families(list(self._groups.items()), {self._tags[t]: n for t, n in events})

    def _families(self, groups: list[tuple[str, _Group]], events: dict[str, int]) -> Iterator[Metric]:
        wait = HistogramMetricFamily(
            "timeslice_acquire_wait_seconds",
            "Time from a job's acquire to its grant (the grant's waited_ms).",
            labels=["group"],
        )
        handoff = HistogramMetricFamily(
            "timeslice_handoff_seconds",
            "Time from the holder leaving (release, cancel or revoke) to the next "
            "job's grant, snapshots and restores included; stream timestamps, millisecond resolution.",
            labels=["group"],
        )
        depth = GaugeMetricFamily(
            "timeslice_queue_depth", "Jobs waiting for the group, the one being switched to included.", labels=["group"]
        )
        epoch = GaugeMetricFamily(
            "timeslice_group_epoch", "The group's current epoch (fencing token).", labels=["group"]
        )
        grants = CounterMetricFamily("timeslice_grants", "Grants that raised the epoch.", labels=["group"])
        releases = CounterMetricFamily(
            "timeslice_releases", "Holds ended by the holder (release, or cancel after grant).", labels=["group"]
        )
        expiries = CounterMetricFamily(
            "timeslice_lease_expiries",
            "Holds revoked by the orchestrator: reason lease_expired (the holder stopped "
            "renewing) or grant_unconfirmed (the grantee never confirmed).",
            labels=["group", "reason"],
        )
        cancelled = CounterMetricFamily(
            "timeslice_waiters_cancelled",
            "Waiters that left the queue without a grant, by reason: cancelled, "
            "timeout, lost (stopped renewing), faulted.",
            labels=["group", "reason"],
        )
        faults = CounterMetricFamily("timeslice_faults", "Jobs marked faulted in the group.", labels=["group"])
        yields = CounterMetricFamily(
            "timeslice_yield_requests",
            "Holders asked to yield: held past the group's quantum while a job waited.",
            labels=["group"],
        )
        min_holds = CounterMetricFamily(
            "timeslice_min_holds",
            "A group's minimum hold, by outcome: kept (a job granted through a switch released before it while others "
            "waited, so the group was kept for it), reacquired (it took the group back within the window, without a "
            "switch), expired (the window ended: the next waiter is served), ended (it faulted or left a node).",
            labels=["group", "outcome"],
        )
        for g, s in groups:
            wait.add_metric([g], s.acquire_wait.buckets(), s.acquire_wait.sum)
            handoff.add_metric([g], s.handoff.buckets(), s.handoff.sum)
            depth.add_metric([g], s.queue_depth)
            epoch.add_metric([g], s.epoch)
            grants.add_metric([g], s.grants)
            releases.add_metric([g], s.releases)
            faults.add_metric([g], s.faults)
            yields.add_metric([g], s.yield_requests)
            for outcome, n in list(s.min_holds.items()):
                min_holds.add_metric([g, outcome], n)
            for reason, n in list(s.expiries.items()):
                expiries.add_metric([g, reason], n)
            for reason, n in list(s.dequeued.items()):
                cancelled.add_metric([g, reason], n)
        applied = CounterMetricFamily(
            "timeslice_events_applied", "Events applied through the core, by event type.", labels=["type"]
        )
        for tag, n in sorted(events.items()):
            applied.add_metric([tag], n)
        latency = HistogramMetricFamily(
            "timeslice_apply_seconds",
            "Time spent in the pure core per event.",
            buckets=self.apply_latency.buckets(),
            sum_value=self.apply_latency.sum,
        )
        yield from (
            wait,
            handoff,
            depth,
            epoch,
            grants,
            releases,
            yields,
            min_holds,
            expiries,
            cancelled,
            faults,
            applied,
            *(f.kind(f.name, f.doc, value=attrgetter(f.attr)(self)) for f in _INSTANCE_FAMILIES),
            latency,
        )


def _depth(rec: GroupRecord) -> int:
    return len(rec.queue) + (1 if rec.switch is not None and rec.switch.to is not None else 0)
