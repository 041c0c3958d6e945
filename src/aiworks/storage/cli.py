"""``aiworks storage fetch``: the storage initializer a runtime pod runs before the runtime starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_storage_parser(sub) -> None:
    st = sub.add_parser("storage", help="fetch models from object storage into a model repository")
    actions = st.add_subparsers(dest="storage_command", metavar="ACTION", required=True)
    fe = actions.add_parser(
        "fetch",
        help="put one model, named by a storage URI, into a model repository",
        description=(
            "Fetch one model into REPOSITORY/MODEL: s3://bucket/prefix, gs://bucket/prefix, "
            "https://host/model.tar.gz (.tgz, .tar, .zip), pvc://claim/path (mounted under --pvc-root), "
            "file:///path, or demo (the suite's demo model named MODEL). S3 reads the AWS_* variables "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL_S3); gs:// reads "
            "STORAGE_EMULATOR_HOST or the metadata server's token. A model already fetched from the same URI "
            "is kept."
        ),
    )
    fe.add_argument("uri", help="storage URI of the model")
    fe.add_argument("--model", required=True, help="model name: the folder created in the repository")
    fe.add_argument("--repository", default="/models", help="model repository to write into (default /models)")
    fe.add_argument("--pvc-root", default="/mnt/pvc", help="where pvc://CLAIM is mounted, as ROOT/CLAIM")
    fe.add_argument("--max-bytes", type=int, help="refuse a model larger than this (default 20 GiB)")
    fe.add_argument("--ca-file", help="CA certificate that signs an https:// source's server")
    fe.add_argument("--force", action="store_true", help="fetch again even if the same URI was fetched before")
    fe.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")
    fe.set_defaults(func=cmd_fetch)


def cmd_fetch(args) -> None:
    from aiworks.core.errors import AIWorksError
    from aiworks.storage.fetch import DEFAULT_MAX_BYTES, fetch_model

    quiet = args.output == "json"
    try:
        result = fetch_model(
            args.uri,
            args.model,
            Path(args.repository),
            pvc_root=Path(args.pvc_root),
            max_bytes=args.max_bytes or DEFAULT_MAX_BYTES,
            ca_file=args.ca_file,
            force=args.force,
            progress=(lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True)),
        )
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None
    if quiet:
        print(json.dumps(result.as_dict()))
    elif result.skipped:
        print(f"model '{result.model}' is already in {result.path} from {result.uri}")
    else:
        print(f"fetched model '{result.model}' into {result.path} ({result.files} files, {result.bytes} bytes)")
