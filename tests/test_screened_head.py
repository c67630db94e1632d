"""The screened LM head (nndf.export.screened_head): on a tied head, greedy search's argmax from int8 logits and a
few exact fp32 dot products must be the fp32 head's, also with tokens banned after; everything else runs the full
head; quantized graphs lose the screen. Synthetic heads with near ties check the bound; the tiny GPT-2 the loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import nndf
from nndf import fast_draw, generation, kept_tokens, processors
from nndf.export.cpu_int8 import screen_weight_levels
from nndf.export.screened_head import (BLOCK, CANDIDATES, INPUT, THRESHOLD, UPPER, screen_constants, screen_head,
                                       strip_screen)
from nndf.generation import GenerationOptions
from nndf.processors import head_screen, screened_kth, screened_top_k
from nndf.sampling import Sampling
from sampling_checks import assert_samples_like_generate
from test_generation_parity import _batch

WIDTH, VOCAB = 48, 3000


def _table(seed: int = 0) -> np.ndarray:
    """A [vocab, width] table with near twins: columns 2i and 2i + 1 differ by 1e-4 of a weight, far below the int8
    head's error, so that the screen must settle those ties with exact dot products."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32) * 0.05
    table[1::2] = table[0::2] + rng.standard_normal((VOCAB // 2, WIDTH)).astype(np.float32) * 5e-6
    return table


def _tied_model(table: np.ndarray, tied: bool = True):
    """ids -> Gather(table) -> `embedded`; h -> MatMul(h, Transpose(table)) -> `logits` (an untied head: MatMul
    over its own [width, vocab] constant), as the exporter writes GPT-2's."""
    import onnx_ir as ir

    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"])]
    inits = [numpy_helper.from_array(table, "table")]
    if tied:
        nodes += [helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "head"], ["logits"])]
    else:
        nodes += [helper.make_node("MatMul", ["h", "head"], ["logits"])]
        inits.append(numpy_helper.from_array(np.ascontiguousarray(table.T), "head"))
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"]),
                        helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "k", WIDTH])],
        [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["b", "s", WIDTH]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "k", VOCAB])], inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))


