"""Seeded sampling and streaming against Hugging Face `generate()`, shared by the parity tests of every family and
backend (tests/test_families.py, test_seq2seq.py, test_blip.py and the trt ones), which load each model once.

`assert_samples_like_generate(model, **inputs)`: for each setting of `SAMPLED`, `model.generate(..., seed=S)` gives
the tokens of `torch.manual_seed(S); generate(do_sample=True, ...)` on the same PyTorch model, and a recording
streamer receives the same `put()` calls (the prompt, then each step's tokens) and one `end()` from both; the
sampled tokens differ from greedy search's (the draw did something).
"""

from __future__ import annotations

import torch

# A flat distribution (every token possible: the draw decides) and a shaped one (every warper on, with the
# repetition penalty); random weights give near-flat logits, so both draw far from greedy search.
SAMPLED = (
    dict(do_sample=True, temperature=1.5, top_k=0, seed=11),
    dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.9, min_p=0.001, typical_p=0.95, repetition_penalty=1.3,
         seed=12),
)


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


def assert_samples_like_generate(model, max_new_tokens: int = 10, **inputs) -> None:
    greedy = model.generate(**inputs, max_new_tokens=max_new_tokens)
    for settings in SAMPLED:
        ours, theirs = RecordingStreamer(), RecordingStreamer()
        sampled = model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=ours, **settings)
        reference = model.hf_generate(**inputs, max_new_tokens=max_new_tokens, streamer=theirs, **settings)
        assert torch.equal(sampled, reference), f"{model.backend} {settings}"
        assert ours.same_as(theirs), f"{model.backend} {settings}: the streamer got other calls than generate()'s"
        assert ours.calls[-1] == ("end",) and len(ours.calls) == 2 + sampled.shape[1] - ours.calls[0][1].shape[1]
        assert not torch.equal(sampled, greedy[:, : sampled.shape[1]]), f"{settings}: sampling gave greedy's tokens"
