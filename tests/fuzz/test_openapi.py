"""schemathesis over the gateway's own OpenAPI document: every operation, generated requests, zero 5xx.

The infer routes publish the OIP request body's JSON Schema (http_codec.INFER_REQUEST_SCHEMA),
so the fuzzer builds inference requests, not empty bodies. Requests carry the fuzz tenant's key.
Each operation gets its own bounded Hypothesis run (schemathesis's pytest plugin does not load
a schema from a fixture under this pytest, so the operations are driven here).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from fuzz.conftest import HEADERS, assert_responsive

EXAMPLES = 20
INFER_EXAMPLES = 60


def test_no_operation_answers_5xx(fuzz_suite, gateway_schema):
    operations = [result.ok() for result in gateway_schema.get_all_operations()]
    assert any(op.path.endswith("/infer") for op in operations)
    for operation in operations:
        examples = INFER_EXAMPLES if operation.path.endswith("/infer") else EXAMPLES

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy())
        def run(case):
            case.call_and_validate(base_url=fuzz_suite.base, headers=HEADERS, checks=[not_a_server_error], timeout=30)

        run()
    assert_responsive(fuzz_suite)
