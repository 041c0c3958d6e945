"""The ``aiworks`` command line's shared faces: --version, a bare ``aiworks``, one flag per concept with the old
spellings still parsing, and ``-o table|json|yaml`` rendered by one helper."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from aiworks.cli import build_parser, main
from aiworks.core.output import emit_record, plain, render
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb


def aiworks(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiworks", *argv], capture_output=True, text=True, timeout=60)


def test_version_prints_the_installed_package_version():
    done = aiworks("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"aiworks {version('aiworks')}"


def test_bare_aiworks_prints_help_and_succeeds():
    done = aiworks()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: aiworks")
    for command in ("up", "status", "traffic", "rollout", "events", "usage", "audit", "convert", "minilm"):
        assert f"    {command} " in done.stdout or f"    {command}\n" in done.stdout, command


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


# Every command that shows something, as a user types it (the required arguments only).
SHOWING = {
    "status": ["status"],
    "traffic get": ["traffic", "get", "iris"],
    "traffic set": ["traffic", "set", "iris", "1=100"],
    "traffic show": ["traffic", "show", "iris"],
    "audit verify": ["audit", "verify", "audit.jsonl"],
    "usage": ["usage"],
    "events": ["events"],
    "rollout status": ["rollout", "status"],
    "rollout start": ["rollout", "start", "iris", "--to", "2"],
    "rollout abort": ["rollout", "abort", "iris"],
    "rollout rollback": ["rollout", "rollback", "iris"],
}


@pytest.mark.parametrize("command", SHOWING)
def test_every_showing_command_takes_output_and_the_json_alias(command):
    argv = SHOWING[command]
    assert _parse(*argv).output == "table"
    for fmt in ("table", "json", "yaml"):
        assert _parse(*argv, "-o", fmt).output == fmt
        assert _parse(*argv, "--output", fmt).output == fmt
    assert _parse(*argv, "--json").output == "json"


def test_an_unknown_output_format_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        _parse("status", "-o", "xml")
    assert info.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["status", "--scheduler", "h:1"], "scheduler_address", "h:1"),
        (["status", "--scheduler-address", "h:1"], "scheduler_address", "h:1"),
        (["traffic", "--scheduler", "h:2", "get", "iris"], "scheduler_address", "h:2"),
        (["traffic", "--scheduler-address", "h:2", "get", "iris"], "scheduler_address", "h:2"),
        (["events", "--monitor", "http://m:1"], "monitor_address", "http://m:1"),
        (["events", "--monitor-address", "http://m:1"], "monitor_address", "http://m:1"),
        (["rollout", "--monitor", "http://m:2", "status"], "monitor_address", "http://m:2"),
        (["rollout", "--monitor-address", "http://m:2", "status"], "monitor_address", "http://m:2"),
        (["usage", "--url", "https://g:1"], "gateway_url", "https://g:1"),
        (["usage", "--gateway-url", "https://g:1"], "gateway_url", "https://g:1"),
        (["kube", "check", "--gateway", "http://g", "--scheduler", "s:1"], "gateway_url", "http://g"),
        (["bench", "-m", "iris", "--url", "g:1"], "url", "g:1"),
        (["bench", "-m", "iris", "--gateway-url", "g:1"], "url", "g:1"),
        (["bench", "-m", "iris", "-u", "g:1"], "url", "g:1"),
        (["kube", "check", "--gateway-url", "http://g", "--scheduler-address", "s:1"], "scheduler_address", "s:1"),
    ],
)
def test_one_flag_per_concept_and_the_old_spellings_still_parse(argv, dest, value):
    assert getattr(_parse(*argv), dest) == value


def test_usage_takes_a_ca_file_or_a_tls_folder():
    from aiworks.core.flags import ca_file

    assert ca_file(_parse("usage", "--cacert", "/x/ca.pem")) == Path("/x/ca.pem")  # before --tls-dir
    assert ca_file(_parse("usage", "--tls-dir", "/certs/admin")) == Path("/certs/admin/ca.crt")
    assert ca_file(_parse("usage")) is None


def _help(*argv: str) -> str:
    parser = build_parser()
    for action in parser._subparsers._group_actions:  # walk down to the subcommand's parser
        sub = action.choices[argv[0]]
    for name in argv[1:]:
        sub = sub._subparsers._group_actions[0].choices[name]
    return sub.format_help()


@pytest.mark.parametrize(
    "argv, shown, hidden",
    [
        (["status"], ["--scheduler-address", "--tls-dir", "-o {table,json,yaml}"], ["--scheduler ", "--json"]),
        (["traffic"], ["--scheduler-address", "--tls-dir"], ["--scheduler "]),
        (["events"], ["--monitor-address", "-o {table,json,yaml}"], ["--monitor ", "--json"]),
        (["rollout"], ["--monitor-address"], ["--monitor "]),
        (["usage"], ["--gateway-url", "--tls-dir"], ["--url", "--cacert", "--json"]),
        (["kube", "check"], ["--gateway-url", "--scheduler-address"], ["--gateway ", "--scheduler "]),
    ],
)
def test_help_shows_the_one_spelling_and_hides_the_old_ones(argv, shown, hidden):
    text = _help(*argv)
    for flag in shown:
        assert flag in text, (argv, flag)
    for flag in hidden:
        assert flag not in text.replace("\n", " "), (argv, flag)


def test_kube_check_still_requires_both_addresses_in_either_spelling():
    from aiworks.core.flags import require

    require(_parse("kube", "check", "--gateway", "http://g", "--scheduler", "s:1"), "--gateway-url",
            "--scheduler-address")  # fmt: skip
    with pytest.raises(SystemExit, match="required: --scheduler-address"):
        require(_parse("kube", "check", "--gateway-url", "http://g"), "--gateway-url", "--scheduler-address")


# ---- rendering ------------------------------------------------------------------------------------------


def _status() -> pb.StatusResponse:
    reply = pb.StatusResponse(caller_auth="token")
    reply.replicas.add(replica_id="runtime-0", address="127.0.0.1:9", live=True, models=["iris:1"])
    reply.traffic.add(model="digits", weights={"1": 90, "2": 10})
    return reply


def test_a_message_renders_field_for_field_in_json_and_yaml():
    doc = json.loads(render(_status(), "json"))
    [replica] = doc["replicas"]
    assert (replica["replica_id"], replica["live"], replica["models"]) == ("runtime-0", True, ["iris:1"])
    assert replica["ejected"] is False and replica["outstanding_rows"] == 0  # defaults are shown, not dropped
    assert doc["traffic"] == [{"model": "digits", "weights": {"1": 90, "2": 10}}]
    assert yaml.safe_load(render(_status(), "yaml")) == doc


def test_table_is_the_commands_own_drawing():
    from aiworks.status import format_status

    reply = _status()
    assert render(reply, "table", lambda: format_status(reply)) == format_status(reply)
    with pytest.raises(ValueError, match="unknown output format"):
        render(reply, "xml", lambda: "")


@dataclass
class _Result:
    ok: bool
    file: Path
    lines: tuple[int, ...]


def test_plain_turns_dataclasses_paths_and_nested_messages_into_data():
    doc = plain({"result": _Result(True, Path("/tmp/a.log"), (1, 2)), "status": [_status()]})
    assert doc["result"] == {"ok": True, "file": "/tmp/a.log", "lines": [1, 2]}
    assert doc["status"][0]["caller_auth"] == "token"
    assert yaml.safe_load(render(doc, "yaml")) == json.loads(render(doc, "json"))


def test_a_stream_of_records_is_json_lines_or_yaml_documents(capsys):
    for i in range(2):
        emit_record({"seq": i}, "json", lambda: "")
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"seq": 0}, {"seq": 1}]
    for i in range(2):
        emit_record({"seq": i}, "yaml", lambda: "")
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == [{"seq": 0}, {"seq": 1}]
    emit_record({"seq": 0}, "table", lambda: "seq 0")
    assert capsys.readouterr().out == "seq 0\n"


# ---- a service's settings are its flags ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["gateway", "scheduler", "runtime", "cache", "monitor"])
def test_a_service_commands_flags_are_its_settings_fields(command):
    """Each flag is a settings field: named after it, typed by it, explained by its description and variable."""
    import importlib

    from aiworks import cli as aiworks_cli

    cache_cli = importlib.import_module("aiworks.cache.cli")
    monitor_cli = importlib.import_module("aiworks.monitor.cli")
    fields = {
        "gateway": (aiworks_cli.GATEWAY_SETTINGS, aiworks_cli.GATEWAY_FLAGS),
        "scheduler": (aiworks_cli.SCHEDULER_SETTINGS, aiworks_cli.SCHEDULER_FLAGS),
        "runtime": (aiworks_cli.RUNTIME_SETTINGS, [*aiworks_cli.RUNTIME_FLAGS, *aiworks_cli.RUNTIME_TRITON_FLAGS]),
        "cache": (cache_cli.SETTINGS, cache_cli.FLAGS),
        "monitor": (monitor_cli.SETTINGS, monitor_cli.FLAGS),
    }[command]
    settings, names = fields
    cls = aiworks_cli._settings_class(settings)
    prefix = cls.model_config["env_prefix"]
    text = " ".join(_help_of(command).split())
    for name in names:
        assert f"--{name.replace('_', '-')}" in text, name
        assert f"{prefix}{name.upper()}" in text, name
        first_words = " ".join(cls.model_fields[name].description.rstrip(".").split()[:3])
        assert first_words in text, (name, first_words)


def _help_of(command: str) -> str:
    parser = build_parser(command)
    return parser._subparsers._group_actions[0].choices[command].format_help()


def test_settings_flags_are_typed_and_override_the_environment(monkeypatch):
    from aiworks.cli import RUNTIME_FLAGS, RUNTIME_TRITON_FLAGS, _settings_class, _settings_from

    monkeypatch.setenv("AIWORKS_RUNTIME_SCHEDULER_ADDRESS", "env:1")
    monkeypatch.setenv("AIWORKS_RUNTIME_PORT", "7000")
    args = build_parser("runtime").parse_args(
        ["runtime", "--port", "7001", "--models", "iris", "digits", "--no-batching", "--gpu-memory-fraction", "0.5"]
    )
    assert (args.port, args.models, args.batching, args.gpu_memory_fraction) == (7001, ["iris", "digits"], False, 0.5)
    settings = _settings_from(_settings_class("aiworks.runtime.settings:RuntimeSettings"), args,
                              [*RUNTIME_FLAGS, *RUNTIME_TRITON_FLAGS])  # fmt: skip
    assert (settings.port, settings.scheduler_address, settings.batching) == (7001, "env:1", False)
    assert settings.models == ["iris", "digits"] and settings.gpu_memory_fraction == 0.5
    for bad in (["--port", "many"], ["--device", "tpu"], ["--triton-instance-kind", "KIND_TPU"]):
        with pytest.raises(SystemExit):
            build_parser("runtime").parse_args(["runtime", *bad])
    monitor = build_parser("monitor").parse_args(["monitor", "--platform", "kubernetes"])
    assert monitor.platform == "kubernetes"
    with pytest.raises(SystemExit):
        build_parser("monitor").parse_args(["monitor", "--platform", "nomad"])  # a Literal's values are choices


def test_the_bare_parser_imports_no_service_settings():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, aiworks.cli; aiworks.cli.build_parser().format_help(); "
         "print(sorted(m for m in sys.modules if m.endswith('.settings') and m.startswith('aiworks.')))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_readme_lists_every_command():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## The command line", 1)[1].split("\n## ", 1)[0]
    commands = build_parser()._subparsers._group_actions[0].choices
    missing = [c for c in commands if f"aiworks {c}" not in section and f"|{c}" not in section]
    assert missing == []


def test_status_run_from_the_folder_of_up_with_the_tiers_shows_its_jobs(tmp_path, monkeypatch):
    """`aiworks status` without --redis-url reads the Redis URL `aiworks up --tiers` left in .aiworks (as the
    tools find its internal token); --redis-url or AIWORKS_BATCH_REDIS_URL still win."""
    import aiworks.status

    seen = []
    monkeypatch.setattr(aiworks.status, "show_status", lambda *args: seen.append(args[3]))
    monkeypatch.delenv("AIWORKS_BATCH_REDIS_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    main(["status"])
    (tmp_path / ".aiworks").mkdir()
    (tmp_path / ".aiworks" / "tiers-redis-url").write_text("redis://127.0.0.1:6390/3\n")
    main(["status"])
    main(["status", "--redis-url", "redis://elsewhere:6379/0"])
    monkeypatch.setenv("AIWORKS_BATCH_REDIS_URL", "redis://from-env:6379/1")
    main(["status"])
    assert seen == [None, "redis://127.0.0.1:6390/3", "redis://elsewhere:6379/0", "redis://from-env:6379/1"]
