"""The secured deployments (issue 24), as rendered, offline: NATS with operator-mode auth and TLS for clients and
routes, every component with its own credential from its own secret, the gRPC API with TLS and a way to identify
callers (never --grpc-insecure), nothing on 0.0.0.0 without a comment saying why, compose publishing on the host's
loopback only, and deploy/make-secrets.sh making the secrets under the names and keys the manifests use (run for
real once `timeslice auth` exists). The helpers are test_deploy.py's."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_deploy import (
    COMPOSE_NATS_CONF,
    MAKE_SECRETS,
    ROOT,
    _auth_cli,
    _block,
    _compose,
    _compose_conf,
    _compose_nats,
    _conf_value,
    _containers,
    _docs,
    _flag,
    _k8s,
    _k8s_files,
    _nats_conf,
    _nats_config_parses,
    _nats_server,
    _projected_files,
    _published,
)

# ---------------------------------------------------------------------------------------------- security


def _workloads() -> dict[str, dict[str, Any]]:
    return {k: d for k, d in _k8s().items() if d["kind"] in {"Deployment", "DaemonSet", "StatefulSet"}}


def _secret_mounts(doc: dict[str, Any]) -> dict[str, set[str]]:
    """Secret name → the directories (mount paths) where the workload's container sees it."""
    pod = doc["spec"]["template"]["spec"]
    (c,) = _containers(doc)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out: dict[str, set[str]] = {}
    for m in c.get("volumeMounts", []):
        v = volumes.get(m["name"], {})
        names = (
            [v["secret"]["secretName"]]
            if "secret" in v
            else [src["secret"]["name"] for src in v.get("projected", {}).get("sources", []) if "secret" in src]
        )
        for n in names:
            out.setdefault(n, set()).add(m["mountPath"])
    return out


def _env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c.get("env", [])}


def _under(path: str, dirs: set[str]) -> bool:
    return any(path.startswith(d.rstrip("/") + "/") for d in dirs)


def test_nats_requires_auth_and_tls() -> None:
    for where, conf in (("k8s", _nats_conf()), ("compose", _compose_conf())):
        assert re.search(r'^\s*include\s+"nats-auth\.conf"', conf, flags=re.MULTILINE), (
            f"{where}: nats.conf must include the operator-mode snippet of `timeslice auth server-config`"
        )
        for key in ("authorization", "no_auth_user", "accounts", "users", "allow_non_tls"):
            assert not re.search(rf"^\s*{key}\b", conf, flags=re.MULTILINE), f"{where}: {key} bypasses the auth"
        top = re.sub(r"^\s*(jetstream|cluster)\s*\{.*?^\s*\}", "", conf, flags=re.MULTILINE | re.DOTALL)
        for scope, text in (("clients", top), ("routes", _block(conf, "cluster"))):
            tls = _block(text, "tls")
            for key in ("cert_file", "key_file", "ca_file"):
                assert _conf_value(tls, key), f"{where}: no TLS {key} for {scope}"
        assert _conf_value(conf, "http").startswith("127.0.0.1:"), f"{where}: monitoring must stay on loopback"


def test_every_k8s_component_mounts_its_own_secrets() -> None:
    want = {
        "StatefulSet/nats": {"nats-auth", "nats-tls"},
        "Deployment/orchestrator": {"orchestrator-creds", "timeslice-ca", "orchestrator-grpc-tls", "nats-auth"},
        "DaemonSet/agent": {"agent-creds", "timeslice-ca"},
    }
    workloads = _workloads()
    assert {k: set(_secret_mounts(d)) for k, d in workloads.items()} == want
    for key, creds in (("Deployment/orchestrator", "orchestrator-creds"), ("DaemonSet/agent", "agent-creds")):
        mounts = _secret_mounts(workloads[key])
        (c,) = _containers(workloads[key])
        env = _env(c)
        assert _under(env["TIMESLICE_CREDS"], mounts[creds]), f"{key}: TIMESLICE_CREDS is not its {creds}"
        assert _under(env["TIMESLICE_TLS_CA"], mounts["timeslice-ca"]), f"{key}: no CA for tls://"
        assert "--creds" not in c["args"] or _under(_flag(c["args"], "--creds") or "", mounts[creds])
    # Each agent uses its own node's credential, named by the downward API (defined before it is used).
    (agent,) = _containers(workloads["DaemonSet/agent"])
    names = [e["name"] for e in agent["env"]]
    assert "$(TIMESLICE_NODE_ID).creds" in _env(agent)["TIMESLICE_CREDS"]
    assert names.index("TIMESLICE_NODE_ID") < names.index("TIMESLICE_CREDS")


