"""The environment the deployment files give each service against that
service's own Settings class, so a renamed setting fails here rather than
being silently ignored in a container."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from typing import Any

import dockerfile
import pytest
from pydantic_settings import BaseSettings

from .support import IMAGE_FOLDERS, REPO, SERVICE_FOLDERS, TIER_PORTS, Rendered

# Settings the deployment files already pass but the services do not define
# yet. Each is ignored until its service reads it; none is pending now.
PENDING: set[str] = set()
COMPOSE_SERVICES = {"gateway": "gateway", "scheduler": "scheduler", "runtime-1": "runtime", "runtime-2": "runtime",
                    "cache": "cache", "monitor": "monitor", **{tier: tier for tier in TIER_PORTS}}


# The tiers' processes -> their package (aiworks.batch has a Settings class; the nearline worker reads its
# variables in its CLI, checked against the names there).
# The tiers image's ENV serves both.
TIER_PACKAGES = {"batch-runner": "batch", "nearline-worker": "nearline", "tiers": "batch"}


def settings_class(component: str) -> type[BaseSettings] | None:
    """The service's Settings class, or None while the service has no settings module."""
    component = TIER_PACKAGES.get(component, component)
    name = f"aiworks.{component}.settings"
    if importlib.util.find_spec(f"aiworks.{component}") is None or importlib.util.find_spec(name) is None:
        return None
    module = importlib.import_module(name)
    prefix = f"AIWORKS_{component.upper()}_"
    [cls] = [
        value for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, BaseSettings)
        and value.model_config.get("env_prefix") == prefix
    ]
    return cls


def check(component: str, env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, complete: bool) -> None:
    if component in ("nearline-worker", "tiers"):
        read = set(re.findall(r"AIWORKS_NEARLINE_[A-Z_]+", (REPO / "src/aiworks/nearline/cli.py").read_text()))
        unknown = {k for k in env if k.startswith("AIWORKS_NEARLINE_")} - read
        assert not unknown, f"aiworks nearline worker reads no {sorted(unknown)}"
    cls = settings_class(component)
    if cls is None:
        return
    prefix = f"AIWORKS_{TIER_PACKAGES.get(component, component).upper()}_"
    ours = {k: v for k, v in env.items() if k.startswith(prefix)}
    unknown = {k for k in ours if k[len(prefix):].lower() not in cls.model_fields} - PENDING
    assert not unknown, f"{cls.__name__} has no setting for {sorted(unknown)}"
    if complete:
        for key in list(os.environ):
            if key.startswith(prefix):
                monkeypatch.delenv(key)
        for key, value in ours.items():
            if isinstance(value, str):
                monkeypatch.setenv(key, value)
        cls()  # the values parse, and nothing required is missing


def test_compose_environment_matches_settings(compose_project: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, component in COMPOSE_SERVICES.items():
        with monkeypatch.context() as patch:
            check(component, compose_project["services"][name]["environment"], patch, complete=True)


def test_chart_environment_matches_settings(rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> None:
    for deployment in rendered.of_kind("Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        with monkeypatch.context() as patch:
            check(component, env, patch, complete=True)


def test_image_environment_matches_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(IMAGE_FOLDERS) - set(SERVICE_FOLDERS) == {"tiers"}
    for component, folder in IMAGE_FOLDERS.items():
        env: dict[str, Any] = {}
        for command in dockerfile.parse_file(str(REPO / "services" / folder / "Dockerfile")):
            if command.cmd == "ENV":
                env.update(zip(command.value[::2], command.value[1::2]))
        check(component, env, monkeypatch, complete=False)
