"""Chaos: groups hand off for minutes while a schedule of bounded faults runs against every part of the stack.

The stack: a 3-node NATS cluster on loopback (stream and buckets at 3 replicas), two orchestrator processes
(leader and hot standby), one agent process (node ``n1``), and ``--groups`` groups of ``--jobs`` job processes
(``bench/_chaos_job.py``: acquire, hold ``--hold-ms``, release; each registered with the agent, so switches run
snapshot and restore operations). Some jobs connect through a TCP proxy on 127.0.0.1, whose connections a fault
cuts. Faults, one every ``--every`` seconds (random kind, each bounded in time):

* ``leader-kill``: SIGKILL of the leading orchestrator (it starts again as the standby);
* ``leader-stop``: SIGSTOP of the leader for 3 s (past its lease), then SIGCONT;
* ``standby-kill``: SIGKILL of the standby (it starts again);
* ``agent-kill``: SIGKILL of the agent (mid-operation when one runs; it starts again at once);
* ``job-kill``: SIGKILL of a job process, holding or waiting (a new process takes its place);
* ``cut``: the proxied jobs' connections cut for 1 s;
* ``nats-restart``: a NATS node (the stream's leader every other time) stopped and started again;
* ``garbage``: 200 malformed, oversized and out-of-range messages on the input subjects.

Scheduling policies under the same faults (off by default): ``--predict`` (the predictive restore), ``--shares``
(weighted fair share, job j of each group weighing j + 1), ``--quantum-ms`` and ``--min-hold-ms``, each set on every
group (or the last ``--policy-groups`` groups, the others staying FIFO) as ``timeslice set-policy`` sets it before the
jobs start; ``--priorities`` gives job j of each group the
priority class j; ``--away-ms`` makes each job stay off the accelerators between a release and its next acquire (job
j for ``away-ms * (1 + j / 2)``, so each has a cycle of its own and the groups are often idle: what the predictive
restore plans on).

Reported: handoffs, faults by kind, the longest time any group had a live waiter but no grant (from the jobs'
logs: the longest gap between grants of a group inside one job's wait), and ``timeslice check``'s verdict over
the whole stream (folded through the core). Fails (exit 1) on any violation. Goals (issue 23): >= 10 minutes
with every fault kind, >= 5,000 handoffs, 0 violations, the longest stall <= lease + 2 s.

Run: ``python bench/chaos.py [--minutes 10] [--groups 3] [--jobs 3] [--every 8] [--json-out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
import msgspec

sys.path.insert(0, str(c.ROOT))  # the loopback cluster and the TCP proxy the tests use
from timeslice_client.bus import connect
from timeslice_client.protocol import GROUPS_BUCKET, STREAM, GroupRecord, SetPolicy, subjects
from timeslice_orchestrator._leadership import holder_pid, read_leader

from tests.tcp_proxy import TcpProxy

KINDS = ("leader-kill", "leader-stop", "standby-kill", "agent-kill", "job-kill", "cut", "nats-restart", "garbage")
LEASE_S = 5.0
NODE = "n1"


class Proc:
    """A process of the stack that faults kill and restart: its argv, its log."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=c.ROOT,
                env=c.child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def _wait_leading(js: Any, orch: list[Proc], timeout: float = 60.0) -> None:
    """Until one of the orchestrator processes leads and its durable consumer is bound."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if (await js.consumer_info(STREAM, "orchestrator")).push_bound:
                return
        if all(p.proc is not None and p.proc.poll() is not None for p in orch):
            raise RuntimeError("every orchestrator exited; see their logs")
        await asyncio.sleep(0.05)  # polling the consumer, bounded by the deadline above
    raise TimeoutError("no orchestrator became ready")


def _garbage(rng: random.Random, groups: list[str]) -> list[tuple[str, bytes]]:
    g = rng.choice(groups)
    big = b"x" * 600_000
    forms = [
        (
            subjects.job(g, "evil", "acquire"),
            b'{"type":"acquire","group":"' + g.encode() + b'","job":"evil","request_id":"' + big + b'"}',
        ),
        (
            subjects.job(g, "evil", "acquire"),
            b'{"type":"acquire","group":"' + g.encode() + b'","job":"evil",'
            b'"request_id":"r","lease_ms":-5,"timeout_ms":1e999}',
        ),
        (
            subjects.job(g, "evil", "release"),
            b'{"type":"release","group":"' + g.encode() + b'","job":"evil",'
            b'"request_id":"r","epoch":99999999999999999999999}',
        ),
        (subjects.job(g, "evil", "renew"), b"\x00\xff not json"),
        (subjects.ctl(g, "tick"), b'{"type":"tick","group":"other-group"}'),
        (subjects.agent_event(NODE, g), b'{"type":"op_result","group":"' + g.encode() + b'","op_id":"","node":"x"}'),
        (
            subjects.job(g, "evil", "cancel"),
            b'{"type":"cancel","group":"' + g.encode() + b'","job":"evil",'
            b'"request_id":"r","reason":"' + b"r" * 5000 + b'"}',
        ),
        (
            f"ts.v1.agent.{NODE}.cmd",
            b'{"type":"snapshot","op_id":"x","group":"a.b","job":"j","node":"n1","epoch":1,"deadline_ms":1}',
        ),
    ]
    return [rng.choice(forms) for _ in range(200)]


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _stalls(logs: dict[str, list[Path]]) -> tuple[float, str]:
    """The longest time a group had a job waiting and granted nobody: per group, the longest gap between the
    group's consecutive grants (and the wait's own start) that lies inside one job's wait."""
    worst, where = 0.0, ""
    for group, paths in logs.items():
        events = [(p, _events(p)) for p in paths]
        grants = sorted(e["t"] for _, evs in events for e in evs if e["ev"] == "granted")
        for _, evs in events:
            for e in evs:
                if e["ev"] != "granted":
                    continue
                start, end = e["asked"], e["t"]
                lo, hi = bisect.bisect_right(grants, start), bisect.bisect_left(grants, end)
                inside = [start, *grants[lo:hi], end]
                gap = max(b - a for a, b in itertools.pairwise(inside))
                if gap > worst:
                    began = time.strftime("%H:%M:%S", time.gmtime(start))
                    worst, where = gap, f"group {group}, a wait that began {began} UTC"
    return worst, where


