"""A screened LM head in the shared-layout graph: greedy search's token (and top-k sampling's kept scores) from a
quarter of the head's bytes, exact.

Why: a decode step reads every weight once, and a tied LM head is the largest (GPT-2 small: 154 of the 497 MB a
step reads). Greedy search needs only the argmax of the logits, top-k sampling only the k highest, and which
columns those are is settled by a few of them.

How, for the rows the graph input `screened_head` asks for:
1. int8 logits for the whole vocabulary: the hidden state quantized per tensor (`DynamicQuantizeLinear`, uint8),
   the head per column to signed integers of at most `nndf.export.cpu_int8.screen_weight_levels` (127 where this
   CPU's u8 x s8 products are exact, VNNI or AMX; else 63, since AVX2's pairs of them fit an int16 only below
   2^15), exact int32 dot products (`MatMulInteger`), scaled. The levels are the export's setting
   (`nndf.export.onnx.export_settings`), so a graph moved to a CPU of the other kind is rebuilt, not misread.
2. A bound on each column's error, from Cauchy-Schwarz: |h.w - h'.w'| <= |h - h'| |w'| + |h| |w - w'| (2-norms;
   the column norms are computed here once, the state's at each step), widened for fp32 rounding.
3. The threshold: the exact fp32 logits of the k columns with the highest int8 ones (`screened_head` = k, at most
   the vocabulary), and the lowest of them, which is at or below the row's k-th largest logit. Every column whose
   upper bound reaches it is a candidate; its fp32 dot product is computed exactly from the embedding table's row
   (the head is tied).
4. The output logits: the candidates' exact values scattered over the int8 ones; and the candidates themselves, as
   the output `screened_candidates` ((row, column) pairs, rows in order, columns ascending within a row; rows count
   the screened (row, position) pairs), so that a draw can pick among them without reading the whole vocabulary
   (`nndf.fast_draw.FastDraw`). Empty for the full head.
A column below the threshold is below each of those k columns. So with up to b tokens
banned after the step (an EOS before min_new_tokens), the k - b highest allowed scores of the output are the fp32
head's, values included, and every other score is below them: the argmax for k = b + 1, and for k = b + top_k
what top-k sampling keeps (its warpers and draw read nothing else). The same holds where b tokens are only
lowered (a repetition penalty above 1: the tokens seen). The other values are int8 approximations: scoring, beam
search, sampling without top-k and processors that change scores otherwise run the full head
(`nndf.generation.head_screen` decides).

`screened_head` 0 (or a batch of no rows) runs the full fp32 head over every row and the screen over none; k >= 1
the screen over every row and the full head over none, which then costs nothing. No `If`: the two parts take row
slices of the hidden states, one of them empty. ONNX Runtime before 1.31 kills the process (SIGFPE) on a TopK over
no rows, so for those versions (`topk_takes_no_rows`) the screen's TopK gets one row of zeros where it has none,
and its result is cut back to the screened rows: a step of the full head pays a TopK over one row, a screened step
a copy of its int8 logits.

The full head reads the embedding table itself, as `MatMul(table, h^T)^T`: ONNX Runtime prepacks a MatMul's
constant second input into a copy of its own, never the first, so the head's weights are held once (the table,
whose pages a greedy generation barely touches) where `MatMul(h, table^T)` held a packed copy beside it (GPT-2
small: 154 MB). The price is MLAS's kernel at one row, which pads it to a block of columns: a full-head step of one
row is slower (GPT-2's head, 2 threads: 11.4 against 8.6 ms; the same from 64 rows).

Only a tied head is screened (the exact dot products read rows of the embedding table, which the graph keeps for
its Gather anyway); an untied head would need a second copy of its weights in the table's orientation.
"""

from __future__ import annotations

import numpy as np

from nndf.backends.ort_runtime import ort_version
from nndf.export.cpu_int8 import screen_weight_levels

INPUT = "screened_head"  # int64 [1]: 0 the full head; k >= 1 the k highest scores exact (module docstring)
CANDIDATES = "screened_candidates"  # int64 [n, 2]: (row, column) of every exact score of the screened rows
RELATIVE_SLACK = 1e-3  # widens each bound for fp32 rounding in the norms and the scaled int8 logits
DOT_SLACK = 1e-5  # x |h| |w|: fp32 rounding of a dot product over the hidden size (pairwise sums: ~1e-6)
PREFIX = "screened_head."  # of every node and initializer the screen adds
# the nodes `strip_screen` finds the screen by
JOIN, FULL, FLAT = f"{PREFIX}join", f"{PREFIX}full", f"{PREFIX}flat"
UPPER, THRESHOLD = f"{PREFIX}upper", f"{PREFIX}threshold"  # each column's upper bound [rows, vocab]; [rows, 1]
BLOCK = 64  # columns per block of the candidates' search (`_columns_reaching`)


