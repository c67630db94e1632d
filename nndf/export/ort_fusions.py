"""ONNX Runtime's fused kernels in the shared-layout decoder graph: fewer, larger nodes for a decode step, and a
lighter load.

Why: at batch 1 every node costs its dispatch whatever its size, so a small or quantized model pays most. The
exporter writes each RMSNorm as seven nodes, each rotary embedding as a dozen (two Slices, Neg, Concat, two Muls,
Add, with a Reshape and a Transpose on either side), and each head split it undoes as two Reshapes: SmolLM2-135M's
exported decode step had 1739 nodes where GPT-2 small's has 474.

- Normalizations: onnxscript's own `ort_fusions` rules (those `onnxscript.rewriter.ort_fusions.optimize_for_ort`
  applies) turn each RMSNorm, with the residual Add before it, into ONNX Runtime's
  SkipSimplifiedLayerNormalization. A LayerNorm stays `LayerNormalization` after its Add: ONNX Runtime's CPU
  kernel for SkipLayerNormalization is 3-5x slower than the two nodes on a prompt (64 rows of GPT-2's 768, 2
  threads: 170 against 51 us; one thread 330 against 64) and no faster on a decode step (18.7 against 15.2 us), so
  GPT-2 small's first token is 3-5% shorter without it (0.966x at batch 1, 0.954x at batch 4; decode steps 0.989x
  and 1.000x: bench/README.md). ONNX Runtime's own SkipLayerNormFusion, which would fuse some pairs at load,
  is off in our CPU sessions (`nndf.backends.ort_runtime.CPU_DISABLED_OPTIMIZERS`). The RMS norm's fused kernel
  is as fast as its two nodes (27.8 against 26.4 us at 64 rows of 576).
- Rotary embeddings: the rules below, as ONNX Runtime's RotaryEmbedding (com.microsoft). onnxscript's rotary rule
  matches our graphs, but its cos/sin cache rule, which makes the kernel's inputs, needs the tables to be computed
  from constant frequencies and does not match; its intermediate op is inlined back into the same small ops. Here
  the kernel is fed the model's own cos and sin instead, whatever scaling the family applies (Llama 3's, longrope,
  an attention factor): the (rows, length, size) tables of this step are flattened to a cache of rows * length
  entries and each position reads its own entry (position ids 0 .. rows * length - 1). This holds for the
  rotate-half convention, whose tables repeat their first half (`cat(freqs, freqs)`), the one whose pattern
  (`x * cos + rotate_half(x) * sin`) the rules match; interleaved rotaries (GPT-J's) do not match and stay as they
  are. Where the rotated heads come straight from a projection and go straight back, the kernel takes the
  projection's (batch, sequence, heads * size) output and the split, the two Transposes and the merge go.
- A Reshape that only undoes the Reshape before it (symbolic shapes equal) goes.
- Attention whose query, key and value are the parts of one Split takes the projection's output whole, as packed
  QKV, and rotates its queries and keys itself where RotaryEmbeddings did (`nndf.export.attention_inputs`).
- A tied LM head becomes a screened one (`nndf.export.screened_head`): greedy search and top-k sampling read an
  int8 copy and a few exact rows of the embedding table, and the full head reads the table itself (no copy).
- A MatMul over a weight larger than 32 MiB (an untied LM head) becomes MatMuls over column chunks of it and a
  Concat: not fewer nodes, but a load that no longer peaks at that weight's size (`split_large_weights`).

Only the shared layout gets these: its graph is ONNX Runtime's alone (contrib ops), where the growing graph is also
what TensorRT builds engines from. A rule that does not match leaves the graph as it is; every family's parity
test checks the result.
"""

from __future__ import annotations

from onnxscript.rewriter import _ir_utils, pattern
from onnxscript.rewriter.ort_fusions.rotary_embedding import _rotate_half_pattern

from nndf.export.attention_inputs import SWAP_HEADS, pack_attention_inputs, rotate_in_attention
from nndf.export.screened_head import screen_head



def _known(dim) -> bool:
    return isinstance(dim, int) or getattr(dim, "value", None) is not None


