"""A workload of the reference API's: ``WorkloadChannel`` streams through stubs that protoc generated from
``tests/reference_api/snapshot_agent_ref.proto`` alone (``--stubs DIR``), in a process of its own (so nothing of
``timeslice_client``'s stubs, nor its descriptor pool, is near it). It does what the reference client does: the first
message registers, each ``AgentCommand`` is answered with a ``CommandResult`` of its command id.

Driven by JSON lines on stdin, reporting JSON lines on stdout:

* ``{"op": "open", "stream": S, "job": J, "group": G, "modes": [1, 2], "default": 1, "tags": [...]}`` opens stream S
  and registers; ``{"op": "open_raw", "stream": S, "first": "<hex>"}`` opens one whose first message is those bytes;
* ``{"op": "fail_next", "stream": S, "error": E}`` answers its next command ok=false; ``{"op": "hold_next", ...}``
  leaves it unanswered; ``{"op": "send_raw", "stream": S, "data": "<hex>"}`` sends bytes as its next message;
* ``{"op": "close", "stream": S}`` ends its requests (half-close); ``{"op": "cancel", "stream": S}`` cancels it.

Reports ``{"event": "command", "stream", "command_id", "kind", "mode", "tags"}`` for each command and
``{"event": "ended", "stream", "code", "details"}`` when a stream ended (``code``: the gRPC status name)."""

from __future__ import annotations

import argparse
import importlib
import json
import queue
import sys
import threading
from typing import Any

import grpc

_lock = threading.Lock()
_END = object()


def emit(**event: Any) -> None:
    with _lock:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


class Stream:
    def __init__(self, name: str, channel: grpc.Channel, pb: Any, first: bytes) -> None:
        self.name, self.pb = name, pb
        self.out: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.plan: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # how to answer the next commands
        call = channel.stream_stream(
            "/snapshot_agent.v1alpha1.SnapshotAgentService/WorkloadChannel",
            request_serializer=lambda b: b,
            response_deserializer=pb.AgentCommand.FromString,
        )
        self.call = call(self._requests(first))
        self.thread = threading.Thread(target=self._serve, name=f"stream-{name}", daemon=True)
        self.thread.start()

    def _requests(self, first: bytes) -> Any:
        yield first
        while (item := self.out.get()) is not _END:
            yield item

    def _serve(self) -> None:
        pb = self.pb
        try:
            for cmd in self.call:
                kind = cmd.WhichOneof("command")
                body = cmd.snapshot if kind == "snapshot" else cmd.restore
                emit(
                    event="command",
                    stream=self.name,
                    command_id=cmd.command_id,
                    kind=kind,
                    mode=cmd.snapshot.mode if kind == "snapshot" else None,
                    tags=list(body.tags),
                )
                how, error = ("ok", "") if self.plan.empty() else self.plan.get()
                if how == "hold":
                    continue
                result = pb.CommandResult(command_id=cmd.command_id, ok=how == "ok", error=error)
                self.out.put(pb.WorkloadMessage(result=result).SerializeToString())
            emit(event="ended", stream=self.name, code="OK", details="")
        except grpc.RpcError as exc:
            emit(event="ended", stream=self.name, code=exc.code().name, details=exc.details() or "")
        finally:
            self.out.put(_END)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--stubs", required=True)
    a = p.parse_args()
    sys.path.insert(0, a.stubs)
    pb = importlib.import_module("snapshot_agent_ref_pb2")
    importlib.import_module("snapshot_agent_ref_pb2_grpc")  # generated beside it: the stub a client would use
    channel = grpc.insecure_channel(a.target)
    streams: dict[str, Stream] = {}
    emit(event="ready")
    for line in sys.stdin:
        req = json.loads(line)
        op, name = req["op"], req.get("stream", "")
        if op == "open":
            caps = pb.WorkloadCapabilities(
                supported_modes=req.get("modes", []), default_mode=req.get("default", 0), tags=req.get("tags", [])
            )
            reg = pb.RegisterWorkload(job_id=req["job"], group=req.get("group", ""), capabilities=caps)
            streams[name] = Stream(name, channel, pb, pb.WorkloadMessage(register=reg).SerializeToString())
        elif op == "open_raw":
            streams[name] = Stream(name, channel, pb, bytes.fromhex(req["first"]))
        elif op == "fail_next":
            streams[name].plan.put(("fail", req["error"]))
        elif op == "hold_next":
            streams[name].plan.put(("hold", ""))
        elif op == "send_raw":
            streams[name].out.put(bytes.fromhex(req["data"]))
        elif op == "close":
            streams[name].out.put(_END)
        elif op == "cancel":
            streams[name].call.cancel()
        emit(event="done", op=op, stream=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
