"""A job process killed during its snapshot, and another process registering as the same job before the agent
noticed the death (``bench/chaos.py``'s job-kill: the victim is killed and its replacement started at once).

The old process's context went with it. The agent used to replace the registration silently: no
``JobUnregistered`` for the old process, so the snapshot it was running, once it saw the processes gone, was
answered as failed with the job still registered; the orchestrator faulted the fresh job for its predecessor's
death, and once an operator cleared that, every later grant of the group showed in ``timeslice check`` as a grant
while the old context might still be loaded (17 ``grant-while-loaded`` in one CI run). Now a registration by other
processes than the registered ones, all of which have exited, first unregisters the old one: the switch ends the
old snapshot as "job gone", nobody is faulted, and the stream checks clean."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
from timeslice_agent import Agent, AgentConfig
from timeslice_client import AsyncTimeSliceClient, GroupRecord
from timeslice_client.protocol import JobRegistered, JobUnregistered, OpKind, OpStarted, decode_input, subjects

from .agent_harness import NODE, Workload, start_cli, switch_under_way
from .helpers import eventually, group_record, running
from .workers import read_stream

GROUP = "g-replaced"


async def test_a_replacement_registered_during_its_predecessors_snapshot_is_not_faulted(
    orchestrator: object, nats_url: str, tmp_path: Path
) -> None:
    # The agent checks a job's processes every 4 s: the replacement registers before it sees the old one gone.
    agent = Agent(AgentConfig(node_id=NODE, nats_url=nats_url, pid_check_s=4.0))
    async with running(agent, timeout=30), AsyncTimeSliceClient("observer", GROUP, nats_url) as observer:
        (tmp_path / "old").mkdir()
        (tmp_path / "new").mkdir()
        old = Workload(tmp_path / "old", nats_url, GROUP, "a", NODE, handler="slow")
        b = Workload(tmp_path, nats_url, GROUP, "b", NODE)
        new: Workload | None = None
        try:
            await switch_under_way(old, b, observer)  # the switch's snapshot of a runs, blocked in a's handler
            old.proc.kill()
            old.proc.wait(10)
            new = Workload(tmp_path / "new", nats_url, GROUP, "a", NODE)
            await new.wait("ready")
            granted = await b.wait("granted", timeout=30)

            async def settled() -> GroupRecord | None:
                rec = await group_record(observer)
                return rec if rec.holder is not None and rec.holder.job == "b" else None

            rec = await eventually(settled, what="the record shows b holding")
            # The old snapshot's command, asked again while it waited, named the old registration: the new process,
            # on the same subject, did not take it for its own (it would have moved its state off for nothing).
            assert new.events("suspend_start") == [], new.events()
            assert "a" not in rec.faulted, rec.faulted  # the fresh process is not faulted for its predecessor
            assert rec.holder is not None and rec.holder.epoch == granted["epoch"]

            stream = await read_stream(nats_url)
            events = [
                (seq, decode_input(data)) for seq, _, subj, data in stream if subj == subjects.agent_event(NODE, GROUP)
            ]
            snap = next(
                msgspec.json.decode(data, type=OpStarted)
                for _, _, subj, data in stream
                if subj == subjects.agent_op(NODE) and b'"job":"a"' in data
            )
            assert snap.kind is OpKind.SNAPSHOT
            regs = [seq for seq, ev in events if isinstance(ev, JobRegistered) and ev.job == "a"]
            gone = [seq for seq, ev in events if isinstance(ev, JobUnregistered) and ev.job == "a"]
            shown = "\n".join(f"{seq} {ev!r}" for seq, ev in events)
            assert len(regs) == 2, shown
            assert gone and regs[0] < gone[0] < regs[1], shown  # the old process left before the new one came

            check = await start_cli(nats_url, "check", "--json", "--timeout", "60")
            out, _ = await asyncio.wait_for(check.communicate(), 120)
            verdict = json.loads(out)
            assert check.returncode == 0 and verdict["ok"], verdict
        finally:
            for w in (old, b, new):
                if w is not None:
                    w.close()