def _same_shape(a, b) -> bool:
    """Shapes known to be equal: same rank, every dimension a number or a named symbol, equal one by one."""
    return (a is not None and b is not None and len(a) == len(b) and all(_known(d) for d in a)
            and all(p == q for p, q in zip(a, b)))


def _rotate_half_refusal(x, start1, end1, start2, end2) -> str | None:
    """Why `x` (the rotated input) and its two Slices are not a rotate-half of (batch, heads, sequence, size)."""
    if x is None or x.shape is None or len(x.shape) != 4:
        return "not a 4D (batch, heads, sequence, size) input"
    heads, size = x.shape[1], x.shape[3]
    if not (isinstance(heads, int) and isinstance(size, int) and size % 2 == 0):
        return "number of heads or head size unknown"
    half = size // 2
    if not (_ir_utils.is_singleton_value(start1, 0) and _ir_utils.is_singleton_value(end1, half)
            and _ir_utils.is_singleton_value(start2, half)
            and _ir_utils.is_singleton_value(end2, lambda end: end >= size)):
        return "not split into two halves"
    return None


def _rotate_half_rotary(op, x, cos, sin, start1, end1, start2, end2):
    """The model's rotary embedding as the exporter writes it: `x * cos + rotate_half(x) * sin`."""
    return x * cos + _rotate_half_pattern(op, x, start1, end1, start2, end2) * sin


def _rotary_embedding(op, x, cos, sin, heads: int, size: int):
    """RotaryEmbedding of `x` (3D (batch, sequence, heads * size) or 4D (batch, heads, sequence, size)) with the
    model's own tables (rows, [1,] length, size) as a cache of rows * length entries."""
    half = size // 2
    first_half = lambda table: op.Reshape(  # noqa: E731
        op.Slice(table, op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), op.Constant(value_ints=[-1])),
        op.Constant(value_ints=[-1, half]))
    rows, length = op.Shape(cos, start=0, end=1), op.Shape(cos, start=-2, end=-1)
    entries = op.Squeeze(op.Mul(rows, length), op.Constant(value_ints=[0]))
    positions = op.Range(op.Constant(value_int=0), entries, op.Constant(value_int=1))
    positions = op.Reshape(positions, op.Concat(rows, length, axis=0))
    if not (_known(cos.shape[0]) and cos.shape[0] == x.shape[0]):  # tables shared by the batch's rows
        positions = op.Expand(positions, op.Concat(op.Shape(x, start=0, end=1), length, axis=0))
    return op.RotaryEmbedding(x, positions, first_half(cos), first_half(sin), interleaved=0, num_heads=heads,
                              _domain="com.microsoft")


class _Rotary(pattern.RewriteRuleClassBase):
    """`x * cos + rotate_half(x) * sin` on (batch, heads, sequence, size) as one RotaryEmbedding."""

    def pattern(self, op, x, cos, sin, start1, end1, start2, end2):
        return _rotate_half_rotary(op, x, cos, sin, start1, end1, start2, end2)

    def check(self, context, x, start1, end1, start2, end2, **_):
        result = pattern.MatchResult()
        if (why := _rotate_half_refusal(x, start1, end1, start2, end2)) is not None:
            return result.fail(why)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        return _rotary_embedding(op, x, cos, sin, x.shape[1], x.shape[3])


class _ProjectionRotary(pattern.RewriteRuleClassBase):
    """A projection's (batch, sequence, heads * size) split into heads, rotated and merged back: one RotaryEmbedding
    of the projection itself."""

    def pattern(self, op, y, split_shape, merge_shape, cos, sin, start1, end1, start2, end2):
        x = op.Transpose(op.Reshape(y, split_shape, _outputs=["split"]), perm=SWAP_HEADS, _outputs=["x"])
        rotated = _rotate_half_rotary(op, x, cos, sin, start1, end1, start2, end2)
        return op.Reshape(op.Transpose(rotated, perm=SWAP_HEADS), merge_shape, _outputs=["merged"])

    def check(self, context, y, split, x, merged, start1, end1, start2, end2, **_):
        result = pattern.MatchResult()
        if (why := _rotate_half_refusal(x, start1, end1, start2, end2)) is not None:
            return result.fail(why)
        heads, size = x.shape[1], x.shape[3]
        if not (_same_shape(y.shape, merged.shape) and len(y.shape) == 3 and y.shape[2] == heads * size
                and split.shape is not None and len(split.shape) == 4
                and _same_shape(split.shape, [y.shape[0], y.shape[1], heads, size])):
            return result.fail("not a split of the last dimension into heads and back")
        return result

    def rewrite(self, op, y, x, cos, sin, **_):
        return _rotary_embedding(op, y, cos, sin, x.shape[1], x.shape[3])


