"""The services' Dockerfiles, parsed by BuildKit's own parser (`dockerfile`)
and linted by hadolint, and the build context's .dockerignore."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tomllib
from pathlib import Path

import dockerfile
import pytest

from .support import CONTRACT_PORTS, IMAGE_FOLDERS, REPO, TIER_PORTS, venv_tool

PINNED_BASE = re.compile(r"^python:3\.11\.\d+-slim-bookworm$")


def commands(component: str) -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(REPO / "services" / IMAGE_FOLDERS[component] / "Dockerfile")))


def final_stage(parsed: list[dockerfile.Command]) -> list[dockerfile.Command]:
    last_from = max(i for i, c in enumerate(parsed) if c.cmd == "FROM")
    return parsed[last_from:]


@pytest.mark.parametrize("component", sorted(IMAGE_FOLDERS))
def test_multi_stage_from_a_pinned_slim_base(component: str) -> None:
    parsed = commands(component)
    args = dict(c.value[0].split("=", 1) for c in parsed if c.cmd == "ARG" and "=" in c.value[0])
    stages = [c.value for c in parsed if c.cmd == "FROM"]
    assert len(stages) >= 2
    for image, *_alias in stages:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert PINNED_BASE.match(resolved), resolved
    copies = [c for c in final_stage(parsed) if c.cmd == "COPY"]
    assert all("--from=build" in c.flags for c in copies), "the runtime stage copies only build output"


@pytest.mark.parametrize("component", sorted(IMAGE_FOLDERS))
def test_runs_the_service_as_non_root(component: str) -> None:
    stage = final_stage(commands(component))
    [user] = [c.value[0] for c in stage if c.cmd == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000
    [entrypoint] = [c for c in stage if c.cmd == "ENTRYPOINT"]
    if component == "tiers":  # one image, two roles: the arguments name the role, the batch runner by default
        [cmd] = [c for c in stage if c.cmd == "CMD"]
        assert entrypoint.json and entrypoint.value == ("aiworks",)
        assert cmd.json and cmd.value == ("batch", "runner")
        return
    assert entrypoint.json and entrypoint.value == ("aiworks", "runtime" if component == "runtime" else component)


@pytest.mark.parametrize("component", sorted(IMAGE_FOLDERS))
def test_exposes_the_contract_ports_and_checks_health(component: str) -> None:
    stage = final_stage(commands(component))
    exposed = {int(p) for c in stage if c.cmd == "EXPOSE" for p in c.value}
    [health] = [c for c in stage if c.cmd == "HEALTHCHECK"]
    if component == "tiers":  # each role's /metrics; the default role's probe
        assert exposed == {p for ports in TIER_PORTS.values() for p in ports.values()}
        env = dict(zip(*[iter(v for c in stage if c.cmd == "ENV" for v in c.value)] * 2))
        assert {env["AIWORKS_BATCH_METRICS_PORT"], env["AIWORKS_NEARLINE_METRICS_PORT"]} == {str(p) for p in exposed}
        assert health.json and health.value == ("CMD", "aiworks", "probe", "--quiet", "batch-runner")
        return
    assert exposed == set(CONTRACT_PORTS[component].values())
    # `aiworks probe` reads the port and TLS files from the service's own environment, so it passes a
    # mutual-TLS handshake that a plain probe could not (docs/security.md).
    assert health.json and health.value == ("CMD", "aiworks", "probe", "--quiet", component)


@pytest.mark.parametrize("component", sorted(IMAGE_FOLDERS))
def test_pip_installs_are_pinned(component: str) -> None:
    for command in commands(component):
        if command.cmd != "RUN":
            continue
        for install in re.findall(r"pip install ([^&]+)", command.value[0]):
            words = install.split()
            files = [words[i + 1] for i, w in enumerate(words) if w == "-r"]
            targets = [t for t in words if not t.startswith("-") and t not in files]
            assert all(t == "." or "==" in t for t in targets), install
            for name in files:  # a requirements file copied from the service's folder: every line pinned
                source = REPO / "services" / IMAGE_FOLDERS[component] / Path(name).name
                pins = [line for line in source.read_text().splitlines() if line.strip() and not line.startswith("#")]
                assert pins and all("==" in line for line in pins), source
    # `pip install .` resolves the pins in pyproject.toml.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "aiworks" and project["scripts"]["aiworks"]
    assert all("==" in d for d in project["dependencies"])


def test_hadolint_is_clean() -> None:
    files = [str(REPO / "services" / folder / "Dockerfile") for folder in IMAGE_FOLDERS.values()]
    result = subprocess.run([venv_tool("hadolint"), *files], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.replace("**/", "")) for p in prefixes):
            result = not negate
    return result


def test_dockerignore_sends_only_the_package() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "src/aiworks/__init__.py", "services/gateway/app.py"):
        assert not ignored(needed, patterns), needed
    for unwanted in (".git/config", ".venv/bin/python", "tests/deploy/conftest.py", "helm/aiworks/Chart.yaml",
                     "model-repository/iris/config.pbtxt", "src/aiworks/__pycache__/x.pyc"):
        assert ignored(unwanted, patterns), unwanted
