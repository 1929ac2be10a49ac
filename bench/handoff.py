"""Handoff latency through the real stack, against a raw NATS request-reply baseline from the same run.

Starts a private nats-server and the orchestrator as its own process (as `timeslice up` deploys
them), then:

* P1 handoff: two job processes ping-pong a group; latency = job A calls release() → job B's
  pending acquire() returns (both clocks are CLOCK_MONOTONIC on one host);
* P2 re-acquire: one job alone releases and re-acquires (IDLE_YIELDED, no switch): a claim, which
  returns at the stream's PubAck (``Acquire.claim_epoch``); P2 through the orchestrator: the same with
  ``fast_reacquire=False``, which waits for the orchestrator's grant notice;
* P1 sync, P2 sync: P1 and P2 (a claim) through the blocking ``TimeSliceClient``, and their ratio to the async
  client's (issue 25: within 1.25x); the two clients run in alternating rounds (``--rounds``, default 4: async then
  sync, then sync then async, ...), so that the machine's drift during the run (on the development VM the same
  figure moves by 20-40% between minutes) weighs on both alike;
* baseline: a raw core NATS request-reply to a responder in another process, same server;
* floor: the lock's own path without the lock: a JetStream publish (awaiting its PubAck) that a push
  consumer in another process receives and answers with a core publish, both subjects stored in a
  stream as the lock's requests and notices are; no timeslice code runs, so no lock through the
  orchestrator can beat it; its first part, the JetStream publish until its PubAck, is a claim's floor;
* P3 gRPC handoff: the same ping-pong as P1 through the orchestrator's gRPC API (blocking Acquire /
  Yield calls, as existing gRPC clients make them), latency = A calls Yield → B's Acquire returns;
  beside it, a plain gRPC unary call (health Check) to the same server as the gRPC baseline.

Each measurement is preceded by the same idle gap (``--gap-ms``), since latency grows with idle
time before a message (on the development VM: p50 0.97 ms after 2 ms idle, 2.0 ms after 100 ms; CPU wake-ups).
Run: ``python bench/handoff.py [--n 2000] [--gap-ms 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common
from _common import pct as _pct
from _handoff_workers import run_role

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- driver


def _handoffs(rows: list[list[Any]]) -> list[float]:
    """Release by one job → the next grant, to another job (ms), from all workers' (kind, job, t) rows."""
    hand: list[float] = []
    last: tuple[str, int] | None = None
    for kind, job, t in sorted(rows, key=lambda r: r[2]):
        if kind == "r":
            last = (job, t)
        elif last is not None:
            if last[0] != job:
                hand.append((t - last[1]) / 1e6)
            last = None
    return hand


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT)


