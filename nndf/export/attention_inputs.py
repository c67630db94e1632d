"""What ONNX Runtime's GroupQueryAttention takes whole, so that the graph need not prepare it node by node: the
packed QKV projection, and the rotary embedding of its queries and keys.

Both rewrite the shared layout's graph (`nndf.export.fused_attention`) after `nndf.export.ort_fusions` has made
its rotary embeddings ONNX Runtime's RotaryEmbedding nodes and the optimizer has inlined everything between a
layer's projection and its attention. A node that does not match stays as it was; every family's parity test
checks the result.
"""

from __future__ import annotations

import onnx_ir as ir

GQA = ("com.microsoft", "GroupQueryAttention")
ROTARY = ("com.microsoft", "RotaryEmbedding")
# GroupQueryAttention's inputs, by index, as ONNX Runtime 1.32 declares them (those after 10 optional)
COS_CACHE, SIN_CACHE, POSITION_IDS, ATTENTION_BIAS, QUERY_SEQLENS = 7, 8, 9, 10, 16
TOTAL_SEQUENCE_LENGTH = 6


def _is(node, kind) -> bool:
    return node is not None and (node.domain, node.op_type) == kind


def _packed_source(split, heads: int, kv_heads: int):
    """The projection output a Split cuts into a layer's query, key and value, when the parts are in the kernel's
    order and sizes, (heads + 2 kv_heads) x head size along the last axis; else None."""
    if split is None or split.op_type != "Split" or split.domain != "" or len(split.outputs) != 3:
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
        if key is None or value is None or split is None or [query, key, value] != list(split.outputs) \
                or any(len(v.uses()) != 1 for v in split.outputs):
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
    """A GroupQueryAttention whose query and key are RotaryEmbeddings (rotate-half, whole heads) of two parts of a
    packed projection's Split, the third part its value, takes the projection whole with `do_rotary=1`: the Split
    and both RotaryEmbeddings go (three nodes a layer). SmolLM2-135M int4 on Zen 4: decode 0.949x and 0.943x per
    step (bench/README.md). The kernel gets what the RotaryEmbeddings got: the step's own cos and sin tables as its
    cache (the family's scaling included; `nndf.export.ort_fusions`) and each token's entry in them as its
    `position_ids`. Two conditions of ONNX Runtime 1.32's CPU kernel:

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
        query, key, value = node.inputs[:3]
        rotaries = [v.producer() if v is not None else None for v in (query, key)]
        if not all(_is(r, ROTARY) and r.attributes.get_int("interleaved", 0) == 0 and len(r.inputs) == 4
                   for r in rotaries) or list(rotaries[0].inputs[1:]) != list(rotaries[1].inputs[1:]) \
                or any(len(v.uses()) != 1 for v in (query, key)):
            continue
        split = rotaries[0].inputs[0].producer()
        if split is None or [rotaries[0].inputs[0], rotaries[1].inputs[0], value] != list(split.outputs) \
                or any(len(v.uses()) != 1 for v in split.outputs):
            continue
        heads, kv_heads = _heads(node)
        source = _packed_source(split, heads, kv_heads)
        positions, cos, sin = rotaries[0].inputs[1:]
        if source is None or rotaries[0].attributes.get_int("num_heads") != heads \
                or rotaries[1].attributes.get_int("num_heads") != kv_heads:
            continue
        size = source.shape[-1] // (heads + 2 * kv_heads)
        half = cos.shape[-1] if cos.shape is not None and len(cos.shape) == 2 else None
        if size % 16 or half != size // 2:  # the kernel's rotary: sizes in 16s, the whole head rotated
            continue
        total = node.inputs[TOTAL_SEQUENCE_LENGTH]
        if (cos, sin, total) not in tables:
            tables[cos, sin, total] = _padded_tables(graph, node, cos, sin, total, f"rotary_cache{len(tables)}")
        if positions not in counts:
            counts[positions] = _every_row_new(graph, node, positions, f"query_seqlens{len(counts)}")
        padded_cos, padded_sin = tables[cos, sin, total]
        bias = node.inputs[ATTENTION_BIAS] if len(node.inputs) > ATTENTION_BIAS else None
        node.resize_inputs(QUERY_SEQLENS + 1)
        for index, given in ((0, source), (1, None), (2, None), (COS_CACHE, padded_cos),
                             (SIN_CACHE, padded_sin), (POSITION_IDS, positions), (ATTENTION_BIAS, bias),
                             (QUERY_SEQLENS, counts[positions])):
            node.replace_input_with(index, given)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 0)
        graph.remove(rotaries, safe=True)
        _remove_split(graph, split)
        rewritten += 1
    return rewritten


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
