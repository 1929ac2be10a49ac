"""RL phase profiles, the per-job schedules drawn from them, and the figures computed from a run's log.

Shared by both modes of trace_replay.py, so the real and the simulated run are judged by the same code:

* a *profile* (``bench/profiles/<name>.json``) lists the phases of one training step, each on the
  ``accelerator`` (wrapped in acquire/release, as ``on_accelerators`` wraps a GPU phase) or on the
  ``cpu``, with a duration drawn uniformly from ``[min_s, max_s]``; a phase may name the ``pools`` (groups) it
  holds, for a job spread over several pools (a disaggregated trainer and sampler: ``bench/_trace_pools.py``); a
  profile without them runs on one group, as before. A profile may also carry the ``published`` figures it is
  modelled on and named switch-cost models per pool (``costs``);
* a *switch profile* gives the bytes a job keeps on an accelerator and the offload/restore bandwidth:
  a snapshot takes ``bytes / offload``, a restore ``bytes / restore`` (modelled seconds);
* a job's *schedule* is its list of steps, each a list of (phase, on accelerator?, seconds), drawn
  with a seed per job, so the same job follows the same durations in every mode;
* a run's *log* is, per job, the times (modelled seconds from the start) at which it asked for the
  accelerators (``acquire``), got them (``grant``), gave them back (``release``), and finished
  (``end``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

PROFILES = Path(__file__).resolve().parent / "profiles"


class PhaseSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    on: Literal["accelerator", "cpu"]
    min_s: float
    max_s: float
    pools: tuple[str, ...] = ()  # the groups an accelerator phase holds, all at once; () on one group's profile
    # A CPU phase that waits for the step's input from a producer running beside the job (a fully-async job's own
    # rollout GPU): the producer makes one input per drawn duration, from the start, at most ``Profile.staleness``
    # inputs ahead of the job; the job waits here until its step's input is ready (multi-pool simulation only; the
    # one-group simulation takes the drawn duration as the wait).
    paced: bool = False


class PoolCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One pool's switch cost under a cost model: given times, or ``bytes_per_job`` at ``gb_per_s`` each way."""

    snapshot_s: float | None = None
    restore_s: float | None = None
    bytes_per_job: int = 0
    gb_per_s: float = 0.0

    @property
    def snapshot(self) -> float:
        if self.snapshot_s is not None:
            return self.snapshot_s
        return self.bytes_per_job / (self.gb_per_s * 1e9) if self.gb_per_s else 0.0

    @property
    def restore(self) -> float:
        if self.restore_s is not None:
            return self.restore_s
        return self.bytes_per_job / (self.gb_per_s * 1e9) if self.gb_per_s else 0.0


class CostModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    description: str
    pools: dict[str, PoolCost]


