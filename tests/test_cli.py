"""The ``timeslice`` command's conventions, as real processes (``python -m timeslice_cli``) against a real
nats-server and orchestrator: one line and a non-zero exit for every error, never a traceback; quiet on a closed
pipe; ``--version``; global flags after the command; help on every flag; ``--json`` a flag everywhere; ``status
--watch`` that fits the terminal and writes no control codes elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from timeslice_cli import build_parser
from timeslice_client import AsyncTimeSliceClient

from .agent_harness import ROOT
from .helpers import eventually_sync

CLI = [sys.executable, "-m", "timeslice_cli"]


def _env() -> dict[str, str]:
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    env.pop("TIMESLICE_CREDS", None)
    return env


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT, check=False
    )


def _one_clear_line(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The command failed and ended in one line on stderr (``timeslice...: ...``, after any log lines), with no
    traceback, naming every needle."""
    assert r.returncode not in (0, None), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("timeslice")]
    assert len(said) == 1 and lines[-1] == said[0], r.stderr
    for n in needles:
        assert n in said[0], (n, said[0])
    return said[0]


def _subparsers(p: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, child in a.choices.items():
                yield name, child
                for sub_name, grandchild in _subparsers(child):
                    yield f"{name} {sub_name}", grandchild


# ---------------------------------------------------------------------- without a server


def test_version() -> None:
    r = _run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("timeslice 0."), r.stdout


def test_a_bad_log_level_is_one_line() -> None:
    _one_clear_line(_run("--log-level", "foo", "status"), "foo", "debug, info")
    _one_clear_line(_run("status", "--log-level", "foo"), "foo")  # after the command too


def test_every_flag_has_help_and_json_is_a_flag_everywhere() -> None:
    missing, json_files = [], []
    for name, cmd in _subparsers(build_parser()):
        for a in cmd._actions:
            if isinstance(a, argparse._SubParsersAction):
                continue  # its commands are checked as parsers of their own
            if not a.help or a.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
            if "--json" in a.option_strings and a.nargs != 0:
                json_files.append(name)
    assert not missing, f"flags without help: {missing}"
    assert not json_files, f"--json takes a value (use -o FILE for a file): {json_files}"


def test_global_flags_after_the_command() -> None:
    p = build_parser()
    args = p.parse_args(["status", "--group", "g", "--log-level", "warning", "--debug"])
    assert args.log_level == "warning" and args.debug is True
    args = p.parse_args(["--log-level", "error", "status"])
    assert args.log_level == "error" and args.debug is False  # not reset by the command's defaults
    assert p.parse_args(["auth", "init", "--debug"]).debug is True


def test_a_command_whose_module_fails_to_import_says_so() -> None:
    code = (
        "import sys; sys.modules['timeslice_cli._auth'] = None; from timeslice_cli import main; "
        "sys.exit(main(['auth', 'init']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env(), check=False
    )
    _one_clear_line(r, "cannot load", "timeslice-server")


def test_the_service_packages_point_to_the_command() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "timeslice_orchestrator", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        check=False,
    )
    assert r.returncode == 2 and "timeslice_cli" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------- against a server


def test_an_invalid_group_id_is_blamed_not_the_bus(nats_url: str) -> None:
    _one_clear_line(_run("status", "--group", "a b", "--nats-url", nats_url), "invalid group id", "'a b'")


@pytest.mark.usefixtures("orchestrator")
async def test_clear_fault_exits_non_zero_when_refused(nats_url: str) -> None:
    r = await asyncio.to_thread(_run, "clear-fault", "--group", "g", "--job", "a/b", "--nats-url", nats_url)
    _one_clear_line(r, "invalid job id")
    r = await asyncio.to_thread(_run, "clear-fault", "--group", "nosuch", "--job", "a", "--nats-url", nats_url)
    _one_clear_line(r, "no group")


def test_agent_status_for_a_node_without_an_agent_is_one_line(nats_url: str) -> None:
    _one_clear_line(
        _run("agent-status", "--node-id", "nosuch", "--timeout", "1", "--nats-url", nats_url),
        "no agent answers for node 'nosuch'",
    )


def test_an_unreachable_server_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    r = _run("events", "--nats-url", f"nats://127.0.0.1:{port}", timeout=90)
    _one_clear_line(r)


