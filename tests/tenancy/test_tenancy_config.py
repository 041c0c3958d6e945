"""The tenants file and the API keys file: loading, the Helm chart's spelling, and errors that name tenant and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiworks.core.errors import InvalidArgument
from aiworks.core.options import Priority, read_options
from aiworks.gateway.auth import hash_api_key
from aiworks.gateway.tenancy import ANONYMOUS, load_tenancy, tenant_classes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tenants.yaml"
DOCS = ROOT / "docs" / "tenancy.md"
HASH_A = hash_api_key("key-a")
HASH_B = hash_api_key("key-b")


def test_no_tenants_file_is_demo_mode():
    config = load_tenancy(None)
    assert config.demo
    assert config.get("") is ANONYMOUS
    assert not ANONYMOUS.limited and ANONYMOUS.allows("anything")


def test_keys_file_without_tenants_file_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="AIWORKS_GATEWAY_TENANTS_FILE is not"):
        load_tenancy(None, tmp_path / "keys.yaml")


def test_full_tenant(write_yaml):
    path = write_yaml(
        "tenants.yaml",
        {
            "tenants": [
                {
                    "id": "acme",
                    "models": ["iris", "digits"],
                    "requests_per_second": 50,
                    "burst": 100,
                    "max_concurrent_requests": 8,
                    "max_request_bytes": 1 << 20,
                    "default_priority": "realtime",
                    "compute_quota": {"seconds": 3600, "window_s": 86400},
                    "api_keys": [HASH_A],
                    "jwt_subjects": ["svc-acme"],
                }
            ],
            "filters": {"deny_patterns": {"ssn": r"\d{3}-\d{2}-\d{4}", "id_card": None}},
        },
    )
    config = load_tenancy(path)
    acme = config.tenants["acme"]
    assert not config.demo
    assert acme.allows("iris") and not acme.allows("bert")
    assert acme.bucket_size == 100 and acme.max_concurrent_requests == 8
    assert acme.compute_quota.seconds == 3600 and acme.compute_quota.window_s == 86400
    assert config.key_hashes == {HASH_A: "acme"}
    assert set(config.deny_patterns) == {"ssn", "id_card"}
    assert config.deny_patterns["id_card"].search(b"123-45-6789")


def test_helm_chart_spelling_is_accepted(write_yaml):
    """helm/aiworks/values.yaml writes name/requestsPerSecond/maxConcurrentRequests."""
    path = write_yaml(
        "tenants.yaml",
        {
            "tenants": [
                {"name": "default", "requestsPerSecond": 100, "maxConcurrentRequests": 32, "models": ["*"]},
                {"name": "research", "requestsPerSecond": 2.5, "maxConcurrentRequests": 4, "models": ["digits"]},
            ]
        },
    )
    config = load_tenancy(path)
    assert config.tenants["default"].requests_per_second == 100
    assert config.tenants["research"].bucket_size == 3  # one second's worth, rounded up
    assert config.tenants["research"].allows("digits") and not config.tenants["research"].allows("iris")


def test_json_is_read_too(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"id": "acme", "api_keys": [HASH_A]}]}))
    assert set(load_tenancy(path).tenants) == {"acme"}


def test_the_example_config_loads():
    config = load_tenancy(EXAMPLE)
    assert {"acme", "research", "batch-jobs"} <= set(config.tenants)
    assert config.jwt is not None and config.jwt.tenant_claim == "tenant"
    assert config.key_hashes[hash_api_key("aiw_example_acme_DO_NOT_USE_IN_PRODUCTION")] == "acme"


def test_the_docs_example_loads(tmp_path):
    text = DOCS.read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "tenants.yaml"
    path.write_text(block)
    config = load_tenancy(path)
    assert set(config.tenants) == {"acme", "research"} and set(config.deny_patterns) == {"id_card", "api_secret"}


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ({"id": "acme", "requests_per_second": -1}, "tenant 'acme': field 'requests_per_second'"),
        ({"id": "acme", "default_priority": "urgent"}, "tenant 'acme': field 'default_priority'"),
        ({"id": "acme", "burst": 5}, "tenant 'acme': .*'burst' is set but 'requests_per_second' is not"),
        ({"id": "acme", "api_keys": ["aiw_plaintextkey"]}, "tenant 'acme': field 'api_keys'.*never put a key itself"),
        ({"id": "acme", "models": ["no spaces"]}, "tenant 'acme': field 'models': .*'no spaces' is not a model name"),
        ({"id": "acme", "compute_quota": {"seconds": 10, "window_s": 0}}, "field 'compute_quota.window_s'"),
        ({"id": "acme", "rate": 5}, "tenant 'acme': field 'rate': Extra inputs"),
        ({"id": "a b"}, "tenant 'a b': field 'id'"),
        ({"models": ["*"]}, "tenant #1: field 'id'"),
    ],
)
def test_validation_errors_name_the_tenant_and_field(write_yaml, tenant, message):
    path = write_yaml("tenants.yaml", {"tenants": [tenant]})
    with pytest.raises(InvalidArgument, match=message):
        load_tenancy(path)


def test_document_level_errors(write_yaml, tmp_path):
    with pytest.raises(InvalidArgument, match="defines no tenants; unset AIWORKS_GATEWAY_TENANTS_FILE"):
        load_tenancy(write_yaml("empty.yaml", {"tenants": []}))
    with pytest.raises(InvalidArgument, match="tenant 'acme': defined twice"):
        load_tenancy(write_yaml("twice.yaml", {"tenants": [{"id": "acme"}, {"id": "acme"}]}))
    with pytest.raises(InvalidArgument, match="field 'jwt.algorithms'.*mixes HMAC"):
        load_tenancy(write_yaml("jwt.yaml", {"tenants": [{"id": "a"}], "jwt": {"algorithms": ["HS256", "RS256"]}}))
    with pytest.raises(InvalidArgument, match="pattern 'bad' is not a valid regular expression"):
        load_tenancy(write_yaml("re.yaml", {"tenants": [{"id": "a"}], "filters": {"deny_patterns": {"bad": "("}}}))
    with pytest.raises(InvalidArgument, match="pattern 'nope' has no regex and is not a built-in"):
        load_tenancy(write_yaml("re2.yaml", {"tenants": [{"id": "a"}], "filters": {"deny_patterns": {"nope": None}}}))
    with pytest.raises(InvalidArgument, match="cannot be read"):
        load_tenancy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [")
    with pytest.raises(InvalidArgument, match="is not valid YAML or JSON"):
        load_tenancy(bad)


def test_jwt_subject_cannot_belong_to_two_tenants(write_yaml):
    path = write_yaml(
        "tenants.yaml", {"tenants": [{"id": "a", "jwt_subjects": ["svc"]}, {"id": "b", "jwt_subjects": ["svc"]}]}
    )
    with pytest.raises(InvalidArgument, match="tenant 'b' field 'jwt_subjects': 'svc' already maps to tenant 'a'"):
        load_tenancy(path)
    path = write_yaml("tenants2.yaml", {"tenants": [{"id": "a"}, {"id": "b", "jwt_subjects": ["a"]}]})
    with pytest.raises(InvalidArgument, match="'a' already maps to tenant 'a'"):
        load_tenancy(path)


def test_api_keys_file(write_yaml):
    tenants = write_yaml("tenants.yaml", {"tenants": [{"id": "acme", "api_keys": [HASH_A]}, {"id": "research"}]})
    keys = write_yaml("keys.yaml", {"keys": [{"hash": HASH_B, "tenant": "research", "label": "notebook"}]})
    config = load_tenancy(tenants, keys)
    assert config.key_hashes == {HASH_A: "acme", HASH_B: "research"}


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"keys": [{"hash": "aiw_secret", "tenant": "acme"}]}, r"key #1: field 'hash' must be 'sha256:"),
        ({"keys": [{"hash": HASH_B, "tenant": "nobody", "label": "ci"}]}, r"key #1 \('ci'\): field 'tenant' names"),
        ({"keys": [{"hash": HASH_B, "tenant": "acme", "secret": "x"}]}, r"unknown field\(s\) \['secret'\]"),
        ({"keys": [{"hash": HASH_A, "tenant": "research"}]}, "already belongs to tenant 'acme'"),
        ({"sha256:abc": "acme"}, "expected a mapping with a 'keys' list"),
    ],
)
def test_api_keys_file_errors(write_yaml, keys, message):
    tenants = write_yaml("tenants.yaml", {"tenants": [{"id": "acme", "api_keys": [HASH_A]}, {"id": "research"}]})
    with pytest.raises(InvalidArgument, match=message):
        load_tenancy(tenants, write_yaml("keys.yaml", keys))


@pytest.mark.parametrize(
    ("tenant", "given", "expected", "clamped"),
    [
        # The default applies when the request names no class...
        ({"default_priority": "batch"}, {}, "batch", False),
        ({"default_priority": "batch"}, {"priority": 0}, "batch", False),
        # ...and is a ceiling: a more urgent class is lowered to it, and the response says so.
        ({"default_priority": "batch"}, {"priority": 1}, "batch", True),
        ({"default_priority": "batch"}, {"priority": "realtime"}, "batch", True),
        ({"default_priority": "standard"}, {"priority": 3}, "batch", False),  # less urgent: kept
        # max_priority allows more than the default.
        ({"default_priority": "batch", "max_priority": "realtime"}, {"priority": 1}, "realtime", False),
        ({"default_priority": "batch", "max_priority": "standard"}, {"priority": "1"}, "standard", True),
        ({"max_priority": "standard"}, {}, "standard", False),  # the server's default, within the ceiling
        ({}, {"priority": 1}, "realtime", False),  # no class, no ceiling
    ],
)
def test_the_tenants_class_is_a_default_and_a_ceiling(write_yaml, tenant, given, expected, clamped):
    config = load_tenancy(write_yaml("t.yaml", {"tenants": [{"id": "jobs", **tenant}]}))
    default, ceiling = tenant_classes(config.tenants["jobs"])
    options = read_options(dict(given), default=default or Priority.STANDARD, ceiling=ceiling)
    assert options.priority is Priority.named(expected)
    assert options.clamped is clamped


def test_a_class_that_names_nothing_is_refused_whatever_the_tenant(write_yaml):
    config = load_tenancy(write_yaml("t.yaml", {"tenants": [{"id": "jobs", "default_priority": "batch"}]}))
    default, ceiling = tenant_classes(config.tenants["jobs"])
    with pytest.raises(InvalidArgument, match="priority"):
        read_options({"priority": "urgent!"}, default=default, ceiling=ceiling)


def test_a_default_more_urgent_than_the_ceiling_is_refused(write_yaml):
    path = write_yaml("t.yaml", {"tenants": [{"id": "jobs", "default_priority": "realtime", "max_priority": "batch"}]})
    with pytest.raises(InvalidArgument, match="'default_priority' realtime is more urgent than 'max_priority' batch"):
        load_tenancy(path)
