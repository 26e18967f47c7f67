"""Op tables: the op types the row reader knows, by how they treat rows.

The rule. An op's type says how its output's rows follow from its inputs':
elementwise (each element from the same position of the inputs), within
each row (a layer, a softmax), a reduction, a segment or sparse segment
reduction, a batch norm, a shape, an op shaped by its `shape` input, a
function or control flow op the reader cannot see inside, an assignment to
a variable. These tables only name the types; the readers (`elementwise`,
`statistics`, `sizes`, `stacked`, `flat`) say what each makes of the rows.
A type missing from every table is an op the library does not know: it
counts as mixing the batch's rows, never as per-example.
"""

# Elementwise arithmetic (with broadcasting): each output element from the
# same position of the inputs, so a copy onto other values of the same
# layout (the whole batch's, a tower's rows) is the same op on them
# (`loss_algebra` and `row_wise_head` rebuild these).
ARITHMETIC = frozenset((
    'Identity', 'StopGradient', 'Cast', 'AddV2', 'Add', 'AddN', 'Sub', 'Mul', 'MulNoNan',
    'RealDiv', 'Div', 'DivNoNan', 'Maximum', 'Minimum', 'Neg', 'Square', 'Sqrt', 'Rsqrt',
    'Exp', 'Log', 'Log1p', 'Pow', 'Abs', 'Reciprocal', 'Inv', 'Tanh', 'Sigmoid', 'Softplus',
    'SquaredDifference', 'Select', 'SelectV2', 'Floor', 'Ceil', 'Round', 'Relu',
    'ClipByValue', 'Equal', 'NotEqual', 'Less', 'LessEqual', 'Greater', 'GreaterEqual',
    'LogicalAnd', 'LogicalOr', 'LogicalNot'))
# Ops applied elementwise (with broadcasting) or within each row.
ELEMENTWISE = ARITHMETIC | frozenset((
    'PreventGradient', 'OptionalFromValue', 'CheckNumerics', 'EnsureShape', 'Snapshot', 'Bitcast', 'FloorDiv',
    'FloorMod', 'Mod', 'TruncateDiv', 'Expm1', 'Sign', 'Softsign', 'Rint', 'Relu6', 'Elu',
    'Selu', 'LeakyRelu', 'Gelu', 'IsNan', 'IsInf', 'IsFinite', 'Erf', 'Erfc', 'Sin', 'Cos',
    'Atan2', 'Xlogy', 'Xdivy', 'Sinh', 'Cosh', 'Atan', 'Asin', 'Acos', 'Tan', 'Lgamma',
    'Digamma', 'Softmax', 'LogSoftmax', 'BiasAdd', 'BiasAddV1',
    'SoftmaxCrossEntropyWithLogits', 'SparseSoftmaxCrossEntropyWithLogits', 'InTopKV2',
    'ZerosLike', 'OnesLike', 'IdentityN', 'L2Normalize', 'ApproximateEqual', 'BitwiseAnd',
    'BitwiseOr', 'BitwiseXor', 'Invert', 'LeftShift', 'RightShift', 'Real', 'Imag', 'Complex',
    'ComplexAbs', 'Conj', 'BroadcastGradientArgs', 'StringToHashBucketFast', 'AsString',
    'OneHot', 'Bucketize', 'Betainc', 'Igamma', 'Igammac', 'Zeta', 'SigmoidGrad', 'TanhGrad',
    'ReluGrad', 'SoftplusGrad', 'RsqrtGrad', 'SqrtGrad', 'StringLength', 'StringToNumber',
    'StringToHashBucket', 'StringToHashBucketStrong', 'StringLower', 'StringUpper',
    'StringStrip', 'RegexFullMatch', 'StaticRegexFullMatch', 'RegexReplace',
    'StaticRegexReplace', 'Substr'))
# Segment reductions: (data, segment_ids[, num_segments]).
SEGMENT_SUMS = frozenset(('UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin',
                          'UnsortedSegmentProd', 'SegmentSum', 'SegmentMean', 'SegmentMax',
                          'SegmentMin', 'SegmentProd'))
