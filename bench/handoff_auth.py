"""What auth and TLS cost a handoff: the same stack with and without them, in the same run.

Three stacks side by side, each a private nats-server and the orchestrator as its own process (as `timeslice up`
deploys them): *plain* (no auth, ``nats://``), *auth* (operator-mode JWT credentials from ``timeslice auth``, a user
per process with its role's permissions) and *auth + TLS* (the same over TLS with a throwaway CA, ``tls://``). On
each, two job processes ping-pong a group (``bench/handoff.py``'s P1: job A calls release() -> job B's pending
acquire() returns); the rounds alternate the stacks' order so that all see the same machine. Every handoff is
preceded by the same idle gap (``--gap-ms``; on the development VM latency grows with the idle time before a
message: CPU wake-ups). Prints p50/p99 of each and their ratio, and the CPU each kind of process (nats-server, the
orchestrator, the two jobs) spent per handoff on each stack: where what auth and TLS add goes.

Run: ``python bench/handoff_auth.py [--n 1000] [--rounds 2] [--gap-ms 2]`` (``--quick``: n 200, 1 round).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
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


def _round(s: _Stack, tmp: Path, k: int, n: int, gap_ms: float) -> list[float]:
    """One ping-pong of ``n`` handoffs on group ``bench-<k>``: the handoff latencies (ms), warm-up tenth skipped."""
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
    rows = [r for out in outs for r in json.loads(out.read_text())]
    grants = {e: t for kind, e, t in rows if kind == "g"}
    releases = {e: t for kind, e, t in rows if kind == "r"}
    hand = [(grants[e + 1] - releases[e]) / 1e6 for e in sorted(releases) if e + 1 in grants]
    return hand[len(hand) // 10 :]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that ended (the job processes of the rounds so far)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(n: int, rounds: int, gap_ms: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-auth-"))
    stacks: list[_Stack] = []
    try:
        stacks = [_plain(tmp), _secure(tmp, tls=False), _secure(tmp, tls=True)]
        for s in stacks:
            _start_orchestrator(s)
        samples: dict[str, list[float]] = {s.name: [] for s in stacks}
        # Where the time goes: CPU seconds per process kind, per stack (on a machine with few cores, CPU spent
        # anywhere on the path is latency). The jobs' share includes their interpreter's start, the same on each.
        cpu: dict[str, dict[str, float]] = {s.name: {"server": 0.0, "orchestrator": 0.0, "jobs": 0.0} for s in stacks}
        for k in range(rounds):
            for s in stacks if k % 2 == 0 else reversed(stacks):
                assert s.orch is not None
                before = (_cpu_s(s.server_pid), _cpu_s(s.orch.pid), _children_cpu_s())
                samples[s.name] += _round(s, tmp, k, n, gap_ms)
                after = (_cpu_s(s.server_pid), _cpu_s(s.orch.pid), _children_cpu_s())
                for kind, b, e in zip(("server", "orchestrator", "jobs"), before, after, strict=True):
                    cpu[s.name][kind] += e - b
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
    for key in ("auth", "secure"):
        out[f"{key}_ratio_p50"] = out[f"{key}_p50_ms"] / out["plain_p50_ms"]
        out[f"{key}_ratio_p99"] = out[f"{key}_p99_ms"] / out["plain_p99_ms"]
    for name, key in (("plain", "plain"), ("auth", "auth"), ("auth+tls", "secure")):
        out[f"{key}_cpu_us_per_handoff"] = {kind: round(1e6 * v / (n * rounds)) for kind, v in cpu[name].items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000, help="handoffs per round and stack")
    p.add_argument("--rounds", type=int, default=2, help="rounds, alternating the stacks' order")
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
    print("CPU per handoff (µs; the jobs' share includes their start, the same on each stack):")
    for key, label in (("plain", "plain"), ("auth", "auth"), ("secure", "auth + TLS")):
        c = res[f"{key}_cpu_us_per_handoff"]
        print(
            f"  {label:<15} nats-server {c['server']:>5}   orchestrator {c['orchestrator']:>5}   "
            f"two jobs {c['jobs']:>5}"
        )


if __name__ == "__main__":
    main()
