"""``aiworks optimize``: build a model's variants and measure each against the original.

For every variant: file size, median latency at batch 1 and batch 32, accuracy
on held-out data when labels are given, and agreement with the original's
outputs (the share of equal predictions for labels, the cosine similarity per
row for float outputs such as embeddings). The table is printed and saved as
``report.md`` and ``report.json`` next to the variants.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from aiworks.lifecycle import variants as V
from aiworks.lifecycle.progress import bar
from aiworks.lifecycle.sessions import open_session

BATCH_SIZES = (1, 32)


@dataclass(slots=True)
class EvalData:
    """Held-out inputs (by graph input name), optional labels, and calibration inputs."""

    name: str
    feeds: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    calibration: dict[str, np.ndarray] | None = None

    @property
    def rows(self) -> int:
        return len(next(iter(self.feeds.values())))


def digits_data() -> EvalData:
    """The digits demo's test split; calibration on 256 rows of its training split."""
    from aiworks.demo.models import digits_split

    x_train, x_test, _, y_test = digits_split()
    return EvalData("digits test split", {"input": x_test}, y_test.astype(np.int64), {"input": x_train[:256]})


def load_npz(
    path: Path, input_names: list[str], calibration: Path | None = None, input_ranks: dict[str, int] | None = None
) -> EvalData:
    """Held-out data from an ``.npz``: ``x`` (or one array per input name), optional ``y``.

    Calibration inputs come from ``calibration`` (an ``.npz`` with the same
    keys), else from ``x_calib`` in the same file, else from the held-out
    inputs themselves (the report says so). Strings load as text tensors; an
    array one rank short of its input (``text`` for a ``[batch, 1]`` input)
    gets the trailing 1.
    """
    data = np.load(path, allow_pickle=False)
    ranks = input_ranks or {}

    def _as_feed(name: str, a: np.ndarray) -> np.ndarray:
        if a.dtype.kind in "US":
            a = a.astype(object)
        if ranks.get(name) == a.ndim + 1:
            a = a[..., None]
        return a

    def feeds_from(d, suffix: str = "") -> dict[str, np.ndarray] | None:
        if len(input_names) == 1 and f"x{suffix}" in d:
            return {input_names[0]: _as_feed(input_names[0], d[f"x{suffix}"])}
        if all(f"{n}{suffix}" in d for n in input_names):
            return {n: _as_feed(n, d[f"{n}{suffix}"]) for n in input_names}
        return None

    feeds = feeds_from(data)
    if feeds is None:
        raise ValueError(f"{path} needs 'x' or arrays named {input_names}; it has {sorted(data.files)}")
    labels = data["y"] if "y" in data.files else None
    calib = feeds_from(np.load(calibration, allow_pickle=False)) if calibration else feeds_from(data, "_calib")
    name = Path(path).name
    if calib is None:
        calib, name = feeds, f"{name} (calibrated on the held-out data itself)"
    return EvalData(name, feeds, labels, calib)


@dataclass(slots=True)
class Row:
    """One variant's measurements."""

    variant: str
    path: str
    size_bytes: int = 0
    latency_ms: dict[str, float] = field(default_factory=dict)  # batch size -> median ms per batch
    accuracy: float | None = None
    agreement: float | None = None  # share of predictions equal to the original's
    cosine_min: float | None = None  # worst per-row cosine similarity to the original's output
    note: str = ""
    error: str = ""


