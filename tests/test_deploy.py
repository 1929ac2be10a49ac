"""The deployment files stay in step with the code: every command they run parses with today's CLI, the
ports they publish are the ports those commands serve, the orchestrator never runs twice, and the image
copies paths that exist. (No Docker engine or cluster answers here or in CI, so this is what can be checked.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from timeslice_orchestrator.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on an unknown flag or a missing value
        pytest.fail(f"`timeslice {' '.join(argv)}` does not parse with the current CLI (exit {exc.code})")


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_compose_commands_parse_and_publish_their_ports() -> None:
    services = _compose()["services"]
    assert {"nats", "orchestrator", "agent"} <= set(services)
    for name in ("orchestrator", "agent"):
        svc = services[name]
        argv = svc["command"]
        assert argv[0] == name
        _parses(argv)
        assert _flag(argv, "--nats-url") == "nats://nats:4222"
        published = {int(p.split(":")[1]) for p in svc.get("ports", [])}
        for flag in ("--grpc-port", "--metrics-port"):
            port = _flag(argv, flag)
            if port is not None:
                assert int(port) in published, f"{name} serves {flag} {port} but does not publish it"
    assert services["orchestrator"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert services["agent"]["pid"] == "host"
    assert "--jetstream" in services["nats"]["command"]


def test_k8s_containers_parse_and_declare_their_ports() -> None:
    kustom = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = [K8S / f for f in kustom["resources"]]
    assert all(f.exists() for f in files)
    kinds: dict[str, dict[str, Any]] = {}
    for f in files:
        for doc in _docs(f):
            kinds[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
            if doc["kind"] not in {"Deployment", "DaemonSet", "StatefulSet"}:
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["image"].startswith("nats:"):
                    continue
                argv = c["args"]
                _parses(argv)
                ports = {p["containerPort"] for p in c.get("ports", [])}
                for flag in ("--metrics-port", "--grpc-port"):
                    port = _flag(argv, flag)
                    host = _flag(argv, "--grpc-host")
                    node_local = flag == "--grpc-port" and host == "127.0.0.1"
                    if port is not None and not node_local:
                        assert int(port) in ports, f"{f.name}: {flag} {port} not in containerPorts {ports}"
    orch = kinds["Deployment/orchestrator"]["spec"]
    assert orch["replicas"] == 1 and orch["strategy"]["type"] == "Recreate"  # no leader election: never two
    agent = kinds["DaemonSet/agent"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in agent["containers"][0]["env"]}
    assert env["TIMESLICE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert agent["hostPID"] is True


def test_dockerfile_copies_existing_paths() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.MULTILINE)
    assert copied
    for group in copied:
        for src in group.split():
            assert (ROOT / src).exists(), f"deploy/Dockerfile copies {src}, which is not in the repository"
    assert 'ENTRYPOINT ["timeslice"]' in text