def _session(model_proto):
    import onnxruntime as ort

    return ort.InferenceSession(model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _screened_proto(table):
    import onnx_ir as ir

    model = _tied_model(table)
    assert screen_head(model) == 1
    return ir.serde.serialize_model(model)


def _hidden(rows: int, seed: int) -> np.ndarray:
    """Hidden states with a few large dimensions, as a trained model's final norm gives (they set the int8 scale)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, 3, WIDTH)).astype(np.float32)
    h[..., :2] *= 20
    return h


def _run(session, h, k):
    ids = np.zeros((1, 1), np.int64)
    return session.run(["logits"], {"ids": ids, "h": h, INPUT: np.array([k], np.int64)})[0]


def test_the_screened_argmax_is_the_fp32_heads_also_with_banned_tokens():
    table = _table()
    session = _session(_screened_proto(table))
    h = _hidden(40, seed=1)
    full = _run(session, h, 0)
    np.testing.assert_allclose(full, h @ table.T, rtol=1e-5, atol=1e-5)  # 0: the full head, every row, same shape
    # the top two of many rows are twins closer than the int8 error: only the exact dot products tell them apart
    top2 = np.sort(full, axis=-1)[..., -2:]
    assert ((top2[..., 1] - top2[..., 0]) < 1e-3).sum() >= 10
    for k in (1, 2, 4):
        screened = _run(session, h, k)
        assert screened.shape == full.shape
        assert np.array_equal(screened.argmax(-1), full.argmax(-1)), k
        winners = full.argmax(-1)[..., None]
        np.testing.assert_allclose(np.take_along_axis(screened, winners, -1), np.take_along_axis(full, winners, -1),
                                   rtol=1e-6, atol=1e-6)
        # the loop bans up to k - 1 tokens after the step (EOS before min_new_tokens): ban each row's k - 1 best
        banned = np.argsort(full, axis=-1)[..., ::-1][..., : k - 1]
        allowed = full.copy()
        for scores in (screened, allowed):
            np.put_along_axis(scores, banned, -np.inf, -1)
        assert np.array_equal(screened.argmax(-1), allowed.argmax(-1)), k
    # where the int8 logits are not the winners, they are approximations: a screened output is not a full one
    assert not np.allclose(_run(session, h, 1), full, atol=1e-4)


def test_an_empty_batch_and_one_row_run_either_way():
    session = _session(_screened_proto(_table()))
    for rows in (0, 1):
        h = _hidden(rows, seed=2)[:, :1]
        for k in (0, 2):
            assert _run(session, h, k).shape == (rows, 1, VOCAB)


def _search_outputs(proto):
    """The screened graph, also giving out each column's upper bound and each row's threshold (their node names)."""
    names = []
    for name in (UPPER, THRESHOLD):
        [node] = [node for node in proto.graph.node if node.name == name]
        proto.graph.output.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None))
        names.append(node.output[0])
    return proto, names


def test_the_candidates_are_every_column_whose_bound_reaches_the_threshold():
    """The blocked search (`_columns_reaching`) finds what a NonZero over whole rows would: every (row, column)
    whose upper bound reaches its row's threshold, row-major, none past the vocabulary (whose last block is padded
    with -inf), also in that partial block, where a whole row reaches it (a -inf threshold) and where none does."""
    from onnx.utils import Extractor

    proto, (upper_name, threshold_name) = _search_outputs(_screened_proto(_table()))
    session = _session(proto)
    h = _hidden(6, seed=7)[:, :2]  # 12 screened rows
    for k in (1, 4, 51):
        feed = {"ids": np.zeros((1, 1), np.int64), "h": h, INPUT: np.array([k], np.int64)}
        found, upper, threshold = session.run([CANDIDATES, upper_name, threshold_name], feed)
        assert threshold.shape == (12, 1) and len(found) >= 12 * k
        assert np.array_equal(found, np.argwhere(upper >= threshold))
    assert VOCAB % BLOCK  # the synthetic graph's last block is partial
    search = _session(Extractor(proto).extract_model([upper_name, threshold_name], [CANDIDATES]))
    upper[0, -3:] = threshold[0] + 1  # the partial last block
    upper[1, :BLOCK + 1] = threshold[1]  # ties, across a block's edge
    threshold[2] = -np.inf  # every column of row 2, none past the vocabulary
    upper[3] = np.nan  # none of row 3
    found = search.run([CANDIDATES], {upper_name: upper, threshold_name: threshold})[0]
    assert np.array_equal(found, np.argwhere(upper >= threshold))
    assert (found[:, 0] == 2).sum() == VOCAB and not (found[:, 0] == 3).any()


def test_an_untied_head_is_not_screened():
    """Its exact dot products would need a second copy of the head in rows: the graph is left as it is."""
    model = _tied_model(_table(), tied=False)
    assert screen_head(model) == 0
    assert INPUT not in [value.name for value in model.graph.inputs]


def test_stripping_the_screen_leaves_the_full_head_and_no_input():
    table = _table()
    proto = _screened_proto(table)
    transposed = [node for node in proto.graph.node if node.op_type == "Transpose" and "table" in node.input]
    assert not transposed  # screened, the full head reads the table itself: nothing for ONNX Runtime to prepack
    assert strip_screen(proto) and not strip_screen(proto)
    # stripped, the head is MatMul(h, Transpose(table)) again, the form the quantizers take a tied head in
    [transpose] = [node for node in proto.graph.node if node.op_type == "Transpose" and "table" in node.input]
    assert [node.op_type for node in proto.graph.node if transpose.output[0] in node.input] == ["MatMul"]
    assert INPUT not in [value.name for value in proto.graph.input]
    assert CANDIDATES not in [value.name for value in proto.graph.output]
    screen_ops = {"MatMulInteger", "ScatterND", "NonZero", "ReduceMax", "Pad"}
    assert not screen_ops & {node.op_type for node in proto.graph.node}
    left = {init.name for init in proto.graph.initializer}
    assert not left & {f"screened_head.{name}" for name in ("weight", "scale", "norms")}
    h = _hidden(3, seed=3)
    out = _session(proto).run(["logits"], {"ids": np.zeros((1, 1), np.int64), "h": h})[0]
    np.testing.assert_allclose(out, h @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("levels", [63, 127])
def test_the_bound_covers_the_weight_rounding(levels):
    """Weights within the levels (63: no int16 saturation on AVX2) and a norm of each column's rounding error that
    bounds it."""
    table = _table()
    constants = screen_constants(table, levels)
    assert constants["weight"].shape == (WIDTH, VOCAB) and np.abs(constants["weight"]).max() == levels
    error = table.T - constants["weight"] * constants["scale"]
    assert np.all(np.linalg.norm(error, axis=0) <= constants["error_norm"])


def test_this_cpus_int8_kernel_is_exact_at_the_levels_it_is_given():
    """The screen's bound holds only if ONNX Runtime's u8 x s8 products are exact at `screen_weight_levels`: the
    worst case (every activation 255 with zero point 0, every weight +-levels, so a saturating int16 pair shows) at
    one and four rows, GPT-2's hidden width, against numpy's int64 products."""
    levels = screen_weight_levels()
    rng = np.random.default_rng(0)
    weight = (rng.choice([-1, 1], size=(768, 512)) * levels).astype(np.int8)
    weight[:, :8] = levels  # columns where every pair of products has the same sign
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "zero"], ["y"])], "int8",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", 768])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", 512])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(0, np.uint8), "zero")])
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    for rows in (1, 4):
        a = np.full((rows, 768), 255, np.uint8)
        a[1:, ::3] = rng.integers(0, 256, size=a[1:, ::3].shape)
        expected = a.astype(np.int64) @ weight.astype(np.int64)
        assert np.array_equal(session.run(None, {"a": a})[0], expected), (levels, rows)


@pytest.mark.parametrize("options, stopping, expected", [
    (GenerationOptions(), None, 1),
    (GenerationOptions(eos_token_id=7, min_new_tokens=5), None, 2),  # EOS banned before the 5th token
    (GenerationOptions(eos_token_id=(7, 8), min_new_tokens=5), None, 3),
    (GenerationOptions(eos_token_id=7, min_new_tokens=None, min_length=20), None, 2),
    (GenerationOptions(sampling=Sampling(do_sample=True)), None, 50),  # generate()'s top-k 50 reads 50 scores
    (GenerationOptions(eos_token_id=7, min_new_tokens=5, sampling=Sampling(do_sample=True, temperature=0.7, top_k=5,
                                                                           top_p=0.9, min_p=0.01, typical_p=0.9)),
     None, 6),
    (GenerationOptions(sampling=Sampling(do_sample=True, top_k=0)), None, 0),  # every score counts
    (GenerationOptions(sampling=Sampling(do_sample=True, top_h=0.5)), None, 0),  # top-h reads all before top-k
    (GenerationOptions(sampling=Sampling(do_sample=True, stream="fast")), None, 50),
    (GenerationOptions(repetition_penalty=1.2), None, 1 + 6),  # lowers at most the 6 tokens seen
    (GenerationOptions(no_repeat_ngram_size=2), None, 0),
    (GenerationOptions(), lambda tokens, scores: False, 0),  # stopping criteria are given the scores
])
def test_greedy_search_asks_for_the_screen_only_where_the_argmax_is_all_it_reads(options, stopping, expected):
    processors = options.processors(prompt_len=4)
    assert head_screen(options, processors, stopping)(torch.zeros((2, 6), dtype=torch.long)) == expected


def test_a_repetition_penalty_widens_the_screen_by_the_tokens_it_may_lower():
    """A penalty above 1 lowers the scores of the tokens already seen (at most the sequences' length), so those
    many more leaders keep the pick exact; too many leaders for the rows, or a penalty below 1, take the full head."""
    options = GenerationOptions(eos_token_id=7, min_new_tokens=5, repetition_penalty=1.3,
                                sampling=Sampling(do_sample=True, top_k=40))
    screen = head_screen(options, options.processors(prompt_len=4), None)
    assert screen(torch.zeros((2, 6), dtype=torch.long)) == 40 + 1 + 6
    assert screen(torch.zeros((4, 300), dtype=torch.long)) == 0  # 4 x 341 leaders: the full head is cheaper
    raising = GenerationOptions(repetition_penalty=0.8)
    assert head_screen(raising, raising.processors(prompt_len=4), None)(torch.zeros((1, 6), dtype=torch.long)) == 0


def _screened_gpt2(family_dirs, onnx_work_dir):
    """The tiny GPT-2 (tied, GPT-2's vocabulary) on its shared-layout export, and the `screened_head` of each step."""
    m = nndf.load("GPT2", backend="onnxrt", torch_dir=str(family_dirs["GPT2"]), working_dir=str(onnx_work_dir),
                  device="cpu", kv_layout="shared")
    asked = []
    run = m.decoder.session.run
    m.decoder.session.run = lambda feeds: asked.append(int(feeds[INPUT][0])) or run(feeds)
    return m, asked


def test_the_tiny_gpt2_screens_greedy_steps_and_nothing_else(family_dirs, onnx_work_dir):
    """The shared-layout export has the screen, --info says so, greedy steps ask for it with room for the banned
    EOS (and, with a repetition penalty, for the tokens seen), beam search, sampling without top-k and scoring do
    not, the tokens are generate()'s; its int8 graph has no screen."""
    m, asked = _screened_gpt2(family_dirs, onnx_work_dir)
    session = m.decoder.session
    assert INPUT in session.input_names and any(note.startswith("LM head: screened") for note in session.info_notes)
    ids, mask = _batch([5, 9, 3])
    ours = m.generate(ids, mask, max_new_tokens=10, min_new_tokens=10)
    assert set(asked) == {2}  # one EOS id banned until the 10th token
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=10, min_new_tokens=10))
    asked.clear()
    penalized = m.generate(ids, mask, max_new_tokens=10, repetition_penalty=1.5)
    assert asked == list(range(1 + 9, 1 + 9 + 10))  # one more seen token each step
    assert torch.equal(penalized, m.hf_generate(ids, mask, max_new_tokens=10, repetition_penalty=1.5))
    asked.clear()
    m.generate(ids, mask, max_new_tokens=3, do_sample=True, top_k=0, seed=0)
    m.generate(ids, mask, max_new_tokens=3, num_beams=2)
    m.logits(ids)
    assert set(asked) == {0}
    quantized = nndf.load("GPT2", backend="onnxrt", loaded=m.loaded, working_dir=str(onnx_work_dir), quantize="int8",
                          kv_layout="shared")
    assert INPUT not in quantized.decoder.session.input_names
    assert not any(note.startswith("LM head") for note in quantized.decoder.session.info_notes)