@dataclass(slots=True)
class OptimizeReport:
    model: str
    data: str
    output: str
    threads: int
    rows: list[Row] = field(default_factory=list)

    def row(self, variant: str) -> Row | None:
        return next((r for r in self.rows if r.variant == variant), None)

    def to_markdown(self) -> str:
        base = self.row("original")
        lines = [
            f"# optimize: {self.model}",
            "",
            f"Held-out data: {self.data}; compared output: `{self.output}`; "
            f"ONNX Runtime CPU, {self.threads} intra-op thread(s); latency is the median per batch.",
            "",
            "| variant | size MB | size vs orig | batch 1 ms | batch 32 ms | rows/s @32 | accuracy | "
            "Δ acc (pts) | vs original | notes |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.rows:
            if r.error:
                lines.append(f"| {r.variant} | | | | | | | | | failed: {r.error} |")
                continue
            b1, b32 = r.latency_ms.get("1"), r.latency_ms.get("32")
            ratio = f"{r.size_bytes / base.size_bytes:.2f}×" if base and base.size_bytes else ""
            acc = f"{100 * r.accuracy:.2f}%" if r.accuracy is not None else "n/a"
            delta = (
                f"{100 * (r.accuracy - base.accuracy):+.2f}"
                if r.accuracy is not None and base and base.accuracy is not None and r is not base
                else ""
            )
            if r.agreement is not None:
                vs = f"{100 * r.agreement:.1f}% same"
            elif r.cosine_min is not None:
                vs = f"cos ≥ {r.cosine_min:.4f}"
            else:
                vs = ""
            lines.append(
                f"| {r.variant} | {r.size_bytes / 1e6:.2f} | {ratio} | {_fmt(b1)} | {_fmt(b32)} | "
                f"{_fmt(32e3 / b32 if b32 else None, 0)} | {acc} | {delta} | {vs} | {r.note} |"
            )
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write(self, out: Path) -> tuple[Path, Path]:
        md, js = Path(out) / "report.md", Path(out) / "report.json"
        md.write_text(self.to_markdown())
        js.write_text(self.to_json())
        return md, js


def _fmt(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _rows(feeds: dict[str, np.ndarray], start: int, count: int) -> dict[str, np.ndarray]:
    """``count`` rows from ``start``, wrapping around when the data is shorter."""
    n = len(next(iter(feeds.values())))
    idx = (np.arange(count) + start) % n
    return {k: v[idx] for k, v in feeds.items()}


def _pick_output(session, requested: str | None) -> str:
    names = [o.name for o in session.get_outputs()]
    if requested:
        if requested not in names:
            raise ValueError(f"the model has no output '{requested}'; it has {names}")
        return requested
    return "label" if "label" in names else names[0]


def _predict(session, feeds, output: str, batch: int = 256) -> np.ndarray:
    n = len(next(iter(feeds.values())))
    parts = [session.run([output], {k: v[i : i + batch] for k, v in feeds.items()})[0] for i in range(0, n, batch)]
    return np.concatenate(parts)


def _labels_of(pred: np.ndarray) -> np.ndarray | None:
    """Class predictions: an integer output as is, a 2-D float output by argmax."""
    if pred.dtype.kind in "iu":
        return pred.reshape(len(pred), -1)[:, 0]
    if pred.dtype.kind == "f" and pred.ndim == 2 and pred.shape[1] > 1:
        return pred.argmax(axis=1)
    return None


def _cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    a = a.reshape(len(a), -1).astype(np.float64)
    b = b.reshape(len(b), -1).astype(np.float64)
    denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cos = np.where(denom > 0, (a * b).sum(axis=1) / np.where(denom > 0, denom, 1), 1.0)
    return float(cos.min())


def measure(
    path: Path,
    data: EvalData,
    output: str,
    *,
    reference: np.ndarray | None = None,
    repeats: int = 50,
    threads: int = 1,
    progress=None,
) -> tuple[Row, np.ndarray]:
    """Size, latency at each of :data:`BATCH_SIZES`, accuracy and agreement; returns the row and predictions."""
    session = open_session(path, threads=threads)
    row = Row(variant="", path=str(path), size_bytes=Path(path).stat().st_size)
    for b in BATCH_SIZES:
        for w in range(3):  # warm-up
            session.run(None, _rows(data.feeds, w, b))
        times = []
        for i in range(repeats):
            feeds = _rows(data.feeds, i * b, b)
            t0 = time.perf_counter()
            session.run(None, feeds)
            times.append((time.perf_counter() - t0) * 1e3)
            if progress is not None:
                progress.update(1)
        row.latency_ms[str(b)] = statistics.median(times)
    pred = _predict(session, data.feeds, output)
    labels = _labels_of(pred)
    if data.labels is not None and labels is not None:
        row.accuracy = float((labels == data.labels.reshape(-1)).mean())
    if reference is not None:
        ref_labels = _labels_of(reference)
        if labels is not None and ref_labels is not None and pred.dtype.kind in "iu":
            row.agreement = float((labels == ref_labels).mean())
        else:
            row.cosine_min = _cosine_min(pred, reference)
    return row, pred


def optimize(
    src: Path,
    out: Path,
    data: EvalData,
    *,
    variants: tuple[str, ...] = V.VARIANTS,
    output: str | None = None,
    repeats: int = 50,
    threads: int = 1,
    show_progress: bool = True,
) -> OptimizeReport:
    """Build ``variants`` of ``src`` under ``out`` and measure them with the original."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(src).parent.name if Path(src).name == "model.onnx" else Path(src).stem
    original = out / f"{stem}.original.onnx"
    shutil.copyfile(src, original)
    out_name = _pick_output(open_session(original), output)
    report = OptimizeReport(str(src), data.name, out_name, threads)

    built: list[tuple[str, Path, str]] = [("original", original, "")]
    builders = {
        "optimized": lambda p, pb: V.graph_optimized(original, p),
        "int8-dynamic": lambda p, pb: V.int8_dynamic(original, p),
        "int8-static": lambda p, pb: V.int8_static(original, p, data.calibration or data.feeds, progress=pb),
        "fp16": lambda p, pb: V.fp16(original, p),
    }
    with bar(len(variants), "building variants", show_progress, unit="variant") as pb:
        for name in variants:
            pb.set_postfix_str(name)
            path = out / f"{stem}.{name}.onnx"
            try:
                built.append((name, path, builders[name](path, None)))
            except Exception as exc:  # one failed variant must not hide the others
                report.rows.append(Row(variant=name, path=str(path), error=f"{type(exc).__name__}: {exc}"[:300]))
            pb.update(1)

    reference = None
    total = len(built) * len(BATCH_SIZES) * repeats
    with bar(total, "measuring", show_progress, unit="run") as pb:
        for name, path, note in built:
            pb.set_postfix_str(name)
            try:
                row, pred = measure(
                    path, data, out_name, reference=reference, repeats=repeats, threads=threads, progress=pb
                )
            except Exception as exc:
                report.rows.append(Row(variant=name, path=str(path), error=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            row.variant, row.note = name, note
            if reference is None:
                reference = pred
            report.rows.append(row)
    order = {n: i for i, n in enumerate(("original", *V.VARIANTS))}
    report.rows.sort(key=lambda r: order.get(r.variant, 99))
    report.write(out)
    return report
