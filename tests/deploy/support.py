"""Constants of the suite's contract and helpers shared by the deployment checks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "aiworks"
MESH = REPO / "mesh"
TESTDATA = Path(__file__).resolve().parent / "testdata"
RELEASE = "aiworks"
NAMESPACE = "aiworks"

# Every service of the suite: compose/Kubernetes component -> ports of the contract.
CONTRACT_PORTS = {
    "gateway": {"http": 8000, "grpc": 8001, "metrics": 8002},
    "scheduler": {"grpc": 8010, "metrics": 8011},
    "runtime": {"grpc": 8020, "metrics": 8021},
    "cache": {"grpc": 8030, "metrics": 8031},
    "monitor": {"http": 8040, "metrics": 8040},
}
# The tiers' processes (one image, services/tiers): component -> their one port, /metrics.
TIER_PORTS = {
    "batch-runner": {"metrics": 8050},
    "nearline-worker": {"metrics": 8051},
}
# What each tier process runs: the tiers image's entrypoint is `aiworks`, these are its first arguments.
TIER_COMMANDS = {"batch-runner": ["batch", "runner"], "nearline-worker": ["nearline", "worker"]}
# Folder under services/ of each component.
SERVICE_FOLDERS = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "runtime": "model-runtime",
    "cache": "cache",
    "monitor": "monitor",
}
# Folder under services/ of each image: the services' and the tiers' one.
IMAGE_FOLDERS = {**SERVICE_FOLDERS, "tiers": "tiers"}
# API groups served by CRDs: kubernetes-validate has no schema for them, so the
# Istio and prometheus-operator models check them instead.
CRD_GROUPS = {"networking.istio.io", "security.istio.io", "monitoring.coreos.com", "cert-manager.io",
              "gateway.networking.k8s.io"}


# libyaml's loader when PyYAML has it: rendered charts are long.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml_documents(text: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a multi-document text."""
    return [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]


def api_group(obj: dict[str, Any]) -> str:
    """The API group of an object ("" for the core group)."""
    api_version = obj["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Paths where two JSON-like values differ, for readable assertion messages."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found: list[str] = []
        for key in sorted(set(expected) | set(actual), key=str):
            where = f"{path}.{key}"
            if key not in actual:
                found.append(f"{where}: dropped (not in the schema)")
            elif key not in expected:
                found.append(f"{where}: added")
            else:
                found += differences(expected[key], actual[key], where)
        return found
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{path}: {len(expected)} items became {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{path}[{i}]")]
    return [] if expected == actual else [f"{path}: {expected!r} became {actual!r}"]


class Rendered:
    """The objects one `helm template` run produced, with small lookups."""

    def __init__(self, manifests: dict[str, str]) -> None:
        self.manifests = manifests
        self.objects: list[dict[str, Any]] = []
        self.sources: list[str] = []
        for path, text in sorted(manifests.items()):
            if not path.endswith(".yaml"):
                continue
            for doc in load_yaml_documents(text):
                self.objects.append(doc)
                self.sources.append(path)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        matches = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
        return matches[0]

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.of_kind(kind)}

    @property
    def notes(self) -> str:
        return next(text for path, text in self.manifests.items() if path.endswith("NOTES.txt"))


def venv_tool(name: str) -> str:
    """A console script installed next to this interpreter (or on PATH)."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    assert found, f"{name} is missing: install requirements-deploy.txt"
    return found


# The public routes every front (Istio ingress, Gateway API, Envoy in compose) must send to the
# gateway: a request's path -> (its port name, whether it is a long-lived stream). Streams get no
# route timeout and no retries (a timeout would cut them, a retry would replay them).
PUBLIC_ROUTES: dict[str, tuple[str, bool]] = {
    "/inference.GRPCInferenceService/ModelInfer": ("grpc", False),
    "/inference.GRPCInferenceService/ModelMetadata": ("grpc", False),
    "/inference.GRPCInferenceService/ModelStreamInfer": ("grpc", True),
    "/aiworks.streams.v1.ResultStreams/Subscribe": ("grpc", True),
    "/v2/health/ready": ("http", False),
    "/v2/models/iris/infer": ("http", False),
    "/v2/models/llm/generate": ("http", False),
    "/v2/models/llm/generate_stream": ("http", True),
    "/v2/models/llm/versions/2/generate_stream": ("http", True),
    "/v2/streams/orders": ("http", True),
    "/v1/models": ("http", False),
    "/v1/embeddings": ("http", False),
    "/v1/completions": ("http", True),
    "/v1/chat/completions": ("http", True),
    "/v1/files": ("http", False),
    "/v1/batches/batch_1/cancel": ("http", False),
}
# Paths no front may route: the gateway's metrics, other services' methods, look-alikes of the public prefixes.
PRIVATE_PATHS = ("/metrics", "/", "/healthz", "/v3/models", "/v1x/models",
                 "/aiworks.scheduler.v1.SchedulerService/Status", "/aiworks.cache.v1.CacheService/Get")  # fmt: skip
# Public paths the gateway serves only with the Batch API on (batchRunner.enabled).
BATCH_PATHS = {"/v1/files", "/v1/batches/batch_1/cancel"}
