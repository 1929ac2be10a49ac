"""Which Kubernetes pod (and which of its containers) a process belongs to, from ``/proc/<pid>/cgroup``.

The kubelet puts every pod in a cgroup of its own and the container runtime every container in one below it, so a
process's cgroup path names its pod's UID and its container's id. The layouts met in practice:

* cgroupfs driver (cgroup v1 and v2): ``/kubepods/pod<uid>/<cid>``, ``/kubepods/burstable/pod<uid>/<cid>``,
  ``/kubepods/besteffort/pod<uid>/<cid>`` (the UID with dashes, the container id bare);
* systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/<scope>`` with the
  UID's dashes written as underscores, and the container's scope ``cri-containerd-<cid>.scope`` (containerd),
  ``crio-<cid>.scope`` (CRI-O; its ``crio-conmon-<cid>.scope`` monitor is no container process) or
  ``docker-<cid>.scope`` (cri-dockerd);
* anything before ``kubepods`` (kind's ``/kubelet/kubepods/…``, a cgroup namespace's ``/../..``) or after the
  container's cgroup (sub-cgroups a container made) does not matter.

A cgroup v1 file has one line per hierarchy (``<id>:<controllers>:<path>``), a v2 file one ``0::<path>`` line, a
hybrid one both. A process is a pod's when its lines name one pod; lines naming two different pods (which no
runtime writes) make it nobody's, and lines naming two containers leave its container unknown: the agent then does
not act on it. Garbage never raises: it is no pod's. Pure but for :func:`read_pod_cgroup`, which reads one bounded
file under a proc root (the real ``/proc``, or a fake one in tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_CGROUP_BYTES", "PodCgroup", "parse_cgroup", "pod_of_path", "read_pod_cgroup"]

MAX_CGROUP_BYTES: Final = 64 * 1024  # of one /proc/<pid>/cgroup (a v1 file with every controller is < 2 KiB)
_MAX_LINES: Final = 256
_MAX_SEGMENTS: Final = 64

_UID: Final = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
# cgroupfs: "pod<uid>"; systemd: "kubepods[-<qos>]-pod<uid_with_underscores>.slice".
_POD_SEGMENT: Final = re.compile(rf"pod(?P<a>{_UID})|kubepods(?:-[a-z]+)?-pod(?P<b>{_UID})\.slice")
_CID: Final = r"[0-9a-f]{12,128}"
# A container's cgroup: a bare id (cgroupfs) or a runtime's systemd scope.
_CONTAINER_SEGMENT: Final = re.compile(rf"(?:(?:cri-containerd|crio|docker)-)?(?P<cid>{_CID})(?:\.scope)?")


@dataclass(frozen=True, slots=True)
class PodCgroup:
    """A process's pod (its UID as the API writes it: lower case, with dashes) and container (its runtime id, as in
    the pod's ``containerStatuses[].containerID`` after ``<runtime>://``; None: in the pod but in no container's
    cgroup, such as a runtime's monitor process, or unknown)."""

    pod_uid: str
    container_id: str | None


def pod_of_path(path: str) -> PodCgroup | None:
    """The pod (and container) a cgroup path names; None when it names none."""
    segments = path.split("/")
    if len(segments) > _MAX_SEGMENTS:
        return None
    for i, seg in enumerate(segments):
        m = _POD_SEGMENT.fullmatch(seg)
        if m is None:
            continue
        uid = (m.group("a") or m.group("b")).replace("_", "-")  # a static pod's UID is a hash: no dashes at all
        cid = None
        if i + 1 < len(segments):
            c = _CONTAINER_SEGMENT.fullmatch(segments[i + 1])
            cid = c.group("cid") if c is not None else None
        return PodCgroup(uid, cid)
    return None


def parse_cgroup(text: str) -> PodCgroup | None:
    """The pod of a ``/proc/<pid>/cgroup`` file's text (see the module doc); None when it names none or two."""
    found: list[PodCgroup] = []
    for line in text.splitlines()[:_MAX_LINES]:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        pod = pod_of_path(parts[2].strip())
        if pod is not None:
            found.append(pod)
    if not found:
        return None
    if len({p.pod_uid for p in found}) != 1:
        return None  # two pods: nobody's
    containers = {p.container_id for p in found if p.container_id is not None}
    pod_uid = found[0].pod_uid
    if len(containers) != 1:
        return PodCgroup(pod_uid, None)
    return PodCgroup(pod_uid, containers.pop())


def read_pod_cgroup(proc_root: str, pid: int) -> PodCgroup | None:
    """The pod of process ``pid`` under ``proc_root``; None when it is in none, gone, or its file is unreadable."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as f:
            data = f.read(MAX_CGROUP_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_CGROUP_BYTES:
        return None
    return parse_cgroup(data.decode("utf-8", errors="replace"))