async def run(a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    tmp = c.scratch_dir("chaos")
    cluster = await c.nats_cluster(tmp, "chaos")
    url = cluster.url
    proxy = await TcpProxy(cluster.urls[0]).start()
    py = sys.executable
    orch = [
        Proc(
            f"orchestrator-{i}",
            [py, "-m", "timeslice_orchestrator", "orchestrator", "--nats-url", url, "--replicas", "3"],
            tmp / f"orchestrator-{i}.log",
        )
        for i in range(2)
    ]
    agent = Proc("agent", [py, "-m", "timeslice_agent", "--node-id", NODE, "--nats-url", url], tmp / "agent.log")
    stop_file = tmp / "stop"
    groups = [f"chaos-{g}" for g in range(a.groups)]
    jobs: list[Proc] = []
    logs: dict[str, list[Path]] = {g: [] for g in groups}
    generation: dict[str, int] = {}

    def job(group: str, j: int) -> Proc:
        name = f"{group}-j{j}"
        n = generation[name] = generation.get(name, -1) + 1
        out = tmp / f"{name}.{n}.jsonl"
        logs[group].append(out)
        via = proxy.url if j == 0 else url  # the first job of each group is behind the proxy
        return Proc(
            name,
            [
                py,
                str(c.BENCH / "_chaos_job.py"),
                "--nats-url",
                via,
                "--group",
                group,
                "--job",
                name,
                "--out",
                str(out),
                "--node",
                NODE,
                "--hold-ms",
                str(a.hold_ms),
                "--lease",
                str(LEASE_S),
                "--stop-file",
                str(stop_file),
                "--away-ms",
                str(a.away_ms * (1 + j / 2)),
                "--priority",
                str(j % 10 if a.priorities else 0),
            ],
            tmp / f"{name}.log",
        )

    faults: dict[str, int] = dict.fromkeys(KINDS, 0)
    fault_log: list[tuple[float, str]] = []
    nc = await connect(url)
    js = nc.jetstream()
    result: dict[str, Any] = {"command": c.command_line(), "machine": c.machine_facts(), "seed": a.seed}
    clears: list[asyncio.Task[None]] = []  # the operator's fault clears after job kills (bounded: 40 s each)
    t_start = time.monotonic()
    try:
        for p in orch:
            p.start()
        await _wait_leading(js, orch)  # the leader creates the stream and buckets at 3 replicas (an agent would not)
        if (policy := _policy(a)) is not None:
            from timeslice_cli._policy import apply_policy

            ruled = groups[len(groups) - a.policy_groups :] if a.policy_groups else groups
            for g in ruled:
                await apply_policy(nc, msgspec.structs.replace(policy, group=g), timeout=60.0)
            result["policy"] = msgspec.to_builtins(policy)
            result["policy_groups"] = ruled
        agent.start()
        await c.wait_agent(url, NODE, timeout=60)  # the jobs register with it
        for g in groups:
            for j in range(a.jobs):
                jobs.append(job(g, j))
                jobs[-1].start()

        async def leader() -> Proc | None:
            with contextlib.suppress(Exception):
                pid = holder_pid(await read_leader(js))
                return next((p for p in orch if p.proc is not None and p.proc.pid == pid), None)
            return None

        async def clear_when_faulted(group: str, name: str, within_s: float = 40.0) -> None:
            """A job killed during one of its switch's operations is faulted once the agent finds its processes
            gone, a moment after the kill (its state is gone); the operator clears that for the process that takes
            its place, as a person would, once it shows. A job killed outside an operation is never faulted."""
            kv = await js.key_value(GROUPS_BUCKET)
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    entry = await kv.get(group)
                    if entry.value and name in msgspec.json.decode(entry.value, type=GroupRecord).faulted:
                        await asyncio.to_thread(
                            subprocess.run,
                            [
                                py,
                                "-m",
                                "timeslice_cli",
                                "--log-level",
                                "warning",
                                "clear-fault",
                                "--nats-url",
                                url,
                                "--group",
                                group,
                                "--job",
                                name,
                            ],
                            cwd=c.ROOT,
                            env=c.child_env(),
                            capture_output=True,
                            timeout=60,
                            check=False,
                        )
                        return
                await asyncio.sleep(0.5)  # polling the record, bounded by the deadline above

        end = t_start + a.minutes * 60
        i = 0
        kinds = list(a.kinds)
        while time.monotonic() < end:
            await asyncio.sleep(a.every)  # the pace of the fault schedule, not a wait for anything
            kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)  # every kind at least once
            i += 1
            if kind in ("leader-kill", "leader-stop", "standby-kill"):
                lead = await leader()
                if lead is None:
                    continue
                target = lead if kind != "standby-kill" else next(p for p in orch if p is not lead)
                assert target.proc is not None
                if kind == "leader-stop":
                    os.kill(target.proc.pid, signal.SIGSTOP)
                    await asyncio.sleep(3.0)  # paused past its lease (1 s)
                    os.kill(target.proc.pid, signal.SIGCONT)
                else:
                    target.kill()
                    target.start()
            elif kind == "agent-kill":
                agent.kill()
                agent.start()
            elif kind == "job-kill":
                victim = rng.choice(jobs)
                victim.kill()
                group, j = victim.name.rsplit("-j", 1)
                jobs[jobs.index(victim)] = fresh = job(group, int(j))
                fresh.start()
                clears.append(asyncio.create_task(clear_when_faulted(group, victim.name)))
            elif kind == "cut":
                proxy.cut()
                await asyncio.sleep(1.0)  # the cut's duration
                proxy.restore()
            elif kind == "nats-restart":
                node = await cluster.stream_leader(STREAM) if faults[kind] % 2 == 0 else rng.randrange(3)
                cluster.stop(node)
                await cluster.restart(node)
            else:
                for subject, data in _garbage(rng, groups):
                    await nc.publish(subject, data)
                await nc.flush()
            faults[kind] += 1
            fault_log.append((round(time.time(), 3), kind))
        await asyncio.gather(*clears)
        stop_file.write_text("stop\n")
        for p in jobs:
            try:
                assert p.proc is not None
                # In a thread: this loop runs the TCP proxy that the first job of each group talks through, and a
                # blocking wait here froze it, cutting those jobs off in their last holds and restores.
                await asyncio.to_thread(p.proc.wait, 120)
            except subprocess.TimeoutExpired:
                p.kill()
        result["minutes"] = round((time.monotonic() - t_start) / 60, 2)
        result["faults"] = faults
        result["fault_log"] = fault_log
        grants = [e for paths in logs.values() for p in paths for e in _events(p) if e["ev"] == "granted"]
        result["handoffs"] = len(grants)
        errors: dict[str, int] = {}
        for paths in logs.values():
            for p in paths:
                for e in _events(p):
                    if e["ev"] == "error":
                        key = f"{e['where']}:{e['type']}"
                        errors[key] = errors.get(key, 0) + 1
        result["job_errors"] = errors
        # Commands the agent's durable consumer delivered again after a restart (its ack floor lags), refused as stale
        agent_log = tmp / "agent.log"
        text = agent_log.read_text(errors="replace") if agent_log.exists() else ""
        result["stale_commands"] = text.count("stale command answered without running")
        stall, where = _stalls(logs)
        result["longest_stall_s"] = round(stall, 3)
        result["longest_stall_where"] = where
        check = _read_stream(py, url, "check")
        result["check_exit"] = check.returncode
        if "policy" in result:
            result["policy_activity"] = _policy_activity(py, url)
        try:
            verdict = json.loads(check.stdout)
            result["check"] = {
                "ok": verdict.get("ok"),
                "summary": verdict.get("summary"),
                "violations": [
                    (
                        v.get("kind"),
                        v.get("group"),
                        v.get("detail"),
                        [(e.get("seq"), e.get("subject")) for e in v.get("events", [])],
                    )
                    for v in verdict.get("violations", [])
                ][:20],
            }
        except ValueError:
            result["check"] = {"ok": False, "summary": (check.stdout + check.stderr)[-2000:]}
        if a.keep and check.returncode != 0:  # the whole stream beside the logs, to read the violations' context
            with (tmp / "events.jsonl").open("wb") as dump:
                subprocess.run(
                    [py, "-m", "timeslice_cli", "--log-level", "warning", "events", "--json", "--nats-url", url],
                    cwd=c.ROOT,
                    env=c.child_env(),
                    stdout=dump,
                    timeout=600,
                    check=False,
                )
        result["orchestrators_alive"] = sum(p.proc is not None and p.proc.poll() is None for p in orch)
    finally:
        for t in clears:
            t.cancel()
        await asyncio.gather(*clears, return_exceptions=True)
        stop_file.write_text("stop\n")
        for p in [*jobs, agent, *orch]:
            with contextlib.suppress(Exception):
                p.stop()
        with contextlib.suppress(Exception):
            await nc.close()
        await proxy.close()
        cluster.close()
        if not a.keep:
            c.remove_dir(tmp)
        else:
            result["scratch"] = str(tmp)
    return result


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {unknown}: choose from {', '.join(KINDS)}")
    return kinds


