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
    assert gpt2.generate(max_new_tokens=3)[0, 0] == gpt2.loaded.generation_config.bos_token_id
    with pytest.raises(UsageError, match="attention_mask was given without input_ids"):
        gpt2.generate(attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=3)
    t5 = nndf.load("T5", torch_dir=str(seq2seq_dirs["t5"]), device="cpu")
    assert t5.loaded.generation_config.bos_token_id is None
    with pytest.raises(ValueError, match="bos_token_id"):
        t5.loaded.model.generate(max_new_tokens=3)
    with pytest.raises(UsageError, match="names no bos_token_id"):
        t5.generate(max_new_tokens=3)
