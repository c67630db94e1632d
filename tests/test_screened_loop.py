"""The screened LM head in the loop: when greedy search and sampling ask for the screen and how wide
(`nndf.processors.head_screen`), the tiny GPT-2's generations on it (greedy, top-k sampling on either stream, the
candidates fetched only for a draw that reads them), and top-k read from the candidates alone
(`screened_kth`, `screened_top_k`). The graph itself: tests/test_screened_head.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nndf
from nndf import fast_draw, generation, kept_tokens, processors
from nndf.export.screened_head import INPUT
from nndf.generation import GenerationOptions
from nndf.processors import head_screen, screened_kth, screened_top_k
from nndf.sampling import Sampling
from sampling_checks import assert_samples_like_generate
from test_generation_parity import _batch


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