def print_report(r: dict[str, Any]) -> bool:
    ok = r.get("check_exit") == 0 and bool(r.get("check", {}).get("ok"))
    print(f"chaos: {r['minutes']} min, {r['handoffs']} handoffs, faults {r['faults']}")
    if "policy" in r:
        print(f"policy of groups {r.get('policy_groups')} (set before the jobs started): {r['policy']}")
        print(f"what the policies did (timeslice replay, all groups): {r.get('policy_activity')}")
    print(f"job errors (logged, the loops went on): {r['job_errors']}")
    print(
        "stale commands the agent answered without running (delivered again after its restarts): "
        f"{r.get('stale_commands', 'not counted')}"
    )
    print(
        f"longest live waiter without a grant: {r['longest_stall_s']:.2f} s ({r['longest_stall_where']}); "
        f"goal <= lease {LEASE_S:.0f} s + 2 s: {'met' if r['longest_stall_s'] <= LEASE_S + 2 else 'MISSED'}"
    )
    print(f"timeslice check: exit {r['check_exit']}: {r['check'].get('summary')}")
    for v in r["check"].get("violations", []):
        print(f"  VIOLATION {v}")
    print(f"orchestrators alive at the end: {r['orchestrators_alive']} of 2; verdict: {'ok' if ok else 'FAILED'}")
    return ok