def topk_takes_no_rows() -> bool:
    """Whether this ONNX Runtime's TopK takes an input of no rows (1.31 and later). Versions 1.20-1.30 divide by
    the row count in their CPU kernel: the process dies of SIGFPE, so the version is read rather than probed."""
    return ort_version() >= (1, 31)


def _tied_head(graph):
    """(the MatMul, its hidden-state input, the [vocab, hidden] table) of a head whose output is the graph's
    `logits` and whose weight is `Transpose(table)` of an initializer the graph also Gathers from; else None."""
    logits = next((value for value in graph.outputs if value.name == "logits"), None)
    head = None if logits is None else logits.producer()
    if head is None or head.op_type != "MatMul" or head.domain != "" or len(head.inputs) != 2:
        return None
    transpose = head.inputs[1].producer()
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain != "":
        return None
    table = transpose.inputs[0]
    perm = transpose.attributes.get("perm")
    if table.const_value is None or len(table.shape or ()) != 2 or \
            (perm is not None and list(perm.as_ints()) != [1, 0]):
        return None
    if not any(use.op_type == "Gather" for use, _ in table.uses()):
        return None
    return head, head.inputs[0], table


def screen_constants(table: np.ndarray, weight_levels: int) -> dict[str, np.ndarray]:
    """What the screen reads besides the table: the int8 head [hidden, vocab] (magnitudes up to `weight_levels`),
    its per-column scales, and the two norms of each column's bound, slack included (float32)."""
    columns = table.astype(np.float64)  # [vocab, hidden]: one row per output column
    peak = np.abs(columns).max(axis=1)
    scale = np.where(peak > 0, peak / weight_levels, 1.0)
    levels = np.clip(np.rint(columns / scale[:, None]), -weight_levels, weight_levels)
    rounded = levels * scale[:, None]
    grow = 1 + RELATIVE_SLACK
    return {
        "weight": np.ascontiguousarray(levels.T.astype(np.int8)),
        "scale": scale.astype(np.float32),
        "rounded_norm": (np.linalg.norm(rounded, axis=1) * grow).astype(np.float32),
        "error_norm": (np.linalg.norm(columns - rounded, axis=1) * grow
                       + DOT_SLACK * np.linalg.norm(columns, axis=1)).astype(np.float32),
    }


