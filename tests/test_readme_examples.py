"""Every Python example of ``README.md`` runs as written, in order, in one job process against a real stack (a
nats-server, the orchestrator and this host's agent), with only what an example leaves to the reader defined before
it (``model`` and ``optimizer``: a small torch model). A README edit that breaks an example fails here; a new
example that needs more than the examples before it must say what in ``GIVEN``."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from timeslice_agent import Agent, AgentConfig
from timeslice_client.workload import default_node_id

from .helpers import run_text, running

ROOT = Path(__file__).resolve().parents[1]

#: What the README leaves to the reader, by a name its examples use first.
GIVEN = {
    "model": """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """,
}


def readme_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_the_examples_this_test_knows() -> None:
    examples = readme_examples()
    assert len(examples) >= 2, "the README's Python examples moved: update this test's GIVEN"


async def test_every_readme_example_runs_in_order_against_a_real_stack(
    orchestrator: object, nats_url: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="the README's offload example registers a torch model")
    parts = ["import sys"]
    for i, code in enumerate(readme_examples()):
        for name, given in GIVEN.items():
            if re.search(rf"\b{name}\b", code) and not any(re.search(rf"\b{name}\s*=", p) for p in parts):
                parts.append(textwrap.dedent(given))
        parts.append(code.replace("    ...", "    pass"))  # the README's elided body of a function
        parts.append(f"print('example {i + 1} ran', flush=True)")
    parts.append("client.close()")
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(parts))
    env = {k: v for k, v in os.environ.items() if k not in ("TIMESLICE_CREDS",)}
    env.update(
        TIMESLICE_NATS_URL=nats_url,
        PYTHONPATH=os.pathsep.join(
            str(ROOT / p) for p in ("libs", "services/orchestrator", "services/agent", "services/cli")
        ),
    )
    async with running(
        Agent(AgentConfig(node_id=default_node_id(), nats_url=nats_url, socket=str(tmp_path / "agent.sock")))
    ):
        env["TIMESLICE_AGENT_SOCKET"] = str(tmp_path / "agent.sock")
        out = await asyncio.to_thread(run_text, [sys.executable, str(script)], timeout=120, cwd=tmp_path, env=env)
    n = len(readme_examples())
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert [ln for ln in out.stdout.splitlines() if ln.endswith(" ran")] == [
        f"example {i + 1} ran" for i in range(n)
    ], out.stdout