def test_only_a_draw_that_reads_the_candidates_has_them_fetched(family_dirs, onnx_work_dir, monkeypatch):
    """A generation's IO binding fetches the screened head's candidates (an output ONNX Runtime allocates anew at
    every step) only where the draw reads them: top-k sampling, not greedy search."""
    from nndf.backends import onnxrt, ort_cache

    bindings = []

    class Recorded(ort_cache.SharedStep):
        def __init__(self, *args):
            super().__init__(*args)
            bindings.append(self.candidates)

    monkeypatch.setattr(onnxrt, "SharedStep", Recorded)
    m, steps = _screened_gpt2(family_dirs, onnx_work_dir)
    ids, mask = _batch([5, 9, 3])
    m.generate(ids, mask, max_new_tokens=4)
    m.generate(ids, mask, max_new_tokens=4, do_sample=True, seed=1)
    assert bindings == [False, True] and set(steps) == {1, 50}
    assert m.decoder.candidates is not None  # the sampled generation's last step's


@pytest.mark.parametrize("settings, asked", [
    (dict(do_sample=True, seed=3), 51),  # generate()'s top-k 50, and the EOS banned before min_new_tokens
    (dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, typical_p=0.95, seed=4), 6),
], ids=["top-k 50", "every warper after top-k"])
def test_top_k_sampling_on_the_screened_head_samples_like_generate(settings, asked, family_dirs, onnx_work_dir,
                                                                    monkeypatch):
    """The k highest scores are exact and every other below them, so the warpers and generate()'s draw see the full
    head's distribution: seeded tokens and streamer calls equal generate()'s, batch 3 with left padding."""
    m, steps = _screened_gpt2(family_dirs, onnx_work_dir)
    ids, mask = _batch([5, 9, 3])
    found = []  # top-k's k-th largest from the graph's candidates, at every step
    monkeypatch.setattr(processors, "screened_kth", lambda *args: found.append(screened_kth(*args)) or found[-1])
    assert_samples_like_generate(m, max_new_tokens=10, settings=dict(settings, min_new_tokens=10), input_ids=ids,
                                 attention_mask=mask)
    assert set(steps) == {asked}
    assert found and all(kept is not None for kept in found)


