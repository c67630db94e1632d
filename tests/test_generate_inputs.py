"""What `Model.generate` does with the inputs a caller gives it, as Hugging Face `generate()` does (checked by
running it): no prompt at all starts from the BOS token, and an input it cannot read is one sentence (a UsageError),
not a traceback from inside the loop, a streamer or transformers' stopping criteria."""

from __future__ import annotations

import warnings

import pytest
import torch

import nndf
from nndf.errors import UsageError


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_dir):
    return nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")


def test_no_input_ids_starts_from_the_bos_token_as_generate(gpt2, seq2seq_dirs):
    """generate() without input_ids starts a decoder-only model from one BOS token (and an encoder-decoder model's
    encoder from it), greedy and with beams; a model with no BOS token is refused, as generate() refuses it."""
    bart = nndf.load("BART", torch_dir=str(seq2seq_dirs["bart"]), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generate()'s advice to set max_new_tokens
        for m in (gpt2, bart):
            for settings in (dict(max_new_tokens=5), dict(max_new_tokens=5, num_beams=2), {}):
                ours = m.generate(**settings)
                assert torch.equal(ours, m.loaded.model.generate(**settings)), (m.spec.family, settings)
                assert torch.equal(ours, m.hf_generate(**settings))
    out = gpt2.generate(max_new_tokens=3)
    assert out[0, 0] == gpt2.loaded.generation_config.bos_token_id
    assert torch.equal(gpt2.new_tokens(out, None), out[:, 1:])  # the new tokens follow that BOS token
    with pytest.raises(UsageError, match="attention_mask was given without input_ids"):
        gpt2.generate(attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=3)
    t5 = nndf.load("T5", torch_dir=str(seq2seq_dirs["t5"]), device="cpu")
    assert t5.loaded.generation_config.bos_token_id is None
    with pytest.raises(ValueError, match="bos_token_id"):
        t5.loaded.model.generate(max_new_tokens=3)
    with pytest.raises(UsageError, match="names no bos_token_id"):
        t5.generate(max_new_tokens=3)


@pytest.mark.parametrize("settings, message", [
    (dict(pad_token_id=10 ** 6), r"pad_token_id must be a token id \(0 to 50256\), got 1000000"),
    (dict(pad_token_id=-1), r"pad_token_id must be a token id \(0 to 50256\), got -1"),
    (dict(eos_token_id="x"), r"eos_token_id must be a token id \(0 to 50256\) or a non-empty list of them, got 'x'"),
    (dict(eos_token_id=1.5), r"eos_token_id must be a token id .*, got 1.5"),  # was cut to 1 without a word
    (dict(eos_token_id=[1, "a"]), r"eos_token_id must be a token id .*, got \[1, 'a'\]"),
    (dict(forced_bos_token_id=50260), r"^forced_bos_token_id must be a token id \(0 to 50256\), got 50260$"),
    (dict(stop_strings=5), r"stop_strings must be a string or a list of strings, as generate\(\) takes them; got 5"),
    (dict(streamer=5), r"streamer must have put\(tokens\) and end\(\), .*; got a int"),
    (dict(attention_mask=torch.full((2, 3), 2)), r"attention_mask must hold 1 for a token and 0 for a pad, .*\[2\]"),
    (dict(input_ids=torch.zeros(0, 3, dtype=torch.long)), r"input_ids has no rows \(shape \(0, 3\)\)"),
])
def test_inputs_generate_cannot_read_are_one_sentence(gpt2, settings, message):
    """Each was a raw error from inside (IndexError from the embedding of a finished row's pad or from the forced
    BOS processor, int()'s ValueError, TypeError from StopStringCriteria, AttributeError from streamer.put, a
    reshape error on no rows) or a silent result (a mask of 2s, which generate() reads as another mask), and is now
    a UsageError naming the keyword; in hf_generate (the reference) too."""
    ids = settings.pop("input_ids", torch.tensor([[5, 6, 7], [8, 9, 10]]))
    for method in (gpt2.generate, gpt2.hf_generate):
        with pytest.raises(UsageError, match=message):
            method(ids, max_new_tokens=3, **settings)


@pytest.mark.parametrize("ids, mask, message", [
    ([[5, 6, 7]], None, r"^input_ids must be a torch tensor \(batch x length\), as generate\(\) takes it; got a list"),
    (torch.tensor([5, 6, 7]), None, r"^input_ids must be 2-D \(batch x length\); got shape \(3,\)"),
    (torch.tensor([[5.0, 6.0]]), None, "^input_ids must hold integer token ids or 0/1 flags; got torch.float32$"),
    (torch.tensor([[5, 6, 7]]), torch.ones(1, 2, dtype=torch.long),
     r"^attention_mask has shape \(1, 2\) and input_ids \(1, 3\); they must match$"),
])
def test_hf_generate_reads_the_prompt_as_generate_does(gpt2, ids, mask, message):
    """hf_generate (the reference beside every backend) refuses a prompt it cannot read in generate's sentence;
    it raised AttributeError, IndexError or a RuntimeError from inside the model."""
    with pytest.raises(UsageError, match=message):
        gpt2.hf_generate(ids, mask, max_new_tokens=3)
