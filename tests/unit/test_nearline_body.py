"""The asynchronous flag in request bodies, the replayed body, and the callback rules (aiworks.nearline)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket

import orjson
import pytest

from aiworks.core.errors import InvalidArgument
from aiworks.nearline.body import mentions_async, replay_body, take_async_flag
from aiworks.nearline.callbacks import CallbackConfig, check_callback_url, signature
from aiworks.nearline.delivery import GuardedResolver

INPUTS = [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]


def _json(doc: dict) -> bytes:
    return orjson.dumps(doc)


def test_the_flag_is_found_at_the_top_or_in_parameters_and_removed():
    top = take_async_flag(_json({"async": True, "inputs": INPUTS}), None)
    assert top.flag is True and orjson.loads(top.body) == {"inputs": INPUTS} and top.header_length is None
    nested = take_async_flag(_json({"inputs": INPUTS, "parameters": {"async": True, "timeout": 2000}}), None)
    assert nested.flag is True and orjson.loads(nested.body)["parameters"] == {"timeout": 2000}
    assert nested.timeout_us == 2000
    off = take_async_flag(_json({"async": False, "inputs": INPUTS}), None)
    assert off.flag is False and b"async" not in off.body


def test_a_mention_elsewhere_leaves_the_body_as_it_is():
    body = _json({"inputs": INPUTS, "parameters": {"tag": "async"}})
    assert mentions_async(body, None)
    found = take_async_flag(body, None)
    assert found.flag is None and found.body is body
    assert not mentions_async(_json({"inputs": INPUTS}), None)
    # Past the letter-by-letter hits (text full of "y"), the plain search still finds it, and only in the header.
    text = _json({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1], "data": ["y" * 500]}]})
    assert not mentions_async(text, None)
    assert mentions_async(text[:-1] + b',"async":true}', None)
    assert mentions_async(b'{"async":true}', None) and mentions_async(b'"async"', None)


def test_a_flag_that_is_not_a_boolean_is_refused():
    with pytest.raises(InvalidArgument, match="'async' must be true or false"):
        take_async_flag(_json({"async": "yes", "inputs": INPUTS}), None)


def test_binary_bodies_keep_their_data_and_get_the_new_header_length():
    data = b"\x00\x01\x02\x03\x04\x05\x06\x07"
    header = _json({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                "parameters": {"binary_data_size": 8}}], "async": True})  # fmt: skip
    body = header + data
    assert mentions_async(body, str(len(header)))
    assert not mentions_async(b'{"inputs": []}' + b'"async"', "14")  # only the JSON header is searched
    found = take_async_flag(body, str(len(header)))
    size = int(found.header_length)
    assert found.flag is True and found.body[size:] == data and b"async" not in found.body[:size]
    replayed, length = replay_body(found.body, found.header_length, 5000)
    assert replayed[int(length):] == data
    assert orjson.loads(replayed[: int(length)])["parameters"] == {"timeout": 5000}


def test_the_replay_carries_the_time_left_and_never_the_flag():
    body, length = replay_body(_json({"async": True, "inputs": INPUTS, "parameters": {"async": True}}), None, 300)
    doc = orjson.loads(body)
    assert length is None and "async" not in doc and doc["parameters"] == {"timeout": 300}
    shorter, _ = replay_body(_json({"inputs": INPUTS, "parameters": {"timeout": 100}}), None, 300)
    assert orjson.loads(shorter)["parameters"]["timeout"] == 100  # the request's own shorter timeout stays
    longer, _ = replay_body(_json({"inputs": INPUTS, "parameters": {"timeout": 900}}), None, 300)
    assert orjson.loads(longer)["parameters"]["timeout"] == 300


def test_callback_urls_must_name_a_listed_host():
    config = CallbackConfig(hosts=("hooks.example.com", "127.0.0.1"), secret_env="X")
    assert check_callback_url("https://HOOKS.example.com:8443/a?b=1", config)
    assert check_callback_url("http://127.0.0.1:9/x", config)
    for url, words in [("https://evil.example.com/", "'evil.example.com' is not in"),
                       ("ftp://hooks.example.com/", "http:// or https://"),
                       ("https://u:p@hooks.example.com/", "credentials"),
                       ("http://[::1]/", "'::1' is not in")]:  # fmt: skip
        with pytest.raises(InvalidArgument, match=words):
            check_callback_url(url, config)
    with pytest.raises(InvalidArgument, match="not in this tenant's callbacks.hosts"):
        check_callback_url("https://hooks.example.com/", None)
    with pytest.raises(ValueError, match="exactly one"):
        CallbackConfig(hosts=("a",))


def test_the_signature_is_hmac_sha256_over_timestamp_dot_body():
    expected = hmac.new(b"k", b"1700000000.{}", hashlib.sha256).hexdigest()
    assert signature(b"k", "1700000000", b"{}") == "sha256=" + expected


def test_names_resolving_to_loopback_are_refused_except_localhost():
    async def resolve(host: str):
        resolver = GuardedResolver()
        try:
            return await resolver.resolve(host, 80)
        finally:
            await resolver.close()

    assert asyncio.run(resolve("localhost"))
    name = socket.gethostname()
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except OSError:
        loopback = False
    if not loopback:
        pytest.skip(f"this machine's name {name!r} does not resolve to a loopback address")
    with pytest.raises(OSError, match="loopback or link-local"):
        asyncio.run(resolve(name))


def test_async_never_travels_to_a_model_and_is_refused_where_nothing_queues():
    from aiworks.core.options import GATEWAY_PARAMETERS, Priority, read_options

    assert "async" in GATEWAY_PARAMETERS  # consumed by the gateway: not copied into the runtime's request
    with pytest.raises(InvalidArgument, match="only POST /v2/models/\\{model\\}/infer queues them"):
        read_options({"async": True}, default=Priority.STANDARD)
    assert read_options({"async": False}, default=Priority.STANDARD).priority == Priority.STANDARD


@pytest.mark.parametrize("header_length", ["²", "٣", "12a", "-1", "9" * 30])
def test_a_header_length_that_is_not_ascii_digits_is_no_error(header_length):
    # "²".isdigit() is true but int("²") raises: the fuzzer found a 500 here (binary bodies).
    body = b'{"inputs": [], "async": true}'
    assert mentions_async(body, header_length)
    take_async_flag(body, header_length)
