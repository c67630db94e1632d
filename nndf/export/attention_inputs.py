"""What ONNX Runtime's GroupQueryAttention takes whole, so that the graph need not prepare it node by node: the
packed QKV projection, and the rotary embedding of its queries and keys.

Both rewrite the shared layout's graph (`nndf.export.fused_attention`) after `nndf.export.ort_fusions` has made
its rotary embeddings ONNX Runtime's RotaryEmbedding nodes and the optimizer has inlined everything between a
layer's projection and its attention. A node that does not match stays as it was; every family's parity test
checks the result.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir


GQA = ("com.microsoft", "GroupQueryAttention")
ROTARY = ("com.microsoft", "RotaryEmbedding")
# GroupQueryAttention's inputs, by index, as ONNX Runtime 1.32 declares them (those after 10 optional)
COS_CACHE, SIN_CACHE, POSITION_IDS, ATTENTION_BIAS, QUERY_SEQLENS = 7, 8, 9, 10, 16
TOTAL_SEQUENCE_LENGTH = 6
SWAP_HEADS = [0, 2, 1, 3]  # (batch, sequence, heads, size) <-> (batch, heads, sequence, size)


def _is(node, kind) -> bool:
    return node is not None and (node.domain, node.op_type) == kind


def _packed_source(split, heads: int, kv_heads: int):
    """The projection output a Split cuts into a layer's query, key and value, when the parts are in the kernel's
    order and sizes, (heads + 2 kv_heads) x head size along the last axis, each read once; else None."""
    if split is None or split.op_type != "Split" or split.domain != "" or len(split.outputs) != 3 \
            or any(len(v.uses()) != 1 for v in split.outputs):
        return None
    source = split.inputs[0]
    rank = len(source.shape) if source.shape is not None else None
    width = source.shape[-1] if rank else None
    if rank != 3 or split.attributes.get_int("axis", 0) not in (-1, 2) or not isinstance(width, int) \
            or width % (heads + 2 * kv_heads):
        return None
    size = width // (heads + 2 * kv_heads)
    given = split.inputs[1] if len(split.inputs) > 1 else None  # the parts' widths; else equal thirds
    widths = given.const_value.numpy().tolist() if given is not None and given.const_value is not None else None
    if (given is not None and widths != [heads * size, kv_heads * size, kv_heads * size]) \
            or (given is None and heads != kv_heads):
        return None
    return source


def _heads(node) -> tuple[int, int]:
    return node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")


def pack_attention_inputs(model) -> int:
    """A GroupQueryAttention whose query, key and value are the three parts of one Split along the last axis (a
    projection's output with no rotary between: GPT-2's) takes that output whole as its packed QKV input, and the
    Split goes: the kernel reads the numbers in place where the Split copied them. GPT-2 small on Zen 4, ONNX
    Runtime's profile of 126 decode steps: GroupQueryAttention and the Splits 2.03 -> 1.57 ms a step at batch 4,
    0.80 -> 0.59 at batch 1; whole steps 0.997x and 0.988x (bench/README.md). Returns how many nodes were packed."""
    packed = 0
    for node in list(model.graph):
        if not _is(node, GQA) or len(node.inputs) < 3:
            continue
        query, key, value = node.inputs[:3]
        split = query.producer() if query is not None else None
        if key is None or value is None or split is None or [query, key, value] != list(split.outputs):
            continue
        source = _packed_source(split, *_heads(node))
        if source is None:
            continue
        node.replace_input_with(0, source)
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        _remove_split(model.graph, split)
        packed += 1
    return packed


def rotate_in_attention(model) -> int:
    """A GroupQueryAttention whose query and key come from RotaryEmbeddings takes them unrotated and rotates them
    itself (`do_rotary=1`), as ONNX Runtime GenAI's graphs have it:
    - Llama's shape (a RotaryEmbedding of each part of a packed projection's Split, the third part the value): the
      kernel takes the projection whole, and the Split and both RotaryEmbeddings go, three nodes a layer.
      SmolLM2-135M on Zen 4, alternating processes, decode per step 0.974x (fp32), 0.95x (int8), 0.94-0.99x (int4).
    - Qwen3's (each part split into heads, RMS-normalized per head, rotated between two Transposes, merged
      back): the kernel takes the merged norms' outputs apart; both rotations and their Transposes go, six nodes
      a layer (a SmolLM2-sized Qwen3: 863 -> 695 nodes, decode 0.98x int4, 1.00x fp32: within the noise).
    The kernel gets what the RotaryEmbeddings got: the step's own cos and sin tables as its cache (the family's
    scaling included; `nndf.export.ort_fusions`) and each token's entry in them as its `position_ids`. Two
    conditions of ONNX Runtime 1.32's CPU kernel:

    - It reads `position_ids` token by token only when told each row's count of new tokens (`query_seqlens`, here
      every row's whole chunk); without it a prompt's rows are all rotated from the first row's first position,
      which a left-padded batch, whose rows start at different positions, cannot have.
    - Its cache must have at least `total_sequence_length` entries, where the step's tables have rows x new
      tokens: they are padded with zeros that no position reads.

    Head sizes that are not a multiple of 16 are refused by the kernel's rotary and stay as they are, and so does
    every node where this ONNX Runtime's kernel has no `query_seqlens`. Returns how many nodes were rewritten."""
    if not kernel_reads_query_seqlens():
        return 0
    graph = model.graph
    tables: dict = {}  # (cos, sin, total) -> the padded pair, made once for all layers
    counts: dict = {}  # positions -> query_seqlens, made once for all layers
    rewritten = 0
    for node in list(graph):
        if not _is(node, GQA) or len(node.inputs) < 7 or node.attributes.get_int("do_rotary", 0):
            continue
        heads, kv_heads = _heads(node)
        query, key, value = node.inputs[:3]
        made = [_rotation(query, heads), _rotation(key, kv_heads)]
        if None in made or value is None or list(made[0].rotary.inputs[1:]) != list(made[1].rotary.inputs[1:]):
            continue
        positions, cos, sin = made[0].rotary.inputs[1:]
        half = cos.shape[-1] if cos.shape is not None and len(cos.shape) == 2 else None
        if not isinstance(half, int) or (2 * half) % 16 \
                or any(_width(v) != n * 2 * half for v, n in ((made[0].part, heads), (made[1].part, kv_heads))):
            continue  # the kernel's rotary: head sizes in 16s, the whole head rotated
        split = value.producer()
        packed = split is not None and [made[0].part, made[1].part, value] == list(split.outputs)
        source = _packed_source(split, heads, kv_heads) if packed else None
        total = node.inputs[TOTAL_SEQUENCE_LENGTH]
        if (cos, sin, total) not in tables:
            tables[cos, sin, total] = _padded_tables(graph, node, cos, sin, total, f"rotary_cache{len(tables)}")
        if positions not in counts:
            counts[positions] = _every_row_new(graph, node, positions, f"query_seqlens{len(counts)}")
        padded_cos, padded_sin = tables[cos, sin, total]
        bias = node.inputs[ATTENTION_BIAS] if len(node.inputs) > ATTENTION_BIAS else None
        for rotation in made:
            rotation.unrotate()
        attention = [source, None, None] if source is not None else [made[0].part, made[1].part, value]
        node.resize_inputs(QUERY_SEQLENS + 1)
        for index, input_ in {0: attention[0], 1: attention[1], 2: attention[2], COS_CACHE: padded_cos,
                              SIN_CACHE: padded_sin, POSITION_IDS: positions, ATTENTION_BIAS: bias,
                              QUERY_SEQLENS: counts[positions]}.items():
            node.replace_input_with(index, input_)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 0)
        graph.remove([*made[0].nodes, *made[1].nodes], safe=True)
        if source is not None:
            _remove_split(graph, split)
        rewritten += 1
    return rewritten