# Layers: input 0 is rows, the others (filters, pooling sizes) must not depend on the batch.
LAYERS = frozenset((
    'Conv2D', 'Conv3D', 'Conv1D', 'DepthwiseConv2dNative', 'MaxPool', 'MaxPoolV2', 'AvgPool',
    'MaxPool3D', 'AvgPool3D', 'LRN', 'Conv2DBackpropInput', 'ResizeBilinear',
    'ResizeNearestNeighbor', 'ResizeBicubic', 'SpaceToDepth', 'DepthToSpace',
    'ExtractImagePatches', 'Dilation2D', 'NearestNeighbors'))
# Sparse segment reductions: (data, indices, segment_ids[, num_segments]).
SPARSE_SEGMENTS = frozenset((
    'SparseSegmentSum', 'SparseSegmentMean', 'SparseSegmentSqrtN',
    'SparseSegmentSumWithNumSegments', 'SparseSegmentMeanWithNumSegments',
    'SparseSegmentSqrtNWithNumSegments'))
FUSED_BATCH_NORMS = frozenset(('FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'))
REDUCTIONS = frozenset(('Sum', 'Mean', 'Max', 'Min', 'Prod', 'All', 'Any', 'EuclideanNorm'))
# The size of the shard's rows (a shape op reads the rows' shape, not their values).
SHAPES = frozenset(('Shape', 'ShapeN'))
# Ops whose `shape` input (index) makes their output's rows.
SHAPED = {'Fill': 0, 'RandomUniform': 0, 'RandomStandardNormal': 0, 'TruncatedNormal': 0,
          'RandomUniformInt': 0, 'StatelessRandomUniformV2': 0, 'StatelessRandomNormalV2': 0,
          'StatelessRandomUniform': 0, 'StatelessRandomNormal': 0,
          'StatelessTruncatedNormal': 0, 'StatelessTruncatedNormalV2': 0,
          'StatelessRandomUniformIntV2': 0, 'BroadcastTo': 1, 'Zeros': 0}
# Function calls and functional control flow: the reader cannot see inside (but a tf.cond's
# branches: `reader`; loops and function calls: `loops`).
FUNCTIONS = frozenset(('PartitionedCall', 'StatefulPartitionedCall', 'If', 'StatelessIf',
                       'While', 'StatelessWhile', 'Case', 'StatelessCase', 'PyFunc',
                       'PyFuncStateless', 'EagerPyFunc'))
# Assignments to a variable: (variable, value, ...), what a metric's update does.
ASSIGNS = frozenset(('AssignAddVariableOp', 'AssignSubVariableOp', 'AssignVariableOp',
                     'AssignAdd', 'AssignSub', 'Assign', 'ResourceScatterAdd', 'ScatterAdd',
                     'ResourceScatterUpdate', 'ScatterUpdate'))
# Batched linear algebra: each op on every matrix of its [..., m, m] inputs alone.
BATCHED_MATRICES = frozenset((
    'MatrixInverse', 'Cholesky', 'MatrixDeterminant', 'LogMatrixDeterminant', 'MatrixSolve',
    'MatrixTriangularSolve', 'MatrixSolveLs', 'Qr', 'Svd', 'SelfAdjointEigV2', 'Eig',
    'MatrixExponential', 'MatrixLogarithm', 'MatrixSquareRoot', 'Lu', 'TridiagonalSolve',
    'TridiagonalMatMul', 'BandedTriangularSolve', 'BatchMatrixInverse', 'BatchCholesky',
    'BatchMatrixDeterminant', 'BatchMatrixSolve', 'BatchMatrixTriangularSolve',
    'BatchMatrixSolveLs', 'BatchSelfAdjointEigV2', 'BatchSvd'))
# Heavy ops: matrix products, einsums, convolutions and the ops of their gradients (what a
# device's share of a step is counted in: `reporting.work_share`, `cross_example='refuse'`).
HEAVY = frozenset((
    'MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3', 'Einsum', 'Conv1D', 'Conv2D',
    'Conv2DBackpropInput', 'Conv2DBackpropFilter', 'Conv3D', 'Conv3DBackpropInputV2',
    'Conv3DBackpropFilterV2', 'DepthwiseConv2dNative', 'DepthwiseConv2dNativeBackpropInput',
    'DepthwiseConv2dNativeBackpropFilter', 'SparseTensorDenseMatMul', 'SparseMatMul'))
