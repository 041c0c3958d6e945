"""The committed dashboards are what scripts/gen_dashboards.py builds now, read the ``prometheus``
datasource, and query only metrics the suite exports (checked against real data in
test_prometheus_live.py)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from .support import DASHBOARDS_DIR, REPO, catalogue, load_dashboards, metric_names, panel_queries, panels, rules
from .support import variables as board_variables


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_dashboards", REPO / "scripts" / "gen_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_committed_dashboards_are_current(generator, tmp_path):
    generator.generate(tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in DASHBOARDS_DIR.glob("*.json")}
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"dashboards are stale, run `python scripts/gen_dashboards.py`: {stale}"


def test_the_dashboards_cover_the_views_the_suite_needs():
    assert set(load_dashboards()) == {
        "aiworks-overview",
        "aiworks-models",
        "aiworks-tenants",
        "aiworks-cache",
        "aiworks-scheduler",
        "aiworks-replicas",
        "aiworks-generation",
        "aiworks-tiers",
    }


@pytest.mark.parametrize("uid", sorted(load_dashboards()))
def test_every_panel_reads_the_chosen_prometheus_in_the_chosen_release(uid):
    """The data source is a variable, and every query selects the namespace and release, so two releases
    scraped by one Prometheus never blend."""
    board = load_dashboards()[uid]
    ids = [p["id"] for p in board["panels"]] + [p["id"] for row in board["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert board["tags"] == ["aiworks"]
    source = {"type": "prometheus", "uid": "${datasource}"}
    chosen = board_variables(board)
    assert [(v["name"], v["type"]) for v in chosen[:3]] == [
        ("datasource", "datasource"), ("namespace", "query"), ("release", "query")
    ]
    assert chosen[0]["query"] == "prometheus"
    assert chosen[1]["allValue"] == chosen[2]["allValue"] == ".*", "All also matches series without the labels"
    scope = 'namespace=~"$namespace", release=~"$release"'
    for panel in panels(board):
        assert panel["datasource"] == source, panel["title"]
        assert panel.get("targets"), f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and all(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["expr"].strip(), panel["title"]
            for name in metric_names(target["expr"]):
                assert target["expr"].count(name + "{" + scope) >= 1, (panel["title"], name)
    for variable in chosen[1:]:
        assert variable["datasource"] == source and variable["query"].startswith("label_values("), variable["name"]
    for variable in chosen[3:]:
        assert scope in variable["query"], variable["name"]


def test_queries_and_rules_read_only_catalogued_metrics():
    known = catalogue()
    exprs = [q.expr for board in load_dashboards().values() for q in panel_queries(board)]
    exprs += [v["query"] for board in load_dashboards().values() for v in board_variables(board)]
    exprs += [rule["expr"] for rule in rules("record") + rules("alert")]
    unknown = {name for expr in exprs for name in metric_names(expr)} - known
    assert not unknown, f"not in src/aiworks/core/metrics.py: {sorted(unknown)}"


def test_the_dashboards_answer_the_questions_of_the_issue():
    """The panels the observability issue asks for, by the metric each must show."""
    shown = {
        uid: {name for q in panel_queries(board) for name in metric_names(q.expr)}
        for uid, board in load_dashboards().items()
    }
    assert {
        "aiworks_gateway_requests_total",
        "aiworks_gateway_request_duration_seconds_bucket",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "aiworks_runtime_gpu_utilization_ratio",
    } <= shown["aiworks-overview"]
    assert {"aiworks_cache_hits_total", "aiworks_cache_misses_total", "aiworks_cache_backend_up"} <= shown[
        "aiworks-cache"
    ]
    assert {
        "aiworks_scheduler_queue_depth_requests",
        "aiworks_scheduler_queue_duration_seconds_bucket",
        "aiworks_scheduler_batch_size_rows_bucket",
        "aiworks_scheduler_retries_total",
        "aiworks_scheduler_timeouts_total",
        "aiworks_scheduler_rejections_total",
        "aiworks_scheduler_ejections_total",
    } <= shown["aiworks-scheduler"]
    assert {
        "aiworks_monitor_replica_health_score",
        "aiworks_scheduler_replica_up",
        "aiworks_scheduler_replica_ejected",
    } <= shown["aiworks-replicas"]
    assert {
        "aiworks_runtime_llm_time_to_first_token_seconds_bucket",
        "aiworks_runtime_llm_inter_token_seconds_bucket",
        "aiworks_runtime_llm_tokens_total",
        "aiworks_runtime_llm_kv_tokens",
        "aiworks_runtime_llm_sequences",
        "aiworks_tenant_tokens_total",
    } <= shown["aiworks-generation"]
    assert {
        "aiworks_scheduler_requests_total",
        "aiworks_nearline_backlog",
        "aiworks_nearline_oldest_age_seconds",
        "aiworks_nearline_queue_wait_seconds_bucket",
        "aiworks_nearline_requests_total",
        "aiworks_nearline_callbacks_total",
        "aiworks_batch_jobs_active",
        "aiworks_batch_rows_total",
        "aiworks_batch_job_progress_ratio",
        "aiworks_batch_in_flight_limit",
        "aiworks_stream_published_total",
        "aiworks_stream_publish_dropped_total",
        "aiworks_stream_subscribers",
        "aiworks_stream_events_sent_total",
        "aiworks_runtime_sequences",
        "aiworks_runtime_sequence_outcomes_total",
    } <= shown["aiworks-tiers"]
    rows = [p["title"] for p in load_dashboards()["aiworks-tiers"]["panels"] if p["type"] == "row"]
    assert rows == ["Online", "Nearline", "Offline", "Result streams", "Twins (stateful sequences)"]
    heatmaps = {p["title"] for p in panels(load_dashboards()["aiworks-replicas"]) if p["type"] == "heatmap"}
    assert heatmaps == {"Health score by replica"}
    tenant_queries = panel_queries(load_dashboards()["aiworks-tenants"])
    assert all('tenant=~"$tenant"' in q.expr for q in tenant_queries)
    model_queries = panel_queries(load_dashboards()["aiworks-models"])
    assert sum('version=~"$version"' in q.expr for q in model_queries) >= len(model_queries) - 1