def test_the_fast_stream_draws_the_same_tokens_from_the_screened_head(family_dirs, onnx_work_dir, monkeypatch):
    """Top-k found among the screened head's candidates alone (the graph's second output) draws the tokens that the
    full head's whole rows give, with the same random numbers."""
    m, steps = _screened_gpt2(family_dirs, onnx_work_dir)
    among = []
    monkeypatch.setattr(fast_draw, "screened_top_k", lambda *args: among.append(screened_top_k(*args)) or among[-1])
    ids, mask = _batch([5, 9, 3])
    settings = dict(max_new_tokens=12, do_sample=True, temperature=0.8, sampling_stream="fast", seed=7)
    screened = m.generate(ids, mask, **settings)
    assert set(steps) == {50}
    # every step's top-k came from the candidates: 3 rows, each with at least 50 of them
    assert len(among) == 12 and all(kept is not None and set(kept[0].tolist()) == {0, 1, 2} for kept in among)
    monkeypatch.setattr(generation, "head_screen", lambda *args: lambda tokens: 0)
    assert torch.equal(screened, m.generate(ids, mask, **settings)) and steps[-1] == 0
    assert len(among) == 12  # the full head gives no candidates: the whole rows were read


def test_top_k_among_candidates_is_top_k_of_the_rows_or_declines():
    """The kept (row, column, score) equal `sampled_top_k`'s over whole rows, in its order, and the k-th
    largest `TopKLogitsWarper`'s; None where the candidates cannot tell (a row with fewer than k, NaN, or a k-th
    largest of -inf, where top-k keeps the whole row)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((3, 500)).astype(np.float32)
    table[1, 7] = np.sort(table[1])[-4]  # a twin of the 4th largest: both kept
    candidates = np.argwhere(table >= np.sort(table, axis=1)[:, -20:-19])  # row-major, the 20 highest per row
    kept = screened_top_k(table, candidates, 4)
    assert all(np.array_equal(a, b) for a, b in zip(kept[:3], kept_tokens.sampled_top_k(table, 4)))
    assert np.array_equal(kept[3], torch.topk(torch.from_numpy(table), 4).values[:, -1].numpy())
    assert len(kept[0]) == 3 * 4 + 1
    assert screened_top_k(table, candidates, 21) is None
    assert screened_top_k(table, candidates[candidates[:, 0] < 2], 4) is None  # no candidates for row 2
    for bad in (np.nan, np.inf):
        spoiled = table.copy()
        spoiled[2, candidates[-1, 1]] = bad
        assert screened_top_k(spoiled, candidates, 4) is None
    banned = table.copy()
    banned[0, candidates[candidates[:, 0] == 0][:, 1][:18]] = -np.inf  # only 2 finite candidates left in row 0
    assert screened_top_k(banned, candidates, 4) is None


def test_one_row_is_read_as_a_batch_of_rows_is_and_declines_alike():
    """Batch 1 takes a path of its own (fewer numpy calls right after a step): each row alone keeps what it keeps in
    the batch, with the same k-th largest, and declines where the batch path declines."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((3, 500)).astype(np.float32)
    table[1, 7] = np.sort(table[1])[-4]  # a twin of the 4th largest
    candidates = np.argwhere(table >= np.sort(table, axis=1)[:, -20:-19])
    batch = screened_top_k(table, candidates, 4)
    for r in range(3):
        alone = candidates[candidates[:, 0] == r] * [0, 1]  # its row numbered 0
        row, column, values, kth = screened_top_k(table[r:r + 1], alone, 4)
        mine = batch[0] == r
        assert np.array_equal(column, batch[1][mine]) and np.array_equal(values, batch[2][mine])
        assert not row.any() and kth.shape == (1,) and kth[0] == batch[3][r]
    one, alone = table[:1].copy(), candidates[candidates[:, 0] == 0]
    assert screened_top_k(one, alone, 21) is None  # fewer than k
    assert screened_top_k(one, candidates[candidates[:, 0] < 2], 4) is None  # a second row's candidates
    for bad in (np.nan, np.inf):
        spoiled = one.copy()
        spoiled[0, alone[-1, 1]] = bad
        assert screened_top_k(spoiled, alone, 4) is None
    one[0, alone[:, 1][:18]] = -np.inf  # a k-th largest of -inf: top-k keeps the whole row
    assert screened_top_k(one, alone, 4) is None