def _piped_to_head(args: list[str], timeout: float = 60) -> tuple[int, str]:
    """``timeslice ARGS | head -n 1``: timeslice's exit code and stderr."""
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    head = subprocess.Popen(["head", "-n", "1"], stdin=proc.stdout, stdout=subprocess.DEVNULL)
    proc.stdout.close()  # only head reads it now
    try:
        head.wait(timeout)
        err = proc.stderr.read().decode()
        proc.wait(timeout)
    finally:
        for p in (proc, head):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return proc.returncode, err


async def _fill(nats_url: str, rounds: int) -> None:
    async with AsyncTimeSliceClient("a", "gpipe", nats_url, fast_reacquire=False) as a:
        for _ in range(rounds):
            await a.acquire(timeout=10)
            await a.release()


@pytest.mark.usefixtures("orchestrator")
async def test_a_closed_pipe_ends_quietly(nats_url: str) -> None:
    await _fill(nats_url, 300)
    for args in (["events"], ["events", "--json"], ["replay", "--json"], ["status", "--watch", "--json"]):
        rc, err = await asyncio.to_thread(_piped_to_head, [*args, "--nats-url", nats_url])
        assert "Traceback" not in err and "BrokenPipe" not in err, (args, err)
        assert rc in (0, 141), (args, rc, err)


@pytest.mark.usefixtures("orchestrator")
async def test_status_watch_into_a_file_writes_no_control_codes(nats_url: str, tmp_path: Path) -> None:
    await _fill(nats_url, 1)
    out = tmp_path / "watch.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [*CLI, "status", "--watch", "--nats-url", nats_url], stdout=f, stderr=subprocess.PIPE, env=_env(), cwd=ROOT
        )
    try:
        await asyncio.to_thread(
            eventually_sync, lambda: out.read_text().count("GROUP") >= 2, timeout=20, what="two frames written"
        )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    text = out.read_text()
    assert "\x1b" not in text, repr(text[:200])
    assert "gpipe" in text


async def _read_some(fd: int, wait_s: float = 1.0) -> bytes:
    """What the terminal's master side has within ``wait_s`` (b"" when nothing, or the other side is closed)."""
    ready, _, _ = await asyncio.to_thread(select.select, [fd], [], [], wait_s)
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every slave side is closed (the CLI exited)
        return b""


@pytest.mark.usefixtures("orchestrator")
async def test_status_watch_on_a_terminal_fits_its_width(nats_url: str, tmp_path: Path) -> None:
    async with AsyncTimeSliceClient("a-job-with-a-long-name", "a-group-with-a-long-name", nats_url) as a:
        await a.acquire(timeout=10)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 52, 0, 0))
        env = _env()
        env.pop("COLUMNS", None)
        # stderr to a file, not a pipe nobody reads: a pipe that fills would block the CLI and look like a hang
        err = tmp_path / "stderr.txt"
        with err.open("wb") as err_file:
            proc = subprocess.Popen(
                [*CLI, "status", "--watch", "--nats-url", nats_url],
                stdin=slave,
                stdout=slave,
                stderr=err_file,
                env=env,
                cwd=ROOT,
            )
        os.close(slave)
        seen = b""
        try:
            deadline = time.monotonic() + 20
            while seen.count(b"\x1b[2J") < 2 and time.monotonic() < deadline:  # two frames, each on a cleared screen
                seen += await _read_some(master)
            proc.send_signal(signal.SIGINT)
            # keep reading the terminal while the CLI stops: its frames must never wait on a full pty
            deadline = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < deadline:
                seen += await _read_some(master, wait_s=0.2)
            exited = proc.poll()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            os.close(master)
        await a.release()
    assert exited == 0, f"status --watch did not stop within 20 s of SIGINT (rc {exited}): {err.read_text()[-3000:]}"
    frame = seen.split(b"\x1b[2J")[1].decode(errors="replace")
    frame = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame)  # the colours and the cursor's move home: no width
    lines = [ln.rstrip("\r") for ln in frame.split("\n") if ln.strip()]
    assert lines and any("a-group-with-a" in ln for ln in lines), frame
    assert all(len(ln) <= 52 for ln in lines), [len(ln) for ln in lines]