def _columns_reaching(tape, const, upper, threshold, vocab: int):
    """The (row, column) pairs, row-major, where `upper` [rows, vocab] >= the row's `threshold` [rows, 1]: what
    `Transpose(NonZero(GreaterOrEqual(upper, threshold)))` gives, in a quarter of its time.

    Why: ONNX Runtime's NonZero walks its input one element at a time (about 3 ns each: 0.2 ms a row of GPT-2's
    vocabulary, 0.86 ms at batch 4, 3% of that step), and only a few columns of a row reach the threshold. So the
    row is cut into blocks of `BLOCK` columns (the last one padded with -inf), each block's largest bound is
    compared first (`ReduceMax`, vectorised), and NonZero walks only the blocks' maxima and the few blocks that
    reach the threshold. The order is NonZero's: rows ascending, columns ascending within a row."""
    def const_here(name: str, array):  # this search's own initializers, apart from the caller's
        return const(f"search.{name}", array)

    blocks = -(-vocab // BLOCK)
    padding = blocks * BLOCK - vocab
    if padding:
        upper = tape.op("Pad", [upper, const_here("pads", np.array([0, 0, 0, padding], np.int64)),
                                const_here("minus_inf", np.array(-np.inf, np.float32))])
    tiles = tape.op("Reshape", [upper, const_here("tiles_shape", np.array([0, blocks, BLOCK], np.int64))])
    block_peak = tape.op("ReduceMax", [tiles, const_here("axis2", np.array([2], np.int64))], {"keepdims": 0})
    hits = tape.op("Transpose", [tape.op("NonZero", [tape.op("GreaterOrEqual", [block_peak, threshold])])],
                   {"perm": [1, 0]})  # [m, 2]: (row, block)
    index0, index1 = (const_here(f"index{i}", np.array(i, np.int64)) for i in (0, 1))
    row_of_hit, block_of_hit = (tape.op("Gather", [hits, index], {"axis": 1}) for index in (index0, index1))
    block_start = tape.op("Mul", [block_of_hit, const_here("block", np.array(BLOCK, np.int64))])
    unsqueeze = const_here("axis1", np.array([1], np.int64))
    columns = tape.op("Add", [tape.op("Unsqueeze", [block_start, unsqueeze]),
                              const_here("block_columns", np.arange(BLOCK, dtype=np.int64))])  # [m, BLOCK]
    reach = tape.op("GreaterOrEqual", [tape.op("GatherND", [tiles, hits]),
                                       tape.op("Gather", [threshold, row_of_hit], {"axis": 0})])
    if padding:  # a -inf threshold (a row of -inf logits) must not reach past the vocabulary
        inside = tape.op("Less", [columns, const_here("vocab_size", np.array(vocab, np.int64))])
        reach = tape.op("And", [reach, inside])
    pairs = tape.op("Transpose", [tape.op("NonZero", [reach])], {"perm": [1, 0]})  # [n, 2]: (hit, column in block)
    rows = tape.op("Gather", [row_of_hit, tape.op("Gather", [pairs, index0], {"axis": 1})], {"axis": 0})
    return tape.op("Concat", [tape.op("Unsqueeze", [rows, unsqueeze]),
                              tape.op("Unsqueeze", [tape.op("GatherND", [columns, pairs]), unsqueeze])], {"axis": 1})


def screen_head(model, weight_levels: int | None = None, topk_no_rows: bool | None = None) -> int:
    """Give the graph a screened head (module docstring) where its head is tied; 1 if it did, 0 if not.
    `weight_levels`: the int8 weights' largest magnitude (default: this CPU's, `screen_weight_levels`);
    `topk_no_rows`: whether the ONNX Runtime that runs the graph takes a TopK over no rows (default: this one's,
    `topk_takes_no_rows`)."""
    import onnx_ir as ir
    from onnx_ir.tape import Tape

    graph = model.graph
    found = _tied_head(graph)
    if found is None or any(value.name == INPUT for value in graph.inputs):
        return 0
    head, hidden, table = found
    vocab, width = table.shape
    constants = screen_constants(table.const_value.numpy(), weight_levels or screen_weight_levels())
    choice = ir.Value(name=INPUT, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]))
    graph.inputs.append(choice)

    tape = Tape()

    def const(name: str, array) -> ir.Value:
        return tape.initializer(ir.tensor(np.asarray(array), name=f"{PREFIX}{name}"))

    zero, one = const("zero", np.array([0], np.int64)), const("one", np.array([1], np.int64))
    rows_axis = const("axis0", np.array([0], np.int64))
    last_axis = const("axis1", np.array([1], np.int64))
    flat = tape.op("Reshape", [hidden, const("flat_shape", np.array([-1, width], np.int64))], name=FLAT)
    rows = tape.op("Slice", [tape.op("Shape", [flat]), zero, one])
    asked = tape.op("Max", [choice, zero])  # k, or 0 for the full head
    screened_rows = tape.op("Mul", [tape.op("Min", [asked, one]), rows])
    full_rows = tape.op("Sub", [rows, screened_rows])
    to_head = tape.op("Slice", [flat, zero, full_rows, rows_axis])
    to_screen = tape.op("Slice", [flat, full_rows, rows, rows_axis])

    # the full head reads the table as it is: as MatMul's first input it is not prepacked (module docstring)
    full = tape.op("Transpose", [tape.op("MatMul", [table, tape.op("Transpose", [to_head], {"perm": [1, 0]})],
                                         name=FULL)], {"perm": [1, 0]})
    levels, step, offset = tape.op_multi_out("DynamicQuantizeLinear", [to_screen], num_outputs=3)
    products = tape.op("MatMulInteger", [levels, const("weight", constants["weight"]), offset])
    column_scale = tape.op("Mul", [step, const("scale", constants["scale"])])
    approx = tape.op("Mul", [tape.op("Cast", [products], {"to": ir.DataType.FLOAT}), column_scale])
    state_error = tape.op("Sub", [tape.op("DequantizeLinear", [levels, step, offset]), to_screen])
    # the bound's two state norms [rows, 2] against the columns' two [2, vocab], added to the int8 logits: one Gemm
    # where two products and two sums each took a pass over the rows
    state_norms = tape.op("Concat", [tape.op("ReduceL2", [state_error, last_axis], {"keepdims": 1}),
                                     tape.op("ReduceL2", [to_screen, last_axis], {"keepdims": 1})], {"axis": 1})
    column_norms = const("norms", np.stack([constants["rounded_norm"], constants["error_norm"]]))
    at_most_vocab = tape.op("Min", [tape.op("Max", [asked, one]), const("vocab_size", np.array([vocab], np.int64))])
    ranked = approx
    if not (topk_takes_no_rows() if topk_no_rows is None else topk_no_rows):  # a zero row where there are none
        missing = tape.op("Sub", [one, tape.op("Min", [screened_rows, one])])
        ranked = tape.op("Pad", [approx, tape.op("Concat", [zero, zero, missing, zero], {"axis": 0})])
    _, leaders = tape.op_multi_out("TopK", [ranked, at_most_vocab], {"axis": -1}, num_outputs=2)  # [rows, k]
    if ranked is not approx:
        leaders = tape.op("Slice", [leaders, zero, screened_rows, rows_axis])
    leaders_exact = tape.op("MatMul", [tape.op("Gather", [table, leaders], {"axis": 0}),  # [rows, k, width]
                                       tape.op("Unsqueeze", [to_screen, const("axis2", np.array([2], np.int64))])])
    # the k-th largest exact logit among those k: at or below the k-th largest of the row
    threshold = tape.op("ReduceMin", [leaders_exact, const("axes12", np.array([1, 2], np.int64))], {"keepdims": 0})
    threshold = tape.op("Unsqueeze", [threshold, last_axis], name=THRESHOLD)
    upper = tape.op("Gemm", [state_norms, column_norms, approx], name=UPPER)
    candidates = _columns_reaching(tape, const, upper, threshold, vocab)
    row_of, column_of = (tape.op("Gather", [candidates, const(f"index{i}", np.array(i, np.int64))], {"axis": 1})
                         for i in (0, 1))
    # each candidate's row of the table against every screened state (a few), then its own state's product: one
    # pass over the gathered rows, where pairing each with a gathered state and summing products takes five
    per_state = tape.op("MatMul", [tape.op("Gather", [table, column_of], {"axis": 0}),
                                   tape.op("Transpose", [to_screen], {"perm": [1, 0]})])
    exact = tape.op("Reshape", [tape.op("GatherElements", [per_state, tape.op("Unsqueeze", [row_of, last_axis])],
                                        {"axis": 1}), const("flat", np.array([-1], np.int64))])
    screened = tape.op("ScatterND", [approx, candidates, exact])
    found = tape.op("Identity", [candidates])
    # each part in the hidden states' shape (either has every row or none), then joined: the join writes the
    # graph's output itself, where a Reshape after it would copy the joined logits into it
    shape = tape.op("Concat", [const("any_rows", np.array([-1], np.int64)),
                               tape.op("Slice", [tape.op("Shape", [hidden]), one,
                                                 const("all_but_last", np.array([-1], np.int64))]),
                               const("vocab", np.array([vocab], np.int64))], {"axis": 0})
    logits = tape.op("Concat", [tape.op("Reshape", [full, shape]), tape.op("Reshape", [screened, shape])],
                     {"axis": 0}, name=JOIN)

    for value in tape.initializers:
        graph.register_initializer(value)
    for index, node in enumerate(tape.nodes):  # named for whoever reads the graph (and the tests)
        node.name = node.name or f"{PREFIX}{node.op_type}_{index}"
    old = head.outputs[0]
    logits.type, logits.shape = old.type, old.shape
    found.name, found.type, found.shape = CANDIDATES, ir.TensorType(ir.DataType.INT64), ir.Shape(["candidates", 2])
    graph.outputs.append(found)
    transposed = head.inputs[1].producer()
    ir.convenience.replace_nodes_and_values(graph, head, [head], list(tape.nodes), [old], [logits])
    if not transposed.outputs[0].uses():  # the table's transposed copy: nothing reads it now
        graph.remove(transposed)
    return 1


