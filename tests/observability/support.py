"""Helpers of the observability tests: the committed dashboards and rules, the metric catalogue, and
a small client of Prometheus' HTTP API."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "deploy" / "prometheus" / "rules"
RULE_TESTS_DIR = REPO / "deploy" / "prometheus" / "tests"
DASHBOARDS_DIR = REPO / "deploy" / "grafana" / "dashboards"

# ---- the committed files -------------------------------------------------------------------------


def load_dashboards() -> dict[str, dict[str, Any]]:
    """uid -> dashboard JSON, as committed."""
    boards = [json.loads(path.read_text()) for path in sorted(DASHBOARDS_DIR.glob("*.json"))]
    return {board["uid"]: board for board in boards}


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str  # uid
    panel: str  # title
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}: {self.expr}"


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a dashboard but the rows, including panels inside collapsed rows."""
    found = []
    for panel in board.get("panels", []):
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def panel_queries(board: dict[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(board["uid"], panel["title"], target["refId"], target["expr"])
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


def variables(board: dict[str, Any]) -> list[dict[str, Any]]:
    return board.get("templating", {}).get("list", [])


def rule_groups() -> list[dict[str, Any]]:
    groups = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def rules(kind: str) -> list[dict[str, Any]]:
    """Every rule of ``kind`` ("record" or "alert") in deploy/prometheus/rules."""
    return [rule for group in rule_groups() for rule in group["rules"] if kind in rule]


# ---- metric names --------------------------------------------------------------------------------

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def metric_names(expr: str) -> set[str]:
    """Raw metrics (the suite's ``aiworks_...`` and the standard ``process_*`` / ``python_*``) an expression
    reads; recorded names hold a colon."""
    bare = _QUOTED.sub('""', expr)  # label values are not names
    return {token for token in _NAME.findall(bare)
            if token.startswith(("aiworks_", "process_", "python_")) and ":" not in token}


def recorded_names(expr: str) -> set[str]:
    """Names of recording rules (``level:metric:operations``) an expression reads."""
    return {token for token in _NAME.findall(_QUOTED.sub('""', expr)) if token.count(":") >= 2}


def catalogue() -> set[str]:
    """Every series name the suite can export, from aiworks.core.metrics and the cache's counters."""
    from dataclasses import fields

    from prometheus_client import Counter, Gauge, Histogram

    from aiworks.cache.dataplane import CacheCounters
    from aiworks.core import metrics

    names = set()
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names.add(f"{value._name}_total")
        elif isinstance(value, Histogram):
            names |= {f"{value._name}_{suffix}" for suffix in ("bucket", "sum", "count")}
        elif isinstance(value, Gauge):
            names.add(value._name)
        elif isinstance(value, str) and value.startswith("aiworks_"):
            names.add(value)
    names |= {f"aiworks_cache_{field.name}_total" for field in fields(CacheCounters)}
    # metrics.standard_process_metrics(): prometheus-client's standard collectors, names unchanged.
    names |= {"process_cpu_seconds_total", "process_resident_memory_bytes"}
    return names


# ---- Prometheus' HTTP API ------------------------------------------------------------------------


class PromQLError(AssertionError):
    """Prometheus refused a query (bad syntax, many-to-many matching...): a bug in the query, never "no data"."""


class PrometheusAPI:
    """The few calls of https://prometheus.io/docs/prometheus/latest/querying/api/ the tests make."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.session = requests.Session()

    def _get(self, path: str, **params) -> Any:
        reply = self.session.get(f"{self.url}{path}", params=params, timeout=10)
        body = reply.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self._get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def series(self, selector: str, start: float, end: float) -> list[dict[str, str]]:
        return self._get("/api/v1/series", **{"match[]": selector, "start": start, "end": end})

    def rule_groups(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/rules")["groups"]

    def targets(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/targets")["activeTargets"]


def has_data(result: list[dict[str, Any]]) -> bool:
    """True when a query result holds at least one number (NaN, a quantile of no observations, is no data)."""
    for series in result:
        samples = series.get("values") or ([series["value"]] if "value" in series else [])
        if any(not math.isnan(float(value)) for _, value in samples):
            return True
    return False
