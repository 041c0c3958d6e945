"""aiworks optimize: variants of digits v2, measured; INT8 stays within 1 point of FP32."""

from __future__ import annotations

import json

import numpy as np

from aiworks.lifecycle.variants import VARIANTS


def test_every_variant_builds_and_is_measured(digits_report):
    report, _ = digits_report
    assert [r.variant for r in report.rows] == ["original", *VARIANTS]
    for row in report.rows:
        assert not row.error, f"{row.variant}: {row.error}"
        assert row.size_bytes > 0 and set(row.latency_ms) == {"1", "32"}
        assert all(v > 0 for v in row.latency_ms.values())
        assert row.accuracy is not None


def test_int8_is_within_one_point_of_fp32(digits_report):
    report, _ = digits_report
    fp32 = report.row("original").accuracy
    assert fp32 > 0.9
    for variant in ("int8-dynamic", "int8-static"):
        row = report.row(variant)
        assert abs(row.accuracy - fp32) <= 0.01, f"{variant}: {row.accuracy:.4f} vs {fp32:.4f}"
        assert row.size_bytes < 0.3 * report.row("original").size_bytes
        assert row.agreement >= 0.98


def test_graph_optimization_fuses_and_fp16_halves(digits_report):
    report, _ = digits_report
    assert "Gemm" in report.row("optimized").note  # MatMul + Add fused
    assert report.row("optimized").agreement == 1.0
    fp16 = report.row("fp16")
    assert fp16.size_bytes < 0.55 * report.row("original").size_bytes
    assert abs(fp16.accuracy - report.row("original").accuracy) <= 0.01


def test_report_is_saved_as_markdown_and_json(digits_report):
    report, out = digits_report
    md = (out / "report.md").read_text()
    assert "| int8-static |" in md and "batch 32 ms" in md
    data = json.loads((out / "report.json").read_text())
    assert [r["variant"] for r in data["rows"]] == [r.variant for r in report.rows]
    for row in report.rows:
        assert (out / row.path.split("/")[-1]).is_file()


def test_cli_with_an_npz_of_held_out_data(tmp_path, capsys):
    import joblib
    from sklearn.neural_network import MLPClassifier

    from aiworks.demo.models import digits_split
    from aiworks.lifecycle.convert import convert

    from .test_convert import run_cli

    x_train, x_test, y_train, y_test = digits_split()
    model = MLPClassifier(hidden_layer_sizes=(32,), max_iter=200, random_state=0).fit(x_train, y_train)
    joblib.dump(model, tmp_path / "small.joblib")
    folder = convert(tmp_path / "small.joblib", tmp_path / "repo").folder
    np.savez(tmp_path / "held_out.npz", x=x_test, y=y_test, x_calib=x_train[:64])

    code = run_cli(
        "optimize",
        str(folder),
        "--data",
        str(tmp_path / "held_out.npz"),
        "--out",
        str(tmp_path / "opt"),
        "--variants",
        "int8-dynamic,int8-static",
        "--repeats",
        "2",
        "--no-progress",
    )

    assert code == 0
    data = json.loads((tmp_path / "opt" / "report.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"original", "int8-dynamic", "int8-static"}
    assert abs(rows["original"]["accuracy"] - model.score(x_test, y_test)) < 1e-9
    assert "| int8-dynamic |" in capsys.readouterr().out
