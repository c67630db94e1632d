"""Seeded sampling and streaming against Hugging Face `generate()`, shared by the parity tests of every family and
backend (tests/test_families.py, test_seq2seq.py, test_blip.py and the trt ones), which load each model once.

`assert_samples_like_generate(model, **inputs)`: `model.generate(..., seed=S)` gives the tokens of
`torch.manual_seed(S); generate(do_sample=True, ...)` on the same PyTorch model, and a recording streamer receives
the same `put()` calls (the prompt, then each step's tokens) and one `end()` from both. The settings draw from the
whole vocabulary (no top-k) at a high temperature, so that on random weights the draw, not the logits' order,
picks every token: the parity cannot come from greedy search by chance. Every warper is checked on GPT-2 in
tests/test_sampling.py (`EVERY_WARPER`): the warpers act on the scores alike whatever computed them.
"""

from __future__ import annotations

import torch

FLAT = dict(do_sample=True, temperature=1.5, top_k=0, seed=11)
EVERY_WARPER = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.9, min_p=0.001, typical_p=0.95,
                    repetition_penalty=1.3, seed=12)


class RecordingStreamer:
    """Hugging Face's streamer protocol, recording every call: ("put", tokens) and ("end",)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(("put", value.clone()))

    def end(self) -> None:
        self.calls.append(("end",))

    def same_as(self, other: "RecordingStreamer") -> bool:
        return len(self.calls) == len(other.calls) and all(
            a[0] == b[0] and (a[0] == "end" or torch.equal(a[1], b[1])) for a, b in zip(self.calls, other.calls))


def assert_samples_like_generate(model, max_new_tokens: int = 10, settings: dict = FLAT, **inputs) -> torch.Tensor:
    """Sampled tokens and streamer calls equal generate()'s; returns the tokens."""
    ours, theirs = RecordingStreamer(), RecordingStreamer()
    sampled = model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=ours, **settings)
    reference = model.hf_generate(**inputs, max_new_tokens=max_new_tokens, streamer=theirs, **settings)
    assert torch.equal(sampled, reference), f"{model.backend} {settings}"
    assert ours.same_as(theirs), f"{model.backend} {settings}: the streamer got other calls than generate()'s"
    prompt = ours.calls[0][1]
    assert ours.calls[-1] == ("end",) and len(ours.calls) == 2 + sampled.shape[1] - prompt.shape[1]
    return sampled
