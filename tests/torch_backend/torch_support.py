"""Models shared by the pytorch backend's tests (fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

# tests/e2e's start_suite, one module whichever folder imports it first (as tests/qos does).
_spec = importlib.util.spec_from_file_location("e2e_support", Path(__file__).parent.parent / "e2e" / "e2e_support.py")
if "e2e_support" not in sys.modules:
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up there
    _spec.loader.exec_module(sys.modules[_spec.name])
start_suite = sys.modules["e2e_support"].start_suite

FEATURES, HIDDEN, CLASSES = 8, 32, 3


class MLP(torch.nn.Module):
    """Two layers; returns (probabilities, logits) so outputs map by index."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(FEATURES, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, features):
        logits = self.out(torch.relu(self.hidden(features)))
        return torch.softmax(logits, dim=1), logits


class Mixer(torch.nn.Module):
    """Two inputs whose order matters: ``scale * x + shift``, with an integer count returned."""

    def forward(self, x, shift):
        return x * 2.0 + shift, (x > 0).sum(dim=1, keepdim=True).to(torch.int64)


MLP_TS_CONFIG = """\
name: "mlp_ts"
platform: "pytorch_libtorch"
max_batch_size: 16
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [
  { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }
]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

MLP_EP_CONFIG = """\
name: "mlp_ep"
backend: "pytorch"
max_batch_size: 16
dynamic_batching { }
"""

MIXER_CONFIG = """\
name: "mixer"
platform: "pytorch_libtorch"
max_batch_size: 8
default_model_filename: "mixer.torchscript"
input [
  { name: "shift" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "mixed" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "positives" data_type: TYPE_INT64 dims: [ 1 ] }
]
"""


def rows(n: int = 5, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, FEATURES)).astype(np.float32)


def write_mlp_models(root: Path) -> Path:
    mlp = MLP().eval()
    example = torch.from_numpy(rows(4))
    (root / "mlp_ts" / "1").mkdir(parents=True)
    torch.jit.trace(mlp, (example,)).save(str(root / "mlp_ts" / "1" / "model.pt"))
    (root / "mlp_ts" / "config.pbtxt").write_text(MLP_TS_CONFIG)

    batch = torch.export.Dim("batch", min=1, max=16)
    program = torch.export.export(mlp, (example,), dynamic_shapes=({0: batch},))
    (root / "mlp_ep" / "1").mkdir(parents=True)
    with open(root / "mlp_ep" / "1" / "model.pt", "wb") as f:
        torch.export.save(program, f)
    (root / "mlp_ep" / "config.pbtxt").write_text(MLP_EP_CONFIG)

    (root / "mixer" / "1").mkdir(parents=True)
    torch.jit.script(Mixer()).save(str(root / "mixer" / "1" / "mixer.torchscript"))
    (root / "mixer" / "config.pbtxt").write_text(MIXER_CONFIG)
    return root


_REFERENCE = MLP().eval()  # made once: MLP() seeds torch's global generator, which threads would race on


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the MLP itself answers, in-process: (probabilities, logits)."""
    with torch.inference_mode():
        probabilities, logits = _REFERENCE(torch.from_numpy(x))
    return probabilities.numpy(), logits.numpy()


def config_with(text: str, **replace: str) -> str:
    for old, new in replace.items():
        text = text.replace(old, new)
    return textwrap.dedent(text)
