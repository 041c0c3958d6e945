"""The e2e test's model versions behave as rollout_models.py says, in ONNX Runtime directly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rollout_models import MODEL, TRIGGER, build_repository


def test_the_repository_versions_behave_as_documented(tmp_path):
    import onnxruntime as ort

    repo = build_repository(tmp_path)
    triggered = np.full((1, 4), TRIGGER, np.float32)
    answers = {}
    for version in ("1", "2", "3", "4"):
        session = ort.InferenceSession(str(Path(repo, MODEL, version, "model.onnx")))
        answers[version] = session.run(None, {"x": np.ones((1, 4), np.float32)})[0]
        if version == "2":
            with pytest.raises(Exception, match="Reshape"):
                session.run(None, {"x": triggered})
        else:
            session.run(None, {"x": triggered})
    for version in ("2", "3", "4"):
        np.testing.assert_allclose(answers[version], answers["1"], rtol=1e-6)
