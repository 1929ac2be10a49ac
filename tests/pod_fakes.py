"""Seams we own for the pod discovery tests: a fake Kubernetes API (an HTTP server on 127.0.0.1, port 0, serving a
pod list the test controls) and a fake proc root (``<pid>/stat``, ``status``, ``cgroup`` for the pods' processes)."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CONTAINERD = "containerd"


def cid(n: int) -> str:
    """A container id (64 hex digits) of its own for ``n``."""
    return f"{n:064x}"


def pod_json(
    uid: str,
    name: str,
    *,
    job: str | None,
    group: str | None = None,
    containers: tuple[str, ...] = (),
    phase: str = "Running",
    namespace: str = "rl",
) -> dict[str, Any]:
    """A pod as the API lists it (with more fields than the agent reads, as the real one)."""
    labels = {"app": name}
    if job is not None:
        labels["timeslice.io/job-id"] = job
    if group is not None:
        labels["timeslice.io/group"] = group
    return {
        "metadata": {
            "uid": uid,
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "resourceVersion": "1",
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {"nodeName": "node-a", "containers": [{"name": "main", "image": "trainer:1"}]},
        "status": {
            "phase": phase,
            "hostIP": "10.0.0.1",
            "containerStatuses": [
                {"name": f"c{i}", "containerID": f"{CONTAINERD}://{c}", "ready": True, "state": {"running": {}}}
                for i, c in enumerate(containers)
            ],
        },
    }


class FakeKubeApi:
    """``GET /api/v1/pods?...`` answered with ``pods`` (or ``status``/``body`` when set), a page of ``limit`` at a
    time as the real API pages (``metadata.continue``: an opaque token, here the offset); every request is recorded
    (path, headers). ``hang``: the handler waits on it (at most 10 s) before answering: an API that does not answer.
    ``expire_next_continue``: the next request that carries a token is answered 410 Gone (its token expired), once;
    ``endless``: every page carries a token (a list that never ends). Events are numbered as the API's resource
    versions (a list answers the last number): a ``watch=1`` request from version ``r`` is sent every event after
    ``r``, as they come (:meth:`push_line`; :meth:`set_pods` pushes a ``MODIFIED``, as a real API would), until its
    ``timeoutSeconds`` (at most 10 s) pass; ``watch_status``: its HTTP status."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.status = 200
        self.body: bytes | None = None
        self.hang: threading.Event | None = None
        self.expire_next_continue = False
        self.endless = False
        self.watch_status = 200
        self._version = 7  # the last event's number: the list's resourceVersion
        self._events: list[tuple[int, bytes]] = []  # every event line pushed, by its number
        self._closing = False
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._mu = threading.Lock()
        self._changed = threading.Condition(self._mu)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if "watch=1" in self.path:
                    self._watch()
                    return
                with api._mu:
                    api.requests.append((self.path, dict(self.headers)))
                    status, body = api.status, api.body
                    if body is None:
                        status, body = api._page(self.path)
                    hang = api.hang
                if hang is not None:
                    hang.wait(10)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _watch(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                end = time.monotonic() + min(10.0, float(query.get("timeoutSeconds", ["10"])[0]))
                after = int(query.get("resourceVersion", ["0"])[0])
                with api._mu:
                    api.requests.append((self.path, dict(self.headers)))
                    status = api.watch_status
                self.send_response(status)  # HTTP/1.0: the body ends when the connection closes
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                while status == 200:
                    with api._changed:
                        while not api._closing and api._version <= after and (left := end - time.monotonic()) > 0:
                            api._changed.wait(left)
                        lines = [(n, line) for n, line in api._events if n > after]
                    if not lines:
                        return
                    try:
                        for n, line in lines:
                            self.wfile.write(line)
                            after = n
                        self.wfile.flush()
                    except OSError:  # the watcher went away
                        return

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-kube-api", daemon=True
        )

    def _page(self, path: str) -> tuple[int, bytes]:
        """The answer to a list request (lock held): a page from its token's offset, of its limit."""
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        token = query.get("continue", [""])[0]
        if token and self.expire_next_continue:
            self.expire_next_continue = False
            gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410}
            return 410, json.dumps(gone).encode()
        start = int(token or 0)
        limit = int(query.get("limit", [str(len(self.pods) or 1)])[0])
        items = self.pods[start : start + limit]
        more = self.endless or start + limit < len(self.pods)
        meta = {"resourceVersion": str(self._version), **({"continue": str(start + limit)} if more else {})}
        return 200, json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}).encode()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def set_pods(self, *pods: dict[str, Any]) -> None:
        with self._changed:
            self.pods = list(pods)
        self.push_line(json.dumps({"type": "MODIFIED", "object": {"metadata": {"name": "any"}}}).encode())

    def push_line(self, line: bytes) -> None:
        """The next event: a line every watch sends, as is (a newline is added)."""
        with self._changed:
            self._version += 1
            self._events.append((self._version, line + b"\n"))
            self._changed.notify_all()

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hang is not None:
            self.hang.set()
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def fake_process(
    root: Path,
    pid: int,
    *,
    pod_uid: str | None,
    container: str | None,
    uid: int = 1000,
    gid: int = 1000,
    start: int = 1000,
    ppid: int = 1,
    systemd: bool = True,
) -> None:
    """Process ``pid`` in the fake proc root ``root``: in container ``container`` of pod ``pod_uid`` (cgroup v2,
    the systemd driver's layout with containerd, or the cgroupfs one), running as ``uid``."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = ["S", ppid, pid, pid, 0, -1, 4194560, 0, 0, 0, 0, 0, 0, 0, 0, 20, 0, 1, 0, start, 0, 0]
    (d / "stat").write_text(f"{pid} (python3) " + " ".join(map(str, rest)) + "\n")
    (d / "status").write_text(
        f"Name:\tpython3\nPid:\t{pid}\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        f"Gid:\t{gid}\t{gid}\t{gid}\t{gid}\n"
    )
    if pod_uid is None:
        path = "/system.slice/sshd.service"
    elif systemd:
        scope = f"/cri-containerd-{container}.scope" if container else ""
        pod = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
        path = f"/kubepods.slice/kubepods-burstable.slice/{pod}{scope}"
    else:
        path = f"/kubepods/besteffort/pod{pod_uid}" + (f"/{container}" if container else "")
    (d / "cgroup").write_text(f"0::{path}\n")


def remove_process(root: Path, pid: int) -> None:
    for f in ("stat", "status", "cgroup"):
        (root / str(pid) / f).unlink(missing_ok=True)
    (root / str(pid)).rmdir()
