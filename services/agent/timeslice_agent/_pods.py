"""This node's pods that carry a timeslice job label, from the Kubernetes API: the input of ``_pod_discovery``.

* :class:`Pod` is what the agent uses of a pod: its UID (which its processes' cgroups name), namespace and name (for
  the logs), the raw values of its ``timeslice.io/job-id`` and ``timeslice.io/group`` labels (checked by the
  discovery, whatever source listed them), its phase and its containers' runtime ids.
* :class:`PodSource` is the seam (``list_pods()``); :class:`KubePodSource` the real one:
  ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>&labelSelector=timeslice.io/job-id&limit=<page>`` per scan,
  page after page (the API's ``continue`` token; at most :data:`MAX_PAGES`, a listing whose token expired meanwhile,
  HTTP 410, is started again once), in-cluster by default (the service account's token and CA under
  ``/var/run/secrets/kubernetes.io/serviceaccount/``, the API at ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``),
  or an explicit URL (with an optional token file and CA).

Why not the ``kubernetes`` client package: the agent makes one read-only GET per scan, and that package brings about
a dozen dependencies (``requests``, ``google-auth``, ``websocket-client``, ``oauthlib``, ``durationpy``…) and tens of
megabytes into the agent's image, plus a second HTTP stack to keep patched. The standard library's ``http.client``
does the GET, in a thread off the event loop (``asyncio.to_thread``), with a timeout on every socket operation and a
deadline on the whole call; no proxy is used (the API server is reached directly, as kubelet does) and no redirect
is followed. The token file is read again for every call: projected service-account tokens are rotated.

The answer is untrusted input: each page's size is bounded (``max_bytes``), and so are the pages read
(:data:`MAX_PAGES`), the pods kept (:data:`MAX_PODS`, over all pages) and a continue token's length; it is decoded
strictly where the agent reads it and leniently elsewhere (the API sends much more), each pod is decoded on its own
(a malformed one is skipped, logged and counted, never the whole list), and every string is bounded. A list that
is no pod list raises :class:`PodListError`, as does an answer other than HTTP 200; the discovery logs it and tries
again next scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import math
import os
import re
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

import msgspec

from ._errors import PodListError
from ._untrusted import Refusal, shown

__all__ = [
    "LABEL_GROUP",
    "LABEL_JOB",
    "MAX_PAGES",
    "MAX_PODS",
    "MAX_WATCH_LINE",
    "PAGE_SIZE",
    "POD_CHANNEL_PREFIX",
    "SERVICE_ACCOUNT_DIR",
    "KubePodSource",
    "Pod",
    "PodPage",
    "PodSource",
    "WatchablePodSource",
    "is_pod_channel",
    "parse_pod_list",
    "parse_pod_page",
    "pod_channel",
]

log = logging.getLogger("timeslice.agent")

LABEL_JOB: Final = "timeslice.io/job-id"  # the job a pod's processes are (its value: a job id)
LABEL_GROUP: Final = "timeslice.io/group"  # its group (optional: AgentConfig.pod_default_group)
SERVICE_ACCOUNT_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_PODS: Final = 1024  # labelled pods on one node (the kubelet's default max-pods is 110)
MAX_POD_LIST_BYTES: Final = 8 << 20  # one page's size (a pod is a few KiB of JSON)
PAGE_SIZE: Final = 256  # pods asked for per page (the API's ``limit``)
MAX_PAGES: Final = 64  # pages read per listing: a listing whose continue token never ends is cut there
_MAX_CONTINUE: Final = 4096  # a continue token's length (the API's are a few hundred bytes)
_GONE: Final = 410  # the API: the continue token expired (the list changed too much meanwhile): list again
MAX_WATCH_LINE: Final = 1 << 20  # one watch event (a pod's JSON): a longer one ends the watch (the list is read again)
MAX_CONTAINERS: Final = 64  # container ids read per pod
POD_CHANNEL_PREFIX: Final = "pod-"  # RegisterJob.channel of a pod's registration: "pod-" + the pod's UID
_MAX_NAME: Final = 253  # a namespace, name or label value (Kubernetes allows 63 for values, 253 for names)
_MAX_TOKEN: Final = 64 * 1024
_CHUNK: Final = 64 * 1024
_UID_RE: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
_NODE_RE: Final = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")  # a DNS subdomain: a node's name
_CONTAINER_ID_RE: Final = re.compile(r"[a-z0-9-]{1,32}://(?P<id>[0-9a-f]{12,128})")  # "containerd://<hex>"


@dataclass(frozen=True, slots=True)
class Pod:
    """One labelled pod of this node. ``job`` and ``group`` are the labels' values as listed (checked later);
    ``containers``: the runtime ids of its containers (``status.containerStatuses``), which its processes' cgroups
    name; the pod's sandbox ("pause") and the runtime's helpers are not among them."""

    uid: str
    namespace: str
    name: str
    job: str
    group: str | None
    phase: str
    containers: frozenset[str] = frozenset()

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class PodSource(Protocol):
    """Where the discovery learns this node's labelled pods. Raises on failure (the scan is then retried)."""

    async def list_pods(self) -> list[Pod]: ...