class Published(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The published figures a profile is modelled on (None: not published). ``duty_pool``: the pool the duty
    figures are of, or ``"mean"`` for the mean over the pools (the share of GPU time held)."""

    source: str
    steps_per_job: int  # the steps each job takes in the modelled run (chosen, see the description)
    duty_pool: str
    duty_solo: float
    duty_shared: float
    swaps: int
    checkpoint_median_s: float
    restore_median_s: float
    solo_s: float | None = None
    shared_s: float | None = None


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    phases: tuple[PhaseSpec, ...]
    published: Published | None = None
    costs: dict[str, CostModel] = msgspec.field(default_factory=dict)
    staleness: int = 0  # how many inputs a paced phase's producer may run ahead of the job

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools the profile's phases hold, sorted; () for a one-group profile."""
        return tuple(sorted({p for ph in self.phases for p in ph.pools}))


class SwitchProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    bytes_per_job: int
    offload_gb_per_s: float
    restore_gb_per_s: float

    @property
    def snapshot_s(self) -> float:
        return self.bytes_per_job / (self.offload_gb_per_s * 1e9)

    @property
    def restore_s(self) -> float:
        return self.bytes_per_job / (self.restore_gb_per_s * 1e9)


Step = list[tuple[str, bool, float]]  # (phase name, on the accelerator, modelled seconds)


def resolve(name_or_path: str) -> Path:
    """A profile by name (``grpo_sync``) or path."""
    p = Path(name_or_path)
    return p if p.suffix == ".json" else PROFILES / f"{name_or_path}.json"


def load_profile(name_or_path: str) -> Profile:
    return msgspec.json.decode(resolve(name_or_path).read_bytes(), type=Profile)


def load_switch(name_or_path: str) -> SwitchProfile:
    return msgspec.json.decode(resolve(name_or_path).read_bytes(), type=SwitchProfile)


def schedule(profile: Profile, steps: int, seed: int) -> list[Step]:
    rng = random.Random(seed)
    return [
        [(ph.name, ph.on == "accelerator", rng.uniform(ph.min_s, ph.max_s)) for ph in profile.phases]
        for _ in range(steps)
    ]


ONE_POOL = "group"  # the pool of a one-group profile's accelerator phases in the multi-pool simulation
# (phase name, pools held (none: off them), modelled seconds, paced: a wait for a producer's input)
PoolStep = list[tuple[str, tuple[str, ...], float, bool]]


def pool_schedule(profile: Profile, steps: int, seed: int) -> list[PoolStep]:
    """As :func:`schedule` (the same draws for the same seed), each phase with the pools it holds (a one-group
    profile's accelerator phases: :data:`ONE_POOL`)."""
    rng = random.Random(seed)
    return [
        [
            (
                ph.name,
                (tuple(sorted(ph.pools)) or (ONE_POOL,)) if ph.on == "accelerator" else (),
                rng.uniform(ph.min_s, ph.max_s),
                ph.paced and ph.on == "cpu",
            )
            for ph in profile.phases
        ]
        for _ in range(steps)
    ]


def accel_seconds(sched: list[Step]) -> float:
    return sum(s for step in sched for _, accel, s in step if accel)


Log = dict[str, list[tuple[str, float]]]  # job -> [(kind, modelled seconds)], kind: acquire/grant/release/end


def switches_between(
    grants: Sequence[tuple[float, str, float]], releases: Sequence[tuple[float, str]]
) -> list[tuple[float, float, str]]:
    """Each grant (time, job, its acquire's time) that followed another job's release (time, job), as
    (that release, or the acquire if later; the grant; the job), in the grants' order."""
    ordered = sorted(releases)
    out: list[tuple[float, float, str]] = []
    ri = 0
    last: tuple[float, str] | None = None
    for t, job, acq in sorted(grants):
        while ri < len(ordered) and ordered[ri][0] <= t:
            last = ordered[ri]
            ri += 1
        if last is not None and last[1] != job:
            out.append((max(last[0], acq), t, job))
    return out


def figures(log: Log, steps: int) -> dict[str, Any]:
    """Wall time, throughput, accelerator duty cycle, and the share of time lost to switching.

    * duty cycle: time some job held the accelerators (grant → release) over the wall time;
    * switching: for each grant that followed another job's release, the time from that release (or
      the acquire, if later) to the grant: the accelerators were idle while state moved and the bus
      passed the decision on. Its share is over the wall time.
    """
    wall = max((t for ev in log.values() for k, t in ev if k == "end"), default=0.0)
    held = 0.0
    grants: list[tuple[float, str, float]] = []  # (grant time, job, its acquire time)
    releases: list[tuple[float, str]] = []
    for job, ev in log.items():
        acq = 0.0
        g: float | None = None
        for k, t in ev:
            if k == "acquire":
                acq = t
            elif k == "grant":
                g = t
                grants.append((t, job, acq))
            elif k == "release" and g is not None:
                held += t - g
                releases.append((t, job))
                g = None
    switches = [t - start for start, t, _ in switches_between(grants, releases)]
    total_steps = steps * len(log)
    return {
        "jobs": len(log),
        "steps_per_job": steps,
        "wall_s": wall,
        "throughput_steps_per_h": total_steps / wall * 3600 if wall else 0.0,
        "duty_cycle": held / wall if wall else 0.0,
        "switches": len(switches),
        "switching_s": sum(switches),
        "switching_share": sum(switches) / wall if wall else 0.0,
        "switch_median_s": sorted(switches)[len(switches) // 2] if switches else 0.0,
    }


def compare(alone: list[dict[str, Any]], shared: dict[str, Any]) -> dict[str, Any]:
    """A shared run against its jobs run alone (each alone, then back to back)."""
    k = shared["jobs"]
    back_to_back = sum(a["wall_s"] for a in alone[:k])
    alone_tp = sum(a["throughput_steps_per_h"] for a in alone[:k]) / k
    return {
        "back_to_back_wall_s": back_to_back,
        "speedup_vs_back_to_back": back_to_back / shared["wall_s"] if shared["wall_s"] else 0.0,
        "throughput_vs_one_alone": shared["throughput_steps_per_h"] / alone_tp if alone_tp else 0.0,
        "alone_duty_cycle": sum(a["duty_cycle"] for a in alone[:k]) / k,
    }
