"""What auth and TLS cost a handoff: the same stack with and without them, in the same run.

Three stacks side by side, each a private nats-server and the orchestrator as its own process (as `timeslice up`
deploys them): *plain* (no auth, ``nats://``), *auth* (operator-mode JWT credentials from ``timeslice auth``, a user
per process with its role's permissions) and *auth + TLS* (the same over TLS with a throwaway CA, ``tls://``). On
each, two job processes ping-pong a group (``bench/handoff.py``'s P1: job A calls release() -> job B's pending
acquire() returns); the rounds alternate the stacks' order so that all see the same machine. Every handoff is
preceded by the same idle gap (``--gap-ms``; on the development VM latency grows with the idle time before a
message: CPU wake-ups). Prints p50/p99 of each and their ratio, and the CPU each kind of process (nats-server, the
orchestrator, the two jobs, each from connected to done) spent per handoff on each stack: where what auth and TLS add
goes.

Each round runs the three stacks one after the other, in an order that turns from round to round; besides the p50
over all rounds, each round's ratio to the plain stack of the same round is printed and their median. Auth adds no
work per message (the server checks a subject against the user's permissions, cached), so the spread of its ratios
around 1 shows how far this run's noise reaches.

Run: ``python bench/handoff_auth.py [--n 350] [--rounds 6] [--gap-ms 2]`` (``--quick``: n 200, 1 round).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the throwaway CA and secured server of the tests (tests/auth_stack.py)


@dataclass
class _Stack:
    name: str
    url: str
    env: dict[str, str]  # the job processes' environment (their credentials and CA, by path)
    stop: Any
    server_pid: int
    orch: subprocess.Popen[bytes] | None = None


def _plain(tmp: Path) -> _Stack:
    from timeslice_orchestrator.embedded import NatsServer

    server = NatsServer(tmp / "plain")
    url = server.start()
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    for k in ("TIMESLICE_CREDS", "TIMESLICE_TLS_CA", "TIMESLICE_TLS_CERT", "TIMESLICE_TLS_KEY"):
        env.pop(k, None)
    assert server.proc is not None
    return _Stack("plain", url, env, server.stop, server.proc.pid)


def _secure(tmp: Path, *, tls: bool) -> _Stack:
    from tests.auth_stack import start_secure_bus

    bus = start_secure_bus(tmp / f"secure-{tls}", tls=tls)
    env = dict(os.environ, TIMESLICE_LOG_LEVEL="warning")
    if bus.certs is not None:
        env["TIMESLICE_TLS_CA"] = str(bus.certs.ca)
    assert bus.server.proc is not None
    stack = _Stack("auth+tls" if tls else "auth", bus.url, env, bus.stop, bus.server.proc.pid)
    stack.env["_ORCH_CREDS"] = str(bus.creds("orchestrator"))
    stack.env["_JOB_A"] = str(bus.creds("job", "job-a"))
    stack.env["_JOB_B"] = str(bus.creds("job", "job-b"))
    return stack


def _start_orchestrator(s: _Stack) -> None:
    env = dict(s.env)
    if "_ORCH_CREDS" in env:
        env["TIMESLICE_CREDS"] = env["_ORCH_CREDS"]
    s.orch = subprocess.Popen(
        [sys.executable, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", s.url], env=env, cwd=ROOT
    )


@dataclass
class _Round:
    handoffs_ms: list[float]  # the warm-up tenth left out
    count: int  # every handoff of the round
    jobs_cpu_s: float  # the two jobs' CPU from connected to done (their interpreters' start left out)


def _round(s: _Stack, tmp: Path, k: int, n: int, gap_ms: float) -> _Round:
    """One ping-pong of ``n`` cycles a job on group ``bench-<k>``."""
    outs, procs = [], []
    for job in ("job-a", "job-b"):
        env = dict(s.env)
        if f"_JOB_{job[-1].upper()}" in env:
            env["TIMESLICE_CREDS"] = env[f"_JOB_{job[-1].upper()}"]
        out = tmp / f"{s.name}-{k}-{job}.json"
        outs.append(out)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "bench" / "handoff.py"),
                    "--role",
                    "pingpong",
                    "--url",
                    s.url,
                    "--group",
                    f"bench-{k}",
                    "--job",
                    job,
                    "--n",
                    str(n),
                    "--gap",
                    str(gap_ms / 1000),
                    "--out",
                    str(out),
                ],
                env=env,
                cwd=ROOT,
            )
        )
    for p in procs:
        if p.wait(timeout=600):
            raise RuntimeError(f"a ping-pong worker on the {s.name} stack failed ({p.returncode})")
    per_job = [json.loads(out.read_text()) for out in outs]
    rows = [r for job_rows in per_job for r in job_rows]
    grants = {e: t for kind, e, t in rows if kind == "g"}
    releases = {e: t for kind, e, t in rows if kind == "r"}
    hand = [(grants[e + 1] - releases[e]) / 1e6 for e in sorted(releases) if e + 1 in grants]
    cpu_ns = 0
    for job_rows in per_job:
        marks = {e: t for kind, e, t in job_rows if kind == "c"}
        cpu_ns += marks[1] - marks[0]
    return _Round(hand[len(hand) // 10 :], len(hand), cpu_ns / 1e9)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _order(stacks: list[_Stack], k: int) -> list[_Stack]:
    """Round ``k``'s order of the stacks: each round starts with the next one, and odd rounds go backwards, so that
    over six rounds each stack runs first, second and last alike (after a fresh start, or after another stack)."""
    turned = stacks[k % len(stacks) :] + stacks[: k % len(stacks)]
    return turned if (k // len(stacks)) % 2 == 0 else turned[::-1]


def run(n: int, rounds: int, gap_ms: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-auth-"))
    stacks: list[_Stack] = []
    try:
        stacks = [_plain(tmp), _secure(tmp, tls=False), _secure(tmp, tls=True)]
        for s in stacks:
            _start_orchestrator(s)
        for s in stacks:  # a short round, not counted: each orchestrator started (its own start's CPU left out)
            _round(s, tmp, rounds, 20, gap_ms)
        samples: dict[str, list[float]] = {s.name: [] for s in stacks}
        # Where the time goes: CPU seconds per process kind, per stack (on a machine with few cores, CPU spent
        # anywhere on the path is latency). The jobs' own from connected to done; the server's and the orchestrator's
        # over the round, the jobs' connections included (a few ms a round).
        cpu: dict[str, dict[str, float]] = {s.name: {"server": 0.0, "orchestrator": 0.0, "jobs": 0.0} for s in stacks}
        handoffs = dict.fromkeys(samples, 0)
        # Each stack's p50 per round, beside the others' of the same round: the ratio of a round is measured over
        # minutes in which the three met the same machine, and their median does not follow one noisy round.
        per_round: list[dict[str, float]] = []
        for k in range(rounds):
            this: dict[str, float] = {}
            for s in _order(stacks, k):
                assert s.orch is not None
                before = (_cpu_s(s.server_pid), _cpu_s(s.orch.pid))
                got = _round(s, tmp, k, n, gap_ms)
                after = (_cpu_s(s.server_pid), _cpu_s(s.orch.pid))
                samples[s.name] += got.handoffs_ms
                this[s.name] = _common.pct(got.handoffs_ms, 50)
                handoffs[s.name] += got.count
                for kind, b, e in zip(("server", "orchestrator"), before, after, strict=True):
                    cpu[s.name][kind] += e - b
                cpu[s.name]["jobs"] += got.jobs_cpu_s
            per_round.append(this)
    finally:
        for s in stacks:
            if s.orch is not None:
                s.orch.terminate()
                s.orch.wait(30)
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {"n": n, "rounds": rounds, "gap_ms": gap_ms, "samples": len(samples["plain"])}
    for name, key in (("plain", "plain"), ("auth", "auth"), ("auth+tls", "secure")):
        out[f"{key}_p50_ms"] = _common.pct(samples[name], 50)
        out[f"{key}_p99_ms"] = _common.pct(samples[name], 99)
    for name, key in (("auth", "auth"), ("auth+tls", "secure")):
        out[f"{key}_ratio_p50"] = out[f"{key}_p50_ms"] / out["plain_p50_ms"]
        out[f"{key}_ratio_p99"] = out[f"{key}_p99_ms"] / out["plain_p99_ms"]
        ratios = [r[name] / r["plain"] for r in per_round]
        out[f"{key}_round_ratios_p50"] = [round(x, 3) for x in ratios]
        out[f"{key}_ratio_p50_median_of_rounds"] = statistics.median(ratios)
    for name, key in (("plain", "plain"), ("auth", "auth"), ("auth+tls", "secure")):
        out[f"{key}_cpu_us_per_handoff"] = {kind: round(1e6 * v / handoffs[name]) for kind, v in cpu[name].items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=350, help="handoffs per job, round and stack (a ping-pong: 2n handoffs)")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each in another order of the stacks")
    p.add_argument("--gap-ms", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="a short run (--n 200, one round)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--json-out", help="also write the figures, command and machine facts as JSON here")
    a = p.parse_args()
    if a.quick:
        a.n, a.rounds = min(a.n, 200), 1
    machine = _common.machine_facts()
    res = run(a.n, a.rounds, a.gap_ms)
    _common.write_result(a.json_out, "handoff_auth", machine, res)
    if a.json:
        print(json.dumps(res))
        return
    print(
        f"handoff (A release -> B acquire returns), {res['samples']} samples per stack, idle gap {res['gap_ms']} ms, "
        f"load {machine.get('loadavg_1m', '?')} at the start"
    )
    print(f"  plain           p50 {res['plain_p50_ms']:.3f} ms   p99 {res['plain_p99_ms']:.3f} ms")
    for key, label in (("auth", "auth"), ("secure", "auth + TLS")):
        print(
            f"  {label:<15} p50 {res[f'{key}_p50_ms']:.3f} ms   p99 {res[f'{key}_p99_ms']:.3f} ms   "
            f"(x{res[f'{key}_ratio_p50']:.3f} p50, x{res[f'{key}_ratio_p99']:.3f} p99 of plain)"
        )
    print("p50 ratio to plain, round by round (each round's stacks one after the other), and their median:")
    for key, label in (("auth", "auth"), ("secure", "auth + TLS")):
        rounds = " ".join(f"{x:.3f}" for x in res[f"{key}_round_ratios_p50"])
        print(f"  {label:<15} {rounds}   median x{res[f'{key}_ratio_p50_median_of_rounds']:.3f}")
    print(
        "  (auth adds no work per message: how far its ratios stray from 1 is this run's noise, which the TLS "
        "figure carries too)"
    )
    print("CPU per handoff (µs; the two jobs' from connected to done, nats-server's and the orchestrator's per round):")
    for key, label in (("plain", "plain"), ("auth", "auth"), ("secure", "auth + TLS")):
        c = res[f"{key}_cpu_us_per_handoff"]
        print(
            f"  {label:<15} nats-server {c['server']:>5}   orchestrator {c['orchestrator']:>5}   "
            f"two jobs {c['jobs']:>5}"
        )


if __name__ == "__main__":
    main()
