"""Every rendered Kubernetes object against the API's own schemas
(kubernetes-validate, strict: unknown fields are errors)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import kubernetes_validate
import pytest

from .support import CRD_GROUPS, Rendered, api_group

# The chart's kubeVersion floor (Chart.yaml) and the newest schemas shipped.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())


@pytest.fixture(scope="module", autouse=True)
def parse_each_schema_once() -> Iterator[None]:
    """kubernetes-validate parses its 2 MB definitions file for every object;
    the files do not change during a run, so parse each one once."""
    original = kubernetes_validate.utils.schema_contents
    kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        kubernetes_validate.utils.schema_contents = original


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_objects_validate_strictly(rendered: Rendered, kube_version: str) -> None:
    failures = []
    for obj, source in zip(rendered.objects, rendered.sources):
        if api_group(obj) in CRD_GROUPS:
            continue  # checked by the Istio and prometheus-operator models
        name = f"{source}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            failures.append(f"{name} at {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            failures.append(f"{name}: {error.message}")
    assert not failures, "\n".join(failures)


def test_only_known_crds_are_left_to_other_checks(rendered: Rendered) -> None:
    groups = {api_group(o) for o in rendered.objects}
    core = {"", "apps", "autoscaling", "batch", "policy", "rbac.authorization.k8s.io", "networking.k8s.io"}
    assert groups - core <= CRD_GROUPS


def test_validator_catches_unknown_fields(rendered: Rendered) -> None:
    """Guard against a vacuous check: a stray field must fail."""
    deployment = next(o for o in rendered.objects if o["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)
