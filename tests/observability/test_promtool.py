"""The recording and alert rules pass promtool: syntax, and unit tests in which every alert fires on
its failure and stays quiet on its near misses (deploy/prometheus/tests)."""

from __future__ import annotations

import subprocess

import yaml

from aiworks.supervisor.prometheus import render_config

from .support import REPO, RULE_TESTS_DIR, RULES_DIR, recorded_names, rule_groups, rules


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_rules_pass_promtool_check(promtool):
    files = sorted(str(p) for p in RULES_DIR.glob("*.yml"))
    assert files
    result = run(promtool, "check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass(promtool):
    files = sorted(str(p) for p in RULE_TESTS_DIR.glob("*.yml"))
    assert files
    result = run(promtool, "test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    cases: dict[str, set[bool]] = {}
    for path in RULE_TESTS_DIR.glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    for alert in rules("alert"):
        assert cases.get(alert["alert"]) == {True, False}, f"{alert['alert']} needs a firing and a quiet unit test"


def test_every_rule_is_labelled_and_reads_recorded_names_that_exist():
    recorded = {rule["record"] for rule in rules("record")}
    assert len({group["name"] for group in rule_groups()}) == len(rule_groups())
    for rule in rules("record"):
        assert rule["record"].count(":") == 2, f"{rule['record']}: use level:metric:operations"
    for rule in rules("record") + rules("alert"):
        assert recorded_names(rule["expr"]) <= recorded, rule["expr"]
    for alert in rules("alert"):
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert {"summary", "description"} <= alert["annotations"].keys(), alert["alert"]
        assert alert["alert"].startswith("AIWorks"), alert["alert"]


def test_the_local_configuration_passes_promtool(promtool, tmp_path):
    config = tmp_path / "prometheus.yml"
    config.write_text(
        render_config(
            {"gateway": ["127.0.0.1:8100"], "runtime": ["127.0.0.1:8110", "127.0.0.1:8111"]}, rules_dir=RULES_DIR
        )
    )
    result = run(promtool, "check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool checks the rule files the configuration names, too.
    assert "SUCCESS" in result.stdout and str(RULES_DIR) in result.stdout


def test_the_compose_configuration_passes_promtool(promtool):
    result = run(promtool, "check", "config", str(REPO / "deploy" / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
