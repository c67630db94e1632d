"""`logit_fidelity` (the agreement and KL columns of accuracy's non-PyTorch rows) on hand-computed probabilities,
and the one PyTorch reference pass that every judged backend shares (tests/test_evaluation.py: the LAMBADA metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from nndf.evaluation import FidelityMetrics, logit_fidelity


class XYZTokenizer:
    def __call__(self, text):
        return {"input_ids": ["xyz".index(c) for c in text]}


def fixed_logits(rows):
    """Logits function returning the given probability rows for positions 0..T-1, whatever the ids are."""

    def fn(ids, mask):
        one = [[math.log(p) for p in rows[t]] for t in range(ids.shape[1])]
        return torch.tensor([one] * ids.shape[0], dtype=torch.float32)

    return fn


def test_fidelity_identical_functions():
    fn = fixed_logits([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    f = logit_fidelity(["xyz", "x"], XYZTokenizer(), fn, fn, max_positions=8, progress=False)
    assert f == FidelityMetrics(positions=4, top1_agreement=1.0, mean_kl=pytest.approx(0.0, abs=1e-12))


def test_fidelity_hand_computed_kl_and_agreement():
    ref = fixed_logits([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]])
    cand = fixed_logits([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]])
    # Position 0: argmax 0 vs 1, KL = 0.5 ln 2 + 0.25 ln 0.5 = 0.25 ln 2; position 1 identical. Text "xyz" is cut
    # to 2 positions by max_positions; "z" adds one more position 0, so 1 of 3 positions agree.
    f = logit_fidelity(["xyz", "z"], XYZTokenizer(), ref, cand, max_positions=2, progress=False)
    assert f.positions == 3
    assert f.top1_agreement == pytest.approx(1 / 3)
    assert f.mean_kl == pytest.approx(2 * 0.25 * math.log(2) / 3, rel=1e-6)
    assert f.as_dict() == {"positions": 3, "top1_agreement": f.top1_agreement, "mean_kl": f.mean_kl}


class _FakeScored:
    """What `DecoderOnly.fidelities` reads of a model: its logits, the PyTorch reference's (counted), tokenizer,
    positions and vocabulary."""

    def __init__(self, logits_fn, reference_fn, calls: list):
        self.logits_fn, self.reference_fn, self.calls = logits_fn, reference_fn, calls
        self.tokenizer, self.max_positions = XYZTokenizer(), 8
        self.shapes = type("Shapes", (), {"vocab_size": 3})()

    def logits(self, ids, attention_mask=None):
        return self.logits_fn(ids, attention_mask)

    def reference_logits(self, ids, attention_mask=None):
        self.calls.append(ids.shape)
        return self.reference_fn(ids, attention_mask)


def test_fidelities_compare_every_backend_with_one_reference_pass():
    """`accuracy` ran the PyTorch reference again for every backend it judged (28 s of a 50 s pass each)."""
    from nndf.architectures import DecoderOnly

    ref = fixed_logits([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    near = fixed_logits([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    calls: list = []
    models = [_FakeScored(ref, ref, calls), _FakeScored(near, ref, calls)]
    texts = ["xyz", "xy", "zz", "x"]  # three lengths: three batches
    same, changed = DecoderOnly().fidelities(texts, models, batch_size=4)
    assert len(calls) == 3  # one reference pass per batch, for both backends
    assert same == logit_fidelity(texts, XYZTokenizer(), ref, ref, max_positions=8, progress=False)
    assert changed == logit_fidelity(texts, XYZTokenizer(), ref, near, max_positions=8, progress=False)
    assert changed.top1_agreement == pytest.approx(4 / 8)  # position 0 of each passage disagrees
    assert DecoderOnly().fidelity(texts, models[1], batch_size=4) == changed


def test_the_fidelity_progress_bar_says_what_it_is_and_how_to_skip_it(capsys):
    fn = fixed_logits([[0.5, 0.25, 0.25]])
    logit_fidelity(["x"], XYZTokenizer(), fn, fn, max_positions=8)
    assert "fidelity vs PyTorch (--no-fidelity skips)" in capsys.readouterr().err


class _Drifted:
    """Another backend of `model` whose logits drift from its own by a fixed pattern (as a quantized export's do)."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # tokenizer, PyTorch reference, shapes: those of the model it drifts from
        return getattr(self.model, name)

    def logits(self, *inputs, attention_mask=None):
        out = self.model.logits(*inputs, attention_mask=attention_mask)
        return out + 0.5 * torch.cos(torch.arange(out.shape[-1], dtype=out.dtype))


def _one_backend_as_before(texts, model, backend, batch_size):
    """The encoder-decoder fidelity of one backend as accuracy computed it before the reference was shared: the
    reference and the candidate each over every batch, compared pair by pair in float64, summed in passage order."""
    from nndf.evaluation import compare_logits
    from nndf.seq2seq.evaluation import encode_pair, teacher_forced_logits

    pairs = [encode_pair(model.tokenizer, text, model.max_positions) for text in texts]
    decoder_inputs = model.architecture.decoder_inputs(model)
    per_pair = [None] * len(pairs)
    references = teacher_forced_logits(lambda i, m, d: model.reference_logits(i, d, attention_mask=m), pairs,
                                       decoder_inputs, batch_size, None)
    candidates = teacher_forced_logits(lambda i, m, d: backend.logits(i, d, attention_mask=m), pairs,
                                       decoder_inputs, batch_size, None)
    for (index, ref), (_, cand) in zip(references, candidates):
        per_pair[index] = compare_logits(ref, cand)
    positions, agree, kl = 0, 0, 0.0
    for n, a, k in per_pair:
        positions, agree, kl = positions + n, agree + a, kl + k
    return FidelityMetrics(positions=positions, top1_agreement=agree / positions, mean_kl=kl / positions)


def test_encoder_decoder_fidelities_share_one_reference_pass(text_models, monkeypatch):
    """accuracy on T5, BART and mBART ran the PyTorch reference again for every backend it judged; now once per
    batch for all of them, each backend's figures those of judging it alone, to the last bit."""
    import nndf
    from nndf.lambada import read_jsonl_texts
    from nndf.seq2seq.evaluation import encode_pair, pair_groups

    from conftest import LAMBADA_FILE

    model = nndf.load("T5", backend="frameworks", torch_dir=str(text_models["T5"]))
    texts = read_jsonl_texts(LAMBADA_FILE)[:8]
    calls: list = []
    reference = model.reference_logits

    def counted(*inputs, **keywords):
        calls.append(inputs[0].shape)
        return reference(*inputs, **keywords)

    monkeypatch.setattr(model, "reference_logits", counted)
    backends = [model, _Drifted(model)]
    figures = model.architecture.fidelities(texts, backends, batch_size=4)
    pairs = [encode_pair(model.tokenizer, text, model.max_positions) for text in texts]
    assert len(calls) == len(list(pair_groups(pairs, 4, None))) < len(texts)  # once per batch, for both backends
    calls.clear()
    assert figures == [_one_backend_as_before(texts, model, backend, 4) for backend in backends]
    assert len(calls) == 2 * len(list(pair_groups(pairs, 4, None)))  # the oracle: once per batch per backend
    assert figures[0].top1_agreement == 1.0 and figures[0].mean_kl < 1e-9
    assert figures[1].mean_kl > 1e-3  # the drift is seen, so the two are not trivially equal
    assert model.architecture.fidelity(texts, backends[1], batch_size=4) == figures[1]
