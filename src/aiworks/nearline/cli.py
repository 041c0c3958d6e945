"""``aiworks nearline worker``: the consumer of the asynchronous request queue (docs/tiers.md)."""

from __future__ import annotations

import os


def add_nearline_parser(sub) -> None:
    np_ = sub.add_parser("nearline", help="nearline tier: the worker that answers asynchronous requests")
    actions = np_.add_subparsers(dest="nearline_command", metavar="ACTION", required=True)
    wk = actions.add_parser("worker", help="take queued asynchronous requests in order, send them to the gateway")
    wk.add_argument("--redis-url", default=os.environ.get("AIWORKS_NEARLINE_REDIS_URL"),
                    help="Redis holding the queue (env AIWORKS_NEARLINE_REDIS_URL)")  # fmt: skip
    wk.add_argument("--gateway-url", default=os.environ.get("AIWORKS_NEARLINE_GATEWAY_URL"),
                    help="the gateway's HTTP base URL (env AIWORKS_NEARLINE_GATEWAY_URL)")  # fmt: skip
    wk.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    wk.add_argument("--deadline-s", type=float, default=30.0,
                    help="deadline of entries queued without one (each carries the gateway's; default 30)")  # fmt: skip
    wk.add_argument("--tenants-file", default=os.environ.get("AIWORKS_NEARLINE_TENANTS_FILE"),
                    help="the gateway's tenants file, for callbacks' hosts and secrets "
                    "(env AIWORKS_NEARLINE_TENANTS_FILE; none: no callbacks are sent)")  # fmt: skip
    wk.add_argument("--callback-timeout-s", type=float, default=5.0, help="timeout of one callback POST (default 5)")
    wk.add_argument("--callback-attempts", type=int, default=3, help="tries per callback, with backoff (default 3)")
    wk.add_argument("--claim-idle-s", type=float, default=30.0,
                    help="take over requests a dead worker left pending this long (default 30)")  # fmt: skip
    wk.add_argument("--result-ttl-s", type=float, default=3600.0, help="how long results are kept (default 3600)")
    wk.add_argument("--metrics-port", type=int, default=os.environ.get("AIWORKS_NEARLINE_METRICS_PORT", "0"),
                    help="serve Prometheus /metrics on this port (env AIWORKS_NEARLINE_METRICS_PORT; 0: none)")  # fmt: skip
    wk.add_argument("--metrics-host", default=os.environ.get("AIWORKS_NEARLINE_METRICS_HOST", "127.0.0.1"),
                    help="address /metrics listens on (env AIWORKS_NEARLINE_METRICS_HOST; default %(default)s)")  # fmt: skip
    wk.add_argument("--ca-file", default=os.environ.get("AIWORKS_NEARLINE_CA_FILE"),
                    help="CA that signs the gateway's certificate, for an https:// gateway URL "
                    "(env AIWORKS_NEARLINE_CA_FILE; default: the system's CAs)")  # fmt: skip
    wk.add_argument("--credential-key-file", default=os.environ.get("AIWORKS_NEARLINE_CREDENTIAL_KEY_FILE"),
                    help="the gateway's credential key file, which opens the callers' credentials it sealed in "
                    "Redis (env AIWORKS_NEARLINE_CREDENTIAL_KEY_FILE; none: a sealed request fails, saying so)")  # fmt: skip
    wk.add_argument("--credential-key-reload-s", type=float,
                    default=float(os.environ.get("AIWORKS_NEARLINE_CREDENTIAL_KEY_RELOAD_S", "10")),
                    help="how often the credential key file is read again, so a rotation step is taken without a "
                    "restart (env AIWORKS_NEARLINE_CREDENTIAL_KEY_RELOAD_S; 0: no periodic re-read; default %(default)s)")  # fmt: skip
    wk.set_defaults(func=cmd_worker)


def cmd_worker(args) -> None:
    import asyncio
    import signal

    from aiworks.core.logging import setup_logging
    from aiworks.core.metrics import serve_metrics_or_warn
    from aiworks.nearline.callbacks import load_callbacks
    from aiworks.nearline.delivery import CallbackSender
    from aiworks.nearline.queue import AsyncQueue
    from aiworks.nearline.worker import NearlineWorker
    from aiworks.security.keyring import watch_key_file
    from aiworks.security.sealing import load_sealer

    if not args.redis_url or not args.gateway_url:
        raise SystemExit("error: --redis-url and --gateway-url are required (AIWORKS_NEARLINE_REDIS_URL, _GATEWAY_URL)")
    setup_logging("nearline-worker", "INFO")
    sealer = load_sealer(args.credential_key_file, "AIWORKS_NEARLINE_CREDENTIAL_KEY_FILE", "requests")
    try:
        callbacks = load_callbacks(args.tenants_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read the callbacks of {args.tenants_file}: {exc}") from None

    async def main() -> None:
        queue = AsyncQueue.from_url(args.redis_url, ttl_s=args.result_ttl_s, sealer=sealer)
        worker = NearlineWorker(queue, args.gateway_url, concurrency=args.concurrency, deadline_s=args.deadline_s,
                                claim_idle_s=args.claim_idle_s, ca_file=args.ca_file,
                                callbacks=CallbackSender(callbacks, timeout_s=args.callback_timeout_s,
                                                         attempts=args.callback_attempts))  # fmt: skip
        if args.metrics_port:
            serve_metrics_or_warn(args.metrics_port, args.metrics_host)
        key_watch = watch_key_file(args.credential_key_file if sealer else None, [sealer], args.credential_key_reload_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await worker.run_forever(stop)
        finally:
            if key_watch is not None:
                key_watch.cancel()
            await queue.close()

    asyncio.run(main())
