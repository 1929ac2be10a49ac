"""A job's own mistakes, told at once and in words that say what to do (issue 25, item 5): a NATS URL that is
malformed, refused, silent, stale or only the default, and a release by a job that does not hold the group."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from timeslice_client import AsyncTimeSliceClient, NotHolder, TimeSliceClient, Unavailable, bus, errors

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_advertised_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No `timeslice up` of this machine's user leaks in: an empty place for the URL file, no $TIMESLICE_NATS_URL."""
    monkeypatch.setenv("TIMESLICE_URL_FILE", str(tmp_path / "up" / "nats.url"))
    monkeypatch.delenv("TIMESLICE_NATS_URL", raising=False)
    return tmp_path / "up" / "nats.url"


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed: connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _connect_error(client: AsyncTimeSliceClient) -> tuple[Unavailable, float]:
    started = time.monotonic()
    try:
        with pytest.raises(Unavailable) as info:
            await client.connect()
    finally:
        await client.close()
    return info.value, time.monotonic() - started


async def test_a_refused_port_fails_at_once_naming_the_url_and_how_up_advertises_it(no_advertised_url: Path) -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    err, took = await _connect_error(AsyncTimeSliceClient("j", "g", url, connect_timeout_s=5))
    assert took < 1.0, f"a refused port took {took:.2f} s to fail"
    assert isinstance(err, errors.BusUnreachable) and err.refused and err.nats_url == url
    text = str(err)
    assert url in text and "refused" in text
    assert "`timeslice up`" in text and str(no_advertised_url) in text and "TIMESLICE_NATS_URL" in text


async def test_every_refused_server_of_a_list_fails_at_once() -> None:
    url = f"nats://127.0.0.1:{_closed_port()},nats://127.0.0.1:{_closed_port()}"
    err, took = await _connect_error(AsyncTimeSliceClient("j", "g", url, connect_timeout_s=5))
    assert took < 1.0 and getattr(err, "refused", False) and url in str(err)


async def test_a_refused_server_beside_a_live_one_is_passed_over(nats_url: str) -> None:
    async with AsyncTimeSliceClient(
        "j", "g", f"nats://127.0.0.1:{_closed_port()},{nats_url}", connect_timeout_s=5
    ) as c:
        assert c._nc is not None and c._nc.is_connected


@contextlib.asynccontextmanager
async def _silent_server() -> AsyncIterator[str]:
    """A port that accepts connections and never says a word (a hung or wrong server)."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_silent_server_fails_within_the_connect_timeout() -> None:
    async with _silent_server() as url:
        err, took = await _connect_error(AsyncTimeSliceClient("j", "g", url, connect_timeout_s=1.5))
    assert took < 1.5 + 0.5, f"the connect took {took:.2f} s, more than its connect_timeout_s of 1.5 s"
    assert url in str(err) and not getattr(err, "refused", True)


async def test_no_url_anywhere_says_it_tried_the_default_and_how_to_set_one(
    no_advertised_url: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = f"nats://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(bus, "_DEFAULT_URL", default)  # port 4222 of this machine may be anyone's
    err, took = await _connect_error(AsyncTimeSliceClient("j", "g", connect_timeout_s=5))
    text = str(err)
    assert took < 1.0 and default in text
    assert "the default" in text and "no URL was given" in text and str(no_advertised_url) in text
    assert "`timeslice up`" in text and "TIMESLICE_NATS_URL" in text and "nats_url=" in text


async def test_a_stale_url_file_is_named(no_advertised_url: Path) -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    no_advertised_url.parent.mkdir(parents=True)
    no_advertised_url.write_text(url + "\n")
    err, _ = await _connect_error(AsyncTimeSliceClient("j", "g", connect_timeout_s=5))
    assert f"advertised by `timeslice up` in {no_advertised_url}" in str(err) and "is not running" in str(err)


async def test_the_env_var_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("TIMESLICE_NATS_URL", url)
    err, _ = await _connect_error(AsyncTimeSliceClient("j", "g", connect_timeout_s=5))
    assert url in str(err) and "from $TIMESLICE_NATS_URL" in str(err)


_ONE_BAD_URL = [  # the error names the URL itself as the entry it refused
    ("http://127.0.0.1:4222", "unknown scheme"),
    ("nats://:4222", "no host"),
    ("nats://127.0.0.1:99999", "Port out of range"),
    ("nats://127.0.0.1:x", "cannot read it"),
]


@pytest.mark.parametrize(
    ("url", "entry", "why"),
    [
        *[(url, url, why) for url, why in _ONE_BAD_URL],
        ("nats://a:4222,,nats://b:4222", "", "empty entry"),  # a list's empty entry: named as ""
        ("nats://a:4222,", "", "empty entry"),
    ],
)
def test_a_malformed_url_is_refused_when_the_client_is_made(url: str, entry: str, why: str) -> None:
    invalid = getattr(errors, "InvalidNatsUrl", ())  # in the error tree of errors.py
    for make in (AsyncTimeSliceClient, TimeSliceClient):
        with pytest.raises(errors.TimeSliceError) as info:
            make("j", "g", url)
        assert isinstance(info.value, invalid) and isinstance(info.value, ValueError), type(info.value)
        assert getattr(info.value, "entry", None) == entry and why in str(info.value)


def test_a_malformed_default_is_refused_naming_where_it_came_from(
    no_advertised_url: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESLICE_NATS_URL", "nats://a:1,,nats://b:2")
    with pytest.raises(errors.TimeSliceError, match=r"\$TIMESLICE_NATS_URL"):
        AsyncTimeSliceClient("j", "g")
    monkeypatch.delenv("TIMESLICE_NATS_URL")
    no_advertised_url.parent.mkdir(parents=True)
    no_advertised_url.write_text("bogus://x:1\n")
    with pytest.raises(errors.TimeSliceError) as info:
        AsyncTimeSliceClient("j", "g")
    assert str(no_advertised_url) in str(info.value) and "unknown scheme" in str(info.value)


async def _record_is(c: AsyncTimeSliceClient, holder: str | None, epoch: int) -> bool:
    """The group's status says so: read by the job that made the calls, it reflects them (``status()`` waits for the
    record, which the orchestrator writes behind its answers), and once it does, the record is stored for others."""
    rec = await c.status()
    return (rec.holder.job if rec.holder else None, rec.epoch) == (holder, epoch)


@pytest.mark.usefixtures("orchestrator")
async def test_not_holder_names_the_groups_epoch_and_holder(nats_url: str) -> None:
    async with AsyncTimeSliceClient("a", "gm", nats_url) as a, AsyncTimeSliceClient("b", "gm", nats_url) as b:
        for _ in range(3):
            await a.acquire(timeout=10)
            await a.release()
        assert await _record_is(a, None, 3), "the record: nobody holds it, epoch 3"
        with pytest.raises(NotHolder) as idle:
            await b.release()
        assert (idle.value.holder, idle.value.epoch) == (None, 3) and "epoch 3" in str(idle.value)
        g = await a.acquire(timeout=10)
        assert g.epoch == 4
        assert await _record_is(a, "a", 4), "the record: a holds it at epoch 4"
        with pytest.raises(NotHolder) as held:
            await b.release()
        assert (held.value.holder, held.value.epoch) == ("a", 4)
        assert "job 'a' holds it at epoch 4" in str(held.value)
        await a.release()
        assert await _record_is(a, None, 4), "the record: nobody holds it, epoch 4"
        with pytest.raises(NotHolder) as again:  # a second release of the same job
            await a.release()
        assert (again.value.holder, again.value.epoch) == (None, 4)
