"""Generation routes are closed by default: with a tenants file, a key is needed and a tenant's model list holds."""

from __future__ import annotations

import shutil

import openai
import pytest
import requests
import yaml
from e2e.e2e_support import start_suite

from aiworks.gateway.auth import generate_api_key

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tenancy(tiny_llm_repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenancy")
    repo = work / "repo"  # the tiny codegen, and a copy of it whose outputs are masked
    shutil.copytree(tiny_llm_repo, repo)
    shutil.copytree(repo / "codegen", repo / "codegen-masked")
    config = (repo / "codegen-masked" / "config.pbtxt").read_text().replace('name: "codegen"', 'name: "codegen-masked"')
    config += '\nparameters { key: "mask_patterns" value: { string_value: "email" } }\n'
    (repo / "codegen-masked" / "config.pbtxt").write_text(config)
    keys, tenants = {}, []
    for tenant_id, fields in (("coder", {"models": ["codegen"], "max_tokens": 8}), ("other", {"models": ["minilm"]}),
                              ("masked", {"models": ["codegen-masked"]})):  # fmt: skip
        keys[tenant_id], digest = generate_api_key()
        tenants.append({"id": tenant_id, **fields, "api_keys": [digest]})
    (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    s = start_suite(repo, work / "logs", replicas=1, cache=False,
                    extra_env={"AIWORKS_GATEWAY_TENANTS_FILE": str(work / "tenants.yaml")})  # fmt: skip
    yield s, keys
    s.supervisor.stop()


def test_generate_routes_need_a_key_and_the_model_in_the_tenants_list(tenancy):
    suite, keys = tenancy
    body = {"text_input": "def ", "max_tokens": 3}
    for route in ("generate", "generate_stream"):
        u = f"http://{suite.http_url}/v2/models/codegen/{route}"
        assert requests.post(u, json=body).status_code == 401
        assert requests.post(u, json=body, headers={"authorization": f"Bearer {keys['other']}"}).status_code == 403
        ok = requests.post(u, json=body, headers={"authorization": f"Bearer {keys['coder']}"})
        assert ok.status_code == 200, ok.text


def test_openai_routes_answer_auth_errors_in_openais_format(tenancy):
    suite, keys = tenancy
    base = f"http://{suite.http_url}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="aiw_not-a-key", max_retries=0).completions.create(model="codegen",
                                                                                               prompt="x")
    other = openai.OpenAI(base_url=base, api_key=keys["other"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        other.completions.create(model="codegen", prompt="x", max_tokens=2)
    assert denied.value.body["type"] == "permission_error"
    assert "codegen" not in [m.id for m in other.models.list()]
    with pytest.raises(openai.NotFoundError):  # another tenant's model: not even its existence is told
        other.models.retrieve("codegen")
    coder = openai.OpenAI(base_url=base, api_key=keys["coder"], max_retries=0)
    assert [m.id for m in coder.models.list()] == ["codegen"]
    assert coder.models.retrieve("codegen").id == "codegen"
    done = coder.completions.create(model="codegen", prompt="import ", max_tokens=4, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4
    r = requests.get(f"{base}/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_tenants_max_tokens_cap_holds_on_every_front_end(tenancy):
    suite, keys = tenancy
    auth = {"authorization": f"Bearer {keys['coder']}"}
    u = f"http://{suite.http_url}/v2/models/codegen/generate"
    over = requests.post(u, json={"text_input": "x", "max_tokens": 9}, headers=auth)
    assert over.status_code == 400 and "cap of 8 (rule max_tokens)" in over.json()["error"]
    assert requests.post(u, json={"text_input": "x", "max_tokens": 8}, headers=auth).status_code == 200
    coder = openai.OpenAI(base_url=f"http://{suite.http_url}/v1", api_key=keys["coder"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="rule max_tokens"):
        coder.chat.completions.create(model="codegen", messages=[{"role": "user", "content": "hi"}], max_tokens=50)


def test_a_model_that_masks_its_outputs_gives_no_log_probabilities(tenancy):
    """Token texts in log probabilities would pass its masking by: asked for on any route, a 400 that says so."""
    suite, keys = tenancy
    client = openai.OpenAI(base_url=f"http://{suite.http_url}/v1", api_key=keys["masked"], max_retries=0)
    assert client.completions.create(model="codegen-masked", prompt="x", max_tokens=2).choices[0].logprobs is None
    # Its stream is held a line at a time (tests/tenancy/test_stream_masking.py) and ends with the same text.
    ask = {"model": "codegen-masked", "prompt": "import ", "max_tokens": 12, "temperature": 0,
           "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="codegen-masked", prompt="x", max_tokens=2, logprobs=1)
    assert "masks its outputs; log probabilities would show its tokens unmasked" in refused.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="codegen-masked", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, logprobs=True, stream=True)  # fmt: skip
    r = requests.post(f"http://{suite.http_url}/v2/models/codegen-masked/generate",
                      json={"text_input": "x", "max_tokens": 2, "logprobs": 0},
                      headers={"authorization": f"Bearer {keys['masked']}"})  # fmt: skip
    assert r.status_code == 400 and "masks its outputs" in r.json()["error"]
    r = requests.post(f"http://{suite.http_url}/v2/models/codegen-masked/generate",
                      json={"text_input": "x", "max_tokens": 0, "prompt_logprobs": 1},
                      headers={"authorization": f"Bearer {keys['masked']}"})  # fmt: skip
    assert r.status_code == 400 and "masks its outputs" in r.json()["error"]
