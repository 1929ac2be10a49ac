"""Jobs found through their pods (Kubernetes, ``AgentConfig.pods``): every ``pod_scan_s``, and as soon as a watch of
the API from the last listing reports a change (at most one scan per :data:`_MIN_SCAN_GAP_S`), the agent lists this
node's pods labelled ``timeslice.io/job-id`` (``_pods``), finds their processes by the cgroups of the proc root
(``_cgroups``), and keeps a registration per pod current, as if each pod's processes had bound themselves: the
node's default backend (``cuda`` where the driver allows), the job id and group from the labels.

* **Which processes.** Those of the pod's containers (the ids its status lists: never its sandbox, nor a runtime's
  monitor), never pid <= 1 nor the agent itself; with NVML, only those NVML lists on a GPU (they hold device
  memory), plus those already registered (a checkpointed process leaves NVML's list); without NVML every process of
  the pod's containers, said once in the log. Their owner (``ProcessOwner``) is the oldest of them; every one must
  run as its uid (real, effective and saved) or a uid the agent allows (``--allow-uid``, ``--allow-other-uids``),
  else it is left out and logged. The start times are stored, so ``ProcessGuard.verify`` and ``may_act`` keep their
  rules when a backend acts.
* **Keeping it current.** A new labelled pod with such processes: its job is registered (the pod's registration is a
  part of the job, its ``channel`` ``pod-<uid>``, so one job may span several pods); changed processes: that part is
  registered again; the pod gone or without processes: the part leaves, and the job with its last part. Every
  change waits for the job's lock, so never while an operation moves the job (and never for long: the next scan
  tries again). A part is added or changed only while the job is IDLE or RUNNING, never to a saved or faulted job
  (its processes stay checkpointed until restored); a part whose pod is gone leaves in any state.
* **A job that registered itself** (a handler, a bind: any registration not from a pod) keeps its registration:
  discovery never adds to it, and drops its own parts of that job (while the job is not saved).
* **Untrusted.** The pod list is checked here, whatever source gave it: a job or group label that is no valid id
  skips the pod, logged once and counted (``timeslice_agent_refused_total{source="pods"}``). The label is the trust
  anchor: whoever may create a labelled pod on this node may bind that job here (docs/security.md).
* **Bounded.** The API call has its timeouts (``_pods``); /proc and NVML are read in a thread; one failed scan is
  logged and counted (``timeslice_agent_task_errors_total{task="pod_scan"}``) and the next one tries again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final

from timeslice_client.protocol import JobState, ProcessOwner, RegisterJob

from ._cgroups import read_pod_cgroup
from ._config import AgentConfig
from ._job_book import JobBook
from ._job_locks import JobLocks
from ._job_parts import views, without_channel
from ._nvml import GpuSource
from ._ownership import ProcessGuard, ProcFS
from ._pods import KubePodSource, Pod, PodSource, WatchablePodSource, is_pod_channel, pod_channel
from ._requests import Requests, log_refusal
from ._untrusted import MAX_PIDS, PID_MAX, Refusal, Refused, check_id
from .backends import BackendUnavailable, node_default_backend
from .metrics import AgentMetrics

__all__ = [
    "PodDiscovery",
    "PodProcess",
    "Selection",
    "pod_source_for",
    "scan_processes",
    "select",
]

log = logging.getLogger("timeslice.agent")

_MIN_SCAN_GAP_S: Final = 0.5  # the least time between two scans (a burst of pod events is one scan, not many)
_MAX_SAID: Final = 4096  # things said once, remembered (then said again)
_CHANGEABLE: Final = (JobState.IDLE, JobState.RUNNING)


def pod_source_for(config: AgentConfig, node: str, metrics: AgentMetrics) -> KubePodSource:
    """The Kubernetes API ``config`` names (in-cluster unless ``pod_api``); raises ``PodListError`` or ``ValueError``
    when it cannot be used, so a misconfigured agent says so at start."""

    def refused(code: Refusal) -> None:
        metrics.refusal("pods", code)

    node_name, timeout_s = config.pod_node_name or node, config.pod_api_timeout_s
    if config.pod_api is None:
        return KubePodSource.in_cluster(node_name, timeout_s=timeout_s, refused=refused)
    return KubePodSource(
        config.pod_api,
        node_name,
        token_file=config.pod_token_file,
        ca_file=config.pod_ca_file,
        timeout_s=timeout_s,
        refused=refused,
    )


@dataclass(frozen=True, slots=True)
class PodProcess:
    """A process of a pod, as the proc root shows it."""

    pid: int
    container_id: str | None
    start: int  # clock ticks after boot
    uids: tuple[int, ...]  # real, effective, saved (and fs)
    gid: int


def scan_processes(proc: ProcFS, pod_uids: Collection[str]) -> dict[str, list[PodProcess]]:
    """The processes of the proc root in the pods ``pod_uids``, by pod UID (blocking: run it in a thread)."""
    if not pod_uids:
        return {}
    try:
        names = os.listdir(proc.root)
    except OSError:
        return {}
    out: dict[str, list[PodProcess]] = {}
    for name in names:
        if not name.isdigit() or not 1 < (pid := int(name)) <= PID_MAX:
            continue
        where = read_pod_cgroup(proc.root, pid)
        if where is None or where.pod_uid not in pod_uids:
            continue
        st, uids, gids = proc.stat(pid), proc.status(pid, "Uid"), proc.status(pid, "Gid")
        if st is None or uids is None or len(uids) < 3 or not gids:
            continue  # gone meanwhile, or unreadable
        out.setdefault(where.pod_uid, []).append(PodProcess(pid, where.container_id, st.start, uids, gids[0]))
    return out


@dataclass(frozen=True, slots=True)
class Selection:
    """The processes of a pod the agent binds to its job (sorted), their owner, and those left out for their uid."""

    pids: tuple[int, ...]
    owner: ProcessOwner
    strangers: tuple[int, ...]


def select(
    pod: Pod,
    found: Iterable[PodProcess],
    *,
    on_gpu: frozenset[int] | None,
    kept: Collection[int],
    own_pid: int,
    allowed_uids: Collection[int] = (),
    any_uid: bool = False,
) -> Selection | None:
    """Which of ``found`` (the pod's processes) the agent binds (see the module doc); None: none. ``on_gpu``: the pids
    NVML lists (None: no NVML); ``kept``: those registered for the pod now."""
    candidates = [
        p
        for p in found
        if p.container_id is not None
        and p.container_id in pod.containers
        and p.pid > 1
        and p.pid != own_pid
        and (on_gpu is None or p.pid in on_gpu or p.pid in kept)
    ]
    if not candidates:
        return None
    oldest = min(candidates, key=lambda p: (p.start, p.pid))
    uid = oldest.uids[0]
    allowed = {uid, *allowed_uids}
    ok = [p for p in candidates if any_uid or all(u in allowed for u in p.uids[:3])]
    strangers = tuple(sorted(p.pid for p in candidates if p not in ok))
    if not ok:
        return None
    chosen = sorted(sorted(ok, key=lambda p: (p.start, p.pid))[:MAX_PIDS], key=lambda p: p.pid)
    owner = ProcessOwner(
        pid=oldest.pid, uid=uid, gid=oldest.gid, start=oldest.start, pid_starts=tuple(p.start for p in chosen)
    )
    return Selection(tuple(p.pid for p in chosen), owner, strangers)


@dataclass(frozen=True, slots=True)
class _Wanted:
    pod: Pod
    group: str
    selection: Selection


def _short(text: str, limit: int = 200) -> str:
    """A string from the pod list, cut for a log line."""
    return text if len(text) <= limit else f"{text[:limit]}…({len(text)} chars)"


class PodDiscovery:
    """The discovery loop of one agent (see the module doc): ``await run(stop)`` in the agent's TaskGroup."""

    def __init__(
        self,
        node: str,
        source: PodSource,
        *,
        config: AgentConfig,
        book: JobBook,
        locks: JobLocks,
        requests: Requests,
        guard: ProcessGuard,
        metrics: AgentMetrics,
        gpus: GpuSource | None,
        nvml_error: str | None = None,
    ) -> None:
        self.node, self._source, self._config = node, source, config
        self._book, self._locks, self._requests, self._guard, self._metrics = book, locks, requests, guard, metrics
        self._gpus, self._nvml_error = gpus, nvml_error
        self._lock_wait_s = min(1.0, config.pod_scan_s)  # a busy job waits for the next scan, not longer
        self._said: collections.OrderedDict[tuple[str, ...], None] = collections.OrderedDict()
        self.scans = 0  # completed scans (tests wait on it)

    # ------------------------------------------------------------------ the loop

    async def run(self, stop: asyncio.Event) -> None:
        if self._gpus is None:
            log.info(
                "pod discovery without NVML (%s): every process of a labelled pod's containers is bound to its "
                "job, not only those holding device memory",
                self._nvml_error or "no GPU source",
                extra={"node": self.node},
            )
        while not stop.is_set():
            try:
                await self.scan()
            except Exception as exc:  # one failed scan never ends the loop (nor the agent): the next one tries again
                self._metrics.task_error("pod_scan")
                log.warning(
                    "pod scan failed: %s; trying again in %g s", exc, self._config.pod_scan_s, extra={"node": self.node}
                )
            await self._pause(stop)

    async def _pause(self, stop: asyncio.Event) -> None:
        """Until the next scan: ``pod_scan_s``, cut short when the source reports a change (a watch of the API from
        the last listing: a pod added, changed or deleted is seen within :data:`_MIN_SCAN_GAP_S`), or ``stop``."""
        interval = self._config.pod_scan_s
        floor = min(interval, _MIN_SCAN_GAP_S)  # scans never come closer than this, whatever the watch says
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(floor):
                await stop.wait()
        if stop.is_set() or interval <= floor:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval - floor):
                if not isinstance(self._source, WatchablePodSource):
                    await stop.wait()
                    return
                stopped = asyncio.ensure_future(stop.wait())
                changed = asyncio.ensure_future(self._source.wait_change(interval - floor))
                try:
                    await asyncio.wait((stopped, changed), return_when=asyncio.FIRST_COMPLETED)
                    if changed.done() and not stopped.done():
                        if changed.exception() is not None:
                            log.debug("pod watch failed: %s", changed.exception(), extra={"node": self.node})
                        if changed.exception() is not None or not changed.result():
                            await stopped  # nothing changed: the rest of the interval
                finally:
                    for task in (stopped, changed):
                        task.cancel()
                    await asyncio.gather(stopped, changed, return_exceptions=True)

    async def scan(self) -> None:
        """One pass: list, find, and bring every pod's registration up to date."""
        pods = await self._source.list_pods()
        backend = node_default_backend(self._config.default_backend)
        if backend is None:
            self._once(
                ("node", "no-backend"),
                "labelled pods are left to the lock alone: this node's default "
                "backend (--default-backend %s) moves nothing",
                self._config.default_backend,
            )
            self.scans += 1
            return
        usable: list[tuple[Pod, str, str]] = []
        for pod in pods:
            if (labels := self._labels(pod)) is not None:
                usable.append((pod, *labels))
        found = await asyncio.to_thread(scan_processes, self._guard.proc, {p.uid for p, _, _ in usable})
        on_gpu = await asyncio.to_thread(self._on_gpu)
        registered = self._registered_pids()
        wanted: dict[str, list[_Wanted]] = {}
        for pod, job, group in usable:
            sel = select(
                pod,
                found.get(pod.uid, ()),
                on_gpu=on_gpu,
                kept=registered.get(pod_channel(pod.uid), ()),
                own_pid=self._guard.own_pid,
                allowed_uids=self._guard.allowed_uids,
                any_uid=self._guard.any_uid,
            )
            if sel is not None and sel.strangers:
                self._once(
                    (pod.uid, "uid", *map(str, sel.strangers)),
                    "pod %s: processes %s run as another uid than "
                    "its processes' owner (uid %d, pid %d) and are left alone (--allow-uid UID allows one)",
                    pod.ref,
                    list(sel.strangers),
                    sel.owner.uid,
                    sel.owner.pid,
                    job=job,
                )
            if sel is not None:
                wanted.setdefault(job, []).append(_Wanted(pod, group, sel))
        ours = {ctx.job for ctx in self._book.jobs.values() if any(is_pod_channel(v.channel) for v in views(ctx))}
        for job in sorted(set(wanted) | ours):
            try:
                await self._reconcile(job, wanted.get(job, []), backend)
            except Exception as exc:  # one job's trouble never holds up the others
                self._metrics.task_error("pod_scan")
                log.warning(
                    "keeping the pods' registration of the job current failed: %r",
                    exc,
                    extra={"node": self.node, "job": job},
                )
        self._forget({p.uid for p in pods} | set(wanted) | {"node"})
        self.scans += 1

    def _labels(self, pod: Pod) -> tuple[str, str] | None:
        """The pod's job and group, when its labels are valid ids (else logged once, counted, None)."""
        if pod.phase in ("Succeeded", "Failed"):
            return None
        try:
            job = check_id("job", pod.job)
            group = check_id("group", pod.group) if pod.group is not None else self._config.pod_default_group
        except Refused as exc:
            if self._first((pod.uid, "label")):  # counted once per pod, not once per scan
                log_refusal(self._metrics, self.node, "pods", exc.code, f"pod {_short(pod.ref)} skipped: {exc}")
            return None
        if group is None:
            self._once(
                (pod.uid, "group"),
                "pod %s (job %s) skipped: it has no timeslice.io/group label and the agent no --pod-default-group",
                pod.ref,
                job,
            )
            return None
        return job, group

    def _on_gpu(self) -> frozenset[int] | None:
        """The pids NVML lists on any GPU (a compute process holds device memory); None without NVML. An NVML
        error fails the scan: binding every process instead would act on processes that hold no GPU state."""
        if self._gpus is None:
            return None
        return frozenset(p.pid for p in self._gpus.processes())

    def _registered_pids(self) -> dict[str, tuple[int, ...]]:
        return {
            v.channel: v.pids
            for ctx in self._book.jobs.values()
            for v in views(ctx)
            if v.channel is not None and is_pod_channel(v.channel)
        }

    # ------------------------------------------------------------------ one job

    async def _reconcile(self, job: str, wanted: list[_Wanted], backend: str) -> None:
        if job in self._requests.leaving:  # the job's own unregistration waits for an operation: later
            return
        held = False
        try:
            async with asyncio.timeout(self._lock_wait_s) as waited, self._locks.hold(job):
                waited.reschedule(None)  # the bound is on the wait for the lock; the writes have their own
                held = True
                await self._apply(job, wanted, backend)
        except TimeoutError:
            if held:
                raise
            log.debug("job busy; its pods are looked at again next scan", extra={"node": self.node, "job": job})

    async def _apply(self, job: str, wanted: list[_Wanted], backend: str) -> None:
        ctx = self._book.jobs.get(job)
        if ctx is not None:
            mine = [v.channel for v in views(ctx) if is_pod_channel(v.channel)]
            if len(mine) < len(views(ctx)):  # the job registered itself: its registration stays the job's
                if mine and ctx.state in _CHANGEABLE:
                    for channel in mine:
                        if channel is not None and (rest := without_channel(ctx, channel)) is not None:
                            ctx = rest
                    await self._book.save(ctx)
                    log.info(
                        "the job registered itself: its pods' registration (%d) is dropped",
                        len(mine),
                        extra={"node": self.node, "job": job, "group": ctx.group},
                    )
                else:
                    self._once(
                        (job, "self"),
                        "job %s registered itself on this node: its pods are left to that registration",
                        job,
                    )
                return
            channels = {pod_channel(w.pod.uid) for w in wanted}
            for channel in mine:
                current = self._book.jobs.get(job)
                if channel is None or channel in channels or current is None:
                    continue
                rest = without_channel(current, channel)
                if rest is None:
                    await self._book.unregister(current, f"its pod ({channel}) is gone, or has no processes left")
                else:
                    await self._book.save(rest)
                    log.info("a pod of the job is gone (%s)", channel, extra={"node": self.node, "job": job})
            ctx = self._book.jobs.get(job)
            if ctx is not None and ctx.state not in _CHANGEABLE:
                return  # saved (its processes stay checkpointed until restored) or faulted: changed once it runs
        for w in wanted:
            await self._register(job, w, backend)

    async def _register(self, job: str, w: _Wanted, backend: str) -> None:
        channel, sel = pod_channel(w.pod.uid), w.selection
        current = self._book.jobs.get(job)
        part = next((v for v in views(current) if v.channel == channel), None) if current is not None else None
        if part is not None and part.pids == sel.pids and part.owner == sel.owner:
            return
        req = RegisterJob(group=w.group, job=job, backends=(backend,), pids=sel.pids, channel=channel)
        try:
            reply = await self._book.register(req, sel.owner)
        except Refused as exc:
            if self._first((w.pod.uid, "refused", str(exc.code))):
                log_refusal(
                    self._metrics,
                    self.node,
                    "pods",
                    exc.code,
                    f"pod {_short(w.pod.ref)} not registered: {exc}",
                    job=job,
                )
            return
        except (BackendUnavailable, ValueError) as exc:
            self._once((w.pod.uid, "unusable"), "pod %s: not registered: %s", w.pod.ref, exc, job=job)
            return
        if not reply.ok:
            self._once((w.pod.uid, "not-ok"), "pod %s: not registered: %s", w.pod.ref, reply.error, job=job)
            return
        log.info(
            "pod %s bound to its job: pids %s (owner pid %d, uid %d)",
            w.pod.ref,
            list(sel.pids)[:8],
            sel.owner.pid,
            sel.owner.uid,
            extra={"node": self.node, "job": job, "group": w.group},
        )

    # ------------------------------------------------------------------ said once

    def _first(self, key: tuple[str, ...]) -> bool:
        """Whether ``key`` comes up for the first time (a pod's trouble stays until the pod changes: it is logged
        once, not every scan)."""
        if key in self._said:
            return False
        self._said[key] = None
        while len(self._said) > _MAX_SAID:
            self._said.popitem(last=False)
        return True

    def _once(self, key: tuple[str, ...], message: str, *args: object, job: str | None = None) -> None:
        """Log a warning the first time ``key`` comes up."""
        if self._first(key):
            extra = {"node": self.node, **({"job": job} if job else {})}
            log.warning(message, *(_short(a) if isinstance(a, str) else a for a in args), extra=extra)

    def _forget(self, present: Collection[str]) -> None:
        """Forget what was said of pods (and jobs) no longer here: a pod that comes back is said again."""
        for key in [k for k in self._said if k[0] not in present]:
            del self._said[key]
