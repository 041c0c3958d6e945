"""What an operator makes before installing with a given values file: Secrets, claims, model stores."""

from __future__ import annotations

from pathlib import Path

from .cluster import Box


def broken_iris(box: Box, workdir: Path, extra: dict) -> None:
    """Claim "models" holding iris/ whose config is fine and whose weights are not ONNX."""
    folder = box.add_claim("models") / "iris"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    from aiworks.demo.models import IRIS_CONFIG

    (folder / "config.pbtxt").write_text(IRIS_CONFIG)
    (folder / "1" / "model.onnx").write_bytes(b"these bytes are not an ONNX model")


def external_stores(box: Box, workdir: Path, extra: dict) -> None:
    """What helm/aiworks/ci/external-values.yaml expects to exist: Secrets, a claim, an S3 bucket, a Redis.

    The S3 server (SeaweedFS) and the Redis run on the node's address, outside the release, as an
    operator's own would; the JWT secret is shared with the scenario through ``extra``.
    """
    import secrets as random
    import shutil
    import subprocess
    import tempfile

    from aiworks.storage.fetch import fetch_model

    from ..storage_servers import ACCESS_KEY, SECRET_KEY, SeaweedS3
    from .network import NODE_ADDRESS

    built = Path(tempfile.mkdtemp(dir=workdir))
    fetch_model("demo", "iris", built)
    claim = box.add_claim("aiworks-models")
    shutil.copytree(built / "iris", claim / "iris")
    # The same weights under another model name, in S3.
    s3_model = built / "iris-s3"
    shutil.copytree(built / "iris", s3_model)
    config = (s3_model / "config.pbtxt").read_text().replace('name: "iris"', 'name: "iris-s3"')
    (s3_model / "config.pbtxt").write_text(config)
    store = SeaweedS3(workdir / "s3", bucket="aiworks-models", ip=NODE_ADDRESS)
    store.start()
    store.put_tree(s3_model, "iris-s3")
    extra.setdefault("_stop", []).append(store.stop)
    box.api.put_secret(box.namespace, "aiworks-model-store", {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY.encode(), "AWS_SECRET_ACCESS_KEY": SECRET_KEY.encode(),
        "AWS_ENDPOINT_URL_S3": store.endpoint.encode(), "AWS_REGION": b"us-east-1",
    })  # fmt: skip
    port = 6391
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", NODE_ADDRESS, "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    extra["_stop"].append(redis.kill)
    box.api.put_secret(box.namespace, "aiworks-redis", {"redis-url": f"redis://{NODE_ADDRESS}:{port}/0".encode()})
    secret = random.token_bytes(32)
    box.api.put_secret(box.namespace, "aiworks-jwt", {"hmac.key": secret})
    extra["jwt_secret"] = secret.hex()


def batch_files(box: Box, workdir: Path, extra: dict) -> None:
    """The claim the gateway and batch runner pods share for the Batch API's files (a ReadWriteMany volume)."""
    box.add_claim("batch-files")