def _width(value) -> int | None:
    """The last dimension of a (batch, sequence, width) value, where known: from its shape, or from the widths of
    the Split that made it."""
    shape = value.shape
    if shape is not None and len(shape) == 3 and isinstance(shape[-1], int):
        return shape[-1]
    split = value.producer()
    widths = split.inputs[1] if split is not None and split.op_type == "Split" and len(split.inputs) > 1 else None
    if widths is None or widths.const_value is None:
        return None
    return int(widths.const_value.numpy()[list(split.outputs).index(value)])


@dataclasses.dataclass
class _Rotation:
    """How a GroupQueryAttention's query or key input is rotated: `rotary` does it, `nodes` (read by nothing else)
    go with it, and `part`, (batch, sequence, heads * size), is what the kernel takes in its place; `merge`, where
    given, is the Reshape that makes `part` and is to read `unrotated` instead of the rotation's output."""

    part: ir.Value
    rotary: ir.Node
    nodes: list[ir.Node]
    merge: ir.Node | None = None
    unrotated: ir.Value | None = None

    def unrotate(self) -> None:
        if self.merge is not None:
            self.merge.replace_input_with(0, self.unrotated)


def _rotation(value, heads: int) -> _Rotation | None:
    """The two ways the shared export rotates a query or key of `heads` heads: a RotaryEmbedding of the
    projection's part as (batch, sequence, heads * size) (Llama's, after nndf.export.ort_fusions), whose input the
    kernel then takes; or, after a per-head RMS norm (Qwen3's), a RotaryEmbedding of (batch, heads, sequence,
    size) between two Transposes, before the Reshape that merges the heads, which then merges the norm's output
    (ONNX Runtime 1.32's CPU kernel has no q/k norms of its own: "implemented only on the CUDA and WebGPU EPs").
    None for anything else (a partial rotary, interleaved pairs, other layouts)."""
    producer = value.producer() if value is not None and len(value.uses()) == 1 else None
    if _is(producer, ROTARY):
        if producer.attributes.get_int("num_heads") != heads or not _rotate_half(producer):
            return None
        return _Rotation(producer.inputs[0], producer, [producer])
    chain = _chain(value, [("", "Reshape"), ("", "Transpose"), ROTARY, ("", "Transpose")])
    if chain is None:
        return None
    merge, back, rotary, swap = chain
    unrotated = swap.inputs[0]
    shape = unrotated.shape
    if not _rotate_half(rotary) or any(_perm(t) != SWAP_HEADS for t in (back, swap)) \
            or shape is None or len(shape) != 4 or shape[2] != heads:
        return None
    return _Rotation(value, rotary, [back, rotary, swap], merge, unrotated)


