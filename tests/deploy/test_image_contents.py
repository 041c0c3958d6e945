"""Each service image holds only what that service imports: services/<svc>/requirements.txt.

Fast and engine-free: in a subprocess, imports of any distribution outside the service's
requirements (and what they require) fail, and the service's modules, the commands its image
runs (probes, the install hook, `helm test`, the storage initializer) and `aiworks --help` must
still import. The image tests (test_images.py) then build and run the real images.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from .support import IMAGE_FOLDERS, REPO

# What each image must be able to import, beyond `aiworks --help`.
MODULES = {
    "gateway": ["aiworks.gateway.server", "aiworks.gateway.auth", "aiworks.gateway.limits", "aiworks.gateway.metering",
                "aiworks.kube.secrets", "aiworks.kube.check", "aiworks.probe", "aiworks.security.certs",
                "redis.asyncio"],
    # Imported only when a setting asks for them: traffic policies in Redis (the chart's default with
    # several schedulers), the LLM backend for `backend: "llm"` models.
    "scheduler": ["aiworks.scheduler.server", "aiworks.scheduler.traffic_store", "aiworks.core.redis_client",
                  "aiworks.probe"],
    "runtime": ["aiworks.runtime.server", "aiworks.runtime.onnxruntime_backend", "aiworks.runtime.triton_backend",
                "aiworks.storage.fetch", "aiworks.storage.s3", "aiworks.storage.gcs", "aiworks.demo.models",
                "sklearn.linear_model", "sklearn.neural_network", "skl2onnx", "aiworks.probe",
                "aiworks.runtime.llm_backend", "tokenizers"],
    "cache": ["aiworks.cache.server", "aiworks.cache.redis_store", "redis.asyncio", "aiworks.probe"],
    "monitor": ["aiworks.monitor.server", "aiworks.monitor.k8s", "kubernetes.client", "kubernetes.config"],
    # The batch runner and the nearline worker: what `aiworks batch runner` and `aiworks nearline worker` import
    # when they start (cmd_runner, cmd_worker) and what a job imports later (Parquet tables, S3 objects).
    "tiers": ["aiworks.batch.runner", "aiworks.batch.jobs", "aiworks.batch.metrics", "aiworks.batch.settings",
              "aiworks.batch.tables", "aiworks.batch.objects", "aiworks.storage.s3", "pyarrow.parquet",
              "aiworks.nearline.worker", "aiworks.nearline.queue", "aiworks.nearline.callbacks",
              "aiworks.nearline.delivery", "aiworks.core.logging", "aiworks.core.metrics", "aiworks.probe",
              "redis.asyncio", "aiohttp", "aiworks.security.sealing"],
}
# Imported when a Parquet job is submitted (the Batch API's checks): the gateway image carries pyarrow for it.
MODULES["gateway"] += ["aiworks.batch.service", "aiworks.batch.tables", "pyarrow.parquet"]
HEAVY = {"onnxruntime", "torch", "sklearn", "scipy", "tensorflow", "transformers"}
MAY_CARRY_HEAVY = {"runtime"}

CHECK = r"""
import importlib, json, sys
allowed = set(json.loads(sys.argv[1]))
modules = json.loads(sys.argv[2])

class Refuse:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"{name} is not in this image", name=name)

sys.meta_path.insert(0, Refuse())
problems = []
for module in ["aiworks.cli", *modules]:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        problems.append(f"{module}: {exc}")
try:
    import aiworks.cli
    aiworks.cli.build_parser().format_help()
except ImportError as exc:
    problems.append(f"aiworks --help: {exc}")
print(json.dumps({"problems": problems, "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def requirements(folder: str) -> list[Requirement]:
    lines = (REPO / "services" / folder / "requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def closure(reqs: list[Requirement]) -> set[str]:
    """Every distribution the requirements pull in, following extras and markers."""
    seen: set[str] = set()
    todo = [(r, set(r.extras)) for r in reqs]
    while todo:
        req, extras = todo.pop()
        name = req.name.lower().replace("_", "-")
        key = name + "[" + ",".join(sorted(extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            needs = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in needs:
            dep = Requirement(text)
            env = [{"extra": e} for e in extras] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(e) for e in env):
                todo.append((dep, set(dep.extras)))
    return {k.split("[")[0] for k in seen}


def top_level_modules(distributions: set[str]) -> set[str]:
    names = set()
    for module, dists in metadata.packages_distributions().items():
        if any(d.lower().replace("_", "-") in distributions for d in dists):
            names.add(module)
    return names


@pytest.mark.parametrize("component", sorted(IMAGE_FOLDERS))
def test_service_imports_only_its_image(component: str) -> None:
    allowed = top_level_modules(closure(requirements(IMAGE_FOLDERS[component]))) | {"aiworks"}
    done = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(sorted(allowed)), json.dumps(MODULES[component])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert not report["problems"], "\n".join(report["problems"])
    if component not in MAY_CARRY_HEAVY:
        assert not HEAVY & set(report["loaded"]), f"{component} imports {HEAVY & set(report['loaded'])}"
        assert not HEAVY & allowed, f"the {component} image would install {HEAVY & allowed}"


@pytest.mark.parametrize("component", sorted(IMAGE_FOLDERS))
def test_image_pins_match_the_project(component: str) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # The dependencies, and the parquet extra (pyarrow, in the gateway and tiers images).
    pins = {Requirement(d).name.lower(): str(Requirement(d).specifier)
            for d in project["dependencies"] + project["optional-dependencies"]["parquet"]}  # fmt: skip
    for req in requirements(IMAGE_FOLDERS[component]):
        assert str(req.specifier).startswith("=="), req
        assert pins.get(req.name.lower()) == str(req.specifier), f"{req} differs from pyproject.toml"
    assert re.search(r"pip install[^\n]*--no-deps \.", (REPO / "services" / IMAGE_FOLDERS[component] / "Dockerfile").read_text())
