"""``aiworks rollout``: progressive canary rollouts, driven by the monitor.

    aiworks rollout start digits --to 2                  5 -> 20 -> 50 -> 100 %, 60 s a step
    aiworks rollout start digits --to 2 --steps 10,50,100 --dwell 2m --watch
    aiworks rollout status [digits] [--watch]
    aiworks rollout abort digits                         stop now, all traffic to stable
    aiworks rollout rollback digits                      back to the previous version, also after completion

A small HTTP client of the monitor's ``/v1/rollouts`` API (docs/rollouts.md),
so it works the same against ``aiworks up``, a container or a port-forwarded
pod. Only the standard library is imported, so ``aiworks --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from aiworks.core.flags import add_monitor_address
from aiworks.core.output import add_output_flag

DEFAULT_MONITOR_URL = "http://127.0.0.1:8040"
EXIT_ROLLED_BACK = 3  # --watch: the rollout ended rolled back or aborted
TERMINAL = ("completed", "rolled_back", "aborted")

ROLLOUT_HELP = """\
Move a model's traffic to a new version step by step. At each step the
canary's error rate and p99 latency over the dwell window are compared with
the stable version's; within the SLO the next step follows, a breach sends
all traffic back to stable at once. After the 100% step passes, the new
version is the stable one; `rollback` still returns to the previous version.
Each step and decision is an event (`aiworks events --kind rollout_rolled_back`).

examples:
  aiworks rollout start digits --to 2
  aiworks rollout start digits --to 2 --steps 10,50,100 --dwell 2m --max-p99-ratio 1.2 --watch
  aiworks rollout status                   every model's latest rollout
  aiworks rollout status digits --watch    follow one until it ends
  aiworks rollout abort digits             stop where it is; all traffic to stable
  aiworks rollout rollback digits          back to the previous stable version
"""

START_HELP = """\
Start a rollout of MODEL to version --to (from the version serving now, or
--from). The first step's weights are in force when this returns.

SLO, judged at the end of every dwell over that window:
  error rate   canary's may exceed stable's by at most --max-error-rate-increase
               (percentage points: 1% or 0.01; every answer but ok is an error)
  p99 latency  canary's may be at most --max-p99-ratio times stable's
               (a canary p99 under --p99-floor never counts as slow)
  data         the canary needs --min-requests requests in the window; short of
               them the dwell is extended up to --max-extensions times, then the
               rollout is rolled back (an unmeasured canary is never promoted)
Defaults come from the monitor (shown by `status` once started).

With --watch, exits 0 when the rollout completes and 3 when it is rolled back or aborted.
"""


# ---- parsing -----------------------------------------------------------------------------------


def parse_duration_s(text: str) -> float:
    """``60s``, ``2m``, ``500ms``, ``1h`` or plain seconds."""
    raw = text.strip().lower()
    for suffix, factor in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if raw.endswith(suffix) and not (suffix == "s" and raw.endswith("ms")):
            raw, scale = raw[: -len(suffix)], factor
            break
    else:
        scale = 1.0
    try:
        value = float(raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a duration such as 60s, 2m or 500ms") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be positive")
    return value


def parse_rate(text: str) -> float:
    """``1%`` or ``0.01`` as the fraction 0.01."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a rate such as 1% or 0.01") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not between 0 and 1 (write 1% or 0.01 for one point)")
    return value


