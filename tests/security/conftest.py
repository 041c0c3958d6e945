"""Security fixtures: two independent CAs with their certificates, and a small real ONNX model.

Certificates are issued once per module: ECDSA key generation is cheap, but
the gRPC tests start several servers and want the same files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from aiworks.security.certs import write_certificates

SERVICES = ("gateway", "scheduler")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """``aiworks certs`` output: ca.crt/ca.key, tls.crt/tls.key, and gateway/ and scheduler/ folders."""
    out = tmp_path_factory.mktemp("pki")
    write_certificates(out, ["localhost", "127.0.0.1"], SERVICES)
    return out


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> Path:
    """A second, unrelated CA issuing certificates for the same names."""
    out = tmp_path_factory.mktemp("other-pki")
    write_certificates(out, ["localhost", "127.0.0.1"], SERVICES)
    return out


def build_mlp() -> onnx.ModelProto:
    """A two-layer MLP (MatMul, Add, Relu) with fixed random weights and a Constant node."""
    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "w2")
    scale = helper.make_node(
        "Constant", [], ["scale"], value=numpy_helper.from_array(np.array([0.5, 2.0, 1.0], np.float32), "scale")
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["y0"]),
        scale,
        helper.make_node("Mul", ["y0", "scale"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[w1, b1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="aiworks-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def onnx_model(tmp_path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save_model(build_mlp(), str(path))
    return path