@pytest.mark.parametrize("io_binding", [False, True])
def test_a_session_returns_the_candidates_as_numpy_beside_its_roles_outputs(io_binding, tmp_path):
    """OrtSession takes the candidates output as optional (a graph without a screen has none) and returns it as a
    numpy array of (row, column) pairs, row-major, that hold each row's argmax; torch tensors for the role's own."""
    from nndf.backends.onnxrt import OrtSession

    table = _table()
    graph = tmp_path / "screened.onnx"
    graph.write_bytes(_screened_proto(table).SerializeToString())
    session = OrtSession(graph, ["ids", "h"], ["embedded", "logits"], io_binding=io_binding)
    assert session.output_names == ("embedded", "logits", CANDIDATES)
    h = _hidden(4, seed=5)[:, :1]
    outputs = session.run({"ids": torch.zeros((1, 1), dtype=torch.int64), "h": torch.from_numpy(h),
                           INPUT: torch.tensor([1])})
    assert isinstance(outputs["logits"], torch.Tensor) and isinstance(outputs[CANDIDATES], np.ndarray)
    found = outputs[CANDIDATES]
    assert found.shape[1] == 2 and np.array_equal(found, found[np.lexsort((found[:, 1], found[:, 0]))])
    best = (h[:, 0] @ table.T).argmax(-1)
    assert all(((found[:, 0] == row) & (found[:, 1] == column)).any() for row, column in enumerate(best))