class _ReshapeUndone(pattern.RewriteRuleClassBase):
    """Reshape(Reshape(y, a), b) with the shape of y: y itself."""

    def pattern(self, op, y, first, second):
        return op.Reshape(op.Reshape(y, first), second, _outputs=["out"])

    def check(self, context, y, out, **_):
        result = pattern.MatchResult()
        if not _same_shape(y.shape, out.shape):
            return result.fail("not back to the input's shape")
        return result

    def rewrite(self, op, y, **_):
        return op.Identity(y)


def merge_sibling_matmuls(model) -> int:
    """MatMuls that multiply the same input by constant 2-D weights of the same K (a layer's query, key and value
    projections; its gate and up projections) as one MatMul over the weights side by side and a Split of its
    output: at batch 1 each MatMul is a pass over its weights and a dispatch to the thread pool, and one longer pass
    is cheaper than three short ones (SmolLM2 fp32 -7% per decode step). Exact: each output column is the same dot
    product, and a quantizer's blocks run along K, so the quantized weights are those of the separate MatMuls.
    Returns how many groups were merged."""
    import numpy as np
    import onnx_ir as ir

    graph = model.graph
    siblings: dict = {}
    for node in graph:
        weight = node.inputs[1] if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2 else None
        if weight is not None and weight.const_value is not None and weight.shape is not None \
                and len(weight.shape) == 2:
            siblings.setdefault(node.inputs[0], []).append(node)
    outputs = set(graph.outputs)
    merged = 0
    for source, nodes in siblings.items():
        weights = [node.inputs[1].const_value.numpy() for node in nodes]
        if len(nodes) < 2 or len({(w.shape[0], w.dtype) for w in weights}) != 1 \
                or any(node.outputs[0] in outputs for node in nodes):
            continue
        name = f"{nodes[0].name}_siblings"
        joined = ir.Value(name=f"{name}.weight", const_value=ir.tensor(np.concatenate(weights, axis=1),
                                                                     name=f"{name}.weight"))
        widths = ir.Value(name=f"{name}.widths", const_value=ir.tensor(np.array([w.shape[1] for w in weights],
                                                                                np.int64), name=f"{name}.widths"))
        graph.register_initializer(joined)
        graph.register_initializer(widths)
        matmul = ir.Node("", "MatMul", [source, joined], name=name)
        # typed as its parts are, so that a later rule (split_large_weights) and the optimizer know it
        width = sum(w.shape[1] for w in weights)
        _type_as(matmul.outputs[0], nodes[0].outputs[0].dtype,
                 None if source.shape is None else ir.Shape([*source.shape[:-1], width]))
        split = ir.Node("", "Split", [matmul.outputs[0], widths], [ir.AttrInt64("axis", -1)],
                        num_outputs=len(nodes), name=f"{name}_split")
        graph.insert_before(nodes[0], [matmul, split])
        for node, part in zip(nodes, split.outputs):
            part.name = f"{node.outputs[0].name}_part"
            _type_as(part, node.outputs[0].dtype, node.outputs[0].shape)
            ir.convenience.replace_all_uses_with(node.outputs[0], part)
        graph.remove(nodes, safe=True)
        merged += 1
    return merged


def _type_as(value, dtype, shape) -> None:
    """Give a new node's output the dtype and shape known of the value it replaces; an unknown one stays unset (a
    dtype set to None is an empty tensor type, on which the optimizer's constant folding fails)."""
    if dtype is not None:
        value.dtype = dtype
    if shape is not None:
        value.shape = shape


