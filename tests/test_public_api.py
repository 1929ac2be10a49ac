"""The public surface of each package, pinned in tests/public_api.json: a name added to or dropped from an
``__all__`` is a decision that shows up there (and in the changelog of whoever depends on it), never an accident of a
refactor. Every exported name resolves, and every public module's ``__all__`` lists only what it defines or
re-exports."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

#: Each package's pinned ``__all__`` (``packages``) and, for modules that need an extra, the extra's import name and
#: the pinned names (``optional``): data, so that a change of the surface reads as a change of this file.
_PINS = json.loads((Path(__file__).with_name("public_api.json")).read_text())
PINNED: dict[str, set[str]] = {package: set(names) for package, names in _PINS["packages"].items()}
# Modules that need an extra: pinned the same way where the extra is installed (``needs``: its import name).
OPTIONAL: dict[str, tuple[str, set[str]]] = {m: (p["needs"], set(p["names"])) for m, p in _PINS["optional"].items()}


@pytest.mark.parametrize("package", sorted(PINNED))
def test_the_public_names_are_the_pinned_ones_and_resolve(package: str) -> None:
    mod = importlib.import_module(package)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), f"{package}.__all__ lists a name twice"
    assert exported == PINNED[package], (
        f"added: {sorted(exported - PINNED[package])}, dropped: {sorted(PINNED[package] - exported)}"
    )
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize(
    "module",
    [
        "timeslice_client.protocol",
        "timeslice_client.bus",
        "timeslice_client.errors",
        "timeslice_client.handlers",
        "timeslice_client.workload",
        "timeslice_client.agent_client",
        "timeslice_client.vllm_engine",
        "timeslice_client.sglang_engine",
        "timeslice_agent.backends",
        "timeslice_orchestrator.core",
        "timeslice_orchestrator.service",
    ],
)
def test_every_public_modules_all_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in getattr(mod, "__all__", ()) if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"


ROOTS = {
    "timeslice_client": "TimeSliceError",
    "timeslice_agent": "AgentServiceError",
    "timeslice_orchestrator": "OrchestratorError",
}


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_each_packages_errors_form_one_tree_under_its_root(package: str) -> None:
    """Every exception a package defines (in its one errors module, and anything it exports) descends from the
    package's root, and every root from the client's ``TimeSliceError``: ``except TimeSliceError`` catches them
    all, ``except OrchestratorError`` one package's."""
    from timeslice_client.errors import TimeSliceError

    mod = importlib.import_module(package)
    root = getattr(mod, ROOTS[package])
    assert issubclass(root, TimeSliceError)
    errors_mod = importlib.import_module(f"{package}.errors" if package == "timeslice_client" else f"{package}._errors")
    found = {n: getattr(errors_mod, n) for n in errors_mod.__all__}
    found.update({n: getattr(mod, n) for n in mod.__all__})
    classes = {n: c for n, c in found.items() if isinstance(c, type) and issubclass(c, BaseException)}
    assert classes, package
    outside = sorted(n for n, c in classes.items() if not issubclass(c, root))
    assert not outside, f"{package}: {outside} are not under {ROOTS[package]}"
    elsewhere = sorted(n for n, c in classes.items() if c.__module__ != errors_mod.__name__)
    assert not elsewhere, f"{package}: {elsewhere} are defined outside {errors_mod.__name__}"


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_the_public_names_of_modules_that_need_an_extra_are_the_pinned_ones(module: str) -> None:
    needs, pinned = OPTIONAL[module]
    pytest.importorskip(needs, reason=f"{module} needs {needs}, which is not installed")
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), f"{module}.__all__ lists a name twice"
    assert exported == pinned, f"added: {sorted(exported - pinned)}, dropped: {sorted(pinned - exported)}"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"


#: The client's private modules a service may import, and why (``timeslice_client._internal``'s docstring): the wire
#: pieces both ends of an exchange need, and three rules the client owns that the services follow. Everything else the
#: services share lives in ``timeslice_client._internal``; any other ``_`` module is the client's own.
SHARED_PRIVATE = {
    "timeslice_client._grpc": "the generated stubs: the job's SnapshotAgentClient and the shims speak one proto",
    "timeslice_client._names": "subjects, built by the client and parsed back by the orchestrator",
    "timeslice_client._bounds": "the wire's field bounds, checked at both ends",
    "timeslice_client._agent_socket": "the agent socket's exchange: the job proves, the agent answers",
    "timeslice_client._bus_auth": "how a connection's identity is found, and the --creds/--tls-* flags that feed it",
    "timeslice_client._publish_rules": "which bus errors are transient: the agent retries by the client's rule",
    "timeslice_client._group_reads": "read-your-writes: GetGroupStatus waits for a record as status() does",
}


def _imports_of_timeslice_client(root: Path) -> dict[str, set[str]]:
    """Each ``timeslice_client`` module the Python files under ``root`` import (a private name imported from the
    package itself, ``from timeslice_client import _x``, counts as the module ``timeslice_client._x``) -> the files."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "timeslice_client":
                    names = [
                        f"timeslice_client.{a.name}"
                        if a.name.startswith("_") and a.name != "__version__"
                        else node.module
                        for a in node.names
                    ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "timeslice_client" or name.startswith("timeslice_client."):
                    found.setdefault(name, set()).add(str(path.relative_to(root.parent)))
    return found


def test_the_services_import_only_the_clients_shared_private_modules() -> None:
    """A service (orchestrator, agent, CLI) imports from ``timeslice_client`` its public modules, ``_internal``, and
    the private modules of ``SHARED_PRIVATE``; a newcomer can tell the client's own modules from the shared ones."""
    services = Path(__file__).resolve().parents[1] / "services"
    stray = {
        module: sorted(files)
        for module, files in _imports_of_timeslice_client(services).items()
        if any(part.startswith("_") for part in module.split(".")[1:2])
        and module.split(".")[1] != "_internal"
        and ".".join(module.split(".")[:2]) not in SHARED_PRIVATE
    }
    assert not stray, f"services import the client's own private modules (move what they share to _internal): {stray}"
