"""Generate the suite's Grafana dashboards into deploy/grafana/dashboards/ (committed JSON).

The dashboards are code, built with grafana-foundation-sdk's builders, so a
panel is reviewed as a query and a title rather than as a thousand lines of
JSON, and the metric names come from one place (src/aiworks/core/metrics.py).
The JSON is committed because Grafana's provisioning, docker-compose and the
Helm chart read the files as they are; tests/observability checks that the
committed files equal what this script produces and that every query returns
data from a real Prometheus scraping a real suite. Never edit the JSON by hand:
change this file and run it.

Every dashboard takes its Prometheus as a variable (``datasource``, any
Prometheus data source; the provisioned one has uid ``prometheus``) and two
scope variables, ``namespace`` and ``release``, which every query and
variable selects on, so two releases scraped by one Prometheus never blend
("All" also matches series without the labels: local and compose scrapes).
The chart's ServiceMonitor adds ``release`` from the Services'
``app.kubernetes.io/instance`` label; prometheus-operator adds ``namespace``.
Queries read raw metrics (not the recording rules), so they work on any
Prometheus that scrapes the suite, with or without deploy/prometheus/rules.

Usage: python scripts/gen_dashboards.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import heatmap, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "deploy" / "grafana" / "dashboards"

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every series a dashboard reads carries these (or lacks them, outside Kubernetes: ".*" matches that too).
SCOPE = 'namespace=~"$namespace", release=~"$release"'
_METRIC = re.compile(r"\b((?:aiworks|process|python)_[A-Za-z0-9_:]*)(?:\{([^}]*)\})?")
RATE = "$__rate_interval"
# The 5xx rows of aiworks.core.errors: the suite's failures. 4xx are the client's; 429 is load shedding.
SERVER_ERRORS = "internal|unimplemented|unavailable|deadline_exceeded"
# Local and compose jobs are aiworks-<kind>; the chart's ServiceMonitor names them after the Service.
JOBS = ".*aiworks-.+"
TAGS = ["aiworks"]

# Selectors of the template variables.
MODEL_VERSION = 'model=~"$model", version=~"$version"'
TENANT = 'tenant=~"$tenant"'
NOT_OK = 'status!="ok"'


# ---- queries -------------------------------------------------------------------------------------


def select(metric: str, selector: str = "") -> str:
    return f"{metric}{{{selector}}}" if selector else metric


def rate(metric: str, selector: str = "", by: str | None = None) -> str:
    """Summed per-second rate of a counter, optionally kept apart by labels."""
    inner = f"rate({select(metric, selector)}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q: float, histogram: str, selector: str = "", by: str = "") -> str:
    """``histogram_quantile`` over buckets summed across instances (the only correct way to aggregate)."""
    labels = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', selector, labels)})"


def ratio_or_zero(metric: str, part: str, whole: str, by: str | None = None) -> str:
    """Share of ``metric{part}`` in ``metric{whole}``: 0, not "no data", while the part has no series yet."""
    numerator = rate(metric, part, by)
    denominator = rate(metric, whole, by)
    zero = "vector(0)" if by is None else f"{denominator} * 0"
    return f"({numerator} or {zero}) / {denominator}"


def rate_or_zero(metric: str, by: str, base: str) -> str:
    """Rate of ``metric`` by ``by``, or 0 while it has no series yet (nothing dropped, no callback sent).

    A labelled counter exports nothing until its first event; ``base`` is an
    always-present counter of the same process whose rate times 0 stands in.
    """
    return f"{rate(metric, by=by)} or {rate(base)} * 0"


def mean(histogram: str, selector: str = "", by: str | None = None) -> str:
    return f"{rate(histogram + '_sum', selector, by)} / {rate(histogram + '_count', selector, by)}"


def scoped(expr: str) -> str:
    """``expr`` with the namespace and release matchers added to every metric selector in it."""

    def add(match: re.Match) -> str:
        inner = match.group(2)
        return f"{match.group(1)}{{{SCOPE}{', ' + inner if inner else ''}}}"

    return _METRIC.sub(add, expr)


def target(expr: str, legend: str = "", *, heatmap_format: bool = False) -> Dataquery:
    query = Dataquery().expr(scoped(expr)).datasource(DATASOURCE).range()
    if legend:
        query = query.legend_format(legend)
    if heatmap_format:
        query = query.format("heatmap")
    return query


# ---- panels --------------------------------------------------------------------------------------


def _thresholds(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(value, color) for value, color in steps])


GREEN_ONLY = _thresholds((None, "green"))
UP_DOWN = _thresholds((None, "red"), (1, "green"))


def graph(title: str, description: str, unit: str, *, stack: bool = False, w: int = 12, h: int = 8):
    """A time series panel; ``stack`` for parts of a whole (requests by status), not for alternatives."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(h)
        .fill_opacity(10)
        .legend(
            common_builders.VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
        )
        # All series in the tooltip, largest first: the stacked panels only make sense that way.
        .tooltip(
            common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
    )
    if stack:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)
    return panel