WEIGHT_CHUNK_BYTES = 32 << 20  # the most one weight of a MatMul may hold in the shared graph (split_large_weights)


def _constant_weight(value):
    """The 2-D array a MatMul's weight input holds: an initializer, or the Transpose of one (a tied LM head, whose
    table the embedding's Gather reads in its own orientation); None for anything else."""
    if value.const_value is not None:
        array = value.const_value.numpy()
        return array if array.ndim == 2 else None
    producer = value.producer()
    if producer is None or producer.op_type != "Transpose" or producer.domain != "" or \
            producer.inputs[0].const_value is None:
        return None
    array = producer.inputs[0].const_value.numpy()
    perm = producer.attributes.get("perm")
    return array.T if array.ndim == 2 and (perm is None or list(perm.as_ints()) == [1, 0]) else None


def split_large_weights(model, chunk_bytes: int | None = None) -> int:
    """MatMuls over a constant weight larger than `chunk_bytes` as several MatMuls over column chunks of it and a
    Concat of their outputs: ONNX Runtime prepacks each constant weight into a copy of its own and frees the original
    afterwards, so a session's load peaks at its largest weight above the steady memory. That weight is the LM head
    (SmolLM2-135M: 113 MB; GPT-2 small: 154 MB), and a tied head is worse: it is the embedding table transposed by
    constant folding, a third copy for the while. Chunks written to the file pre-transposed load, pack and go one by
    one (SmolLM2's session: 681 -> 600 MiB peak in four chunks, steady 573 either way); the table stays for the
    embedding's Gather, which reads one row per token. (In the shared layout a tied head is screened first and
    reads the table itself, so no longer comes here: `nndf.export.screened_head`.) Exact: each output column is the
    same dot product over K. Returns how many MatMuls were split."""
    import numpy as np
    import onnx_ir as ir

    limit = WEIGHT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    graph = model.graph
    split = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
            continue
        weight = _constant_weight(node.inputs[1])
        if weight is None or weight.nbytes <= limit:
            continue
        parts, products, base = [], [], node.name or node.outputs[0].name
        for index, columns in enumerate(np.array_split(weight, -(-weight.nbytes // limit), axis=1)):
            name = f"{base}_chunk{index}"
            chunk = ir.Value(name=f"{name}.weight", const_value=ir.tensor(np.ascontiguousarray(columns),
                                                                          name=f"{name}.weight"))
            graph.register_initializer(chunk)
            parts.append(ir.Node("", "MatMul", [node.inputs[0], chunk], name=name))
            products.append(parts[-1].outputs[0])
        joined = ir.Node("", "Concat", products, [ir.AttrInt64("axis", -1)], name=f"{base}_chunks")
        old = node.outputs[0]
        _type_as(joined.outputs[0], old.dtype, old.shape)
        ir.convenience.replace_nodes_and_values(graph, node, [node], [*parts, joined], [old], joined.outputs)
        split += 1
    return split


def fuse_for_onnxruntime(model) -> dict[str, int]:
    """Apply the rules to an onnx_ir model in place, one after another (a rule set tries its rules node by node,
    and the plain rotary would match inside a projection's before the larger pattern is seen); how many times each
    applied."""
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    own = lambda rule: pattern.RewriteRuleSet([rule.rule()]).apply_to_model  # noqa: E731
    rules = (("rms_normalization", fuse_rms_normalization),  # onnxscript's, named as `fuse_xformers` reports them
             ("skip_rms_normalization", fuse_skip_rms_normalization),
             ("projection_rotary_embedding", own(_ProjectionRotary)), ("rotary_embedding", own(_Rotary)),
             ("reshape_undone", own(_ReshapeUndone)), ("sibling_matmuls", merge_sibling_matmuls),
             ("screened_head", screen_head), ("large_weights", split_large_weights))
    counts = {name: rule(model) for name, rule in rules}
    optimize(model)  # inlines what a rule left as an intermediate function, drops unused nodes, merges equal ones
    # on the optimized graph: a Split meets its GroupQueryAttention only once the functions between them are inlined
    counts["rotary_in_attention"] = rotate_in_attention(model)
    counts["packed_attention"] = pack_attention_inputs(model)
    return counts
