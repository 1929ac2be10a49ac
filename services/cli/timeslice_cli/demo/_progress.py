"""Live progress of the demo's jobs: one line per job, redrawn in place on a terminal, a line every
few steps otherwise (logs, CI). Holds only each job's latest state, so it stays small however long
the run."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from . import _messages as m

__all__ = ["Progress"]

_REDRAW_S = 0.25


@dataclass(slots=True)
class _Line:
    job: str
    run: str
    steps: int
    step: int = 0
    phase: str = "starting"
    holding: bool = False
    reward: float | None = None
    waited_ms: float = 0.0
    suspends: int = 0
    resumes: int = 0
    offloaded: bool = False
    done: bool = False

    def render(self, state: str | None = None) -> str:
        state = state or ("done" if self.done else ("HOLDING " if self.holding else "") + self.phase)
        where = "off-accelerator" if self.offloaded else "on-accelerator"
        reward = f"{'-':>5}" if self.reward is None else f"{self.reward:5.3f}"
        return (
            f"  {self.job:<8} {self.run:<6} step {self.step:>3}/{self.steps:<3} reward {reward}  "
            f"{state:<20} waited {self.waited_ms / 1000:6.1f}s  state {where:<15} "
            f"moved out/in {self.suspends}/{self.resumes}"
        )


class Progress:
    """Feed it the jobs' messages with :meth:`update`; call :meth:`tick` now and then to redraw."""

    def __init__(self, out: TextIO | None = None, *, live: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._lines: dict[str, _Line] = {}
        self._drawn = 0
        self._last = 0.0

    def start(self, run: str, jobs: list[str], steps: int) -> None:
        self._lines = {j: _Line(j, run, steps) for j in jobs}
        self._drawn = 0
        self.tick(force=True)

    def update(self, run: str, msg: m.JobMessage) -> None:
        """A message from a job of ``run`` (messages of a run not shown now are dropped)."""
        line = self._lines.get(msg.job)
        if line is None or line.run != run:
            return
        if isinstance(msg, m.Built):
            line.phase = f"built ({msg.backend})"
        elif isinstance(msg, m.Ready):
            line.phase = "ready"
        elif isinstance(msg, m.PhaseChange):
            line.step, line.phase, line.holding = msg.step, msg.name, msg.holding
        elif isinstance(msg, m.StepDone):
            line.step, line.reward = msg.step, msg.reward
            line.waited_ms += msg.waited_ms
            every = max(1, line.steps // 4)
            if not self.live and (msg.step % every == 0 or msg.step == line.steps):
                print(line.render("step done"), file=self.out, flush=True)
        elif isinstance(msg, m.Offload):
            if msg.action == "suspend":
                line.suspends += 1
                line.offloaded = True
            else:
                line.resumes += 1
                line.offloaded = False
        elif isinstance(msg, m.Done):
            line.done, line.holding = True, False
        self.tick()

    def tick(self, *, force: bool = False) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last < _REDRAW_S:
            return
        self._last = now
        text = [ln.render() for ln in self._lines.values()]
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + "".join(f"\x1b[2K{t}\n" for t in text))
        self.out.flush()
        self._drawn = len(text)

    def finish(self) -> None:
        self.tick(force=True)
        self._drawn = 0