@runtime_checkable
class WatchablePodSource(PodSource, Protocol):
    """A source that can also say when the pods changed after its last listing: the discovery then scans at once,
    not at its next interval."""

    async def wait_change(self, timeout_s: float) -> bool: ...


def pod_channel(uid: str) -> str:
    """The ``channel`` of the registration the discovery makes for the pod ``uid`` (one part of its job)."""
    return POD_CHANNEL_PREFIX + uid


def is_pod_channel(channel: str | None) -> bool:
    """Whether a registration's ``channel`` is a pod's (made by the discovery)."""
    return channel is not None and channel.startswith(POD_CHANNEL_PREFIX)


# What the agent reads of the API's answer (everything else is ignored).
class _Meta(msgspec.Struct):
    uid: str = ""
    namespace: str = ""
    name: str = ""
    labels: dict[str, str] = {}


class _ContainerStatus(msgspec.Struct):
    containerID: str = ""


class _Status(msgspec.Struct):
    phase: str = ""
    containerStatuses: list[_ContainerStatus] = []


class _PodItem(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    status: _Status = msgspec.field(default_factory=_Status)


class _ListMeta(msgspec.Struct):
    continue_: str = msgspec.field(default="", name="continue")
    resourceVersion: str = ""


class _WatchObject(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)


class _WatchEvent(msgspec.Struct):
    type: str = ""
    object: _WatchObject = msgspec.field(default_factory=_WatchObject)


class _PodList(msgspec.Struct):
    kind: str = ""
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[msgspec.Raw] = []


_list_decoder = msgspec.json.Decoder(_PodList)
_item_decoder = msgspec.json.Decoder(_PodItem)
_event_decoder = msgspec.json.Decoder(_WatchEvent)

Problem = tuple[Refusal, str]  # a pod skipped: why (a metric label) and what (a log line)


def parse_pod_list(data: bytes) -> tuple[list[Pod], list[Problem]]:
    """The labelled pods of an API answer (a ``PodList``), and the pods skipped with why. Raises ``ValueError`` when
    the answer is no pod list at all."""
    page = parse_pod_page(data, room=MAX_PODS)
    return page.pods, [*page.problems, _too_many()] if page.over else page.problems


@dataclass(frozen=True, slots=True)
class PodPage:
    """One page of a listing: its labelled pods, the pods skipped with why, the token of the next page ("" on the
    last one), whether pods past the room left were dropped, and the list's ``resourceVersion`` (what a watch
    follows from; "" when the API gave none or one too long)."""

    pods: list[Pod]
    problems: list[Problem]
    next_token: str
    over: bool
    version: str


def _too_many() -> Problem:
    return Refusal.TOO_LARGE, f"over {MAX_PODS} labelled pods on this node; the first {MAX_PODS} are used"


def parse_pod_page(data: bytes, *, room: int) -> PodPage:
    """One page of a listing, its pods at most ``room`` (what :data:`MAX_PODS` leaves). Raises ``ValueError`` when
    the answer is no pod list at all, or its continue token is too long."""
    try:
        listing = _list_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"the answer is no pod list: {shown(str(exc), 200)}") from None
    if listing.kind not in ("", "PodList"):
        raise ValueError(f"the answer is a {shown(listing.kind)}, not a PodList")
    if len(listing.metadata.continue_) > _MAX_CONTINUE:
        raise ValueError(f"the list's continue token is longer than {_MAX_CONTINUE} characters")
    pods: list[Pod] = []
    problems: list[Problem] = []
    for i, raw in enumerate(listing.items[: max(0, room)]):
        try:
            item = _item_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            problems.append((Refusal.UNDECODABLE, f"pod #{i} of the list is malformed: {shown(str(exc), 200)}"))
            continue
        pod_or_problem = _pod(item)
        if isinstance(pod_or_problem, Pod):
            pods.append(pod_or_problem)
        else:
            problems.append(pod_or_problem)
    version = listing.metadata.resourceVersion
    return PodPage(
        pods, problems, listing.metadata.continue_, len(listing.items) > room, version if len(version) <= 128 else ""
    )


