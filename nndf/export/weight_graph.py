"""Rewrites of an exported graph that put every weight matrix where ONNX Runtime's quantizers can take it.

What the exporter gives us (torch dynamo exporter, optimize=True; inspected on GPT-2): every Conv1D (attention
qkv and output projections, MLP up and down) is a 2-D `Gemm(Reshape(x, [-1, K]), W[K, N], bias)` followed by a
Reshape back to 3-D, with alpha = beta = 1 and no transposes (the bias input is absent when it was all zeros, as
in randomly initialised models); attention's two MatMuls multiply activations; and the tied LM head is
`MatMul(h, Transpose(wte))`, whose output is `logits`, with `wte` the one initializer the embedding `Gather` also
reads. Hence, on a copy of the graph and before quantizing (`prepare_graph`):

1. Each `Gemm` with a constant weight becomes `MatMul(x, W)` (+ `Add(bias)`) under the Gemm's output name: ORT's
   weight-only quantizer handles MatMul only ("Unsupported operator Gemm for weight only quantization"), and
   restricting both quantizers to one op type keeps them off everything else. transB = 1 transposes the constant;
   a Gemm with other alpha/beta/transA, or whose weight is not a constant, stays in fp32 (and is reported). When
   the shapes the exporter recorded prove it, the Reshapes to 2-D and back are dropped too (MatMul broadcasts over
   leading dims): 6 of the 8 per GPT-2 layer, ~5% of a batch-1 decode step.
2. Each `MatMul(x, Transpose(W))` with a constant 2-D `W` reads its own constant `W.T` instead. Both quantizers
   need a constant weight and skip the tied LM head otherwise, yet it is the largest matrix of a small model (38 M
   of GPT-2 small's 124 M parameters: ~6 ms/step at batch 1). The Gather keeps the fp32 table, so embeddings stay
   exact; the price is a second (quantized) copy of the table in the file. An untied weight read only through
   the Transpose is replaced by its copy.
3. Nodes left unread (the Transposes, the shape arithmetic of dropped Reshapes) are removed.
"""

from __future__ import annotations


def node_attribute(node, name: str, default):
    """The value of a node's attribute, or `default` where the node leaves it out (ONNX's defaults are per op)."""
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def prepare_graph(model) -> dict[str, int]:
    """Rewrite `model` (an onnx ModelProto with its weights loaded) in place for weight quantization.

    Gemm -> MatMul (+ Add) and MatMul(x, Transpose(W)) -> MatMul(x, W.T) as in the module docstring; returns counts
    of what was rewritten and of what was left alone. Node output names, graph inputs and outputs do not change.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    used_names = {n.name for n in graph.node} | {o for n in graph.node for o in n.output} | set(inits)
    used_names |= {i.name for i in graph.input}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in used_names:
            name, k = f"{base}_{k}", k + 1
        used_names.add(name)
        return name

    copies: dict[str, str] = {}  # initializer -> its transposed copy (one however many nodes read it)

    def transposed(source: str) -> str:
        if source not in copies:
            copy = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(inits[source]).T),
                                           fresh(f"{source}.transposed"))
            graph.initializer.append(copy)
            inits[copy.name] = copy
            copies[source] = copy.name
        return copies[source]

    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*graph.value_info, *graph.input, *graph.output] if v.type.tensor_type.HasField("shape")}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in graph.output}

    def unflattened(node, k: int, n: int):
        """(x, y, reshapes) when `node` is Reshape(x, [-1, K]) -> node -> Reshape(., x.shape[:-1] + [N]) = y."""
        flatten = producers.get(node.input[0])
        after = readers.get(node.output[0], [])
        if flatten is None or flatten.op_type != "Reshape" or len(readers[node.input[0]]) != 1:
            return None
        if len(after) != 1 or after[0].op_type != "Reshape" or node.output[0] in outputs:
            return None
        x, y = flatten.input[0], after[0].output[0]
        source, target = shapes.get(x), shapes.get(y)
        if not source or not target or any(d in (0, "") for d in source + target):
            return None  # unknown dims: cannot prove that MatMul on x gives y's shape
        if len(source) < 2 or source[-1] != k or target != source[:-1] + [n]:
            return None
        return x, y, (flatten, after[0])

    counts = {"gemm_rewritten": 0, "gemm_left": 0, "transposed_weights": 0, "reshapes_removed": 0}
    dropped: set[int] = set()
    new_nodes = []
    for node in graph.node:
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        alpha, beta = node_attribute(node, "alpha", 1.0), node_attribute(node, "beta", 1.0)
        trans_a, trans_b = node_attribute(node, "transA", 0), node_attribute(node, "transB", 0)
        weight = node.input[1]
        if alpha != 1.0 or beta != 1.0 or trans_a or weight not in inits:
            counts["gemm_left"] += 1
            new_nodes.append(node)
            continue
        if trans_b:
            weight = transposed(weight)
        x, y = node.input[0], node.output[0]
        folded = unflattened(node, *inits[weight].dims)
        if folded is not None:  # MatMul broadcasts over leading dims: the Reshapes to 2-D and back are not needed
            x, y, reshapes = folded
            dropped.update(id(r) for r in reshapes)
            counts["reshapes_removed"] += 2
        has_bias = len(node.input) > 2 and node.input[2] != ""
        product = fresh(f"{y}_matmul") if has_bias else y
        stem = node.name or "gemm"
        new_nodes.append(helper.make_node("MatMul", [x, weight], [product], name=fresh(f"{stem}_MatMul")))
        if has_bias:
            new_nodes.append(helper.make_node("Add", [product, node.input[2]], [y], name=fresh(f"{stem}_bias")))
        counts["gemm_rewritten"] += 1
    del graph.node[:]
    graph.node.extend(n for n in new_nodes if id(n) not in dropped)

    producers = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
            continue
        if len(inits[transpose.input[0]].dims) != 2 or list(node_attribute(transpose, "perm", [1, 0])) != [1, 0]:
            continue
        node.input[1] = transposed(transpose.input[0])
        counts["transposed_weights"] += 1

    # Drop what the rewrites left unread: Transposes of constants, the shape arithmetic of removed Reshapes, and
    # untied weights whose transposed copy replaced them. (ONNX ops have no side effects: an unread node is dead.)
    while True:
        read = {x for n in graph.node for x in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    for index in reversed([k for k, i in enumerate(graph.initializer) if i.name in copies and i.name not in read]):
        del inits[graph.initializer[index].name]
        del graph.initializer[index]  # by index: remove() would compare weight tensors byte by byte
    live = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | set(inits)
    for v in [v for v in graph.value_info if v.name not in live]:
        graph.value_info.remove(v)
    return counts


def weight_matmuls(model) -> list[str]:
    """Names of the MatMul nodes whose second input is a 2-D fp32 constant: the ones the quantizers replace."""
    from onnx import TensorProto

    weights = {i.name for i in model.graph.initializer if len(i.dims) == 2 and i.data_type == TensorProto.FLOAT}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def non_finite_weights(model) -> list[str]:
    """Names of the 2-D fp32 initializers (the weight matrices and embedding tables the quantizers read) holding a
    NaN or an infinity. No trained or random model has one, while bytes overwritten at a file's size give them at
    once: what tells a quantizer failure on a damaged export from one on a sound graph."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    return [init.name for init in model.graph.initializer if len(init.dims) == 2
            and init.data_type == TensorProto.FLOAT and not np.isfinite(numpy_helper.to_array(init)).all()]