def single(title: str, description: str, unit: str, thresholds: ThresholdsConfig = GREEN_ONLY, *, w: int = 4):
    """A stat of the last value, its background coloured by ``thresholds``: the "is it healthy" glance."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(4)
        .thresholds(thresholds)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def states(title: str, description: str, one: str, zero: str, *, one_is_good: bool = True, w: int = 12,
           minus_one: str | None = None):  # fmt: skip
    """A state timeline of a 0/1 gauge, each value named and coloured (green for the good one); ``minus_one``
    names a third state, -1, in blue: neither good nor bad (a replica stopping on purpose)."""
    good, bad = ("green", "red") if one_is_good else ("red", "green")
    values = {"1": ValueMappingResult(text=one, color=good), "0": ValueMappingResult(text=zero, color=bad)}
    if minus_one is not None:
        values["-1"] = ValueMappingResult(text=minus_one, color="blue")
    mapping = ValueMap(values)
    return (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(w)
        .height(8)
        .mappings([mapping])
        .thresholds(_thresholds((None, bad), (1, good)))
        .fill_opacity(80)
    )


def heat_colors(scheme: str, scale: HeatmapColorScale) -> heatmap.HeatmapColorOptions:
    """A colour scheme with every field Grafana reads set (the SDK leaves steps at 0, an empty scale)."""
    return (
        heatmap.HeatmapColorOptions()
        .mode(HeatmapColorMode.SCHEME)
        .scheme(scheme)
        .scale(scale)
        .exponent(0.5)
        .steps(64)
        .fill("dark-orange")
        .reverse(False)
    )


class Board:
    """One dashboard being built: numbers panels and queries so the output is stable and valid."""

    def __init__(self, uid: str, title: str, description: str):
        self.builder = (
            Dashboard(title)
            .uid(uid)
            .description(description)
            .tags(TAGS)
            .time("now-1h", "now")
            .refresh("30s")
            .timezone("browser")
            .tooltip(DashboardCursorSync.CROSSHAIR)
            .link(
                DashboardLink("AIWorks dashboards")
                .type(DashboardLinkType.DASHBOARDS)
                .tags(TAGS)
                .as_dropdown(True)
                .keep_time(True)
                .include_vars(False)
            )
        )
        self._next_id = 1
        # The data source first, then the scope: every other variable and query reads them.
        self.builder = self.builder.with_variable(
            DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        self._scope_variable("namespace", "Namespace", "label_values(aiworks_gateway_requests_total, namespace)")
        self._scope_variable(
            "release", "Release", 'label_values(aiworks_gateway_requests_total{namespace=~"$namespace"}, release)'
        )

    def _scope_variable(self, name: str, label: str, query: str) -> None:
        self.builder = self.builder.with_variable(
            QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .include_all(True)
            .all_value(".*")
        )

    def variable(self, name: str, label: str, query: str) -> Board:
        """A multi-value query variable with "All" meaning any value, the empty one included."""
        self.builder = self.builder.with_variable(
            QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(scoped(query))
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        return self

    def row(self, title: str) -> Board:
        self.builder = self.builder.with_row(Row(title).id(self._take_id()))
        return self

    def panel(self, panel: Builder, *queries: Dataquery) -> Board:
        for index, query in enumerate(queries):
            panel = panel.with_target(query.ref_id(chr(ord("A") + index)))
        self.builder = self.builder.with_panel(panel.id(self._take_id()))
        return self

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def build(self):
        return self.builder.build()


# ---- the dashboards ------------------------------------------------------------------------------


def overview() -> Board:
    requests = "aiworks_gateway_requests_total"
    duration = "aiworks_gateway_request_duration_seconds"
    return (
        Board(
            "aiworks-overview",
            "AIWorks / Overview",
            "Is the suite healthy? Traffic, latency and errors at the gateway, processes and replicas up, "
            "CPU, GPU and memory. Follow the links for the model, tenant, scheduler, cache and replica views.",
        )
        .row("Service level")
        .panel(single("Requests/s", "Inference requests answered by the gateway.", "reqps"), target(rate(requests)))
        .panel(
            single("p50 latency", "Median end-to-end latency at the gateway, all models.", "s"),
            target(quantile(0.5, duration)),
        )
        .panel(
            single(
                "p99 latency",
                "99th percentile end-to-end latency at the gateway, all models. Alert AIWorksHighLatencyP99 at 500 ms.",
                "s",
                _thresholds((None, "green"), (0.25, "yellow"), (0.5, "red")),
            ),
            target(quantile(0.99, duration)),
        )
        .panel(
            single(
                "Server errors",
                "Share of requests answered with a 5xx status. Alert AIWorksHighErrorRate at 5%.",
                "percentunit",
                _thresholds((None, "green"), (0.01, "yellow"), (0.05, "red")),
            ),
            target(ratio_or_zero(requests, f'status=~"{SERVER_ERRORS}"', "")),
        )
        .panel(
            single(
                "Processes down",
                "Suite processes Prometheus cannot scrape (gateway, scheduler, runtimes, cache, monitor).",
                "none",
                _thresholds((None, "green"), (1, "red")),
            ),
            target(f'count(up{{job=~"{JOBS}"}} == 0) or vector(0)'),
        )
        .panel(
            single(
                "Replicas live / ejected",
                "Runtime replicas the scheduler can route to, and those it has ejected for failing.",
                "none",
            ),
            target("sum(aiworks_scheduler_replica_up)", "live"),
            target("sum(aiworks_scheduler_replica_ejected)", "ejected"),
        )
        .row("Traffic and latency")
        .panel(
            graph(
                "Requests/s by status", "Gateway answers by outcome; anything but ok is an error.", "reqps", stack=True
            ),
            target(rate(requests, by="status"), "{{status}}"),
        )
        .panel(
            graph("Latency", "End-to-end latency at the gateway, all models.", "s"),
            target(quantile(0.5, duration), "p50"),
            target(quantile(0.9, duration), "p90"),
            target(quantile(0.99, duration), "p99"),
        )
        .panel(
            graph(
                "Error ratio by status",
                "Share of requests per error status: 5xx are the suite's failures, 4xx the client's, "
                "resource_exhausted (429) is load shedding.",
                "percentunit",
            ),
            target(
                f"{rate(requests, NOT_OK, 'status')} / ignoring(status) group_left {rate(requests)}",
                "{{status}}",
            ),
        )
        .panel(
            graph("Requests/s by model", "Where the traffic goes.", "reqps", stack=True),
            target(rate(requests, by="model, version"), "{{model}} v{{version}}"),
        )
        .panel(
            graph("In flight at the gateway", "Requests the gateway is handling now, by protocol.", "short"),
            target("sum by (protocol) (aiworks_gateway_inflight_requests)", "{{protocol}}"),
        )
        .panel(
            graph("Queued in the scheduler", "Requests waiting for a replica, by model version.", "short", stack=True),
            target("sum by (model, version) (aiworks_scheduler_queue_depth_requests)", "{{model}} v{{version}}"),
        )
        .row("Resources")
        .panel(
            graph("CPU by process", "CPU time used per second (cores), per suite process.", "short"),
            target(
                "sum by (job, instance) (rate(process_cpu_seconds_total[$__rate_interval]))",
                "{{job}} {{instance}}",
            ),
        )
        .panel(
            graph("Memory by process", "Resident memory per suite process.", "bytes"),
            target("sum by (job, instance) (process_resident_memory_bytes)", "{{job}} {{instance}}"),
        )
        .panel(
            graph("GPU utilisation", "Busy share of each GPU a runtime replica uses.", "percentunit").max(1),
            target("avg by (replica, gpu) (aiworks_runtime_gpu_utilization_ratio)", "{{replica}} gpu {{gpu}}"),
        )
        .panel(
            graph("GPU memory", "Used share of each GPU's memory, per runtime replica.", "percentunit").max(1),
            target(
                "sum by (replica, gpu) (aiworks_runtime_gpu_memory_used_bytes)"
                " / sum by (replica, gpu) (aiworks_runtime_gpu_memory_total_bytes)",
                "{{replica}} gpu {{gpu}}",
            ),
        )
    )


def models() -> Board:
    requests = "aiworks_gateway_requests_total"
    sel = MODEL_VERSION
    return (
        Board(
            "aiworks-models",
            "AIWorks / Models",
            "One model and version at a time: its traffic, errors and latency, and where the time goes "
            "(gateway, queue, batch round trip, compute).",
        )
        .variable("model", "Model", "label_values(aiworks_gateway_requests_total, model)")
        .variable("version", "Version", 'label_values(aiworks_gateway_requests_total{model=~"$model"}, version)')
        .row("Traffic")
        .panel(
            graph(
                "Requests/s by version and status",
                "Gateway answers for the selected model versions.",
                "reqps",
                stack=True,
            ),
            target(rate(requests, sel, "model, version, status"), "{{model}} v{{version}} {{status}}"),
        )
        .panel(
            graph("Server error ratio", "Share of requests answered with a 5xx status.", "percentunit"),
            target(
                ratio_or_zero(requests, f'{sel}, status=~"{SERVER_ERRORS}"', sel, "model, version"),
                "{{model}} v{{version}}",
            ),
        )
        .panel(
            graph("Latency at the gateway", "End-to-end latency per version.", "s"),
            target(
                quantile(0.5, "aiworks_gateway_request_duration_seconds", sel, "model, version"),
                "p50 {{model}} v{{version}}",
            ),
            target(
                quantile(0.99, "aiworks_gateway_request_duration_seconds", sel, "model, version"),
                "p99 {{model}} v{{version}}",
            ),
        )
        .panel(
            graph(
                "Cache lookups by result",
                "The gateway's result-cache lookups for the selected models.",
                "reqps",
                stack=True,
            ),
            target(
                rate("aiworks_gateway_cache_lookups_total", 'model=~"$model"', "model, result"), "{{model}} {{result}}"
            ),
        )
        .row("Where the time goes")
        .panel(
            graph(
                "p99 by stage",
                "End to end (gateway) contains the queue wait and the batch round trip, which contains compute. "
                "A wide gap between two lines is where the time goes.",
                "s",
                w=24,
            ),
            target(quantile(0.99, "aiworks_gateway_request_duration_seconds", sel), "end to end (gateway)"),
            target(quantile(0.99, "aiworks_scheduler_queue_duration_seconds", sel), "queue wait (scheduler)"),
            target(
                quantile(0.99, "aiworks_scheduler_batch_duration_seconds", sel),
                "batch round trip (scheduler to runtime)",
            ),
            target(quantile(0.99, "aiworks_runtime_compute_duration_seconds", sel), "compute (runtime)"),
        )
        .panel(
            graph(
                "Mean batch size", "Rows per batch the scheduler sent; larger batches use the hardware better.", "short"
            ),
            target(mean("aiworks_scheduler_batch_size_rows", sel, "model, version"), "{{model}} v{{version}}"),
        )
        .panel(
            graph("Compute p99 by replica", "Backend compute time of one batch on each replica.", "s"),
            target(quantile(0.99, "aiworks_runtime_compute_duration_seconds", sel, "instance"), "{{instance}}"),
        )
        .row("Runtime replicas")
        .panel(
            graph("Rows/s by replica", "Inferences (rows) computed per second on each replica.", "short", stack=True),
            target(rate("aiworks_runtime_inference_rows_total", sel, "instance, version"), "{{instance}} v{{version}}"),
        )
        .panel(
            graph("Batches/s by outcome", "Batches executed by the runtimes, by status.", "short", stack=True),
            target(rate("aiworks_runtime_executions_total", sel, "version, status"), "v{{version}} {{status}}"),
        )
    )


def tenants() -> Board:
    requests = "aiworks_gateway_requests_total"
    duration = "aiworks_gateway_request_duration_seconds"
    return (
        Board(
            "aiworks-tenants",
            "AIWorks / Tenants",
            "Per tenant: how much each sends, the latency and the errors it sees, and how often it is refused. "
            "With tenancy off every request has the empty tenant.",
        )
        .variable("tenant", "Tenant", "label_values(aiworks_gateway_requests_total, tenant)")
        .row("Tenants")
        .panel(single("Requests/s", "Requests of the selected tenants.", "reqps", w=8), target(rate(requests, TENANT)))
        .panel(
            single(
                "p99 latency",
                "End-to-end p99 of the selected tenants.",
                "s",
                _thresholds((None, "green"), (0.5, "red")),
                w=8,
            ),
            target(quantile(0.99, duration, TENANT)),
        )
        .panel(
            single(
                "Errors",
                "Share of the selected tenants' requests that did not end ok (any status).",
                "percentunit",
                _thresholds((None, "green"), (0.05, "red")),
                w=8,
            ),
            target(ratio_or_zero(requests, f"{TENANT}, {NOT_OK}", TENANT)),
        )
        .panel(
            graph("Requests/s by tenant", "Traffic per tenant.", "reqps", stack=True),
            target(rate(requests, TENANT, "tenant"), "{{tenant}}"),
        )
        .panel(
            graph("Share of traffic", "Each tenant's share of all requests.", "percentunit", stack=True).max(1),
            target(f"{rate(requests, TENANT, 'tenant')} / ignoring(tenant) group_left {rate(requests)}", "{{tenant}}"),
        )
        .panel(
            graph("Latency by tenant", "End-to-end latency per tenant.", "s"),
            target(quantile(0.5, duration, TENANT, "tenant"), "p50 {{tenant}}"),
            target(quantile(0.99, duration, TENANT, "tenant"), "p99 {{tenant}}"),
        )
        .panel(
            graph("Errors by tenant and status", "Share of each tenant's requests per error status.", "percentunit"),
            target(
                f"{rate(requests, f'{TENANT}, {NOT_OK}', 'tenant, status')}"
                f" / ignoring(status) group_left {rate(requests, TENANT, 'tenant')}",
                "{{tenant}} {{status}}",
            ),
        )
        .panel(
            graph(
                "Refused (429) by tenant",
                "Requests answered 429: a full queue or the tenant's quota.",
                "reqps",
                stack=True,
                w=24,
            ),
            target(rate(requests, f'{TENANT}, status="resource_exhausted"', "tenant, model"), "{{tenant}} {{model}}"),
        )
    )


def cache() -> Board:
    lookups = "aiworks_gateway_cache_lookups_total"
    service_ratio = (
        "sum(rate(aiworks_cache_hits_total[$__rate_interval])) / (sum(rate(aiworks_cache_hits_total[$__rate_interval]))"
        " + sum(rate(aiworks_cache_misses_total[$__rate_interval])))"
    )
    operations = ("hits", "misses", "puts", "rejected_puts", "invalidations", "bypassed", "store_errors")
    return (
        Board(
            "aiworks-cache",
            "AIWorks / Result cache",
            "Does the result cache pay? Hit ratio as the gateway and the cache service see it, what the cache does, "
            "and whether its store (Redis or in-process) is up.",
        )
        .row("Cache")
        .panel(
            single("Hit ratio (cache service)", "Hits over hits and misses in the cache service.", "percentunit", w=6),
            target(service_ratio),
        )
        .panel(
            single("Hit ratio (gateway)", "Hits over hits and misses of the gateway's lookups.", "percentunit", w=6),
            target(ratio_or_zero(lookups, 'result="hit"', 'result=~"hit|miss"')),
        )
        .panel(
            single(
                "Store up", "Whether every cache's store answers; down while a breaker is open.", "none", UP_DOWN, w=6
            ).mappings([ValueMap({"1": ValueMappingResult(text="up"), "0": ValueMappingResult(text="down")})]),
            target("min(aiworks_cache_backend_up)"),
        )
        .panel(
            single(
                "Store errors/s",
                "Failed or timed-out store calls.",
                "short",
                _thresholds((None, "green"), (0.001, "red")),
                w=6,
            ),
            target("sum(rate(aiworks_cache_store_errors_total[$__rate_interval]))"),
        )
        .panel(
            graph(
                "Hit ratio by model", "Per model, from the gateway's lookups (models with the cache on).", "percentunit"
            ).max(1),
            target(ratio_or_zero(lookups, 'result="hit"', 'result=~"hit|miss"', "model"), "{{model}}"),
        )
        .panel(
            graph(
                "Gateway lookups by result",
                "hit, miss, bypass (cache off for the model) or error.",
                "reqps",
                stack=True,
            ),
            target(rate(lookups, by="result"), "{{result}}"),
        )
        .panel(
            graph("Cache operations/s", "What the cache service did, per second.", "short"),
            *(
                target(f"sum(rate(aiworks_cache_{name}_total[$__rate_interval]))", name.replace("_", " "))
                for name in operations
            ),
        )
        .panel(
            states("Store up", "Each cache's store over time; down means requests bypass the cache.", "up", "down"),
            target("max by (instance, store) (aiworks_cache_backend_up)", "{{store}} {{instance}}"),
        )
    )


def scheduler() -> Board:
    sel = MODEL_VERSION
    return (
        Board(
            "aiworks-scheduler",
            "AIWorks / Scheduler: queues and batching",
            "Why is a model slow or refusing work? Queue depth and wait per priority, batch sizes, "
            "and the retries, timeouts, rejections and ejections that protect the suite.",
        )
        .variable("model", "Model", "label_values(aiworks_scheduler_requests_total, model)")
        .variable("version", "Version", 'label_values(aiworks_scheduler_requests_total{model=~"$model"}, version)')
        .row("Queues")
        .panel(
            graph("Queue depth by priority", "Requests waiting, by class.", "short", stack=True),
            target(f"sum by (priority) (aiworks_scheduler_queue_depth_requests{{{sel}}})", "{{priority}}"),
        )
        .panel(
            graph("Queue wait by priority", "Time from arrival to the batch being sent.", "s"),
            target(quantile(0.5, "aiworks_scheduler_queue_duration_seconds", sel, "priority"), "p50 {{priority}}"),
            target(quantile(0.99, "aiworks_scheduler_queue_duration_seconds", sel, "priority"), "p99 {{priority}}"),
        )
        .panel(
            graph("Queued bytes", "Input bytes waiting per model version (bounded by max_queue_bytes).", "bytes"),
            target(f"sum by (model, version) (aiworks_scheduler_queue_bytes{{{sel}}})", "{{model}} v{{version}}"),
        )
        .panel(
            graph("Requests/s by priority and status", "Requests the scheduler finished.", "reqps", stack=True),
            target(rate("aiworks_scheduler_requests_total", sel, "priority, status"), "{{priority}} {{status}}"),
        )
        .row("Batching")
        .panel(
            heatmap.Panel()
            .title("Batch size distribution")
            .description("Batches sent per size bucket (rows) over time.")
            .datasource(DATASOURCE)
            .span(12)
            .height(8)
            .calculate(False)
            .color(heat_colors("Oranges", HeatmapColorScale.EXPONENTIAL))
            .y_axis(heatmap.YAxisConfig().unit("short"))
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE)),
            target(
                f"sum by (le) (increase(aiworks_scheduler_batch_size_rows_bucket{{{sel}}}[$__rate_interval]))",
                "{{le}}",
                heatmap_format=True,
            ),
        )
        .panel(
            graph("Mean batch size", "Rows per batch the scheduler sent.", "short"),
            target(mean("aiworks_scheduler_batch_size_rows", sel, "model, version"), "rows {{model}} v{{version}}"),
        )
        .panel(
            graph("Batch round trip", "Time from sending a batch to its answer, retries included.", "s"),
            target(
                quantile(0.5, "aiworks_scheduler_batch_duration_seconds", sel, "model, version"),
                "p50 {{model}} v{{version}}",
            ),
            target(
                quantile(0.99, "aiworks_scheduler_batch_duration_seconds", sel, "model, version"),
                "p99 {{model}} v{{version}}",
            ),
        )
        .row("Failures")
        .panel(
            graph(
                "Retries/s", "Batches re-sent to another replica after a transport failure or per-try timeout.", "short"
            ),
            target(rate("aiworks_scheduler_retries_total", sel, "model, version"), "{{model}} v{{version}}"),
        )
        .panel(
            graph("Timeouts/s", "Requests whose deadline passed in the queue or while running.", "short"),
            target(rate("aiworks_scheduler_timeouts_total", sel, "model, version"), "{{model}} v{{version}}"),
        )
        .panel(
            graph("Rejections/s by reason", "Requests refused at admission (429 or 503).", "short", stack=True),
            target(
                rate("aiworks_scheduler_rejections_total", sel, "model, version, reason"),
                "{{model}} v{{version}} {{reason}}",
            ),
        )
        .panel(
            graph("Ejections", "Replicas taken out of routing, by reason (all models).", "short", stack=True),
            target(
                "sum by (replica, reason) (increase(aiworks_scheduler_ejections_total[$__rate_interval]))",
                "{{replica}} {{reason}}",
            ),
        )
    )


def replicas() -> Board:
    return (
        Board(
            "aiworks-replicas",
            "AIWorks / Replica health",
            "Which runtime replica is the problem? The monitor's health score per replica over time, "
            "the scheduler's view (live, ejected, load, latency) and whether each process answers.",
        )
        .row("Health")
        .panel(
            heatmap.Panel()
            .title("Health score by replica")
            .description("The monitor's score per replica (0 bad, 100 healthy) over time; red rows need a look.")
            .datasource(DATASOURCE)
            .span(24)
            .height(9)
            .calculate(False)
            .color(heat_colors("RdYlGn", HeatmapColorScale.LINEAR).min(0).max(100))
            # Grafana hides cells at or below 1e-9 by default; a score of 0 (a dead replica) must show.
            .filter_values(heatmap.FilterValueRange().le(-1))
            .cell_gap(1)
            .y_axis(heatmap.YAxisConfig().unit("short"))
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN).value("score")),
            target("max by (replica) (aiworks_monitor_replica_health_score)", "{{replica}}"),
        )
        .panel(
            states("Live (scheduler)", "Whether the scheduler can route to each replica; stopping: it drains what "
                   "it holds after its stop signal (a rolling update, a scale-in), not a fault.", "live", "down",
                   minus_one="stopping"),  # fmt: skip
            # 1 live, 0 down, -1 stopping (the "or" keeps the panel for schedulers without the stopping gauge).
            target("max by (replica) (aiworks_scheduler_replica_up) - (max by (replica) "
                   "(aiworks_scheduler_replica_stopping) or 0 * max by (replica) (aiworks_scheduler_replica_up))",
                   "{{replica}}"),  # fmt: skip
        )
        .panel(
            states(
                "Ejected (scheduler)", "Replicas taken out of routing for failing.", "ejected", "in", one_is_good=False
            ),
            target("max by (replica) (aiworks_scheduler_replica_ejected)", "{{replica}}"),
        )
        .panel(
            states("Runtime processes (scrape)", "Whether Prometheus can scrape each runtime process.", "up", "down"),
            target('max by (instance) (up{job=~".*aiworks-runtime.*"})', "{{instance}}"),
        )
        .panel(
            graph(
                "Replicas desired and running (monitor)",
                "Runtime replicas the monitor wants, and those running.",
                "short",
            ),
            target("max by (state) (aiworks_monitor_runtime_replicas)", "{{state}}"),
        )
        .row("Load")
        .panel(
            graph(
                "Batch latency by replica", "The scheduler's moving average of each replica's batch latency.", "s", w=6
            ),
            target("max by (replica) (aiworks_scheduler_replica_latency_seconds)", "{{replica}}"),
        )
        .panel(
            graph(
                "Batches in flight by replica",
                "Batches each replica is running, as the scheduler counts them.",
                "short",
                w=6,
            ),
            target("sum by (replica) (aiworks_scheduler_replica_inflight_batches)", "{{replica}}"),
        )
        .panel(
            graph(
                "Requests in flight by replica",
                "Requests and generations each replica is serving, as it counts them. A replica that got its stop "
                "signal drains this to 0 before it exits (`aiworks status` shows it as stopping meanwhile).",
                "short",
                w=6,
            ),
            target("max by (replica) (aiworks_runtime_inflight_requests)", "{{replica}}"),
        )
        .panel(
            graph("Models loaded by replica", "Model versions ready on each replica.", "short", w=6),
            target("max by (replica) (aiworks_runtime_models_loaded)", "{{replica}}"),
        )
        .row("Monitor")
        .panel(
            graph(
                "Monitor actions",
                "What the monitor did (restart, scale, eject), and why. The anomalies it noticed are in its "
                "events: `aiworks events`.",
                "short",
                stack=True,
                w=24,
            ),
            target(
                "sum by (action, reason) (increase(aiworks_monitor_actions_total[$__rate_interval]))",
                "{{action}} ({{reason}})",
            ),
        )
    )


def generation() -> Board:
    sel = MODEL_VERSION
    ttft, itl = "aiworks_runtime_llm_time_to_first_token_seconds", "aiworks_runtime_llm_inter_token_seconds"
    return (
        Board(
            "aiworks-generation",
            "AIWorks / Generation",
            "Text generation on the llm backend (continuous batching): time to first token and between tokens, "
            "tokens per second, KV-cache use, running and waiting sequences, and each tenant's tokens.",
        )
        .variable("model", "Model", "label_values(aiworks_runtime_llm_kv_tokens, model)")
        .variable("version", "Version", 'label_values(aiworks_runtime_llm_kv_tokens{model=~"$model"}, version)')
        .row("Generation")
        .panel(
            graph(
                "Time to first token",
                "From a generation's arrival at its replica to its first token: the wait for KV room and the "
                "prompt's prefill (alert: AIWorksTimeToFirstTokenP99).",
                "s",
                w=8,
            ),
            target(quantile(0.5, ttft, sel, "model, version"), "p50 {{model}} v{{version}}"),
            target(quantile(0.99, ttft, sel, "model, version"), "p99 {{model}} v{{version}}"),
        )
        .panel(
            graph("Inter-token latency", "Between a generation's consecutive tokens: one decoding step.", "s", w=8),
            target(quantile(0.5, itl, sel, "model, version"), "p50 {{model}} v{{version}}"),
            target(quantile(0.99, itl, sel, "model, version"), "p99 {{model}} v{{version}}"),
        )
        .panel(
            graph("Tokens/s", "Prompt tokens read and completion tokens made per second.", "short", stack=True, w=8),
            target(rate("aiworks_runtime_llm_tokens_total", sel, "model, version, kind"), "{{kind}} v{{version}}"),
        )
        .panel(
            graph(
                "Prompt tokens copied",
                "Prompt tokens whose cache entries an engine copied from a running sequence of the same tenant "
                "instead of reading them (n choices, a shared system prompt), and all prompt tokens, per second.",
                "short",
                w=8,
            ),
            target(rate("aiworks_runtime_llm_prompt_tokens_reused_total", sel, "model, version"), "copied v{{version}}"),
            target(rate("aiworks_runtime_llm_tokens_total", f'{sel}, kind="prompt"', "model, version"),
                   "all v{{version}}"),  # fmt: skip
        )
        .panel(
            graph(
                "KV-cache use",
                "KV-cache tokens reserved by running generations (prompt plus max_tokens each), and the budget, "
                "summed over the replicas.",
                "short",
                w=8,
            ),
            target(
                f"sum by (model, version, kind) ({select('aiworks_runtime_llm_kv_tokens', sel)})",
                "{{kind}} v{{version}}",
            ),  # fmt: skip
        )
        .panel(
            graph(
                "Sequences running and waiting",
                "Generations in the running batch, and those waiting for KV room (waiting for long: add replicas "
                "or KV budget).",
                "short",
                w=8,
            ),
            target(
                f"sum by (model, version, state) ({select('aiworks_runtime_llm_sequences', sel)})",
                "{{state}} v{{version}}",
            ),  # fmt: skip
        )
        .panel(
            graph(
                "Tokens/s by tenant",
                "Prompt and completion tokens metered per tenant at the gateway (usage; a tenant's "
                "max_tokens_per_minute limits the sum).",
                "short",
                stack=True,
                w=24,
            ),
            target(rate("aiworks_tenant_tokens_total", 'model=~"$model"', "tenant, kind"), "{{tenant}} {{kind}}"),
        )
    )


def tiers() -> Board:
    online = "aiworks_scheduler_requests_total"
    wait = "aiworks_nearline_queue_wait_seconds"
    return (
        Board(
            "aiworks-tiers",
            "AIWorks / Tiers",
            "The three tiers and the result streams side by side (docs/tiers.md): online requests by class, "
            "the nearline queue of asynchronous requests, the offline batch jobs, and the streams twins read.",
        )
        .row("Online")
        .panel(
            graph(
                "Requests/s by class",
                "Requests the replicas' queues took, by priority class (realtime, standard, batch: the batch "
                "runner's chunks and the nearline worker's requests come as batch and standard work).",
                "reqps",
                stack=True,
                w=8,
            ),
            target(rate(online, by="priority"), "{{priority}}"),
        )
        .panel(
            graph(
                "Queue wait p99 by class",
                "99th percentile of the time a request waited in a replica's queue before its batch ran, by class: "
                "batch work yields to online traffic, so its wait grows first.",
                "s",
                w=8,
            ),
            target(quantile(0.99, "aiworks_scheduler_queue_duration_seconds", by="priority"), "p99 {{priority}}"),
        )
        .panel(
            graph("Request latency p99", "99th percentile of the gateway's request duration, by protocol.", "s", w=8),
            target(quantile(0.99, "aiworks_gateway_request_duration_seconds", by="protocol"), "p99 {{protocol}}"),
        )
        .row("Nearline")
        .panel(
            graph(
                "Backlog and oldest age",
                "Asynchronous requests queued and not yet answered, and the age of the oldest one a worker took "
                "(alert: AIWorksNearlineOldestAgeHigh when it stays above the nearline deadline).",
                "short",
                w=8,
            ),
            target(f"max({select('aiworks_nearline_backlog')})", "backlog"),
            target(f"max({select('aiworks_nearline_oldest_age_seconds')})", "oldest age (s)"),
        )
        .panel(
            graph(
                "Queue wait",
                "Time an asynchronous request waited in the Redis stream before a worker took it: p50 and p99.",
                "s",
                w=8,
            ),
            target(quantile(0.5, wait), "p50"),
            target(quantile(0.99, wait), "p99"),
        )
        .panel(
            graph(
                "Requests/s by outcome",
                "Asynchronous requests answered: completed, failed (an error stored as the result) and expired "
                "(taken after their deadline); and callbacks delivered or failed after their retries.",
                "reqps",
                w=8,
            ),
            target(rate("aiworks_nearline_requests_total", by="status"), "{{status}}"),
            target(
                rate_or_zero("aiworks_nearline_callbacks_total", "status", "aiworks_nearline_requests_total"),
                "callback {{status}}",
            ),
        )
        .row("Offline")
        .panel(
            single("Active jobs", "Batch jobs not yet ended (queued, running, cancelling).", "short"),
            target(f"sum({select('aiworks_batch_jobs_active')})"),
        )
        .panel(
            graph(
                "Rows/s",
                "Input lines of batch jobs answered per second, by outcome (ok or failed).",
                "short",
                stack=True,
                w=10,
            ),
            target(rate("aiworks_batch_rows_total", by="status"), "{{status}}"),
        )
        .panel(
            graph(
                "In-flight limit",
                "Requests each runner may have in flight now: its AIMD limit, cut when online traffic needs the "
                "replicas and grown back while they are idle.",
                "short",
                w=10,
            ),
            target(f"max by (instance) ({select('aiworks_batch_in_flight_limit')})", "{{instance}}"),
        )
        .panel(
            graph("Job progress", "Lines done / lines of each job not yet ended.", "percentunit", w=12),
            target(f"max by (job, tenant) ({select('aiworks_batch_job_progress_ratio')})", "{{job}} {{tenant}}"),
        )
        .panel(
            graph(
                "Jobs ended and chunks",
                "Batch jobs ended per second by final status, chunks recorded, and jobs paused because their "
                "store (S3) could not be reached (they resume by themselves; the runner's log names the error).",
                "short",
                w=12,
            ),
            target(rate("aiworks_batch_jobs_finished_total", by="status"), "jobs {{status}}"),
            target(rate("aiworks_batch_chunks_total"), "chunks"),
            target(rate("aiworks_batch_job_pauses_total"), "pauses (store unreachable)"),
        )
        .row("Result streams")
        .panel(
            graph(
                "Published and dropped/s",
                "Result records appended to streams, and those not published (by reason: the publisher's queue "
                "full, a Redis error).",
                "short",
                w=8,
            ),
            target(rate("aiworks_stream_published_total"), "published"),
            target(
                rate_or_zero("aiworks_stream_publish_dropped_total", "reason", "aiworks_stream_published_total"),
                "dropped {{reason}}",
            ),
        )
        .panel(
            graph(
                "Subscribers",
                "SSE subscribers connected, and those the gateway dropped (slow or failed).",
                "short",
                w=8,
            ),
            target(f"sum({select('aiworks_stream_subscribers')})", "connected"),
            target(
                rate_or_zero("aiworks_stream_subscribers_dropped_total", "reason", "aiworks_stream_events_sent_total"),
                "dropped/s {{reason}}",
            ),
        )
        .panel(
            graph(
                "Events/s", "Stream entries written to subscribers, and events raised by stream rules.", "short", w=8
            ),
            target(rate("aiworks_stream_events_sent_total"), "sent"),
            target(rate("aiworks_stream_rule_events_total"), "rule events"),
        )
        .row("Twins (stateful sequences)")
        .panel(
            graph(
                "Sequences held",
                "Sequences of stateful models each replica holds: active (in a slot, the twin's state there) or "
                "waiting for a slot. A stopping replica's drain waits for its sequences to end or idle out.",
                "short",
                stack=True,
                w=12,
            ),
            target(f"sum by (replica, state) ({select('aiworks_runtime_sequences')})", "{{replica}} {{state}}"),
        )
        .panel(
            graph(
                "Sequences/s by outcome",
                "Sequences started, ended by their client, released idle (max_sequence_idle_microseconds passed "
                "without a request: a twin that went quiet) and refused (every slot and the backlog full: 429).",
                "short",
                w=12,
            ),
            target(rate("aiworks_runtime_sequence_outcomes_total", by="outcome"), "{{outcome}}"),
        )
    )


DASHBOARDS: dict[str, Callable[[], Board]] = {
    "aiworks-overview.json": overview,
    "aiworks-models.json": models,
    "aiworks-tenants.json": tenants,
    "aiworks-cache.json": cache,
    "aiworks-scheduler.json": scheduler,
    "aiworks-replicas.json": replicas,
    "aiworks-generation.json": generation,
    "aiworks-tiers.json": tiers,
}


def render(board: Board) -> str:
    """The dashboard as Grafana JSON: sorted keys and a final newline, so diffs stay small."""
    return json.dumps(board.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def generate(out: Path) -> list[Path]:
    """Write every dashboard to ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in DASHBOARDS.items():
        path = out / name
        path.write_text(render(make()))
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
