"""Model and version names: one check wherever a name arrives, and a repository that cannot be left."""

from __future__ import annotations

import os

import pytest

from aiworks.core.errors import InvalidArgument, NotFound
from aiworks.core.names import check_model_name, check_version, inside, valid_model_name
from aiworks.runtime.repository import ModelRepository


@pytest.mark.parametrize("name", ["echo", "digits_v2", "minilm-l6.int8", "A" * 128, "..a", "a..b"])
def test_valid_names(name):
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name", ["", ".", "..", "/elsewhere/echo", "../echo", "a/b", "a\\b", "echo\x00", "é", "a b", "A" * 129, "%2F"]
)
def test_invalid_names_are_400_and_short(name):
    assert not valid_model_name(name)
    with pytest.raises(InvalidArgument) as info:
        check_model_name(name)
    assert info.value.status.http == 400 and len(info.value.message) < 200


def test_versions_are_numbers_or_empty():
    assert check_version("") == "" and check_version("12") == "12"
    for bad in ("-1", "1.0", "../1", "1" * 20, "latest"):
        with pytest.raises(InvalidArgument, match="is not valid: a version is a decimal number"):
            check_version(bad)


def test_inside_follows_symlinks_and_names_no_path(tmp_path):
    root, outside = tmp_path / "repo", tmp_path / "elsewhere"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "link")
    assert inside(root, root / "a", "model 'a' folder") == (root / "a").resolve()
    with pytest.raises(InvalidArgument) as info:
        inside(root, root / "link", "model 'link' folder")
    assert info.value.message == "model 'link' folder resolves outside the model repository"
    assert str(tmp_path) not in info.value.message


def _model(folder, config="max_batch_size: 0\n"):
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"not really a model")
    (folder / "config.pbtxt").write_text(config)


def test_the_repository_refuses_names_and_links_that_leave_it(tmp_path):
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    _model(root / "echo")
    _model(outside / "echo", "max_batch_size: 0\n# an outside config\n")
    os.symlink(outside / "echo", root / "evil")  # a folder link out of the repository
    _model(root / "config_link")
    (root / "config_link" / "config.pbtxt").unlink()
    os.symlink(outside / "echo" / "config.pbtxt", root / "config_link" / "config.pbtxt")
    _model(root / "file_link")
    (root / "file_link" / "1" / "model.onnx").unlink()
    os.symlink(outside / "echo" / "1" / "model.onnx", root / "file_link" / "1" / "model.onnx")
    repo = ModelRepository(root)

    assert repo.entry("echo").config.source_file == "config.pbtxt"
    for name in (str(outside / "echo"), "../elsewhere/echo", "..", "echo/../../elsewhere/echo"):
        with pytest.raises(InvalidArgument) as info:
            repo.entry(name)
        assert str(root) not in info.value.message and str(tmp_path) not in info.value.message
    for name, what in (("evil", "folder"), ("config_link", "file config.pbtxt")):
        with pytest.raises(InvalidArgument, match=f"model '{name}' {what} resolves outside the model repository"):
            repo.entry(name)
    config = repo.entry("file_link").config
    with pytest.raises(InvalidArgument, match="model 'file_link' file 1/model.onnx resolves outside"):
        repo.model_file(config, 1)
    with pytest.raises(NotFound) as info:
        repo.entry("missing")
    assert info.value.message == "model 'missing' is not in the model repository"
    assert "evil" in repo.names() and "%2F" not in repo.names()
    assert repo.relative(f"failed to open {root.resolve()}/echo/1/model.onnx") == "failed to open echo/1/model.onnx"