def _pod(item: _PodItem) -> Pod | Problem:
    m = item.metadata
    where = f"pod {shown(m.namespace, 60)}/{shown(m.name, 80)}"
    if _UID_RE.fullmatch(m.uid) is None:
        return Refusal.INVALID_ID, f"{where}: its uid {shown(m.uid)} is no pod UID"
    if not m.namespace or not m.name or len(m.namespace) > _MAX_NAME or len(m.name) > _MAX_NAME:
        return Refusal.TOO_LARGE, f"{where} (uid {m.uid}): its namespace or name is empty or too long"
    job, group = m.labels.get(LABEL_JOB), m.labels.get(LABEL_GROUP)
    if job is None:
        return Refusal.INVALID_ID, f"{where} (uid {m.uid}) has no {LABEL_JOB} label"
    if len(job) > _MAX_NAME or (group is not None and len(group) > _MAX_NAME):
        return Refusal.TOO_LARGE, f"{where} (uid {m.uid}): a timeslice label is too long"
    containers = []
    for s in item.status.containerStatuses[:MAX_CONTAINERS]:
        c = _CONTAINER_ID_RE.fullmatch(s.containerID)
        if c is not None:  # "" while a container is being created
            containers.append(c.group("id"))
    phase = item.status.phase if len(item.status.phase) <= 32 else "Unknown"
    return Pod(
        uid=m.uid,
        namespace=m.namespace,
        name=m.name,
        job=job,
        group=group,
        phase=phase,
        containers=frozenset(containers),
    )