def _rotate_half(rotary) -> bool:
    return rotary.attributes.get_int("interleaved", 0) == 0 and len(rotary.inputs) == 4


def _perm(transpose) -> list[int] | None:
    perm = transpose.attributes.get("perm")
    return None if perm is None else list(perm.as_ints())


def _chain(value, kinds) -> list | None:
    """The producers of `value`, its first input's, and so on, when they are of `kinds` in that order and each
    output along the way is read once; else None."""
    nodes = []
    for kind in kinds:
        producer = value.producer() if value is not None and len(value.uses()) == 1 else None
        if not _is(producer, kind):
            return None
        nodes.append(producer)
        value = producer.inputs[0]
    return nodes


def kernel_reads_query_seqlens() -> bool:
    """Whether this ONNX Runtime's GroupQueryAttention declares the `query_seqlens` input (ONNX Runtime 1.32 does;
    the schema is read rather than a version guessed)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    schemas = getattr(state, "get_all_operator_schema", None)
    if schemas is None:
        return False
    for schema in schemas():
        if (schema.domain, schema.name) == GQA:
            names = [given.name for given in schema.inputs]
            return len(names) > QUERY_SEQLENS and names[QUERY_SEQLENS] == "query_seqlens"
    return False


def _remove_split(graph, split) -> None:
    """Remove a Split whose outputs are no longer read, and its widths where nothing else reads them (ONNX Runtime
    warns at every load of an initializer no node uses)."""
    widths = split.inputs[1] if len(split.inputs) > 1 else None
    graph.remove(split, safe=True)
    if widths is not None and not widths.uses() and graph.initializers.get(widths.name) is widths:
        del graph.initializers[widths.name]


def _constant(graph, name: str, values: list[int]):
    import numpy as np

    value = ir.Value(name=name, const_value=ir.tensor(np.array(values, np.int64), name=name))
    graph.register_initializer(value)
    return value


def _add(graph, before, op_type: str, inputs, name: str, **attributes):
    node = ir.Node("", op_type, inputs, [ir.convenience.convert_attribute(k, v) for k, v in attributes.items()],
                   name=name)
    graph.insert_before(before, node)
    return node.outputs[0]


def _padded_tables(graph, before, cos, sin, total, name: str):
    """cos and sin, (entries, half), with zero rows after them up to `total` (an int32 scalar) entries where they
    hold fewer."""
    zero, one = _constant(graph, f"{name}_zero", [0]), _constant(graph, f"{name}_one", [1])
    pair = _constant(graph, f"{name}_pair", [0, 0])
    entries = _add(graph, before, "Shape", [cos], f"{name}_entries", start=0, end=1)
    wanted = _add(graph, before, "Cast", [_add(graph, before, "Reshape", [total, one], f"{name}_total")],
                  f"{name}_total_int64", to=ir.DataType.INT64)
    short = _add(graph, before, "Max", [_add(graph, before, "Sub", [wanted, entries], f"{name}_short"), zero],
                 f"{name}_missing")
    pads = _add(graph, before, "Concat", [pair, short, zero], f"{name}_pads", axis=0)
    return tuple(_add(graph, before, "Pad", [table, pads], f"{name}_{which}")
                 for which, table in (("cos", cos), ("sin", sin)))


def _every_row_new(graph, before, positions, name: str):
    """`query_seqlens`: every row's count of new tokens, the chunk's whole length (int32, one per row), read from
    the shape of the rotary's position ids (rows, new tokens), which all layers share."""
    rows = _add(graph, before, "Shape", [positions], f"{name}_rows", start=0, end=1)
    length = _add(graph, before, "Shape", [positions], f"{name}_length", start=1, end=2)
    return _add(graph, before, "Cast", [_add(graph, before, "Expand", [length, rows], f"{name}_int64")], name,
                to=ir.DataType.INT32)
