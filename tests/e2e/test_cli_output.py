"""``aiworks status`` and ``aiworks traffic`` against the started suite: ``-o table|json|yaml`` show the same facts,
and the spellings from before ``--scheduler-address`` and ``-o`` still work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from e2e_support import tool_env


@pytest.fixture(scope="module")
def cli(suite):
    env = tool_env(suite.supervisor)  # the CLI acts as admin, with the suite's token file
    address = suite.supervisor.scheduler_address

    def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "aiworks", *argv], capture_output=True, text=True, timeout=60,
                              env=env)  # fmt: skip
        if check:
            assert done.returncode == 0, done.stderr
        return done

    run.address = address
    return run


def test_status_in_each_format_tells_the_same_replicas(cli):
    table = cli("status", "--scheduler-address", cli.address).stdout
    as_json = json.loads(cli("status", "--scheduler-address", cli.address, "-o", "json").stdout)
    as_yaml = yaml.safe_load(cli("status", "--scheduler-address", cli.address, "-o", "yaml").stdout)
    replicas = {r["replica_id"]: r for r in as_json["replicas"]}
    assert set(replicas) == {"runtime-0", "runtime-1"}
    assert all(r["live"] and "iris:1" in r["models"] for r in replicas.values())
    assert as_yaml["caller_auth"] == as_json["caller_auth"] and "token" in as_json["caller_auth"]
    assert {r["replica_id"] for r in as_yaml["replicas"]} == set(replicas)
    for replica_id, replica in replicas.items():  # the table names the same replicas at the same addresses
        assert replica_id in table and replica["address"] in table
    assert table.startswith("callers checked by:") and "retry budget:" in table


def test_status_keeps_the_old_flags(cli):
    old = json.loads(cli("status", "--scheduler", cli.address, "--json").stdout)
    assert {r["replica_id"] for r in old["replicas"]} == {"runtime-0", "runtime-1"}


def test_traffic_set_get_and_show_print_json_and_yaml(cli):
    try:
        set_ = json.loads(cli("traffic", "--scheduler-address", cli.address, "set", "digits", "1=90", "2=10",
                              "-o", "json").stdout)  # fmt: skip
        assert set_ == {"model": "digits", "weights": {"1": 90, "2": 10}}
        got = yaml.safe_load(cli("traffic", "--scheduler-address", cli.address, "get", "digits", "-o", "yaml").stdout)
        assert got == set_
        shown = json.loads(cli("traffic", "--scheduler", cli.address, "show", "digits", "--json").stdout)
        assert shown == {"policy": set_, "shadows": []}
        table = cli("traffic", "--scheduler-address", cli.address, "get", "digits").stdout
        assert table.startswith("digits: v1=90 (90%)  v2=10 (10%)")
        status = json.loads(cli("status", "--scheduler-address", cli.address, "-o", "json").stdout)
        assert {"model": "digits", "weights": {"1": 90, "2": 10}} in status["traffic"]
    finally:
        cli("traffic", "--scheduler-address", cli.address, "set", "digits", "--clear")
    cleared = json.loads(cli("traffic", "--scheduler-address", cli.address, "get", "digits", "-o", "json").stdout)
    assert cleared == {"model": "digits", "weights": {}}


def test_a_refused_call_says_why_in_any_format(cli, tmp_path):
    done = subprocess.run(  # no token file: the scheduler refuses the call
        [sys.executable, "-m", "aiworks", "status", "--scheduler-address", cli.address, "-o", "json"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0 and done.stdout == ""
    assert "error:" in done.stderr and "AIWORKS_INTERNAL_TOKEN_FILE" in done.stderr
