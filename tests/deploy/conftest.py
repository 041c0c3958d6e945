"""Fixtures for the deployment checks: the Helm chart rendered by the real Helm
engine, the mesh and Envoy files, and the compose project as Docker Compose
loads it. Nothing here needs a cluster, a Docker engine or the network."""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from .support import CHART, MESH, NAMESPACE, RELEASE, REPO, TESTDATA, Rendered, load_yaml_documents, venv_tool


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    loaded = helm.Chart.load(str(CHART))
    try:
        yield loaded
    finally:
        loaded.close()


@pytest.fixture(scope="session")
def all_features_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / "all-features-values.yaml").read_text())


@pytest.fixture(scope="session")
def mesh_values() -> dict[str, Any]:
    return yaml.safe_load((TESTDATA / "mesh-values.yaml").read_text())


@pytest.fixture(scope="session")
def render(chart: Any) -> Callable[[dict[str, Any] | None], Rendered]:
    """Render the chart offline with the real Helm engine; results are cached."""
    cache: dict[str, Rendered] = {}

    def _render(values: dict[str, Any] | None = None) -> Rendered:
        key = json.dumps(values, sort_keys=True)
        if key not in cache:
            manifests = chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
            cache[key] = Rendered(manifests)
        return cache[key]

    return _render


CI_VALUES = sorted(p.stem.removesuffix("-values") for p in (CHART / "ci").glob("*-values.yaml"))


@pytest.fixture(scope="session", params=["default", *CI_VALUES])
def rendered(request: pytest.FixtureRequest, render: Callable[..., Rendered]) -> Rendered:
    """The chart rendered with its defaults and with each ci/*-values.yaml (every feature on, an operator's own stores)."""
    if request.param == "default":
        return render(None)
    return render(yaml.safe_load((CHART / "ci" / f"{request.param}-values.yaml").read_text()))


@pytest.fixture(scope="session")
def full(render: Callable[..., Rendered], all_features_values: dict[str, Any]) -> Rendered:
    """The chart rendered with every feature on."""
    return render(all_features_values)


@pytest.fixture(scope="session")
def mesh_documents() -> dict[str, dict[str, Any]]:
    """The standalone Istio policies in mesh/, by file name."""
    docs = {}
    for path in sorted(MESH.glob("*.yaml")):
        [doc] = load_yaml_documents(path.read_text())
        docs[path.name] = doc
    return docs


@pytest.fixture(scope="session")
def compose_project() -> dict[str, Any]:
    """docker-compose.yml as Docker Compose itself loads, validates and normalises it."""
    result = subprocess.run(
        [venv_tool("docker-compose"), "-f", str(REPO / "docker-compose.yml"), "config", "--format", "json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        # Defaults of the file's ${VAR:-default} apply, whatever the caller's shell has.
        env={"PATH": "/usr/bin:/bin", "HOME": tempfile.gettempdir()},
    )
    assert result.returncode == 0, f"docker compose refused docker-compose.yml:\n{result.stderr}"
    return json.loads(result.stdout)


@pytest.fixture(scope="session")
def envoy_config() -> dict[str, Any]:
    return yaml.safe_load((MESH / "envoy" / "envoy.yaml").read_text())
