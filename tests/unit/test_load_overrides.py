"""Triton's load overrides: parsing the parameters, and the runtime repository writing files only where it may."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.core.load_overrides import LoadOverrides, overrides_from_parameters
from aiworks.runtime.repository import ModelRepository

CONFIG = json.dumps({
    "platform": "onnxruntime_onnx", "max_batch_size": 4,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
})  # fmt: skip


@pytest.fixture
def repo(tmp_path) -> ModelRepository:
    (tmp_path / "repository" / "m" / "1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    return ModelRepository(tmp_path / "repository")


# ---- parameters --------------------------------------------------------------------------------------


def test_http_parameters_decode_base64_files_and_keep_the_config():
    got = overrides_from_parameters(
        {"config": CONFIG, "file:1/model.onnx": base64.b64encode(b"\x00\x01").decode()}, base64_files=True
    )
    assert got == LoadOverrides(CONFIG, {"1/model.onnx": b"\x00\x01"}) and got.file_bytes == 2


def test_grpc_parameters_take_bytes():
    assert overrides_from_parameters({"file:1/a": b"xy", "config": "{}"}, base64_files=False).files == {"1/a": b"xy"}
    with pytest.raises(InvalidArgument, match="must be a bytes parameter"):
        overrides_from_parameters({"file:1/a": "xy", "config": "{}"}, base64_files=False)


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"file:1/a": "!!!", "config": "{}"}, "not valid base64"),
        ({"file:1/a": "eHk="}, "needs a 'config' parameter"),
        ({"config": 3}, "must be a string"),
        ({"file:": "eHk=", "config": "{}"}, "names no file"),
        ({"colour": "red"}, "'colour' is not supported"),
    ],
)
def test_bad_parameters_are_refused_by_name(parameters, message):
    with pytest.raises(InvalidArgument, match=message):
        overrides_from_parameters(parameters, base64_files=True)


def test_no_parameters_are_no_overrides():
    assert not overrides_from_parameters({}, base64_files=True)


# ---- the repository --------------------------------------------------------------------------------------


def test_files_land_in_the_models_folder_and_a_new_models_folder_is_made(repo):
    config = repo.apply_overrides("fresh", LoadOverrides(CONFIG, {"1/model.onnx": b"abc", "2/sub/x.bin": b"d"}), 100)
    assert config.max_batch_size == 4 and config.name == "fresh"
    assert (repo.root / "fresh" / "1" / "model.onnx").read_bytes() == b"abc"
    assert (repo.root / "fresh" / "2" / "sub" / "x.bin").read_bytes() == b"d"
    assert not [p for p in (repo.root / "fresh").rglob(".upload-*")]  # written beside, renamed over
    entry = repo.entry("fresh", config)
    assert entry.config is config and entry.versions == (1, 2)


def test_a_config_alone_writes_nothing(repo):
    config = repo.apply_overrides("m", LoadOverrides(json.dumps({"max_batch_size": 2})), 100)
    assert config.max_batch_size == 2 and sorted(p.name for p in (repo.root / "m").iterdir()) == ["1"]


@pytest.mark.parametrize(
    "path, message",
    [
        ("../n/1/model.onnx", "'..'"),
        ("1/../../n/model.onnx", "'..'"),
        ("1//model.onnx", "empty"),
        ("./1/model.onnx", "'.'"),
        ("/etc/passwd", "relative"),
        ("1\\model.onnx", "relative"),
        ("C:model.onnx", "relative"),
        ("config.pbtxt", "'config' parameter"),
    ],
)
def test_a_path_that_is_not_plainly_inside_the_folder_is_refused_before_anything_is_written(repo, path, message):
    overrides = LoadOverrides(CONFIG, {"1/fine.onnx": b"ok", path: b"bad"})
    with pytest.raises(InvalidArgument, match=message) as refused:
        repo.apply_overrides("m", overrides, 100)
    assert str(repo.root) not in refused.value.message
    assert not (repo.root / "m" / "1" / "fine.onnx").exists()


def test_links_on_the_way_or_at_the_target_are_refused_and_nothing_goes_through_them(repo, tmp_path):
    (repo.root / "m" / "2").symlink_to(tmp_path / "outside")
    with pytest.raises(InvalidArgument, match="link"):
        repo.apply_overrides("m", LoadOverrides(CONFIG, {"2/model.onnx": b"x"}), 100)
    (repo.root / "m" / "1" / "model.onnx").symlink_to(tmp_path / "outside" / "target")
    with pytest.raises(InvalidArgument, match="link"):
        repo.apply_overrides("m", LoadOverrides(CONFIG, {"1/model.onnx": b"x"}), 100)
    assert list((tmp_path / "outside").iterdir()) == []


def test_a_model_folder_that_links_out_of_the_repository_is_refused(repo, tmp_path):
    os.symlink(tmp_path / "outside", repo.root / "evil")
    with pytest.raises(InvalidArgument, match="outside the model repository") as refused:
        repo.apply_overrides("evil", LoadOverrides(CONFIG, {"1/model.onnx": b"x"}), 100)
    assert str(tmp_path) not in refused.value.message
    assert list((tmp_path / "outside").iterdir()) == []


def test_more_bytes_than_the_cap_are_refused_before_the_folder_is_made(repo):
    with pytest.raises(PayloadTooLarge, match="more than the 4 bytes"):
        repo.apply_overrides("big", LoadOverrides(CONFIG, {"1/a": b"xy", "1/b": b"xyz"}), 4)
    assert not (repo.root / "big").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        ("{not json", "config"),
        (json.dumps({"max_batch_sise": 2}), "max_batch_sise"),
        (json.dumps({"name": "other"}), "does not match"),
        (json.dumps({"max_batch_size": -1}), ">= 0"),
    ],
)
def test_an_invalid_config_is_refused_with_its_reason_and_no_file_is_written(repo, config, message):
    with pytest.raises(InvalidArgument, match=message):
        repo.apply_overrides("m", LoadOverrides(config, {"1/model.onnx": b"x"}), 100)
    assert not (repo.root / "m" / "1" / "model.onnx").exists()


def test_an_invalid_model_name_is_refused(repo):
    with pytest.raises(InvalidArgument):
        repo.apply_overrides("..", LoadOverrides(CONFIG, {"1/model.onnx": b"x"}), 100)
    assert not (Path(repo.root).parent / "1").exists()
