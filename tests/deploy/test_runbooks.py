"""Every alert has a runbook: its runbook_url names a section of docs/runbooks.md, and the chart can
point the address at wherever the docs are served."""

from __future__ import annotations

import re
from typing import Any

import yaml

from .support import RELEASE, REPO


def alerts() -> list[dict[str, Any]]:
    found = []
    for path in sorted((REPO / "deploy" / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            found += [rule for rule in group["rules"] if "alert" in rule]
    return found


def anchors() -> set[str]:
    text = (REPO / "docs" / "runbooks.md").read_text()
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", text, re.M)}


def test_every_alert_links_to_its_runbook_section() -> None:
    sections = anchors()
    found = alerts()
    assert found
    for alert in found:
        url = alert["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page.endswith("/docs/runbooks.md") and anchor == alert["alert"].lower(), url
        assert anchor in sections, f"docs/runbooks.md has no section for {alert['alert']}"
    assert sections == {a["alert"].lower() for a in found}, "one section per alert, no stale ones"


def test_chart_points_runbooks_where_the_docs_are_served(render: Any) -> None:
    base = "https://docs.example.com/aiworks/runbooks"
    rendered = render({"metrics": {"prometheusRule": {"enabled": True, "runbookBaseUrl": base}}})
    [rule] = rendered.of_kind("PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith(base + "#aiworks") for u in urls)
    assert rule["metadata"]["name"] == RELEASE
