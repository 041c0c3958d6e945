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
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(DEFAULT_OUT): p.read_text()
        for p in DEFAULT_OUT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(str(k) for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
