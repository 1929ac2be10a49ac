"""``_cgroups``: a process's pod and container from its ``/proc/<pid>/cgroup``, for the layouts of the cgroupfs and
systemd drivers, cgroup v1 and v2, containerd, CRI-O and cri-dockerd; garbage is nobody's and never raises."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from timeslice_agent._cgroups import MAX_CGROUP_BYTES, PodCgroup, parse_cgroup, pod_of_path, read_pod_cgroup

UID = "1f4a2b3c-5d6e-4f70-8a9b-0c1d2e3f4a5b"
CID = "0123456789abcdef" * 4
U_ = UID.replace("-", "_")


@pytest.mark.parametrize(
    ("text", "cid"),
    [
        # cgroup v1, cgroupfs driver: guaranteed, burstable, besteffort
        (f"12:memory:/kubepods/pod{UID}/{CID}\n11:cpu,cpuacct:/kubepods/pod{UID}/{CID}\n", CID),
        (f"4:pids:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n", CID),
        (f"3:devices:/kubepods/besteffort/pod{UID}/{CID}\n", CID),
        # cgroup v1, systemd driver: containerd, CRI-O, cri-dockerd
        (
            f"1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/"
            f"cri-containerd-{CID}.scope\n",
            CID,
        ),
        (
            f"9:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/crio-{CID}.scope\n",
            CID,
        ),
        (f"7:cpu:/kubepods.slice/kubepods-pod{U_}.slice/docker-{CID}.scope\n", CID),
        # cgroup v2
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope\n",
            CID,
        ),
        (f"0::/kubepods/burstable/pod{UID}/{CID}\n", CID),
        # hybrid: the v2 line names no pod, the v1 lines do
        (f"12:memory:/kubepods/pod{UID}/{CID}\n0::/\n", CID),
        # nested: kind's kubelet prefix, a cgroup namespace's "..", a container's own sub-cgroup
        (f"0::/kubelet/kubepods/besteffort/pod{UID}/{CID}/init.scope\n", CID),
        (f"0::/../../kubepods-besteffort-pod{U_}.slice/cri-containerd-{CID}.scope\n", CID),
        # in the pod, in no container: CRI-O's monitor, the pod's own cgroup
        (f"0::/kubepods.slice/kubepods-pod{U_}.slice/crio-conmon-{CID}.scope\n", None),
        (f"0::/kubepods/pod{UID}\n", None),
    ],
)
def test_the_pod_and_container_of_every_common_layout(text: str, cid: str | None) -> None:
    assert parse_cgroup(text) == PodCgroup(UID, cid)


def test_a_static_pods_hash_uid_is_found_too() -> None:
    uid = "6d5b5f5c0a1d0c8e6b7c8d9e0f1a2b3c"
    assert parse_cgroup(f"0::/kubepods/besteffort/pod{uid}/{CID}\n") == PodCgroup(uid, CID)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0::/\n",
        "0::/system.slice/containerd.service\n",
        "12:memory:/user.slice/user-1000.slice/session-3.scope\n",
        f"0::/kubepods/podNOTAUID/{CID}\n",
        f"0::/kubepods/pod{UID[:-1]}/{CID}\n",  # one hex digit short
        f"/kubepods/pod{UID}/{CID}\n",  # no hierarchy fields
        # two lines naming two different pods: nobody's
        f"12:memory:/kubepods/pod{UID}/{CID}\n0::/kubepods/pod{'2' + UID[1:]}/{CID}\n",
    ],
)
def test_what_names_no_single_pod_is_nobodys(text: str) -> None:
    assert parse_cgroup(text) is None


def test_two_containers_of_one_pod_leave_the_container_unknown() -> None:
    other = "f" * 64
    assert parse_cgroup(f"12:memory:/kubepods/pod{UID}/{CID}\n0::/kubepods/pod{UID}/{other}\n") == PodCgroup(UID, None)


@given(st.text(max_size=400))
def test_garbage_never_raises(text: str) -> None:
    parse_cgroup(text)
    pod_of_path(text)


_qos = st.sampled_from(["", "burstable/", "besteffort/"])
_uids = st.uuids().map(str)
_cids = st.text("0123456789abcdef", min_size=12, max_size=64)


@given(_uids, _cids, _qos, st.sampled_from(["cri-containerd", "crio", "docker", None]), st.booleans())
def test_a_generated_layout_names_its_pod_and_container(
    uid: str, cid: str, qos: str, runtime: str | None, v2: bool
) -> None:
    if runtime is None:  # cgroupfs
        path = f"/kubepods/{qos}pod{uid}/{cid}"
    else:  # systemd
        q = qos.rstrip("/")
        slices = f"/kubepods.slice/kubepods-{q}.slice/kubepods-{q}-pod" if q else "/kubepods.slice/kubepods-pod"
        path = f"{slices}{uid.replace('-', '_')}.slice/{runtime}-{cid}.scope"
    line = f"0::{path}" if v2 else f"5:memory:{path}"
    assert parse_cgroup(line + "\n") == PodCgroup(uid, cid)


def test_read_pod_cgroup_reads_a_fake_proc_and_bounds_the_file(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(f"0::/kubepods/pod{UID}/{CID}\n")
    assert read_pod_cgroup(str(tmp_path), 42) == PodCgroup(UID, CID)
    assert read_pod_cgroup(str(tmp_path), 43) is None  # gone
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "cgroup").write_text(f"0::/kubepods/pod{UID}/{CID}\n" + "x" * MAX_CGROUP_BYTES)
    assert read_pod_cgroup(str(tmp_path), 44) is None  # too large to be a cgroup file
    (tmp_path / "45").mkdir()
    (tmp_path / "45" / "cgroup").write_bytes(b"\xff\xfe0::/kubepods/pod\x00\n")
    assert read_pod_cgroup(str(tmp_path), 45) is None