class _Cut:
    """A watch's socket, shut down from the event loop's side when the wait ends (cancelled, or timed out), so that
    the thread blocked reading it returns at once; http.client drops its own reference to the socket of a response
    that ends with the connection, so it is kept here."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._done = False

    def hold(self, sock: socket.socket | None) -> bool:
        """Keep ``sock`` (the thread, once connected); False when the wait has ended already."""
        self._sock = sock
        if self._done:
            self.now()
            return False
        return True

    def now(self) -> None:
        self._done = True
        if (sock := self._sock) is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class KubePodSource:
    """This node's labelled pods from the Kubernetes API at ``api`` (``https://host:port``, or ``http://`` for a
    local proxy or a test); ``token_file``: a bearer token, read for every call; ``ca_file``: the CA to verify the
    server with (None: the system's). ``refused`` counts each pod skipped (by its reason)."""

    def __init__(
        self,
        api: str,
        node_name: str,
        *,
        token_file: str | None = None,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        max_bytes: int = MAX_POD_LIST_BYTES,
        page_size: int = PAGE_SIZE,
        refused: Callable[[Refusal], None] = lambda code: None,
    ) -> None:
        parts = urllib.parse.urlsplit(api)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"the Kubernetes API URL {api!r} is not http(s)://host[:port][/path]")
        if _NODE_RE.fullmatch(node_name) is None:
            raise ValueError(
                f"{node_name!r} is not a Kubernetes node name (a DNS subdomain: a-z 0-9 . -); give "
                "--pod-node-name (the DaemonSet passes spec.nodeName)"
            )
        if timeout_s <= 0 or max_bytes <= 0 or not 0 < page_size <= MAX_PODS:
            raise ValueError(
                f"timeout_s ({timeout_s}) and max_bytes ({max_bytes}) must be positive, page_size ({page_size}) "
                f"from 1 to {MAX_PODS}"
            )
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self.page_size = page_size
        self._pods_path = f"{parts.path.rstrip('/')}/api/v1/pods"
        self._selectors = urllib.parse.urlencode(
            {"fieldSelector": f"spec.nodeName={node_name}", "labelSelector": LABEL_JOB}
        )
        self.path = f"{self._pods_path}?{self._selectors}&limit={page_size}"
        self.url = f"{parts.scheme}://{parts.netloc}{self.path}"
        self.node_name, self.token_file, self.timeout_s, self.max_bytes = node_name, token_file, timeout_s, max_bytes
        self._ssl = ssl.create_default_context(cafile=ca_file) if self._https else None
        self._refused = refused
        self._version = ""  # the resourceVersion of the last listing: where a watch starts

    @classmethod
    def in_cluster(
        cls,
        node_name: str,
        *,
        environ: Mapping[str, str] | None = None,
        account_dir: str = SERVICE_ACCOUNT_DIR,
        timeout_s: float = 10.0,
        refused: Callable[[Refusal], None] = lambda code: None,
    ) -> KubePodSource:
        """The API server of the cluster this agent runs in, as its service account sees it (``PodListError`` when
        it runs in none: no ``KUBERNETES_SERVICE_HOST``, or no service-account token mounted)."""
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise PodListError(
                "(in-cluster)",
                "$KUBERNETES_SERVICE_HOST is not set: the agent runs in no Kubernetes "
                "pod; give the API's URL (--pod-api) or run without --pods",
            )
        token = f"{account_dir}/token"
        if not os.path.exists(token):
            raise PodListError(
                "(in-cluster)",
                f"no service-account token at {token}: give the agent's pod a service "
                "account (deploy/k8s/agent.yaml) with automountServiceAccountToken",
            )
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(
            f"https://{netloc}",
            node_name,
            token_file=token,
            ca_file=f"{account_dir}/ca.crt",
            timeout_s=timeout_s,
            refused=refused,
        )

    async def list_pods(self) -> list[Pod]:
        """This node's labelled pods now, read page by page. Raises :class:`PodListError` (a page not answered
        within the timeout, an HTTP error, no pod list, more than :data:`MAX_PAGES` pages, a listing whose continue
        token expired twice); pods that are malformed are skipped, logged and counted."""
        for attempt in (1, 2):
            try:
                return await self._list_once()
            except PodListError as exc:
                if exc.status != _GONE or attempt == 2:
                    raise
                log.info("the pod listing's continue token expired (the list changed meanwhile): listing again")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _list_once(self) -> list[Pod]:
        pods: list[Pod] = []
        problems: list[Problem] = []
        token = ""
        for page in range(MAX_PAGES):
            path = self.path if not token else f"{self.path}&{urllib.parse.urlencode({'continue': token})}"
            try:
                async with asyncio.timeout(self.timeout_s * 3):  # the page's own deadline is 2x; this is its backstop
                    data = await asyncio.to_thread(self._get, path)
            except TimeoutError:
                raise PodListError(self.url, f"no answer within {self.timeout_s * 3:g} s (page {page + 1})") from None
            try:
                got = parse_pod_page(data, room=MAX_PODS - len(pods))
            except ValueError as exc:
                raise PodListError(self.url, str(exc), status=200) from None
            pods += got.pods
            problems += got.problems
            token = got.next_token
            self._version = got.version  # the last page's: the whole list's version
            if got.over or (token and len(pods) >= MAX_PODS):  # more pods than MAX_PODS: the rest is not read
                problems.append(_too_many())
                break
            if not token:
                break
        else:
            raise PodListError(self.url, f"the list did not end within {MAX_PAGES} pages of {self.page_size}")
        for code, message in problems:
            self._refused(code)
            log.warning("skipped a pod of the list: %s", message, extra={"refusal": str(code)})
        return pods

    async def wait_change(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the API to report a change to this node's labelled pods since the last
        listing (a watch from its ``resourceVersion``): True when one came, or when the watch cannot go on (its
        version expired, an event it cannot read: list again); False when nothing changed, or no listing was made
        yet. Raises :class:`PodListError` when the API refuses the watch."""
        version = self._version
        if not version or timeout_s <= 0:
            return False
        cut = _Cut()
        try:
            async with asyncio.timeout(timeout_s + 3 * self.timeout_s):  # backstop: the thread's reads are bounded
                return await asyncio.to_thread(self._watch, version, timeout_s, cut)
        except TimeoutError:
            return True
        finally:  # cancelled (the agent stops) or done: a read still blocked in the thread ends at once
            cut.now()

    def _watch(self, version: str, timeout_s: float, cut: _Cut) -> bool:
        """The watch itself (blocking: run in a thread); ``cut`` gets its socket, so that it can be cut."""
        query = urllib.parse.urlencode(
            {
                "watch": "1",
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(max(1, math.ceil(timeout_s))),
            }
        )
        path = f"{self._pods_path}?{self._selectors}&{query}"
        deadline = time.monotonic() + timeout_s + self.timeout_s
        with self._api(timeout_s + self.timeout_s, "the watch failed") as (conn, headers):
            conn.connect()
            if not cut.hold(conn.sock):
                return False
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            if resp.status == _GONE:
                return True
            if resp.status != 200:
                raise PodListError(self.url, f"the watch was answered HTTP {resp.status}", status=resp.status)
            while time.monotonic() < deadline:
                line = resp.readline(MAX_WATCH_LINE + 1)
                if not line:
                    return False  # the API ended the watch (timeoutSeconds): nothing changed
                if len(line) > MAX_WATCH_LINE:
                    log.warning("a pod watch event is longer than %d bytes: listing again", MAX_WATCH_LINE)
                    return True
                if not line.strip():
                    continue
                try:
                    event = _event_decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    return True  # unreadable: the list says what is there
                if event.type == "BOOKMARK":  # no change, only a newer version to follow from
                    if 0 < len(v := event.object.metadata.resourceVersion) <= 128:
                        self._version = v
                    continue
                return True  # ADDED, MODIFIED, DELETED, or an ERROR (e.g. the version expired): list again
            return False

    @contextlib.contextmanager
    def _api(self, timeout_s: float, failed: str) -> Iterator[tuple[http.client.HTTPConnection, dict[str, str]]]:
        """A connection to the API whose every socket operation waits at most ``timeout_s``, with the headers of a
        request on it (the token read now); closed after. The connection failing (a socket, HTTP or TLS error) is a
        :class:`PodListError` that says ``failed``, as every other failure of a call to the API is."""
        headers = {"Accept": "application/json", "User-Agent": "timeslice-agent"}
        if (token := self._token()) is not None:
            headers["Authorization"] = f"Bearer {token}"
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host or "", self._port, timeout=timeout_s, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host or "", self._port, timeout=timeout_s)
        try:
            yield conn, headers
        except PodListError:
            raise
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            raise PodListError(self.url, f"{failed}: {exc!r}") from exc
        finally:
            conn.close()

    def _token(self) -> str | None:
        if self.token_file is None:
            return None
        try:
            with open(self.token_file, "rb") as f:
                token = f.read(_MAX_TOKEN + 1)
        except OSError as exc:
            raise PodListError(self.url, f"the token file {self.token_file} cannot be read: {exc}") from exc
        if len(token) > _MAX_TOKEN or not token.strip():
            raise PodListError(self.url, f"the token file {self.token_file} is empty or larger than {_MAX_TOKEN} bytes")
        return token.decode("ascii", errors="replace").strip()

    def _get(self, path: str) -> bytes:
        """The answer's body to ``GET path`` (blocking: run in a thread). Every socket operation waits at most
        ``timeout_s``, and the whole call gives up past twice that."""
        deadline = time.monotonic() + 2 * self.timeout_s
        with self._api(self.timeout_s, "no answer") as (conn, headers):
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            body = bytearray()
            while len(body) <= self.max_bytes:
                if time.monotonic() > deadline:
                    raise PodListError(
                        self.url, f"the answer took longer than {2 * self.timeout_s:g} s", status=resp.status
                    )
                chunk = resp.read(min(_CHUNK, self.max_bytes + 1 - len(body)))
                if not chunk:
                    break
                body += chunk
        if resp.status != 200:
            hint = (
                (
                    ": the agent's service account may not list pods (apply deploy/k8s/agent.yaml's ClusterRole and "
                    "ClusterRoleBinding)"
                )
                if resp.status in (401, 403)
                else ""
            )
            raise PodListError(
                self.url, f"HTTP {resp.status}{hint}: {shown(bytes(body[:300]), 320)}", status=resp.status
            )
        if len(body) > self.max_bytes:
            raise PodListError(self.url, f"the answer is larger than {self.max_bytes} bytes", status=resp.status)
        return bytes(body)