def _worker(tmp: Path, role: str, url: str, n: int, gap: str, *args: str) -> Any:
    """One worker process of ``role`` making ``n`` requests after a ``gap`` each; what it wrote, less the warm-up
    tenth."""
    out = tmp / f"{role}.json"
    w = _spawn("--role", role, "--url", url, *args, "--n", str(n), "--gap", gap, "--out", str(out))
    w.wait()
    if w.returncode:
        raise RuntimeError(f"the {role} worker failed")
    return json.loads(out.read_text())[n // 10 :]


def _responder(tmp: Path, role: str, url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """A responder process of ``role``, started and ready (it runs until the driver stops ``procs``)."""
    ready = tmp / f"{role}.ready"
    resp = _spawn("--role", role, "--url", url, "--out", str(ready))
    procs.append(resp)
    _common.wait_file(ready, resp, 30)


def _pingpong_rows(
    tmp: Path,
    url: str,
    group: str,
    n: int,
    gap: str,
    procs: list[subprocess.Popen[bytes]],
    role: str,
    jobs: tuple[str, str] = ("job-a", "job-b"),
) -> list[list[Any]]:
    """Two job processes of ``role`` ping-pong ``group``; their (kind, epoch or job, t) rows together."""
    outs = [tmp / f"{group}-{job}.json" for job in jobs]
    pair = [
        _spawn(
            "--role", role, "--url", url, "--group", group, "--job", job, "--n", str(n), "--gap", gap, "--out", str(o)
        )
        for job, o in zip(jobs, outs, strict=True)
    ]
    procs += pair
    for w in pair:
        w.wait()
    if any(w.returncode for w in pair):
        raise RuntimeError(f"a {role} worker failed")
    return [row for o in outs for row in json.loads(o.read_text())]


def _pingpong_run(
    tmp: Path, url: str, group: str, n: int, gap: str, procs: list[subprocess.Popen[bytes]], role: str
) -> list[float]:
    """Two job processes of ``role`` ping-pong ``group``; the handoffs (ms), less the warm-up tenth."""
    rows = _pingpong_rows(tmp, url, group, n, gap, procs, role)
    grants = {e: t for k, e, t in rows if k == "g"}
    releases = {e: t for k, e, t in rows if k == "r"}
    hand = [(grants[e + 1] - releases[e]) / 1e6 for e in sorted(releases) if e + 1 in grants]
    return hand[len(hand) // 10 :]  # skip the warm-up tenth


def _sync_async_rounds(
    tmp: Path, url: str, n: int, gap: str, procs: list[subprocess.Popen[bytes]], rounds: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """P1 and P2 through each client in ``rounds`` alternating rounds of ``n / rounds`` each (fresh processes and
    groups per round, each less its warm-up tenth): the handoffs and re-acquires (ms) of the async and the sync
    client."""
    per = max(20, n // rounds)
    hand: list[float] = []
    hand_sync: list[float] = []
    re_lat: list[float] = []
    re_sync: list[float] = []
    for r in range(rounds):
        for sync in (False, True) if r % 2 == 0 else (True, False):
            sfx = "-sync" if sync else ""
            (hand_sync if sync else hand).extend(
                _pingpong_run(tmp, url, f"bench{sfx}-{r}", per, gap, procs, f"pingpong{sfx}")
            )
            (re_sync if sync else re_lat).extend(
                x / 1e6 for x in _worker(tmp, f"reacquire{sfx}", url, per, gap, "--group", f"bench-solo{sfx}-{r}")
            )
    return hand, hand_sync, re_lat, re_sync


def run(n: int, gap_ms: float, grpc: bool = False, rounds: int = 4) -> dict[str, Any]:
    from timeslice_orchestrator.embedded import NatsServer

    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-"))
    server = NatsServer(tmp / "nats")
    url = server.start()
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    grpc_target = f"127.0.0.1:{_free_port()}"
    orch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "timeslice_orchestrator",
            "orchestrator",
            "--nats-url",
            url,
            "--grpc-host",
            "127.0.0.1",
            "--grpc-port",
            grpc_target.rsplit(":", 1)[1],
        ],
        env=env,
    )
    procs: list[subprocess.Popen[bytes]] = [orch]
    gap = str(gap_ms / 1000)
    try:
        # Baseline: raw request-reply, responder in another process.
        _responder(tmp, "responder", url, procs)
        base = [x / 1e6 for x in _worker(tmp, "requester", url, n, gap)]

        # Floor: the same path without the lock (JetStream publish -> push consumer -> core notice).
        _responder(tmp, "js-responder", url, procs)
        floor_rows = _worker(tmp, "js-requester", url, n, gap)
        floor = [x / 1e6 for _, x in floor_rows]
        pub_ack = [x / 1e6 for x, _ in floor_rows]

        # P1 and P2 (a claim), through AsyncTimeSliceClient and through TimeSliceClient (the blocking facade), in
        # alternating rounds (async first in even rounds, sync first in odd ones), so that a drift of the machine's
        # speed during the run weighs on both clients alike; then P2 through the orchestrator (claims turned off).
        hand, hand_sync, re_lat, re_sync = _sync_async_rounds(tmp, url, n, gap, procs, rounds)
        re_plain = [x / 1e6 for x in _worker(tmp, "reacquire-plain", url, n, gap, "--group", "bench-solo-plain")]

        # P3: the P1 ping-pong through the gRPC API, and a plain gRPC call as its baseline.
        g_base = [x / 1e6 for x in _worker(tmp, "grpc-requester", grpc_target, n, gap)]
        g_rows = _pingpong_rows(tmp, grpc_target, "bench-grpc", n, gap, procs, "grpc-pingpong", ("grpc-a", "grpc-b"))
        g_hand = _handoffs(g_rows)
        g_hand = g_hand[len(g_hand) // 10 :]
    finally:
        _common.stop_procs(procs)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    b50 = _pct(base, 50)
    f50 = _pct(floor, 50)
    a50 = _pct(pub_ack, 50)
    return {
        "n": n,
        "gap_ms": gap_ms,
        "handoff_p50_ms": _pct(hand, 50),
        "handoff_p99_ms": _pct(hand, 99),
        "reacquire_p50_ms": _pct(re_lat, 50),
        "reacquire_p99_ms": _pct(re_lat, 99),
        "baseline_reqrep_p50_ms": b50,
        "baseline_reqrep_p99_ms": _pct(base, 99),
        "handoff_vs_baseline": _pct(hand, 50) / b50,
        "reacquire_vs_baseline": _pct(re_lat, 50) / b50,
        "floor_js_p50_ms": f50,
        "floor_js_p99_ms": _pct(floor, 99),
        "handoff_vs_floor": _pct(hand, 50) / f50,
        "reacquire_vs_floor": _pct(re_lat, 50) / f50,
        "reacquire_vs_pub_ack": _pct(re_lat, 50) / a50,
        "reacquire_plain_p50_ms": _pct(re_plain, 50),
        "reacquire_plain_p99_ms": _pct(re_plain, 99),
        "reacquire_plain_vs_floor": _pct(re_plain, 50) / f50,
        "floor_pub_ack_p50_ms": a50,
        "floor_pub_ack_p99_ms": _pct(pub_ack, 99),
        "samples": len(hand),
        "handoff_sync_p50_ms": _pct(hand_sync, 50),
        "handoff_sync_p99_ms": _pct(hand_sync, 99),
        "handoff_sync_vs_async": _pct(hand_sync, 50) / _pct(hand, 50),
        "reacquire_sync_p50_ms": _pct(re_sync, 50),
        "reacquire_sync_p99_ms": _pct(re_sync, 99),
        "reacquire_sync_vs_async": _pct(re_sync, 50) / _pct(re_lat, 50),
        "sync_samples": len(hand_sync),
        "sync_async_rounds": rounds,
        "grpc_handoff_p50_ms": _pct(g_hand, 50),
        "grpc_handoff_p99_ms": _pct(g_hand, 99),
        "grpc_baseline_unary_p50_ms": _pct(g_base, 50),
        "grpc_baseline_unary_p99_ms": _pct(g_base, 99),
        "grpc_samples": len(g_hand),
    }


def _print(res: dict[str, Any]) -> None:
    def line(label: str, key: str, tail: str = "") -> None:
        print(f"  {label} p50 {res[f'{key}_p50_ms']:.3f} ms   p99 {res[f'{key}_p99_ms']:.3f} ms{tail}")

    print(f"handoff (A release -> B acquire returns), n={res['samples']}, idle gap {res['gap_ms']} ms")
    line("P1 handoff    ", "handoff", f"   = {res['handoff_vs_baseline']:.2f}x baseline p50")
    line(
        "P2 re-acquire ",
        "reacquire",
        f"   = {res['reacquire_vs_baseline']:.2f}x baseline p50, {res['reacquire_vs_pub_ack']:.2f}x a JetStream "
        "publish+PubAck (a claim)",
    )
    line(
        "P1 sync       ",
        "handoff_sync",
        f"   = {res['handoff_sync_vs_async']:.2f}x P1 (async) p50   (TimeSliceClient, the blocking facade)",
    )
    line("P2 sync       ", "reacquire_sync", f"   = {res['reacquire_sync_vs_async']:.2f}x P2 (async) p50")
    line(
        "P2 through the orchestrator (fast_reacquire=False) ",
        "reacquire_plain",
        f"   = {res['reacquire_plain_vs_floor']:.2f}x floor p50",
    )
    line("baseline: raw NATS request-reply", "baseline_reqrep")
    line(
        "floor: JetStream publish -> push consumer -> core notice, no lock,",
        "floor_js",
        f"   (P1 = {res['handoff_vs_floor']:.2f}x, P2 = {res['reacquire_vs_floor']:.2f}x floor p50)",
    )
    line("of it, the JetStream publish until its PubAck", "floor_pub_ack")
    print(f"gRPC API (blocking Acquire/Yield through the orchestrator's shim), n={res['grpc_samples']}")
    line(
        "P3 gRPC handoff",
        "grpc_handoff",
        f"   (bus client P1 p50 {res['handoff_p50_ms']:.3f} ms, p99 {res['handoff_p99_ms']:.3f} ms)",
    )
    line("baseline: plain gRPC unary call", "grpc_baseline_unary")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--gap-ms", type=float, default=2.0)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--json-out", help="also write the figures, command and machine facts as JSON here")
    p.add_argument("--quick", action="store_true", help="a short run (--n 300)")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="alternating rounds of the async and the sync client for P1 and P2 (each n / rounds; default 4)",
    )
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--group", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--gap", type=float, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role:
        run_role(a)
        return
    if a.quick:
        a.n = min(a.n, 300)
    machine = _common.machine_facts()  # when the run starts: its time and load are those of the start
    res = run(a.n, a.gap_ms, rounds=max(1, a.rounds))
    _common.write_result(a.json_out, "handoff", machine, res)
    if a.json:
        print(json.dumps(res))
        return
    _print(res)


if __name__ == "__main__":
    main()
