"""``aiworks batch``: run the batch runner, and submit, watch, cancel and fetch jobs through the gateway's Batch API.

The client commands are plain HTTP clients of the gateway (``--url``,
default ``$AIWORKS_GATEWAY_URL`` or http://127.0.0.1:8000) and send
``$AIWORKS_API_KEY`` (or ``--api-key-file``) as the bearer token. Progress
goes to stderr, results to stdout; ``-o json`` prints the Batch object.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"
_DONE = ("completed", "failed", "cancelled", "expired")


def add_batch_parser(sub) -> None:
    bp = sub.add_parser("batch", help="batch jobs (offline tier): run the runner, submit, status, cancel, results, "
                        "files")  # fmt: skip
    actions = bp.add_subparsers(dest="batch_command", metavar="ACTION", required=True)

    rn = actions.add_parser("runner", help="run a batch runner: takes jobs from Redis, sends them to the gateway")
    rn.add_argument("--redis-url", help="Redis holding the jobs (env AIWORKS_BATCH_REDIS_URL)")
    rn.add_argument("--gateway-url", help="the gateway's HTTP base URL (env AIWORKS_BATCH_GATEWAY_URL)")
    rn.add_argument("--concurrency", type=int, help="requests in flight per chunk (env AIWORKS_BATCH_CONCURRENCY)")
    rn.add_argument("--lease-ttl-s", type=float, help="life of a job's lease (env AIWORKS_BATCH_LEASE_TTL_S)")
    rn.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: none; env "
                    "AIWORKS_BATCH_METRICS_PORT)")  # fmt: skip
    rn.add_argument("--metrics-host", help="address /metrics listens on (env AIWORKS_BATCH_METRICS_HOST; default "
                    "127.0.0.1)")  # fmt: skip
    rn.set_defaults(func=cmd_runner)

    def client(p) -> None:
        p.add_argument("-u", "--url", default=os.environ.get("AIWORKS_GATEWAY_URL", DEFAULT_URL),
                       help="gateway HTTP base URL (env AIWORKS_GATEWAY_URL; default %(default)s)")  # fmt: skip
        p.add_argument("--api-key-file", help="file holding the API key (default: env AIWORKS_API_KEY)")
        p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")

    sm = actions.add_parser("submit", help="upload a JSONL or Parquet file and start a batch job")
    sm.add_argument("input", help="JSONL file (one OIP inference request per line, optional custom_id) or Parquet "
                    "file (columns are the model's inputs, optional custom_id column; docs/tiers.md)")  # fmt: skip
    sm.add_argument("--format", choices=["jsonl", "parquet"], help="input format (default: by the extension, "
                    ".parquet or JSONL); a Parquet job's output file is Parquet")  # fmt: skip
    sm.add_argument("--input-column", action="append", default=[], metavar="INPUT=COL[,COL...]",
                    help="Parquet: fill model input INPUT from these columns (repeat per input; default: each "
                    "column is the input of its name)")  # fmt: skip
    sm.add_argument("-m", "--model", required=True, help="model name")
    sm.add_argument("-x", "--model-version", default="", help="model version (default: the served one)")
    sm.add_argument("--chunk-size", type=int, help="lines per checkpointed chunk (gateway default 100)")
    sm.add_argument("--completion-window", default="24h", help="completion window (default 24h)")
    sm.add_argument("--wait", action="store_true", help="show progress until the job ends")
    client(sm)
    sm.set_defaults(func=cmd_submit)

    st = actions.add_parser("status", help="a job's status and progress")
    st.add_argument("id", help="batch id")
    st.add_argument("--wait", action="store_true", help="show progress until the job ends")
    client(st)
    st.set_defaults(func=cmd_status)

    cn = actions.add_parser("cancel", help="cancel a job: it stops within one chunk and keeps what finished")
    cn.add_argument("id", help="batch id")
    client(cn)
    cn.set_defaults(func=cmd_cancel)

    rs = actions.add_parser("results", help="print a finished job's output (or error) file")
    rs.add_argument("id", help="batch id")
    rs.add_argument("--errors", action="store_true", help="the error file instead of the output file")
    rs.add_argument("--out", help="write to this file instead of stdout")
    client(rs)
    rs.set_defaults(func=cmd_results)

    fl = actions.add_parser("files", help="list your files: uploads and jobs' output and error files")
    fl.add_argument("--purpose", choices=["batch", "batch_output"], help="only uploads, or only jobs' files")
    client(fl)
    fl.set_defaults(func=cmd_files)

    df = actions.add_parser("delete-file", help="delete files from storage (refused while a job not ended reads "
                            "one)")  # fmt: skip
    df.add_argument("ids", nargs="+", metavar="FILE_ID", help="file ids (aiworks batch files lists them)")
    client(df)
    df.set_defaults(func=cmd_delete_file)


# ---- the runner ---------------------------------------------------------------------------------------


def cmd_runner(args) -> None:
    import asyncio
    import signal

    from pydantic import ValidationError

    from aiworks.batch.jobs import JobStore
    from aiworks.batch.metrics import serve_runner_metrics
    from aiworks.batch.runner import BatchRunner
    from aiworks.batch.settings import BatchSettings
    from aiworks.core.logging import setup_logging
    from aiworks.security.keyring import watch_key_file
    from aiworks.security.sealing import load_sealer

    overrides = {k: v for k, v in {
        "redis_url": args.redis_url, "gateway_url": args.gateway_url, "concurrency": args.concurrency,
        "lease_ttl_s": args.lease_ttl_s, "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
    }.items() if v is not None}  # fmt: skip
    try:
        settings = BatchSettings(**overrides)
    except ValidationError as exc:
        raise SystemExit(f"error: batch runner settings: {exc}") from None
    setup_logging("batch-runner", "INFO")
    _lower_priority(settings.nice)
    sealer = load_sealer(settings.credential_key_file, "AIWORKS_BATCH_CREDENTIAL_KEY_FILE", "jobs")

    async def main() -> None:
        store = JobStore.from_url(settings.redis_url, sealer=sealer)
        runner = BatchRunner(store, settings)
        key_watch = watch_key_file(settings.credential_key_file if sealer else None, [sealer],
                                   settings.credential_key_reload_s)  # fmt: skip
        if settings.metrics_port:
            serve_runner_metrics(runner, settings.metrics_port, settings.metrics_host)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await runner.run_forever(stop)
        finally:
            if key_watch is not None:
                key_watch.cancel()
            await runner.close()
            await store.close()

    asyncio.run(main())


def _lower_priority(nice: int) -> None:
    """Raise this process's niceness to ``nice`` before any thread starts (threads inherit it; on Linux it is
    per thread). Never lowers it: a runner started under ``nice`` keeps what it was given."""
    import logging

    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        logging.getLogger("aiworks.batch").info("runner niceness %d (was %d): online work gets the CPU first", nice, current)


# ---- the client commands ------------------------------------------------------------------------------


def _session(args):
    """A session to the gateway at ``args.url``: a gateway it cannot reach is one line naming the URL and why, not
    a traceback (as the other commands say of the scheduler or the monitor)."""
    import requests

    class GatewaySession(requests.Session):
        def request(self, method, url, *more, **options):
            try:
                return super().request(method, url, *more, **options)
            except requests.ConnectionError as exc:
                why = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc))
                raise SystemExit(f"error: cannot reach the gateway at {args.url}: "
                                 f"{why.group(1) if why else type(exc).__name__}") from None  # fmt: skip
            except requests.Timeout:
                raise SystemExit(f"error: the gateway at {args.url} did not answer {method} {url} in time") from None

    key = os.environ.get("AIWORKS_API_KEY", "")
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
    session = GatewaySession()
    if key:
        session.headers["authorization"] = f"Bearer {key}"
    return session


def _check(reply):
    if reply.status_code >= 400:
        try:
            message = reply.json().get("error", reply.text)
        except ValueError:
            message = reply.text
        if isinstance(message, dict):
            message = message.get("message", message)
        raise SystemExit(f"error: {reply.status_code}: {message}")
    return reply


def _print(args, batch: dict) -> None:
    if args.output == "json":
        print(json.dumps(batch, indent=2))
        return
    counts = batch["request_counts"]
    print(f"{batch['id']}  {batch['status']}  {counts['completed']} ok, {counts['failed']} failed "
          f"of {counts['total']}  {batch['endpoint']}")  # fmt: skip


def progress_line(batch: dict, started: float, start_done: int, now: float) -> str:
    """``[#####-----] 1200/2000 60% 410 rows/s ETA 2s`` for one Batch object."""
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    width = 30
    filled = int(width * done / total) if total else 0
    rate = (done - start_done) / (now - started) if now > started else 0.0
    eta = f"ETA {max(0, total - done) / rate:.0f}s" if rate > 0 and total else "ETA -"
    share = f"{100 * done / total:.0f}%" if total else "-"
    bar = "#" * filled + "-" * (width - filled)
    return f"[{bar}] {done}/{total or '?'} {share} {rate:.0f} rows/s {eta} {batch['status']}"


def _watch(args, session, batch_id: str) -> dict:
    started, first = time.monotonic(), None
    while True:
        batch = _check(session.get(f"{args.url}/v1/batches/{batch_id}", timeout=30)).json()
        counts = batch["request_counts"]
        if first is None:
            first = counts["completed"] + counts["failed"]
        sys.stderr.write("\r" + progress_line(batch, started, first, time.monotonic()))
        sys.stderr.flush()
        if batch["status"] in _DONE:
            sys.stderr.write("\n")
            return batch
        time.sleep(0.5)


def cmd_submit(args) -> None:
    session = _session(args)
    path = Path(args.input)
    if not path.is_file():
        raise SystemExit(f"error: input file {args.input} does not exist")
    form = args.format or ("parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl")
    input_columns = {}
    for spec in args.input_column:
        name, sep, columns = spec.partition("=")
        if not sep or not name or not columns:
            raise SystemExit(f"error: --input-column takes INPUT=COL[,COL...], not '{spec}'")
        input_columns[name] = columns.split(",")
    media_type = "application/vnd.apache.parquet" if form == "parquet" else "application/jsonl"
    with path.open("rb") as f:
        files = {"file": (path.name, f, media_type)}
        uploaded = _check(session.post(f"{args.url}/v1/files", data={"purpose": "batch"}, files=files, timeout=300))
    uploaded = uploaded.json()
    version = f"/versions/{args.model_version}" if args.model_version else ""
    body = {"input_file_id": uploaded["id"], "endpoint": f"/v2/models/{args.model}{version}/infer",
            "completion_window": args.completion_window}  # fmt: skip
    if args.chunk_size:
        body["chunk_size"] = args.chunk_size
    if args.format:
        body["format"] = args.format
    if input_columns:
        body["input_columns"] = input_columns
    batch = _check(session.post(f"{args.url}/v1/batches", json=body, timeout=60)).json()
    if args.wait:
        batch = _watch(args, session, batch["id"])
    _print(args, batch)


def cmd_status(args) -> None:
    session = _session(args)
    if args.wait:
        batch = _watch(args, session, args.id)
    else:
        batch = _check(session.get(f"{args.url}/v1/batches/{args.id}", timeout=30)).json()
    _print(args, batch)


def cmd_cancel(args) -> None:
    session = _session(args)
    _print(args, _check(session.post(f"{args.url}/v1/batches/{args.id}/cancel", timeout=30)).json())


def cmd_results(args) -> None:
    session = _session(args)
    batch = _check(session.get(f"{args.url}/v1/batches/{args.id}", timeout=30)).json()
    file_id = batch["error_file_id"] if args.errors else batch["output_file_id"]
    if not file_id:
        which = "error" if args.errors else "output"
        raise SystemExit(f"error: batch {args.id} is {batch['status']} and has no {which} file yet")
    reply = _check(session.get(f"{args.url}/v1/files/{file_id}/content", timeout=300, stream=True))
    with reply, (open(args.out, "wb") if args.out else contextlib.nullcontext(sys.stdout.buffer)) as out:
        for block in reply.iter_content(1 << 20):  # as the gateway streams it: no file held in memory
            out.write(block)


def cmd_files(args) -> None:
    session = _session(args)
    files, after = [], ""
    while True:  # the gateway pages as OpenAI's does
        query = f"?limit=1000{after}" + (f"&purpose={args.purpose}" if args.purpose else "")
        page = _check(session.get(f"{args.url}/v1/files{query}", timeout=60)).json()
        files += page["data"]
        if not page["has_more"]:
            break
        after = f"&after={page['last_id']}"
    if args.output == "json":
        print(json.dumps(files, indent=2))
        return
    width = max((len(f["id"]) for f in files), default=0)  # uploads' ids are shorter than jobs' files'
    for f in files:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(f["created_at"]))
        print(f"{f['id']:<{width}}  {f['purpose']:<12}  {f['bytes']:>12,} B  {created}  {f['filename']}")


def cmd_delete_file(args) -> None:
    session = _session(args)
    done = [_check(session.delete(f"{args.url}/v1/files/{file_id}", timeout=60)).json() for file_id in args.ids]
    if args.output == "json":
        print(json.dumps(done, indent=2))
        return
    for d in done:
        print(f"{d['id']}  deleted")
