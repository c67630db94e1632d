"""bench/triton_cpu.py's pieces that need no server: the texts it sends and its report (the figures themselves are
measured by running it, never in tests)."""

from __future__ import annotations

from conftest import load_bench

triton_cpu = load_bench("triton_cpu")


def test_texts_are_cut_to_the_asked_length(minilm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    texts = triton_cpu.texts_of(tokenizer, 16, 12)
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    assert len(texts) == 12 and max(lengths) <= 16 and min(lengths) >= 12


def test_report_gives_requests_per_second_and_the_overhead():
    results = {"direct": triton_cpu.summary([0.010] * 9 + [0.02]),
               "http": triton_cpu.summary([0.015] * 10)}
    text = triton_cpu.render(results)
    assert "direct      10.00   10.00        90.9  -" in text and "+5.00 ms (1.50x)" in text
    assert round(results["http"]["requests_per_s"], 1) == 66.7
