"""Each service has one public face: code outside a service imports only its client (and its settings, server and
cli modules, which the command line and tools start it or talk to it with), never its other modules.

The client owns the service's generated gRPC stub too: code outside a service may import its protobuf messages
(``*_pb2``), never its ``*_pb2_grpc`` module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Import name of each service package and its folder.
SERVICES = {"gateway": "gateway", "scheduler": "scheduler", "runtime": "model-runtime", "cache": "cache",
            "monitor": "monitor"}  # fmt: skip
FACES = {"client", "settings", "server", "cli"}
# Generated protobuf package of each service (aiworks.pb.<name>.v1) -> the service folder that owns its stub.
PROTO_OWNERS = {"scheduler": "scheduler", "runtime": "model-runtime", "cache": "cache"}
# Code that may still build another service's stub itself, and why.
_LEAN_IMAGE = (
    "the monitor's image carries neither numpy nor tritonclient, which aiworks.scheduler.client pulls in for the "
    "gateway's Routing (tests/deploy/test_image_contents.py); a numpy-free control client would remove this"
)
STUB_EXCEPTIONS: dict[str, str] = {
    "services/monitor/platform.py": _LEAN_IMAGE,
    "services/monitor/rollout_targets.py": _LEAN_IMAGE,
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def _violations() -> list[str]:
    found = []
    sources = [*ROOT.joinpath("src", "aiworks").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]
    for path in sources:
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("src", "aiworks", "pb"):
            continue
        own = next((name for name, folder in SERVICES.items() if rel.parts[:2] == ("services", folder)), None)
        for line, module, names in _imports(path):
            parts = module.split(".")
            if len(parts) < 2 or parts[0] != "aiworks" or parts[1] not in SERVICES or parts[1] == own:
                continue
            modules = [parts[2]] if len(parts) > 2 else names  # "from aiworks.cache import client"
            bad = [m for m in modules if m not in FACES]
            if bad:
                found.append(f"{rel}:{line} imports {module} {bad if len(parts) == 2 else ''}".rstrip())
    return found


def test_no_code_reaches_into_another_service():
    assert _violations() == []


def _stub_imports(path: Path, rel: Path) -> list[str]:
    """``aiworks.pb.<svc>.v1.*_pb2_grpc`` imported outside the service folder that owns it."""
    found = []
    for line, module, names in _imports(path):
        parts = module.split(".")
        if parts[:2] != ["aiworks", "pb"] or len(parts) < 3 or parts[2] not in PROTO_OWNERS:
            continue
        if rel.parts[:2] == ("services", PROTO_OWNERS[parts[2]]):
            continue
        grpc_modules = [m for m in [parts[-1], *names] if m.endswith("_pb2_grpc")]
        if grpc_modules:
            found.append(f"{rel}:{line} imports {module} {grpc_modules}")
    return found


def _stub_violations() -> list[str]:
    found = []
    sources = [
        *ROOT.joinpath("src", "aiworks").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py"),
        *ROOT.joinpath("scripts").rglob("*.py"), *ROOT.joinpath("bench").rglob("*.py"),
    ]  # fmt: skip
    for path in sources:
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("src", "aiworks", "pb") or str(rel) in STUB_EXCEPTIONS:
            continue
        found.extend(_stub_imports(path, rel))
    return found


def test_only_a_service_builds_its_own_grpc_stub():
    assert _stub_violations() == []


def test_the_stub_check_sees_each_import_form(tmp_path):
    """The check is not vacuous: each way of importing a stub is caught outside its service, allowed inside."""
    source = tmp_path / "x.py"
    source.write_text(
        "from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc\n"
        "import aiworks.pb.cache.v1.cache_pb2_grpc\n"
        "from aiworks.pb.runtime.v1.runtime_pb2_grpc import RuntimeServiceStub\n"
        "from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb\n"
    )
    outside = _stub_imports(source, Path("src/aiworks/tool.py"))
    assert [v.split(" ")[0] for v in outside] == ["src/aiworks/tool.py:1", "src/aiworks/tool.py:2",
                                                  "src/aiworks/tool.py:3"]  # fmt: skip
    inside = _stub_imports(source, Path("services/scheduler/server.py"))
    assert [v.split(":")[1].split(" ")[0] for v in inside] == ["2", "3"]  # cache's and runtime's stubs
