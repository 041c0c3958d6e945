"""The lifecycle subcommands: ``convert``, ``optimize``, ``split``, ``minilm`` and ``llm``.

``add_lifecycle_parsers(sub)`` registers them on the ``aiworks`` parser.
Imports happen inside each command, so ``aiworks --help`` stays instant and
works without the lifecycle extras installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Exit status when a model converted but uses operators its target does not support.
EXIT_UNSUPPORTED_OPS = 3
# Exit status of optimize --tensorrt where TensorRT or a GPU is missing.
EXIT_NO_TENSORRT = 4


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---- convert ---------------------------------------------------------------------------------


def cmd_convert(args) -> None:
    from aiworks.lifecycle.convert import CONVERT_STEPS, convert, parse_input_spec
    from aiworks.lifecycle.progress import Steps

    try:
        inputs = [parse_input_spec(text, i) for i, text in enumerate(args.input or [])]
        result = convert(
            Path(args.source),
            Path(args.out),
            name=args.name,
            framework=args.framework,
            inputs=inputs,
            output_names=args.output_name,
            opset=args.opset,
            target=args.target,
            max_batch_size=args.max_batch_size,
            progress=Steps("convert", CONVERT_STEPS, enabled=not args.no_progress),
        )
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        _fail(str(exc))
    print(result.summary())
    if not result.report.ok:
        print(
            f"warning: {len(result.report.unsupported)} operator type(s) unsupported on {args.target}", file=sys.stderr
        )
        raise SystemExit(EXIT_UNSUPPORTED_OPS)


# ---- optimize --------------------------------------------------------------------------------


def _eval_data(spec: str, model_path: Path, calibration: str | None):
    from aiworks.lifecycle.optimize import digits_data, load_npz
    from aiworks.lifecycle.sessions import open_session

    if spec == "digits":
        return digits_data()
    inputs = open_session(model_path).get_inputs()
    ranks = {i.name: len(i.shape) for i in inputs}
    return load_npz(Path(spec), [i.name for i in inputs], Path(calibration) if calibration else None, ranks)


def cmd_optimize_tensorrt(args) -> None:
    from aiworks.lifecycle.layout import find_onnx
    from aiworks.lifecycle.tensorrt_build import TensorRTUnavailable
    from aiworks.lifecycle.tensorrt_plan import build_plan_folder, parse_profile

    try:
        src = find_onnx(Path(args.model))
        profiles = dict(parse_profile(p) for p in args.profile or [])
        name = args.name or f"{src.parent.parent.name if src.parent.name.isdigit() else src.stem}_trt"
        print(f"building a TensorRT engine ({args.precision}) from {src}; this takes minutes", file=sys.stderr)
        folder = build_plan_folder(
            src, Path(args.out), name, precision=args.precision, max_batch_size=args.max_batch_size, profiles=profiles
        )
    except TensorRTUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_NO_TENSORRT) from None
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    print(f"wrote {folder} (platform tensorrt_plan: the runtime serves it through Triton, docs/triton.md)")


def cmd_optimize(args) -> None:
    from aiworks.lifecycle.layout import find_onnx
    from aiworks.lifecycle.optimize import optimize
    from aiworks.lifecycle.variants import VARIANTS

    if args.tensorrt:
        return cmd_optimize_tensorrt(args)
    if not args.data:
        _fail("give --data (or --tensorrt to build a TensorRT engine instead)")

    variants = tuple(v.strip() for v in args.variants.split(",")) if args.variants else VARIANTS
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        _fail(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        src = find_onnx(Path(args.model))
        data = _eval_data(args.data, src, args.calibration)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    report = optimize(
        src,
        Path(args.out),
        data,
        variants=variants,
        output=args.output,
        repeats=args.repeats,
        threads=args.threads,
        show_progress=not args.no_progress,
    )
    print(report.to_markdown())
    print(f"saved {Path(args.out) / 'report.md'} and {Path(args.out) / 'report.json'}")


# ---- split -----------------------------------------------------------------------------------


def _split_feeds(spec: str | None, stage1: Path, batch: int):
    import numpy as np

    from aiworks.lifecycle.sessions import open_session, sample_feeds

    session = open_session(stage1)
    names = [i.name for i in session.get_inputs()]
    ranks = {i.name: len(i.shape) for i in session.get_inputs()}
    if spec is None:
        return sample_feeds(session, batch=batch)
    if spec == "digits":
        from aiworks.lifecycle.optimize import digits_data

        feeds = digits_data().feeds
    else:
        from aiworks.lifecycle.optimize import load_npz

        feeds = load_npz(Path(spec), names, input_ranks=ranks).feeds
    return {k: np.ascontiguousarray(v[:batch]) for k, v in feeds.items()}


def cmd_split(args) -> None:
    import onnx

    from aiworks.lifecycle.layout import find_onnx
    from aiworks.lifecycle.split import cut_candidates, measure_split, split_model

    try:
        src = find_onnx(Path(args.model))
    except FileNotFoundError as exc:
        _fail(str(exc))
    if args.list:
        for t in cut_candidates(onnx.load(str(src))):
            print(t)
        return
    if not args.cut or not args.out:
        _fail("give --cut TENSOR[,TENSOR...] (once per cut) and --out DIR, or --list to see the tensors")
    cuts = [[n.strip() for n in c.split(",") if n.strip()] for c in args.cut]
    try:
        folders = split_model(src, cuts, Path(args.out), name=args.name, max_batch_size=args.max_batch_size)
    except ValueError as exc:
        _fail(str(exc))
    for f in folders:
        print(f"wrote {f}")
    if args.pipeline:
        from aiworks.lifecycle.pipeline import write_pipeline

        folder = write_pipeline(Path(args.out), args.pipeline, folders, micro_batch_rows=args.micro_batch_rows)
        print(f"wrote {folder} (a pipeline of {len(folders)} stages, run by the scheduler)")
    report = measure_split(src, folders, _split_feeds(args.data, find_onnx(folders[0]), args.batch))
    print(report.format())
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_dict(), indent=2))
        print(f"saved {args.report}")


# ---- minilm ----------------------------------------------------------------------------------


def cmd_minilm_build(args) -> None:
    from aiworks.lifecycle import minilm
    from aiworks.lifecycle.progress import Steps

    int8 = args.int8 or args.int8_full
    total = minilm.build_steps(int8=int8, torch=args.format != "onnx", tokens=args.tokens)
    steps = Steps("minilm build", total, enabled=not args.no_progress)
    if args.format != "onnx":
        if args.int8 or args.int8_full or args.tokens:
            _fail("--int8, --int8-full and --tokens are for --format onnx")
        try:
            exported = minilm.build_torch(
                Path(args.out),
                format=args.format,
                name=args.name or minilm.TORCH_NAME,
                precision=args.precision,
                cuda_graph_tokens=args.cuda_graph_tokens,
                progress=steps,
            )
        except ValueError as exc:
            _fail(str(exc))
        print(exported.summary())
        print(f"in: INT64 'input_ids', 'attention_mask' [-1] (tokenize with the model's tokenizer); "
              f"out: FP32 'embedding' [{minilm.DIM}]")  # fmt: skip
        print(exported.config)
        return
    if args.precision != "fp32" or args.cuda_graph_tokens:
        _fail("--precision and --cuda-graph-tokens are for the torchscript and torch-export formats")
    if args.tokens:
        folder = minilm.build_token_onnx(Path(args.out), name=args.name or minilm.TOKENS_NAME, progress=steps)
        print(f"wrote {folder} (in: INT64 'input_ids', 'attention_mask' [-1]; out: FP32 'embedding' [{minilm.DIM}])")
    else:
        folder = minilm.build(Path(args.out), int8=int8, int8_full=args.int8_full, progress=steps)
        print(f"wrote {folder} (text in: BYTES 'text' [1]; out: FP32 'embedding' [{minilm.DIM}])")
    print((folder / "config.pbtxt").read_text())


def cmd_minilm_embed(args) -> None:
    import numpy as np

    from aiworks.lifecycle import minilm
    from aiworks.lifecycle.layout import find_onnx

    model = find_onnx(Path(args.model) / args.version if args.version else Path(args.model))
    vectors = minilm.embed(model, args.text)
    print(f"{model}: {vectors.shape[0]} embeddings of {vectors.shape[1]} floats")
    sims = vectors @ vectors.T
    for i, text in enumerate(args.text):
        print(f"  [{i}] {text[:60]!r}: " + " ".join(f"{s:.3f}" for s in sims[i]))
    if args.json:
        print(json.dumps(np.round(vectors, 6).tolist()))


# ---- llm -------------------------------------------------------------------------------------


def cmd_llm_build(args) -> None:
    from aiworks.lifecycle import llm

    spec = llm.LlmSpec(layers=args.layers, steps=args.steps, random=args.random, seed=args.seed)
    cache = None if args.no_cache else Path(args.cache_dir)
    folder, report = llm.build(
        Path(args.out), spec, name=args.name, cache_dir=cache, progress=not args.quiet,
        kv_budget_tokens=args.kv_budget_tokens, max_sequences=args.max_sequences, threads=args.threads,
        instances=args.instances, precision=args.precision,
    )  # fmt: skip
    print(f"wrote {folder} (text_input BYTES [1] in, text_output BYTES [1] per token out; decoupled)")
    print(json.dumps(report))


# ---- parsers ---------------------------------------------------------------------------------


def add_lifecycle_parsers(sub) -> None:
    """Register ``convert``, ``optimize``, ``split`` and ``minilm`` on an argparse subparsers object."""
    fmt = argparse.RawDescriptionHelpFormatter

    cv = sub.add_parser(
        "convert",
        help="convert a PyTorch, scikit-learn, TensorFlow or ONNX model to a Triton-layout ONNX model folder",
        formatter_class=fmt,
        description="Writes OUT/NAME/config.pbtxt and OUT/NAME/1/model.onnx, checks the graph, compares it with\n"
        "the source framework on a sample input, and prints an operator-compatibility report.\n"
        f"Exit status {EXIT_UNSUPPORTED_OPS}: converted, but some operators are unsupported on the target.",
    )
    cv.add_argument(
        "source", help=".pt/.pth (TorchScript or pickled module), .pkl/.joblib, .keras/.h5 or SavedModel, .onnx"
    )
    cv.add_argument("--out", required=True, help="model repository to write the model folder into")
    cv.add_argument("--name", help="model name (default: the source file's stem)")
    cv.add_argument("--framework", default="auto", choices=["auto", "pytorch", "sklearn", "tensorflow", "onnx"])
    cv.add_argument(
        "--input",
        action="append",
        metavar="[NAME:]SHAPE[:DTYPE]",
        help="example input for tracing, batch first, e.g. input:1x3x224x224:float32 (repeat per input; "
        "PyTorch needs it)",
    )
    cv.add_argument("--output-name", action="append", help="output name (repeat per output; PyTorch only)")
    cv.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    cv.add_argument("--target", default="onnxruntime-cpu", choices=["onnxruntime-cpu", "tensorrt"])
    cv.add_argument("--max-batch-size", type=int, default=64, help="config max_batch_size when the graph batches")
    cv.add_argument("--no-progress", action="store_true", help="no step lines on stderr")
    cv.set_defaults(func=cmd_convert)

    op = sub.add_parser(
        "optimize",
        help="build graph-optimized, INT8 and FP16 variants and measure them against the original",
        formatter_class=fmt,
        description="Variants: optimized (ONNX Runtime offline graph optimization), int8-dynamic, int8-static\n"
        "(calibrated), fp16. Each is measured for size, latency at batch 1 and 32, accuracy on\n"
        "held-out data and agreement with the original. Writes OUT/report.md and OUT/report.json.",
    )
    op.add_argument("model", help="an .onnx file or a model folder (its latest version)")
    op.add_argument(
        "--data",
        help="'digits' (the demo's test split) or an .npz with x (or one array per input name) and optional y",
    )
    op.add_argument("--calibration", help=".npz of calibration inputs for int8-static (default: x_calib in --data)")
    op.add_argument("--out", required=True, help="folder for the variants and the report")
    op.add_argument("--variants", help="comma-separated subset of optimized,int8-dynamic,int8-static,fp16")
    op.add_argument("--output", help="output to score (default: 'label' if present, else the first)")
    op.add_argument("--repeats", type=int, default=50, help="timed runs per batch size (default 50)")
    op.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (default 1)")
    op.add_argument("--no-progress", action="store_true", help="no progress bars")
    trt = op.add_argument_group(
        "TensorRT engine (--tensorrt)",
        f"needs the tensorrt package and an NVIDIA GPU; exit status {EXIT_NO_TENSORRT} says one is missing",
    )
    trt.add_argument("--tensorrt", action="store_true", help="build OUT/NAME/1/model.plan for Triton instead")
    trt.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16", "bf16", "int8"])
    trt.add_argument("--name", help="model name (default: the model's name + _trt)")
    trt.add_argument("--max-batch-size", type=int, default=64, help="largest batch the engine takes (default 64)")
    trt.add_argument("--profile", action="append", metavar="NAME:MIN/OPT/MAX",
                     help="shapes of a dynamic input, batch first, e.g. input_ids:1x16/32x128/64x128")  # fmt: skip
    op.set_defaults(func=cmd_optimize)

    sp = sub.add_parser(
        "split",
        help="cut an ONNX graph at named tensors into stages, one model folder each",
        formatter_class=fmt,
        description="Writes OUT/NAME_stage1 ... and reports bytes sent between stages against the raw input, and\n"
        "latency against the unsplit model (in-process). --list shows the tensors a cut can name.\n"
        "--pipeline NAME also writes OUT/NAME, an ensemble of the stages the suite serves as one model.",
    )
    sp.add_argument("model", help="an .onnx file or a model folder (its latest version)")
    sp.add_argument("--list", action="store_true", help="list intermediate tensors with their shapes and exit")
    sp.add_argument(
        "--cut", action="append", metavar="TENSOR[,TENSOR...]", help="one cut point (repeat for more stages)"
    )
    sp.add_argument("--out", help="model repository to write the stage folders into")
    sp.add_argument("--name", help="base model name (default: the model's name)")
    sp.add_argument("--data", help="'digits' or an .npz for the report (default: random inputs)")
    sp.add_argument("--batch", type=int, default=32, help="rows measured in the report (default 32)")
    sp.add_argument("--report", help="also save the report as JSON to this file")
    sp.add_argument("--max-batch-size", type=int, default=64)
    sp.add_argument(
        "--pipeline", metavar="NAME", help="also write a pipeline model NAME chaining the stages (served by the suite)"
    )
    sp.add_argument(
        "--micro-batch-rows",
        type=int,
        default=0,
        help="pipeline requests with more rows flow through the stages in micro-batches of this many (default: whole)",
    )
    sp.set_defaults(func=cmd_split)

    ml = sub.add_parser("minilm", help="the MiniLM-L6 sentence-embedding model (text in, embeddings out)")
    ml_sub = ml.add_subparsers(dest="minilm_command", metavar="ACTION", required=True)
    mb = ml_sub.add_parser(
        "build",
        help="write a Triton-layout MiniLM model folder: ONNX (tokenizer in the graph) or PyTorch",
        formatter_class=fmt,
        description="--format onnx (default) writes 'minilm': text in, the tokenizer inside the graph.\n"
        "--format torchscript or torch-export writes 'minilm_torch' for the runtime's pytorch backend\n"
        "(platform pytorch_libtorch, model.pt): token ids in. --tokens writes the ONNX encoder with token\n"
        "ids in ('minilm_tokens'), the pytorch model's twin on ONNX Runtime.",
    )
    mb.add_argument("--out", required=True, help="model repository to write the model folder into")
    mb.add_argument("--format", default="onnx", choices=["onnx", "torchscript", "torch-export"])
    mb.add_argument("--name", help="model name (default: minilm, minilm_torch or minilm_tokens)")
    mb.add_argument("--tokens", action="store_true", help="ONNX with token ids in, no tokenizer (--format onnx)")
    mb.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                    help="what the pytorch backend computes in (PyTorch formats)")  # fmt: skip
    mb.add_argument("--cuda-graph-tokens", type=int, metavar="N",
                    help="CUDA graphs for batches padded to N tokens, on a GPU (PyTorch formats)")  # fmt: skip
    mb.add_argument("--int8", action="store_true", help="add version 2: per-channel INT8 (FFN down-projections FP32)")
    mb.add_argument(
        "--int8-full", action="store_true", help="version 2 with every MatMul in INT8 (faster, cosine ~0.985)"
    )
    mb.add_argument("--no-progress", action="store_true", help="no step lines on stderr")
    mb.set_defaults(func=cmd_minilm_build)
    ll = sub.add_parser("llm", help="the codegen decoder: a small GPT-2 trained on the Python standard library")
    ll_sub = ll.add_subparsers(dest="llm_command", metavar="ACTION", required=True)
    lb = ll_sub.add_parser(
        "build", help="train (cached) and export the codegen model for the runtime's llm backend",
        description="Trains a byte-level BPE and a GPT-2 decoder on the standard library's source on the CPU\n"
        "(cached under --cache-dir), exports it to ONNX with its KV cache, and writes <out>/<name>.",
        formatter_class=fmt,
    )  # fmt: skip
    lb.add_argument("--out", default="model-repository", help="model repository to write the model folder into")
    lb.add_argument("--name", default="codegen", help="model name (default: codegen)")
    lb.add_argument("--steps", type=int, default=400, help="training steps (default 400: ~3 min on 2 idle cores)")
    lb.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    lb.add_argument("--seed", type=int, default=0)
    lb.add_argument("--random", action="store_true", help="random weights, no training (tests and benchmarks)")
    lb.add_argument("--cache-dir", default=".aiworks/cache/llm", help="where trained weights are kept between builds")
    lb.add_argument("--no-cache", action="store_true", help="neither read nor keep the trained weights")
    lb.add_argument("--kv-budget-tokens", type=int, default=16384, help="the replica's KV-cache budget in tokens")
    lb.add_argument("--max-sequences", type=int, default=32, help="sequences decoded together at most")
    lb.add_argument("--threads", type=int, default=1,
                    help="ONNX Runtime intra-op threads of each instance's decoder (default 1)")
    lb.add_argument("--instances", type=int, default=2,
                    help="engines side by side in a replica (instance_group count; default 2), sharing its KV budget "
                    "and sequences evenly")  # fmt: skip
    lb.add_argument("--precision", choices=["fp32", "int8"], default="fp32",
                    help="the exported decoder's matrix products: fp32 (default: the trained weights as they are) or "
                    "int8 (dynamic quantization, per-channel weights: 2-3x faster on a CPU with VNNI); the report's "
                    "served_held_out_loss says what it costs")  # fmt: skip
    lb.add_argument("--quiet", action="store_true", help="no progress bar")
    lb.set_defaults(func=cmd_llm_build)
    me = ml_sub.add_parser("embed", help="embed sentences with a built model, in-process, and show similarities")
    me.add_argument("text", nargs="+")
    me.add_argument("--model", default="model-repository/minilm", help="the minilm model folder or an .onnx")
    me.add_argument("--version", help="version folder (default: the latest)")
    me.add_argument("--json", action="store_true", help="also print the embeddings as JSON")
    me.set_defaults(func=cmd_minilm_embed)