def strip_screen(model) -> bool:
    """Take the screen out of a graph (an onnx ModelProto) that has one, in place: every row goes through the full
    head, and the graph no longer takes `screened_head` nor gives `screened_candidates` (a session feeds and reads
    them only where a graph has them). For graphs whose head is quantized: screening an int8 or int4 head against
    the fp32 table would give greedy search another argmax than the head's, and the quantizers would take the
    screen's lookup for an embedding. Returns whether there was a screen."""
    from onnx import helper

    graph = model.graph
    nodes = {node.name: node for node in graph.node}
    join, flat, full = nodes.get(JOIN), nodes.get(FLAT), nodes.get(FULL)
    if join is None or flat is None or full is None:
        return False
    # the head as the exporter wrote it, MatMul(h, Transpose(table)), where the quantizers take a tied head
    table, hidden = full.input[0], flat.input[0]
    # it gives the join's output (the graph's logits, in the hidden states' shape) in the join's place
    head = [helper.make_node("Transpose", [table], [f"{FULL}.table_t"], name=f"{FULL}.table_t", perm=[1, 0]),
            helper.make_node("MatMul", [hidden, f"{FULL}.table_t"], [join.output[0]], name=f"{FULL}.head")]
    at = list(graph.node).index(join)
    graph.node.remove(join)
    for offset, node in enumerate(head):
        graph.node.insert(at + offset, node)
    for value in [value for value in graph.output if value.name == CANDIDATES]:
        graph.output.remove(value)
    needed = {value.name for value in graph.output}
    kept = []
    for node in reversed(graph.node):  # nodes are in topological order: consumers after producers
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(name for name in node.input if name)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    for init in [init for init in graph.initializer if init.name not in needed]:
        graph.initializer.remove(init)
    for value in [value for value in graph.input if value.name == INPUT]:
        graph.input.remove(value)
    return True
