"""``timeslice advise``: predict what sharing a group would give jobs that ran alone, before they try it.

Each job's run is read off the stream (its holds and the gaps between them: :func:`trace_of`), the jobs are
started together on one group in simulated time through the orchestrator's own pure core (:func:`simulate`), and
the simulated run gives the makespan, the group's duty cycle and the switches beside the same jobs back to back
(:func:`predict`)::

    events = await read_window(url, since_ms=...)            # timeslice_orchestrator.replay
    replay = fold_events(events, since_ms=...)
    prediction = predict(traces(replay, ["job-a", "job-b"]))
    print(render_prediction(prediction, ...))

What it models and leaves out: docs/scheduling.md, "Predicting a shared run".
"""

from ._model import CostSource, JobOutcome, JobTrace, Phase, Prediction, SwitchCost
from ._predict import predict
from ._simulate import AgentOp, Log, SimRun, agent_op, client_acquire, simulate
from ._text import render_prediction
from ._traces import MAX_JOBS, job_spec, measured_cost, trace_of, traces

__all__ = [
    "MAX_JOBS",
    "AgentOp",
    "CostSource",
    "JobOutcome",
    "JobTrace",
    "Log",
    "Phase",
    "Prediction",
    "SimRun",
    "SwitchCost",
    "agent_op",
    "client_acquire",
    "job_spec",
    "measured_cost",
    "predict",
    "render_prediction",
    "simulate",
    "trace_of",
    "traces",
]