def parse_steps(text: str) -> list[int]:
    try:
        steps = [int(p.strip().rstrip("%")) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not comma-separated percents such as 5,20,50,100") from None
    if not steps:
        raise argparse.ArgumentTypeError("give at least one step, ending at 100")
    return steps


# ---- HTTP --------------------------------------------------------------------------------------


def call(monitor_url: str, method: str, path: str, body: dict | None = None, timeout_s: float = 15.0) -> Any:
    """One call to the monitor's API, as ``admin`` (docs/security.md); its error message becomes SystemExit."""
    from aiworks.core.errors import AIWorksError
    from aiworks.security.callers import TOKEN_FILE_ENV, tool_caller

    headers = {}
    data = None
    if method != "GET":  # the monitor takes JSON only, with a length, from a caller with a token
        data = json.dumps(body if body is not None else {}).encode()
        headers["Content-Type"] = "application/json"
        try:
            caller = tool_caller()
        except AIWorksError as exc:
            raise SystemExit(f"error: {exc}") from None
        if caller is None:
            raise SystemExit(
                f"error: no token to act with: set {TOKEN_FILE_ENV} to the suite's token file "
                "(`aiworks up` makes .aiworks/internal-token)"
            )
        headers["Authorization"] = caller.bearer()
    request = urllib.request.Request(f"{monitor_url.rstrip('/')}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc).get("error") or exc.reason
        except (ValueError, AttributeError):
            message = exc.reason
        raise SystemExit(f"error: {message} (HTTP {exc.code})") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"error: cannot reach the monitor at {monitor_url}: {exc}") from None


def _quote(model: str) -> str:
    return urllib.parse.quote(model, safe="")


# ---- output ------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _side(stats: dict | None) -> str:
    if not stats:
        return "no baseline"
    return f"{stats['error_rate'] * 100:.3g}% errors, p99 {_ms(stats['p99_s'])}, {stats['requests']} req"


def format_rollout(r: dict, history: bool = True) -> str:
    weights = "  ".join(f"v{v}={w}" for v, w in r["weights"].items())
    head = f"{r['model']}: v{r['stable']} -> v{r['canary']}  {r['phase']}"
    if r["phase"] == "progressing":
        head += f"  step {r['step']}/{len(r['steps'])} ({r['canary_weight']}%)"
        if r.get("dwell_left_s") is not None:
            head += f"  judged in {r['dwell_left_s']:.0f} s"
    lines = [head, f"  weights: {weights}" + ("" if r["applied"] else f"  (NOT APPLIED YET: {r['apply_error']})")]
    if r.get("message"):
        lines.append(f"  {r['reason']}: {r['message']}")
    j = r.get("last_judgement")
    if j:
        lines.append(
            f"  last judgement ({j['verdict']}, {j['window_s']:.0f} s window): canary {_side(j['canary'])}"
            f" | stable ({j['baseline']}) {_side(j['stable'])}"
        )
    if history and r.get("history"):
        lines.append("  history:")
        for h in r["history"]:
            lines.append(f"    {h['time']}  {h['event']:<20} step {h['step']} {h['canary_weight']:>3}%  {h['message']}")
    return "\n".join(lines)


def _print(doc: Any, output: str, history: bool = True) -> None:
    """One answer of the monitor; JSON stays on one line, as --watch prints a stream of them."""
    from aiworks.core.output import emit_record

    def table() -> str:
        if isinstance(doc, list):
            return "\n".join(format_rollout(r, history) for r in doc) if doc else "no rollouts yet"
        return format_rollout(doc, history)

    emit_record(doc, output, table)


# ---- commands ----------------------------------------------------------------------------------


def _watch(args, model: str) -> None:
    last = None
    try:
        while True:
            doc = call(args.monitor_address, "GET", f"/v1/rollouts/{_quote(model)}")
            key = (doc["phase"], doc["step"], doc["applied"], doc["reason"], doc["extensions"])
            if key != last:
                _print(doc, args.output, history=False)
                last = key
            if doc["phase"] in TERMINAL and doc["applied"]:
                if doc["phase"] != "completed":
                    raise SystemExit(EXIT_ROLLED_BACK)
                return
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass


def run_rollout(args: argparse.Namespace) -> None:
    action = args.rollout_action
    if action == "start":
        body = {"model": args.model, "canary": args.to}
        optional = {
            "stable": args.from_version,
            "steps": args.steps,
            "dwell_s": args.dwell,
            "max_error_rate_increase": args.max_error_rate_increase,
            "max_p99_ratio": args.max_p99_ratio,
            "min_requests": args.min_requests,
            "max_extensions": args.max_extensions,
            "p99_floor_s": args.p99_floor,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        doc = call(args.monitor_address, "POST", "/v1/rollouts", body)
        _print(doc, args.output)
        if args.watch:
            _watch(args, args.model)
    elif action == "status":
        if args.watch:
            if not args.model:
                raise SystemExit("error: --watch follows one rollout; name its model")
            _watch(args, args.model)
            return
        path = f"/v1/rollouts/{_quote(args.model)}" if args.model else "/v1/rollouts"
        doc = call(args.monitor_address, "GET", path)
        _print(doc if args.model else doc["rollouts"], args.output)
    else:  # abort, rollback
        _print(call(args.monitor_address, "POST", f"/v1/rollouts/{_quote(args.model)}/{action}"), args.output)


def add_rollout_parser(sub) -> argparse.ArgumentParser:
    """Add ``rollout start|status|abort|rollback`` to the ``aiworks`` command's subparsers."""
    p = sub.add_parser(
        "rollout",
        help="progressive canary rollouts with automatic rollback (through the monitor)",
        description=ROLLOUT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_monitor_address(p, DEFAULT_MONITOR_URL)
    actions = p.add_subparsers(dest="rollout_action", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        add_output_flag(q)  # json: the monitor's answer, one line each

    start = actions.add_parser(
        "start",
        help="start moving a model's traffic to a new version",
        description=START_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    start.add_argument("model")
    start.add_argument("--to", required=True, metavar="VERSION", help="the canary version (required)")
    start.add_argument(
        "--from", dest="from_version", metavar="VERSION", help="the stable version (default: the one serving now)"
    )
    start.add_argument("--steps", type=parse_steps, help="canary percent per step, ending at 100 (default 5,20,50,100)")
    start.add_argument(
        "--dwell", type=parse_duration_s, help="time at each step before it is judged: 60s, 2m (default 60s)"
    )
    start.add_argument(
        "--max-error-rate-increase", type=parse_rate, metavar="RATE",
        help="canary error rate above stable's that rolls back: 1%% or 0.01 (default 1%%)",
    )  # fmt: skip
    start.add_argument(
        "--max-p99-ratio", type=float, metavar="X", help="canary p99 over stable p99 that rolls back (default 1.5)"
    )
    start.add_argument("--min-requests", type=int, metavar="N", help="canary requests needed to judge (default 50)")
    start.add_argument(
        "--max-extensions", type=int, metavar="N", help="dwell extensions while short of data (default 3)"
    )
    start.add_argument(
        "--p99-floor", type=parse_duration_s, metavar="DURATION", help="canary p99 never slow below this (default 5ms)"
    )
    start.add_argument("--watch", action="store_true", help="follow the rollout until it completes or rolls back")
    start.add_argument(
        "--interval", type=parse_duration_s, default=2.0, help="polling interval of --watch (default 2s)"
    )
    common(start)

    status = actions.add_parser("status", help="show rollouts: step, weights, last judgement, history")
    status.add_argument("model", nargs="?", help="one model (default: every model's latest rollout)")
    status.add_argument("--watch", action="store_true", help="follow the model's rollout until it ends")
    status.add_argument(
        "--interval", type=parse_duration_s, default=2.0, help="polling interval of --watch (default 2s)"
    )
    common(status)

    abort = actions.add_parser("abort", help="stop a rollout in progress; all traffic back to stable")
    abort.add_argument("model")
    common(abort)

    rollback = actions.add_parser(
        "rollback", help="all traffic back to the previous stable version (in progress or completed)"
    )
    rollback.add_argument("model")
    common(rollback)

    p.set_defaults(func=run_rollout)
    return p
