"""Tests for nndf.evaluation: hand-computed LAMBADA metrics on a fake model, batching, and a trained tiny GPT-2.

The fake model is a table of next-token probabilities keyed by the token prefix, so every expected number below
is a closed-form expression of probabilities chosen in the test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nndf.errors import HarnessError, UsageError
from nndf.evaluation import (
    LambadaMetrics,
    evaluate_lambada,
    lm_eval_context_target,
    logit_fidelity,
)
from nndf.lambada import read_jsonl_texts, sample_texts

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Character vocabulary: ' ' = 0, 'a'..'k' = 1..11, and 12 is a BOS id some fake tokenizers prepend.
CHARS = " abcdefghijk"
VOCAB = {c: i for i, c in enumerate(CHARS)}
V = 13
BOS = 12
SP, A, B, C, D, E, F = (VOCAB[c] for c in " abcdef")


class CharTokenizer:
    """One id per character, optionally prepending BOS when special tokens are requested (the HF default)."""

    def __init__(self, bos: int | None = None):
        self.bos = bos
        self.bos_token_id = bos
        self.eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [VOCAB[c] for c in text]
        return ([self.bos] if add_special_tokens and self.bos is not None else []) + ids

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: list[int]) -> str:
        return "".join("<s>" if i == BOS else CHARS[i] for i in ids)


class TableModel:
    """Logits function whose next-token distribution at each position is looked up by the prefix.

    Listed tokens get the listed probabilities; the rest of the mass is spread evenly over the other tokens; an
    unlisted prefix gives a uniform distribution. Every call's input is recorded.
    """

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]]):
        self.table = table
        self.calls: list[list[int]] = []
        self.batches = 0

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert input_ids.dtype == torch.long and input_ids.shape == attention_mask.shape
        self.batches += 1
        batch = []
        for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            length = sum(mask)
            assert mask == [1] * length + [0] * (len(mask) - length), "sequences must be padded on the right"
            ids = row[:length]
            self.calls.append(ids)
            rows = []
            for t in range(len(row)):  # pad positions get whatever their prefix gives: scoring must ignore them
                listed = self.table.get(tuple(row[: t + 1]), {})
                rest = (1.0 - sum(listed.values())) / (V - len(listed))
                rows.append([math.log(listed.get(v, rest)) for v in range(V)])
            batch.append(rows)
        return torch.tensor(batch, dtype=torch.float32)


def evaluate(texts, table, tokenizer=None, **kwargs):
    model = TableModel(table)
    kwargs.setdefault("max_positions", 64)
    kwargs.setdefault("progress", False)
    metrics = evaluate_lambada(texts, tokenizer or CharTokenizer(), model, **kwargs)
    return metrics, model


# ----------------------------------------------------------------------------------------------------------------
# NVIDIA-demo and lm-eval metrics on hand-computed cases
# ----------------------------------------------------------------------------------------------------------------


def test_two_passages_all_metrics_and_one_call_per_passage():
    # "ab c" -> [a, b, ' ', c]: every next token has p = 0.5 and is the argmax.
    # "ba d" -> [b, a, ' ', d]: p(a) = 0.1, p(' ') = 0.2 (not argmax), p(d) = 0.3 with token 7 at 0.4 (rank 2).
    table = {
        (A,): {B: 0.5},
        (A, B): {SP: 0.5},
        (A, B, SP): {C: 0.5},
        (B,): {A: 0.1, 5: 0.6},
        (B, A): {SP: 0.2, 6: 0.7},
        (B, A, SP): {D: 0.3, 7: 0.4},
    }
    m, model = evaluate(["ab c", "ba d"], table, tokens_to_generate=1, top_n=2)

    assert model.calls == [[A, B, SP], [B, A, SP]]
    assert m.samples == 2 and m.top_n == 2
    assert m.top1 == pytest.approx(0.5)  # c is the argmax, d is second
    assert m.topN == pytest.approx(1.0)  # both within the top 2
    assert m.top10 == pytest.approx(1.0)
    # Per passage mean NLL of the last token, then exp of the mean over passages.
    assert m.token_perplexity == pytest.approx(math.exp((math.log(2) + math.log(1 / 0.3)) / 2), rel=1e-5)
    seq_p2 = (math.log(10) + math.log(5) + math.log(1 / 0.3)) / 3
    assert m.sequence_perplexity == pytest.approx(math.exp((math.log(2) + seq_p2) / 2), rel=1e-5)
    # lm-eval: target " c" / " d" is two tokens [' ', x]; only the first passage is greedy.
    assert m.lm_eval_accuracy == pytest.approx(0.5)
    assert m.lm_eval_perplexity == pytest.approx(math.sqrt(4 / 0.06), rel=1e-5)


def test_log_perplexity_is_clipped_at_12_per_passage():
    # "ab cd": every token has p = e^-30 and is ranked last; "ba dc": every token has p = 0.5 and is the argmax.
    tiny = math.exp(-30)
    table = {
        (A,): {B: tiny},
        (A, B): {SP: tiny},
        (A, B, SP): {C: tiny},
        (A, B, SP, C): {D: tiny},
        (B,): {A: 0.5},
        (B, A): {SP: 0.5},
        (B, A, SP): {D: 0.5},
        (B, A, SP, D): {C: 0.5},
    }
    m, _ = evaluate(["ab cd", "ba dc"], table, tokens_to_generate=2, top_n=5)

    clipped = math.exp((12 + math.log(2)) / 2)  # unclipped this would be exp(15.35) -> capped at 1e5
    assert m.token_perplexity == pytest.approx(clipped, rel=1e-5)
    assert m.sequence_perplexity == pytest.approx(clipped, rel=1e-5)
    assert (m.top1, m.topN, m.top10) == pytest.approx((0.5, 0.5, 0.5))  # rank 13 of 13 misses even top 10
    # lm-eval has no clip: target " cd" has log-likelihood -90, " dc" has 3 ln 0.5.
    assert m.lm_eval_accuracy == pytest.approx(0.5)
    assert m.lm_eval_perplexity == pytest.approx(math.exp((90 + 3 * math.log(2)) / 2), rel=1e-5)


def test_clip_applies_to_the_passage_mean_and_summary_is_capped_at_1e5():
    # Targets c (p = e^-30) and d (p = 0.5): mean NLL (30 + ln 2) / 2 > 12 is clipped to 12, exp(12) > 1e5 is
    # capped. Clipping each token instead would give exp((12 + ln 2) / 2) = 570.5.
    table = {
        (A,): {B: 0.5},
        (A, B): {SP: 0.5},
        (A, B, SP): {C: math.exp(-30)},
        (A, B, SP, C): {D: 0.5},
    }
    m, _ = evaluate(["ab cd"], table, tokens_to_generate=2)

    assert m.token_perplexity == 100000.0
    assert m.sequence_perplexity == pytest.approx(math.exp((30 + 3 * math.log(2)) / 4), rel=1e-5)
    assert m.top1 == pytest.approx(0.5)


def test_short_passage_is_skipped_for_demo_metrics_only():
    # With tokens_to_generate=3, "e f" (3 tokens) has no context left; "ab c" (4 tokens) does.
    table = {
        (A,): {B: 0.5},
        (A, B): {SP: 0.5},
        (A, B, SP): {C: 0.5},
        (E,): {SP: 0.5},
        (E, SP): {F: 0.25},
    }
    m, _ = evaluate(["ab c", "e f"], table, tokens_to_generate=3)

    assert m.samples == 2
    assert m.token_perplexity == pytest.approx(2.0, rel=1e-5)
    assert m.sequence_perplexity == pytest.approx(2.0, rel=1e-5)
    assert m.top1 == pytest.approx(1.0)
    assert m.lm_eval_accuracy == pytest.approx(1.0)
    assert m.lm_eval_perplexity == pytest.approx(2**2.5, rel=1e-5)  # lls -2 ln 2 and -3 ln 2


def test_all_passages_too_short_gives_nan_demo_metrics():
    m, _ = evaluate(["e f"], {}, tokens_to_generate=5)
    assert math.isnan(m.top1) and math.isnan(m.token_perplexity) and math.isnan(m.sequence_perplexity)
    assert m.lm_eval_perplexity == pytest.approx(13.0**2, rel=1e-5)  # uniform over 13 tokens, 2 target tokens


def test_bos_tokenizer_scores_both_families_after_bos_in_one_call():
    # A tokenizer that prepends BOS (OPT's, Llama's): the demo sees tokenizer(text) = [BOS, a, b, ' ', c], and so
    # does lm-eval, whose hf model encodes with the tokenizer's own special tokens: its target [' ', c] scores
    # 0.25 x 0.25 after BOS (ppl 16; without BOS it would score 0.5 x 0.5, ppl 4).
    table = {
        (A,): {B: 0.5},
        (A, B): {SP: 0.5},
        (A, B, SP): {C: 0.5},
        (BOS,): {A: 0.25},
        (BOS, A): {B: 0.25},
        (BOS, A, B): {SP: 0.25},
        (BOS, A, B, SP): {C: 0.25},
    }
    m, model = evaluate(["ab c"], table, tokenizer=CharTokenizer(bos=BOS))

    assert model.calls == [[BOS, A, B, SP]]
    assert m.token_perplexity == pytest.approx(4.0, rel=1e-5)
    assert m.sequence_perplexity == pytest.approx(4.0, rel=1e-5)
    assert m.top1 == pytest.approx(1.0)
    assert m.lm_eval_perplexity == pytest.approx(16.0, rel=1e-5)
    assert m.lm_eval_accuracy == pytest.approx(1.0)


def test_truncation_cuts_lm_eval_from_the_left_and_the_demo_from_the_right():
    # "ab cd" = [a, b, ' ', c, d] with max_positions=3: lm-eval scores window [b, ' ', c] (predicting ' ', c, d);
    # the demo keeps [a, b, ' '] and predicts b then ' ' (the last token of the cut sequence).
    table = {
        (B,): {SP: 0.5},
        (B, SP): {C: 0.5},
        (B, SP, C): {D: 0.5},
        (A,): {B: 0.5},
        (A, B): {SP: 0.25},
    }
    m, model = evaluate(["ab cd"], table, max_positions=3)

    assert sorted(model.calls) == sorted([[B, SP, C], [A, B]])
    assert m.lm_eval_perplexity == pytest.approx(8.0, rel=1e-5)
    assert m.lm_eval_accuracy == pytest.approx(1.0)
    assert m.token_perplexity == pytest.approx(4.0, rel=1e-5)
    assert m.sequence_perplexity == pytest.approx(math.sqrt(8.0), rel=1e-5)


def test_target_longer_than_window_is_a_usage_error():
    with pytest.raises(UsageError, match="max_positions 2"):
        evaluate(["ab cd"], {}, max_positions=2)


def test_lm_eval_split_uses_single_spaces_only():
    assert lm_eval_context_target("one two\nthree") == ("one", " two\nthree")
    assert lm_eval_context_target("a  b") == ("a ", " b")


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tokens_to_generate": 0}, "--tokens-to-generate"),
        ({"top_n": 0}, "--topN"),
        ({"max_positions": 1}, "max_positions"),
    ],
)
def test_bad_settings_are_usage_errors(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        evaluate(["ab c"], {}, **kwargs)


def test_no_passages_is_a_usage_error():
    with pytest.raises(UsageError, match="no LAMBADA passages"):
        evaluate([], {})


def test_wrong_logits_shape_is_a_harness_error():
    def bad(ids, mask):
        return torch.zeros(1, ids.shape[1] + 1, V)

    with pytest.raises(HarnessError, match=r"shape \(1, 4, 13\)"):
        evaluate_lambada(["ab c"], CharTokenizer(), bad, max_positions=64, progress=False)


def test_as_dict_and_progress_bar(capsys):
    m = evaluate_lambada(["ab c"], CharTokenizer(), TableModel({}), max_positions=64, progress=True)
    assert isinstance(m, LambadaMetrics)
    assert list(m.as_dict()) == [
        "samples", "top_n", "top1", "topN", "top10", "token_perplexity", "sequence_perplexity",
        "lm_eval_accuracy", "lm_eval_perplexity", "cut_passages",
    ]
    assert "LAMBADA" in capsys.readouterr().err
    with pytest.raises(AttributeError):
        m.samples = 3  # frozen


# ----------------------------------------------------------------------------------------------------------------
# Trained tiny GPT-2 that memorised LAMBADA passages 2500-2999
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2():
    if not (SHARED_DATA / "lambada-tiny-gpt2").is_dir() or not (SHARED_DATA / "lambada").is_dir():
        pytest.skip(f"shared test data is absent at {SHARED_DATA} (only present on the project's build machine)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "gpt2-tokenizer")
    model = AutoModelForCausalLM.from_pretrained(SHARED_DATA / "lambada-tiny-gpt2").eval()
    texts = read_jsonl_texts(SHARED_DATA / "lambada" / "lambada_test.jsonl")
    return tokenizer, model, texts


def _tiny_metrics(tiny_gpt2, lo, hi):
    tokenizer, model, texts = tiny_gpt2
    calls = []

    def logits_fn(ids, mask):
        calls.append(ids.shape[1])
        return model(ids, attention_mask=mask).logits

    passages = [t for _, t in sample_texts(texts[lo:hi], 20, seed=0)]
    metrics = evaluate_lambada(passages, tokenizer, logits_fn, max_positions=model.config.n_positions, progress=False)
    return metrics, calls


def test_tiny_gpt2_memorised_passages(tiny_gpt2):
    m, calls = _tiny_metrics(tiny_gpt2, 2500, 3000)
    assert m.samples == 20 and len(calls) == 20  # GPT-2 adds no BOS: one forward pass per passage
    assert m.lm_eval_accuracy == 1.0
    assert 1.0 < m.lm_eval_perplexity < 1.5  # 1.14 over all 500 passages
    assert m.top1 == 1.0 and m.token_perplexity < 1.5


def test_tiny_gpt2_unseen_passages(tiny_gpt2):
    m, _ = _tiny_metrics(tiny_gpt2, 2000, 2500)
    assert m.lm_eval_accuracy == 0.0
    assert m.lm_eval_perplexity > 1000.0
    assert m.top1 < 0.2


def test_tiny_gpt2_in_batches_gives_the_one_by_one_figures(tiny_gpt2):
    """Batches of passages of one length: exactly the figures of one passage per pass, in fewer passes."""
    tokenizer, model, texts = tiny_gpt2
    calls = []

    def logits_fn(ids, mask):
        calls.append(ids.shape[0])
        return model(ids, attention_mask=mask).logits

    passages = [t for _, t in sample_texts(texts[2400:2800], 60, seed=1)]  # memorised and unseen
    one = evaluate_lambada(passages, tokenizer, logits_fn, max_positions=model.config.n_positions, progress=False)
    assert calls == [1] * 60
    calls.clear()
    batched = evaluate_lambada(passages, tokenizer, logits_fn, max_positions=model.config.n_positions,
                               progress=False, batch_size=8)
    assert len(calls) < 45 and max(calls) > 2
    assert batched == one  # to the last bit
    calls.clear()
    fidelity = logit_fidelity(passages[:20], tokenizer, logits_fn, logits_fn, max_positions=model.config.n_positions,
                              progress=False, batch_size=5, max_batch_tokens=5 * 60)
    assert fidelity.top1_agreement == 1.0 and fidelity.mean_kl == 0.0
    assert max(calls) < 5  # the token budget split batches of long passages


def test_table_model_in_batches_is_exact():
    """A model whose rows do not depend on each other gives exactly the one-by-one figures in any batching,
    padded positions ignored; identical passages share one pass."""
    table = {(0,): {1: 0.6}, (0, 1): {2: 0.5}, (2,): {0: 0.9}, (2, 0): {1: 0.3}}
    texts = ["ab c", "c ab", "ab c", "a b", "cab c a", "ba c"]
    one, model_one = evaluate(texts, table, tokens_to_generate=2)
    for batch_size in (2, 4, 100):
        batched, model = evaluate(texts, table, tokens_to_generate=2, batch_size=batch_size)
        assert batched == one
        assert model.batches < model_one.batches
        assert len(model.calls) == len({tuple(c) for c in model_one.calls})


def test_length_groups_take_the_longest_first_within_rows_and_tokens():
    from nndf.batching import length_groups

    lengths = [3, 10, 1]
    assert list(length_groups([3, 10, 1, 7, 7, 2, 7, 3], 2)) == [[1], [3, 4], [6], [0, 7], [5], [2]]
    assert list(length_groups([5, 5, 5, 5, 5], 4, max_tokens=10)) == [[0, 1], [2, 3], [4]]
    assert list(length_groups([50, 1], 4, max_tokens=20)) == [[0], [1]]  # a long sequence still gets its pass
    assert list(length_groups([(4, 2), (4, 3), (4, 2)], 8)) == [[0, 2], [1]]  # pairs: both parts equal
    with pytest.raises(UsageError, match="--batch-size must be at least 1"):
        list(length_groups(lengths, 0))