def _read_stream(py: str, url: str, command: str) -> subprocess.CompletedProcess[str]:
    """``timeslice <command> --json`` over the whole stream (``check`` or ``replay``), its output captured."""
    return subprocess.run(
        [py, "-m", "timeslice_cli", "--log-level", "warning", command, "--nats-url", url, "--json", "--timeout", "300"],
        cwd=c.ROOT,
        env=c.child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


_ACTIVITY = ("yield_requests", "min_holds_kept", "fair_share_choices", "predictions", "predictions_hit")


def _policy_activity(py: str, url: str) -> dict[str, int] | str:
    """What the policies did over the whole stream, summed over the groups (``timeslice replay``'s summary; FIFO
    groups count none): that a run with a policy really exercised it. A string (the reason) when replay failed."""
    out = _read_stream(py, url, "replay")
    try:
        groups = json.loads(out.stdout)["summary"]["groups"].values()
    except (ValueError, KeyError, AttributeError):
        return f"timeslice replay exited {out.returncode}: {(out.stdout + out.stderr)[-300:]}"
    return {k: sum(int(g.get(k, 0)) for g in groups) for k in _ACTIVITY}


def _policy(a: argparse.Namespace) -> SetPolicy | None:
    """The policy every group gets before its jobs start (its ``group`` filled in per group), or None: FIFO."""
    shares = {f"chaos-{g}-j{j}": j + 1 for g in range(a.groups) for j in range(a.jobs)} if a.shares else None
    policy = SetPolicy(
        group="chaos",
        quantum_ms=a.quantum_ms or None,
        min_hold_ms=a.min_hold_ms or None,
        predict=True if a.predict else None,
        shares=shares,
    )
    return None if policy == SetPolicy(group="chaos") else policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--every", type=float, default=8.0, help="seconds between faults")
    p.add_argument("--hold-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs) and say where")
    p.add_argument(
        "--kinds",
        type=_kinds,
        default=KINDS,
        help=f"comma-separated fault kinds to run (default: all of {','.join(KINDS)})",
    )
    p.add_argument("--predict", action="store_true", help="every group with the predictive restore on")
    p.add_argument("--shares", action="store_true", help="weighted fair share: job j of each group weighs j + 1")
    p.add_argument("--quantum-ms", type=int, default=0, help="every group's quantum (0: none)")
    p.add_argument("--min-hold-ms", type=int, default=0, help="every group's minimum hold (0: none)")
    p.add_argument(
        "--policy-groups",
        type=int,
        default=0,
        help="set the policy on the last N groups only, the others staying FIFO (default 0: every group)",
    )
    p.add_argument("--priorities", action="store_true", help="job j of each group asks in priority class j")
    p.add_argument(
        "--away-ms",
        type=float,
        default=0.0,
        help="each job's time off the accelerators between its release and its next acquire",
    )
    p.add_argument("--json-out", default=None)
    p.add_argument("--quick", action="store_true", help="one minute, a fault every 5 s (every kind once)")
    a = p.parse_args()
    if a.quick:
        a.minutes, a.every = 1.0, 5.0
    c.run_and_report(run(a), print_report, a.json_out)


if __name__ == "__main__":
    main()
