"""``_pods``: this node's labelled pods from the Kubernetes API (a fake one here: an HTTP server on 127.0.0.1): the
query names the node and the label, the token is sent (and read again at every call), a malformed pod is skipped and
counted while the others are used, and an API that refuses, answers garbage, too much, or nothing raises
``PodListError`` within its bounds."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_agent._errors import PodListError
from timeslice_agent._pods import (
    MAX_PAGES,
    MAX_PODS,
    MAX_WATCH_LINE,
    PAGE_SIZE,
    KubePodSource,
    Pod,
    parse_pod_list,
)
from timeslice_agent._untrusted import Refusal

from .helpers import eventually
from .pod_fakes import FakeKubeApi, cid, pod_json

UID_A = "1f4a2b3c-5d6e-4f70-8a9b-0c1d2e3f4a5b"
UID_B = "2f4a2b3c-5d6e-4f70-8a9b-0c1d2e3f4a5b"


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


async def test_the_query_names_this_node_and_the_label_and_sends_the_token(
    kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("first-token\n")
    kube_api.set_pods(pod_json(UID_A, "trainer-0", job="ppo-a", group="g1", containers=(cid(1), cid(2))))
    source = KubePodSource(kube_api.url, "node-a", token_file=str(token), timeout_s=5)
    pods = await source.list_pods()
    assert pods == [
        Pod(
            uid=UID_A,
            namespace="rl",
            name="trainer-0",
            job="ppo-a",
            group="g1",
            phase="Running",
            containers=frozenset({cid(1), cid(2)}),
        )
    ]
    path, headers = kube_api.requests[-1]
    url = urllib.parse.urlsplit(path)
    assert url.path == "/api/v1/pods"
    assert urllib.parse.parse_qs(url.query) == {
        "fieldSelector": ["spec.nodeName=node-a"],
        "labelSelector": ["timeslice.io/job-id"],
        "limit": [str(PAGE_SIZE)],
    }
    assert headers["Authorization"] == "Bearer first-token"
    token.write_text("rotated-token")  # projected service-account tokens are rotated: read at every call
    await source.list_pods()
    assert kube_api.requests[-1][1]["Authorization"] == "Bearer rotated-token"


async def test_a_malformed_pod_is_skipped_and_counted_and_the_others_are_used(kube_api: FakeKubeApi) -> None:
    good = pod_json(UID_A, "ok", job="j", containers=(cid(1),))
    no_uid = pod_json("not-a-uid", "bad-uid", job="j")
    wrong_type = pod_json(UID_B, "bad-labels", job="j")
    wrong_type["metadata"]["labels"] = ["not", "a", "map"]
    no_label = pod_json(UID_B, "no-label", job=None)
    kube_api.set_pods(no_uid, good, wrong_type, no_label)
    refused: list[Refusal] = []
    pods = await KubePodSource(kube_api.url, "node-a", timeout_s=5, refused=refused.append).list_pods()
    assert [p.name for p in pods] == ["ok"]
    assert sorted(refused) == sorted([Refusal.INVALID_ID, Refusal.UNDECODABLE, Refusal.INVALID_ID])


def _uid(n: int) -> str:
    return f"{n:08x}-5d6e-4f70-8a9b-0c1d2e3f4a5b"


async def test_a_list_in_pages_is_read_to_its_end_in_order(kube_api: FakeKubeApi) -> None:
    kube_api.set_pods(*(pod_json(_uid(i), f"p{i}", job=f"j{i}") for i in range(5)))
    pods = await KubePodSource(kube_api.url, "node-a", timeout_s=5, page_size=2).list_pods()
    assert [p.name for p in pods] == ["p0", "p1", "p2", "p3", "p4"]
    queries = [urllib.parse.parse_qs(urllib.parse.urlsplit(path).query) for path, _ in kube_api.requests]
    assert [q["limit"] for q in queries] == [["2"]] * 3
    assert [q.get("continue") for q in queries] == [None, ["2"], ["4"]]  # each page asks from the last one's token
    assert all(q["fieldSelector"] == ["spec.nodeName=node-a"] for q in queries)


async def test_a_continue_token_that_expired_starts_the_listing_again_once(kube_api: FakeKubeApi) -> None:
    kube_api.set_pods(*(pod_json(_uid(i), f"p{i}", job="j") for i in range(3)))
    kube_api.expire_next_continue = True  # the list changed while it was read: 410 Gone for the second page
    pods = await KubePodSource(kube_api.url, "node-a", timeout_s=5, page_size=2).list_pods()
    assert [p.name for p in pods] == ["p0", "p1", "p2"]  # read again from the start: nothing twice, nothing lost
    assert len(kube_api.requests) == 4  # page 1, page 2 (410), page 1, page 2


async def test_a_list_that_never_ends_is_cut_at_max_pages(kube_api: FakeKubeApi) -> None:
    kube_api.endless = True  # every page names a next one, and none holds a pod
    with pytest.raises(PodListError, match=f"did not end within {MAX_PAGES} pages"):
        await KubePodSource(kube_api.url, "node-a", timeout_s=5, page_size=1).list_pods()
    assert len(kube_api.requests) == MAX_PAGES


async def test_pods_past_max_pods_over_several_pages_are_not_read_and_counted_once(kube_api: FakeKubeApi) -> None:
    kube_api.set_pods(*(pod_json(_uid(i), f"p{i}", job="j") for i in range(MAX_PODS + 10)))
    refused: list[Refusal] = []
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5, page_size=300, refused=refused.append)
    pods = await source.list_pods()
    assert len(pods) == MAX_PODS and pods[-1].name == f"p{MAX_PODS - 1}"
    assert refused == [Refusal.TOO_LARGE]
    assert len(kube_api.requests) == -(-MAX_PODS // 300)  # the pages up to MAX_PODS, not the one after


def test_a_page_size_out_of_range_is_refused() -> None:
    for size in (0, MAX_PODS + 1):
        with pytest.raises(ValueError, match="page_size"):
            KubePodSource("http://127.0.0.1:1", "node-a", page_size=size)


def test_parse_keeps_only_container_ids_it_can_read_and_bounds_strings() -> None:
    import json

    pod = pod_json(UID_A, "p", job="j", containers=(cid(7),))
    pod["status"]["containerStatuses"].append({"name": "starting", "containerID": ""})
    pod["status"]["containerStatuses"].append({"name": "odd", "containerID": "containerd://../../etc"})
    long_name = pod_json(UID_B, "x" * 300, job="j")
    pods, problems = parse_pod_list(json.dumps({"kind": "PodList", "items": [pod, long_name]}).encode())
    assert [p.containers for p in pods] == [frozenset({cid(7)})]
    assert [code for code, _ in problems] == [Refusal.TOO_LARGE]
    for bad in (b"", b"not json", b'{"kind": "Status", "items": []}', b'{"items": 3}', b"[]"):
        with pytest.raises(ValueError):
            parse_pod_list(bad)


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (403, b'{"kind":"Status","reason":"Forbidden"}', "may not list pods"),
        (200, b'{"kind":"PodList","metadata":{"continue":"' + b"x" * 5000 + b'"},"items":[]}', "continue token"),
        (500, b"oops", "HTTP 500"),
        (200, b"<html>not json</html>", "no pod list"),
        (200, b'{"kind":"PodList","items":[' + b'{"metadata":{}},' * 200_000 + b"{}]}", "larger than"),
    ],
)
async def test_an_api_that_refuses_or_answers_garbage_raises_pod_list_error(
    kube_api: FakeKubeApi, status: int, body: bytes, says: str
) -> None:
    kube_api.status, kube_api.body = status, body
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5, max_bytes=1 << 20)
    with pytest.raises(PodListError, match=says) as caught:
        await source.list_pods()
    assert caught.value.url == source.url


async def test_an_api_that_does_not_answer_raises_within_the_timeout(kube_api: FakeKubeApi) -> None:
    kube_api.hang = threading.Event()
    source = KubePodSource(kube_api.url, "node-a", timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(PodListError, match="no answer"):
        await source.list_pods()
    assert time.monotonic() - t0 < 3
    kube_api.hang.set()


async def test_nobody_listening_raises_pod_list_error() -> None:
    with FakeKubeApi() as api:
        url = api.url  # closed on exit: nobody listens there any more
    with pytest.raises(PodListError, match="no answer"):
        await KubePodSource(url, "node-a", timeout_s=1).list_pods()


def test_in_cluster_uses_the_service_account_and_says_when_it_runs_in_no_cluster(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t")
    with pytest.raises(PodListError, match="KUBERNETES_SERVICE_HOST"):
        KubePodSource.in_cluster("node-a", environ={}, account_dir=str(tmp_path))
    with pytest.raises(PodListError, match="no service-account token"):
        KubePodSource.in_cluster(
            "node-a", environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, account_dir=str(tmp_path / "nowhere")
        )


def test_in_cluster_builds_the_https_url_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ssl

    (tmp_path / "token").write_text("t")
    seen: list[str | None] = []
    monkeypatch.setattr(ssl, "create_default_context", lambda cafile=None: seen.append(cafile))
    source = KubePodSource.in_cluster(
        "node-a",
        environ={"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"},
        account_dir=str(tmp_path),
    )
    assert source.url.startswith("https://[fd00::1]:6443/api/v1/pods?")
    assert source.token_file == f"{tmp_path}/token" and seen == [f"{tmp_path}/ca.crt"]


@pytest.mark.parametrize("node", ["", "Node_A", "-a", "a" * 254, "a/b"])
def test_a_node_name_that_is_none_is_refused(node: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes node name"):
        KubePodSource("http://127.0.0.1:1", node)


@pytest.mark.parametrize("api", ["ftp://x", "127.0.0.1:6443", "https://", "https://h/?q=1"])
def test_an_api_url_that_is_none_is_refused(api: str) -> None:
    with pytest.raises(ValueError, match="not http"):
        KubePodSource(api, "node-a")


# ---------------------------------------------------------------------------------------------- the watch


async def test_no_watch_before_a_listing_and_a_watch_from_the_listings_version_says_a_change_at_once(
    kube_api: FakeKubeApi,
) -> None:
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5)
    assert await source.wait_change(5) is False  # nothing listed yet: nothing to follow from
    assert kube_api.requests == []
    await source.list_pods()
    waiting = asyncio.ensure_future(source.wait_change(5))
    await eventually(lambda: len(kube_api.requests) == 2, what="the watch asked")
    t0 = time.monotonic()
    kube_api.push_line(json.dumps({"type": "ADDED", "object": pod_json(UID_A, "new", job="j")}).encode())
    assert await asyncio.wait_for(waiting, 5) is True
    assert time.monotonic() - t0 < 1
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(kube_api.requests[-1][0]).query)
    assert query == {
        "fieldSelector": ["spec.nodeName=node-a"],
        "labelSelector": ["timeslice.io/job-id"],
        "watch": ["1"],
        "resourceVersion": ["7"],  # the listing's
        "allowWatchBookmarks": ["true"],
        "timeoutSeconds": ["5"],
    }


async def test_a_bookmark_is_no_change_and_the_next_watch_follows_from_its_version(kube_api: FakeKubeApi) -> None:
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5)
    await source.list_pods()
    kube_api.push_line(json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "42"}}}).encode())
    t0 = time.monotonic()
    assert await source.wait_change(1) is False  # the API ends the watch at timeoutSeconds: nothing changed
    assert 0.9 <= time.monotonic() - t0 < 4
    await source.wait_change(0.5)
    assert "resourceVersion=42" in kube_api.requests[-1][0]


@pytest.mark.parametrize(
    "line",
    [
        b'{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}',
        b"not json at all",
        b'{"type": "MODIFIED", "object": {"metadata": {"name": "' + b"x" * (MAX_WATCH_LINE + 10) + b'"}}}',
    ],
    ids=["expired", "unreadable", "too-long"],
)
async def test_a_watch_that_cannot_go_on_says_list_again(kube_api: FakeKubeApi, line: bytes) -> None:
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5)
    await source.list_pods()
    kube_api.push_line(line)
    assert await source.wait_change(5) is True


async def test_a_watch_refused_raises_and_one_gone_says_list_again(kube_api: FakeKubeApi) -> None:
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5)
    await source.list_pods()
    kube_api.watch_status = 410
    assert await source.wait_change(5) is True
    kube_api.watch_status = 403
    with pytest.raises(PodListError, match="HTTP 403"):
        await source.wait_change(5)


async def test_a_cancelled_watch_ends_at_once(kube_api: FakeKubeApi) -> None:
    source = KubePodSource(kube_api.url, "node-a", timeout_s=5)
    await source.list_pods()
    waiting = asyncio.ensure_future(source.wait_change(8))
    await eventually(lambda: len(kube_api.requests) == 2, what="the watch asked")
    t0 = time.monotonic()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert time.monotonic() - t0 < 1
