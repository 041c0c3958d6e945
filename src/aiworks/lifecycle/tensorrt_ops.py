"""The ONNX operators the TensorRT ONNX parser accepts: a declared list, shipped as data.

TensorRT is not installed on CPU machines, so its support cannot be asked at
run time. This list follows the operator table of the onnx-tensorrt parser
for TensorRT 10 (default ``ai.onnx`` domain only: TensorRT parses no
``ai.onnx.ml`` operators and no string tensors). Ops it lists with
restrictions (for example Loop, Scan, If, NonZero) count as supported here;
the report says so, and trtexec has the final word.
"""

TENSORRT_VERSION = "10.x"

TENSORRT_OPS = frozenset(
    """
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool
    BatchNormalization BlackmanWindow Cast CastLike Ceil Celu Clip Compress Concat ConcatFromSequence
    Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace DequantizeLinear
    Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor
    Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool
    Greater GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow HardSigmoid
    HardSwish Hardmax Identity If InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu
    Less LessOrEqual Log LogSoftmax Loop LpNormalization LpPool LRN LSTM MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
    Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range
    Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd
    ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign Round Scan Scatter
    ScatterElements ScatterND Selu SequenceAt SequenceConstruct SequenceEmpty SequenceErase
    SequenceInsert SequenceLength Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus
    Softsign SpaceToDepth Split SplitToSequence Sqrt Squeeze STFT Sub Sum Tan Tanh ThresholdedRelu
    Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
    """.split()
)

# Ops whose TensorRT support carries restrictions worth a line in the report.
TENSORRT_RESTRICTED = {
    "Loop": "supported with restrictions on scan outputs",
    "Scan": "supported with restrictions",
    "If": "the condition must be an initializer or a build-time constant for best results",
    "NonZero": "data-dependent output shape",
    "NonMaxSuppression": "data-dependent output shape",
    "Cast": "no casts to or from string",
    "Resize": "not every coordinate_transformation_mode is supported",
}
