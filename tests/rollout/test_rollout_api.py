"""The /v1/rollouts routes on a real aiohttp server, driven by the real ``aiworks rollout`` command.

The server checks callers as the monitor's does (an admin's bearer token, JSON
bodies); the command reads its token from ``$AIWORKS_INTERNAL_TOKEN_FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import yaml
from aiohttp import web
from rollout_support import Behaviour, make_rig

from aiworks.monitor.rollout_routes import add_rollout_routes
from aiworks.monitor.server import control_guard
from aiworks.rollout_cli import add_rollout_parser, parse_duration_s, parse_rate
from aiworks.security.callers import TOKEN_FILE_ENV, CallerAuth, ClientCaller, ensure_secret_file

pytestmark = pytest.mark.loopback


@pytest.fixture
async def served(tmp_path, monkeypatch):
    token_file = tmp_path / "internal-token"
    secret = ensure_secret_file(token_file)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))  # what the CLI acts with
    rig = make_rig()
    rig.admin = {"Authorization": ClientCaller.from_secret("admin", secret).bearer()}
    app = web.Application(middlewares=[control_guard(CallerAuth(secret=secret))])
    add_rollout_routes(app, rig.controller)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield rig, f"http://{host}:{port}"
    await runner.cleanup()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiworks")
    add_rollout_parser(p.add_subparsers(dest="command"))
    return p


async def aiworks(url: str, *argv: str, flag: str = "--monitor") -> int | str:
    """``aiworks rollout --monitor URL ...`` in a thread (it blocks on HTTP; the server runs on this loop).

    Returns the exit status: 0, or what SystemExit carried (an error message or a code).
    """
    args = parser().parse_args(["rollout", flag, url, *argv])

    def invoke() -> int | str:
        try:
            args.func(args)
        except SystemExit as exc:
            return exc.code
        return 0

    return await asyncio.to_thread(invoke)


async def test_start_status_abort_and_rollback_through_the_cli(served, capsys):
    rig, url = served
    assert await aiworks(
        url, "start", "m", "--to", "2", "--from", "1", "--steps", "10,50,100", "--dwell", "30s",
        "--max-error-rate-increase", "2%", "--max-p99-ratio", "1.2", "--min-requests", "20", "--json",
    ) == 0  # fmt: skip
    started = json.loads(capsys.readouterr().out)
    assert started["phase"] == "progressing" and started["weights"] == {"1": 90, "2": 10}
    assert started["policy"] == {
        "steps": [10, 50, 100], "dwell_s": 30.0, "max_error_rate_increase": 0.02, "max_p99_ratio": 1.2,
        "min_requests": 20, "max_extensions": 3, "p99_floor_s": 0.005,
    }  # fmt: skip
    assert rig.target.current["m"] == {"1": 90, "2": 10}

    failed = await aiworks(url, "start", "m", "--to", "3")
    assert failed.startswith("error: a rollout of m is in progress") and failed.endswith("(HTTP 409)")

    rig.clock.advance(30)
    await rig.controller.tick()
    assert await aiworks(url, "status", "m") == 0
    text = capsys.readouterr().out
    assert "m: v1 -> v2  progressing  step 2/3 (50%)" in text and "weights: v1=50  v2=50" in text
    assert "last judgement (pass, 30 s window): canary 0% errors, p99 10 ms, 300 req" in text
    assert "rollout_promoted" in text and "history:" in text

    assert await aiworks(url, "abort", "m") == 0
    assert "m: v1 -> v2  aborted" in capsys.readouterr().out
    assert rig.target.current["m"] == {"1": 100, "2": 0}
    assert (await aiworks(url, "abort", "m")).endswith("not in progress (HTTP 412)")
    assert "already back on v1" in await aiworks(url, "rollback", "m")
    assert await aiworks(url, "status", "nope") == "error: no rollout of nope (HTTP 404)"

    assert await aiworks(url, "status", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in listed] == ["m"]
    assert await aiworks(url, "status", "-o", "json", flag="--monitor-address") == 0
    assert json.loads(capsys.readouterr().out) == listed
    assert await aiworks(url, "status", "m", "-o", "yaml", flag="--monitor-address") == 0
    one = yaml.safe_load(capsys.readouterr().out)
    assert (one["model"], one["phase"], one["weights"]) == ("m", listed[0]["phase"], listed[0]["weights"])


async def test_watch_follows_a_rollout_to_its_end(served, capsys):
    rig, url = served
    rig.traffic.versions = {"2": Behaviour(0.0, 0.010)}

    async def drive():
        while rig.controller.status("m")["phase"] == "progressing":
            await asyncio.sleep(0.05)
            rig.clock.advance(30)
            await rig.controller.tick()

    watch = asyncio.create_task(
        aiworks(url, "start", "m", "--to", "2", "--from", "1", "--steps", "50,100", "--watch", "--interval", "50ms")
    )
    while not rig.target.calls:
        await asyncio.sleep(0.01)
    await drive()
    assert await watch == 0
    assert "m: v1 -> v2  completed" in capsys.readouterr().out

    assert await aiworks(url, "rollback", "m") == 0
    assert "rolled back on request after completion" in capsys.readouterr().out
    assert rig.target.current["m"] == {"1": 100, "2": 0}


async def test_bad_requests_get_the_error_table_status(served):
    import aiohttp

    rig, url = served
    json_headers = {**rig.admin, "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for body, status, message in [
            (b"not json", 400, "not JSON"),
            (b"[1]", 400, "JSON object"),
            (b'{"canary": "2"}', 400, "give the model"),
            (b'{"model": "m"}', 400, "give the canary"),
            (b'{"model": "m", "to": "2", "from": "1", "steps": "5,50"}', 400, "last step must be 100"),
            (b'{"model": "m", "to": "2", "from": "1", "dwell_s": "soon"}', 400, "bad rollout setting"),
            (b'{"model": "m", "to": "2", "canary": "3"}', 400, "name the same field"),
            (b'{"model": "m", "to": "9"}', 412, "not ready"),
        ]:
            async with session.post(f"{url}/v1/rollouts", data=body, headers=json_headers) as resp:
                assert resp.status == status, body
                assert message in (await resp.json())["error"]
        async with session.post(f"{url}/v1/rollouts", data=b'{"model": "m", "to": 2}') as resp:
            assert resp.status == 401  # no token: a stranger (or a web page) cannot start a rollout
        async with session.post(f"{url}/v1/rollouts", data=b'{"model": "m", "to": 2}', headers=rig.admin) as resp:
            assert resp.status == 415  # not declared JSON: what a cross-site form would send
        async with session.post(
            f"{url}/v1/rollouts", json={"model": "m", "to": 2, "steps": "20,100"}, headers=rig.admin
        ) as resp:
            assert resp.status == 201
            assert (await resp.json())["weights"] == {"1": 80, "2": 20}
        async with session.get(f"{url}/v1/rollouts") as resp:
            assert [r["canary"] for r in (await resp.json())["rollouts"]] == ["2"]


def test_help_and_value_parsing(capsys):
    with pytest.raises(SystemExit) as done:
        parser().parse_args(["rollout", "start", "--help"])
    assert done.value.code == 0
    start_help = capsys.readouterr().out
    assert "--max-error-rate-increase RATE" in start_help and "1% or 0.01" in start_help
    assert "exits 0 when the rollout completes and 3" in start_help
    assert parse_duration_s("500ms") == 0.5 and parse_duration_s("2m") == 120 and parse_duration_s("60s") == 60
    assert parse_duration_s("45") == 45
    assert parse_rate("1%") == pytest.approx(0.01) and parse_rate("0.05") == 0.05
    with pytest.raises(argparse.ArgumentTypeError, match="1% or 0.01"):
        parse_rate("5")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration_s("soon")
