"""What each image would run, read from the project's own Dockerfiles: entrypoint, environment, workdir.

The box runs containers as local processes from this checkout's virtual
environment, so an image's ``/opt/aiworks/bin`` is the venv's ``bin`` and its
``python`` the venv's interpreter. Third-party images map to the Debian
package that ships the same program (Redis).
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent
# image repository (without registry) -> folder under services/
SUITE_IMAGES = {
    "aiworks/gateway": "gateway",
    "aiworks/scheduler": "scheduler",
    "aiworks/model-runtime": "model-runtime",
    "aiworks/cache": "cache",
    "aiworks/monitor": "monitor",
    "aiworks/tiers": "tiers",
}
THIRD_PARTY = {"redis": {"entrypoint": [], "cmd": ["redis-server"], "env": {}}}


@dataclass
class Image:
    """An image's ENTRYPOINT, CMD, ENV and WORKDIR."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"


def repository_of(reference: str) -> str:
    """``registry.example.com/aiworks/gateway:0.1.0`` -> ``aiworks/gateway``; ``redis:7`` -> ``redis``."""
    name = reference.rsplit("@", 1)[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]
    if parts[0] == "library":
        parts = parts[1:]
    return "/".join(parts[-2:]) if parts[-2:-1] == ["aiworks"] else parts[-1]


def image(reference: str) -> Image:
    repository = repository_of(reference)
    if repository in THIRD_PARTY:
        spec = THIRD_PARTY[repository]
        return Image(list(spec["entrypoint"]), list(spec["cmd"]), dict(spec["env"]))
    folder = SUITE_IMAGES.get(repository)
    if folder is None:
        raise KeyError(f"the box has no stand-in for image {reference}")
    parsed = list(dockerfile.parse_file(str(REPO / "services" / folder / "Dockerfile")))
    last = max(i for i, c in enumerate(parsed) if c.cmd == "FROM")
    result = Image([], [])
    for command in parsed[last:]:
        if command.cmd == "ENV":
            result.env.update(zip(command.value[::2], command.value[1::2]))
        elif command.cmd == "ENTRYPOINT":
            result.entrypoint = list(command.value)
        elif command.cmd == "CMD":
            result.cmd = list(command.value)
        elif command.cmd == "WORKDIR":
            result.workdir = command.value[0]
    return result


def host_path_env(env: dict[str, str]) -> dict[str, str]:
    """The image's PATH with its virtual environment replaced by this checkout's."""
    path = env.get("PATH", "$PATH")
    path = re.sub(r"/opt/aiworks/bin", str(VENV_BIN), path)
    return {**env, "PATH": path.replace("$PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")}


def executable(name: str) -> str:
    """A program of the image, as this machine has it."""
    if name == "python" or name.startswith("python3"):
        return sys.executable
    local = VENV_BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed here (the box runs images' programs locally)")
    return found