def test_the_agent_may_read_pods_and_nothing_else() -> None:
    """--pods needs the agent's service account to list its node's pods: it gets get/list/watch on pods through one
    ClusterRole bound to it alone, and no RBAC object in the manifests grants more (nor to anybody else)."""
    k8s = _k8s()
    agent = k8s["DaemonSet/agent"]["spec"]["template"]["spec"]
    account = agent["serviceAccountName"]
    namespace = k8s["DaemonSet/agent"]["metadata"]["namespace"]
    assert k8s[f"ServiceAccount/{account}"]["metadata"]["namespace"] == namespace
    assert agent.get("automountServiceAccountToken", True), "the agent reads its token from the mounted account"
    (c,) = _containers(k8s["DaemonSet/agent"])
    assert "--pods" in c["args"] and agent["hostPID"] is True
    roles = {k: d for k, d in k8s.items() if d["kind"] in {"Role", "ClusterRole"}}
    bindings = {k: d for k, d in k8s.items() if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}}
    assert len(roles) == 1 and len(bindings) == 1, (sorted(roles), sorted(bindings))
    ((role_key, role),) = roles.items()
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"], rule
        assert set(rule["verbs"]) <= {"get", "list", "watch"} and "list" in rule["verbs"], rule
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
    (binding,) = bindings.values()
    assert f"{binding['roleRef']['kind']}/{binding['roleRef']['name']}" == role_key
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    for key, doc in _workloads().items():  # no other workload runs as the agent's account
        if key != "DaemonSet/agent":
            assert doc["spec"]["template"]["spec"].get("serviceAccountName") != account, key


def test_every_compose_component_mounts_its_own_secrets() -> None:
    doc = _compose()
    services = doc["services"]
    mine = {n: {s["source"] for s in svc.get("secrets", [])} for n, svc in services.items()}
    nats = {"nats-auth", "nats-cert", "nats-key", "ca"}
    orch = {"orchestrator-creds", "ca", "grpc-cert", "grpc-key", "nats-auth"}
    assert mine == {
        "nats-1": nats,
        "nats-2": nats,
        "nats-3": nats,
        "orchestrator-1": orch,
        "orchestrator-2": orch,
        "agent": {"agent-node-0-creds", "ca"},
    }
    for name, svc in services.items():
        env = svc.get("environment", {})
        if "TIMESLICE_CREDS" in env:
            targets = {s["source"]: s["target"] for s in svc["secrets"]}
            creds = [t for src, t in targets.items() if src.endswith("-creds")]
            assert creds == [env["TIMESLICE_CREDS"]], f"{name}: TIMESLICE_CREDS is not its own credential"
            assert env["TIMESLICE_TLS_CA"] == targets["ca"]
        elif name not in _compose_nats(services):
            pytest.fail(f"{name} connects to NATS without a credential")
    files = [Path(v["file"]) for v in doc["secrets"].values()]
    assert all(f.parts[:3] == (".", "deploy", "secrets") or f.parts[:2] == ("deploy", "secrets") for f in files)
    assert "deploy/secrets/" in (ROOT / ".gitignore").read_text().split()


def _all_argv() -> list[tuple[str, list[str]]]:
    out = [
        (k, c["args"]) for k, d in _workloads().items() for c in _containers(d) if not c["image"].startswith("nats:")
    ]
    return out + [
        (f"compose {n}", s["command"])
        for n, s in _compose()["services"].items()
        if n not in _compose_nats(_compose()["services"])
    ]


def test_nothing_listens_on_every_address_without_saying_so() -> None:
    for where, argv in _all_argv():
        for port_flag, host_flag in (
            ("--grpc-port", "--grpc-host"),
            ("--metrics-port", "--metrics-host"),
            ("--grpc-health-port", "--grpc-health-host"),
        ):
            if _flag(argv, port_flag) not in (None, "-1"):
                assert _flag(argv, host_flag), f"{where}: {port_flag} without {host_flag} (the default may change)"
    for f in [*_k8s_files(), ROOT / "docker-compose.yml", COMPOSE_NATS_CONF]:
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if "0.0.0.0" not in line.split("#")[0]:
                continue
            assert "#" in line, f"{f.name}:{i + 1} listens on 0.0.0.0 without a comment saying why: {line.strip()}"
    for name, svc in _compose()["services"].items():
        for host, port, _ in _published(svc):
            assert host == "127.0.0.1", f"compose {name} publishes {port} on {host}, not the host's loopback"


