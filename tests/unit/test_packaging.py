"""The distribution's package list and the generated protobuf code stay current."""

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for package, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    # Folders mapped to their own package are found twice (under aiworks/ and on their own).
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_generated_proto_code_is_current(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_proto import DEFAULT_OUT, generate
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    # protoc ran in a process of its own: grpc_tools' protobuf C++ runtime in this one made onnxruntime-extensions'
    # copy (another version, sharing its process-wide symbols) abort on import or corrupt the heap later.
    assert "grpc_tools._protoc_compiler" not in sys.modules
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(DEFAULT_OUT): p.read_text()
        for p in DEFAULT_OUT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(str(k) for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


def test_the_otlp_exporter_and_envoys_protos_share_one_opentelemetry_proto():
    """xds-protos ships an old opentelemetry common.proto; the Makefile reinstalls the exporter's own copy last.

    Without that the OTLP exporter fails to import in a clean install (no InstrumentationScope), which
    only shows when a service starts with tracing on.
    """
    # Envoy's OpenTelemetry tracer config, which imports that proto, still loads.
    from envoy.config.trace.v3 import opentelemetry_pb2  # noqa: F401
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