def test_grpc_is_served_with_tls_and_identified_callers_only() -> None:
    served = 0
    for where, argv in _all_argv():
        if _flag(argv, "--grpc-port") in (None, "-1"):
            continue
        served += 1
        assert "--grpc-insecure" not in argv, f"{where}: insecure gRPC"
        assert _flag(argv, "--grpc-tls-cert") and _flag(argv, "--grpc-tls-key"), f"{where}: gRPC without TLS"
        assert _flag(argv, "--grpc-tls-client-ca") or _flag(argv, "--grpc-trust-account"), (
            f"{where}: gRPC with no way to identify callers (client CA or trusted account)"
        )
    assert served == 3  # the k8s orchestrator, compose orchestrator-1 and -2
    (c,) = _containers(_workloads()["Deployment/orchestrator"])
    mounts = _secret_mounts(_workloads()["Deployment/orchestrator"])
    for flag, secret in (
        ("--grpc-tls-cert", "orchestrator-grpc-tls"),
        ("--grpc-tls-key", "orchestrator-grpc-tls"),
        ("--grpc-trust-account", "nats-auth"),
    ):
        assert _under(_flag(c["args"], flag) or "", mounts[secret]), f"k8s orchestrator: {flag} is not in {secret}"


def _script_secrets() -> dict[str, set[str]]:
    """Secret name → its keys, as deploy/make-secrets.sh creates them."""
    out: dict[str, set[str]] = {}
    for name, rest in re.findall(r"^secret ([a-z-]+) (.*)$", MAKE_SECRETS.read_text(), flags=re.MULTILINE):
        out[name] = set(re.findall(r"--from-file=([A-Za-z0-9_.$-]+)=", rest))
    return out


def test_make_secrets_makes_what_the_manifests_use() -> None:
    assert MAKE_SECRETS.stat().st_mode & 0o111, "deploy/make-secrets.sh is not executable"
    done = subprocess.run(["bash", "-n", str(MAKE_SECRETS)], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    made = _script_secrets()
    text = MAKE_SECRETS.read_text()
    assert "agent-creds" in made and '"--from-file=$n.creds=$f"' in text  # one key per node
    for key, doc in _workloads().items():
        pod = doc["spec"]["template"]["spec"]
        for v in pod.get("volumes", []):
            refs = (
                [v["secret"]]
                if "secret" in v
                else [s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
            )
            for ref in refs:
                name = ref.get("secretName") or ref["name"]
                assert name in made, f"{key} mounts Secret/{name}, which make-secrets.sh does not make"
                for item in ref.get("items", []):
                    assert item["key"] in made[name], f"{key}: Secret/{name} has no key {item['key']}"
        (c,) = _containers(doc)
        for path in _env(c).values():  # files the container reads from a mounted secret
            for name, dirs in _secret_mounts(doc).items():
                if _under(path, dirs) and "$(" not in path:
                    assert Path(path).name in made[name], f"{key}: {path} is not a key of Secret/{name}"
    for f in (Path(v["file"]).name for v in _compose()["secrets"].values()):
        assert f in text or (f.startswith("agent-") and '"agent-$n.creds"' in text), f"make-secrets.sh makes no {f}"


def test_make_secrets_runs_with_the_real_cli(tmp_path: Path) -> None:
    if not _auth_cli():
        pytest.skip("this CLI has no `timeslice auth` yet")
    if shutil.which("openssl") is None or shutil.which("kubectl") is None:
        pytest.skip("needs openssl and kubectl")
    cli = tmp_path / "timeslice"
    cli.write_text(f'#!/bin/sh\nexec {sys.executable} -m timeslice_cli "$@"\n')
    cli.chmod(0o755)
    out = tmp_path / "secrets"
    env = dict(os.environ, TIMESLICE=str(cli), OUT=str(out))
    for args in (["compose"], ["k8s", "gpu-a", "gpu-b"]):
        done = subprocess.run(
            ["bash", str(MAKE_SECRETS), *args], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
    for f in [*out.glob("*.creds"), *out.glob("*.key"), out / "nats-auth.conf"]:
        assert f.stat().st_mode & 0o077 == 0, f"{f.name} is readable by others"
    secrets = {d["metadata"]["name"]: d for f in (out / "k8s").glob("*.yaml") for d in _docs(f)}
    assert set(secrets) == set(_script_secrets())
    assert {"gpu-a.creds", "gpu-b.creds", "node-0.creds"} == set(secrets["agent-creds"]["data"])
    # The NATS config of the StatefulSet with the real snippet and certificate.
    sts = _k8s()["StatefulSet/nats"]
    (c,) = _containers(sts)
    root = tmp_path / "root"
    for path, what in _projected_files(sts["spec"]["template"]["spec"], c).items():
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if what == "config":
            dest.write_text(
                _nats_conf()
                .replace("/etc/nats/", f"{root}/etc/nats/")
                .replace("store_dir: /data", f"store_dir: {tmp_path}/data")
            )
        else:
            name, key = what.split(":")
            dest.write_bytes(base64.b64decode(secrets[name]["data"][key]))
    _nats_config_parses(_nats_server(), root / "etc/nats/nats.conf")
