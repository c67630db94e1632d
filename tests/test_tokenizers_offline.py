"""The offline T5, BART and mBART-50 tokenizers of tokenizers_offline.py behave as the real ones do where users rely
on it: AutoTokenizer loads them with the hub off, text round-trips, the special tokens sit at the real models' ids,
and a model sized by vocab_size() takes every id they give."""

from __future__ import annotations

import json
import os
import unicodedata

import pytest
import torch
from conftest import LAMBADA_FILE, TOKENIZER_DIR, needs_shared

import tokenizers_offline as tok_off

TEXTS = [  # LAMBADA passages past the ones the SentencePiece models were trained on
    json.loads(line)["text"] for i, line in enumerate(open(LAMBADA_FILE, encoding="utf-8"))
    if 4000 <= i < 4010
] if LAMBADA_FILE.exists() else []
PROMPT = "translate English to German: Hello"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def t5_dir(root):
    return tok_off.t5_tokenizer_dir(root, real=False)


@pytest.fixture(scope="module")
def bart_dir(root):
    return tok_off.bart_tokenizer_dir(root)


@pytest.fixture(scope="module")
def mbart50_dir(root):
    return tok_off.mbart50_tokenizer_dir(root)


def load(folder, **kwargs):
    from transformers import AutoTokenizer

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert (folder / "tokenizer.json").is_file()  # so loading needs neither sentencepiece nor protobuf
    return AutoTokenizer.from_pretrained(folder, **kwargs)


def round_trips(tokenizer, texts, sentencepiece: bool):
    """decode(encode(text)) is the text: byte for byte with byte-level BPE; with SentencePiece, as its nmt_nfkc
    normalisation leaves it (NFKC, so "…" comes back as "...", and runs of white space as one space), as in T5."""
    for text in texts:
        ids = tokenizer(text).input_ids
        assert tokenizer.unk_token_id not in ids, text
        expected = " ".join(unicodedata.normalize("NFKC", text).split()) if sentencepiece else text
        assert tokenizer.decode(ids, skip_special_tokens=True) == expected, text


def forward(config, ids, labels):
    """A model of `config` takes the ids and labels (an id >= config.vocab_size would raise an index error)."""
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
    assert out.logits.shape[-1] == config.vocab_size and torch.isfinite(out.loss)


@needs_shared(LAMBADA_FILE)
def test_t5_built_has_t5s_layout_and_round_trips(t5_dir):
    from transformers import T5Config, T5Tokenizer

    t5 = load(t5_dir)
    assert isinstance(t5, T5Tokenizer) and not tok_off.source(t5_dir)["real"]
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    assert len(t5) == tok_off.vocab_size(t5_dir) == tok_off.T5_BUILT_VOCAB_SIZE == 1100
    # sentinels after the pieces, in reverse, as in t5-small (<extra_id_0> = 32099 there)
    assert t5.convert_tokens_to_ids("<extra_id_0>") == len(t5) - 1
    assert t5.convert_tokens_to_ids("<extra_id_99>") == tok_off.T5_BUILT_PIECES
    assert t5.model_max_length == 512

    enc = t5(PROMPT)
    assert enc.input_ids[-1] == t5.eos_token_id and enc.input_ids.count(t5.eos_token_id) == 1
    assert t5.decode(enc.input_ids) == PROMPT + "</s>"
    assert t5.decode(enc.input_ids, skip_special_tokens=True) == PROMPT
    both = t5(PROMPT, text_target="Hallo")
    assert both.labels[-1] == t5.eos_token_id and t5.decode(both.labels, skip_special_tokens=True) == "Hallo"
    batch = t5([PROMPT, "Hello"], padding=True)
    assert batch.input_ids[1][-1] == t5.pad_token_id and batch.attention_mask[1][-1] == 0
    sentinel = t5("The <extra_id_0> walks in <extra_id_1> park").input_ids
    assert [len(t5) - 1, len(t5) - 2] == [i for i in sentinel if i >= tok_off.T5_BUILT_PIECES]
    round_trips(t5, TEXTS, sentencepiece=True)

    config = T5Config(vocab_size=tok_off.vocab_size(t5_dir), d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=1,
                      num_decoder_layers=1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    forward(config, t5(TEXTS[0]).input_ids[:64] + [len(t5) - 1], both.labels)
    assert T5Config().vocab_size == 32128 >= tok_off.T5_REAL_VOCAB_SIZE  # t5-small's config fits the real tokenizer


@needs_shared(LAMBADA_FILE)
def test_builds_are_reused_and_deterministic(root, t5_dir, mbart50_dir, tmp_path):
    made = {p.name: p.stat().st_mtime_ns for p in t5_dir.iterdir()}
    assert tok_off.t5_tokenizer_dir(root, real=False) == t5_dir
    assert {p.name: p.stat().st_mtime_ns for p in t5_dir.iterdir()} == made  # reused, not rebuilt
    again = tok_off.mbart50_tokenizer_dir(tmp_path)  # a second build elsewhere gives the same bytes
    for name in ("sentencepiece.bpe.model", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (mbart50_dir / name).read_bytes(), name


def test_real_t5_spiece_is_checked(tmp_path, monkeypatch):
    fake = tmp_path / "spiece.model"
    fake.write_bytes(b"not the T5 model")
    monkeypatch.setenv(tok_off.T5_SPIECE_ENV, str(fake))
    with pytest.raises(ValueError, match="not the real T5 spiece.model"):
        tok_off.real_t5_spiece()
    with pytest.raises(ValueError, match="not the real T5 spiece.model"):
        tok_off.t5_tokenizer_dir(tmp_path)


def test_real_t5_gives_t5_smalls_ids(root):
    if tok_off.real_t5_spiece() is None:  # a $NNDF_T5_SPIECE that is not the real model fails here instead
        pytest.skip(f"no real T5 spiece.model here (set ${tok_off.T5_SPIECE_ENV}, see tokenizers_offline.py)")
    folder = tok_off.t5_tokenizer_dir(root)
    t5 = load(folder)
    assert tok_off.source(folder)["real"]
    assert len(t5) == tok_off.vocab_size(folder) == tok_off.T5_REAL_VOCAB_SIZE
    assert t5(PROMPT).input_ids == [13959, 1566, 12, 2968, 10, 8774, 1]  # as t5-small / flan-t5 tokenize it
    assert t5.convert_tokens_to_ids(["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_99>"]) == [
        0, 1, 2, 32099, 32000]


@needs_shared(TOKENIZER_DIR)
def test_bart_has_barts_layout_over_gpt2s_bpe(bart_dir):
    from transformers import AutoTokenizer, BartConfig, BartTokenizer

    bart = load(bart_dir)
    assert isinstance(bart, BartTokenizer)
    assert (bart.bos_token_id, bart.pad_token_id, bart.eos_token_id, bart.unk_token_id) == (0, 1, 2, 3)
    assert (bart.cls_token_id, bart.sep_token_id, bart.mask_token_id) == (0, 2, 50264)
    assert bart.convert_tokens_to_ids(["madeupword0000", "madeupword0002"]) == [50261, 50263]
    assert len(bart) == tok_off.vocab_size(bart_dir) == tok_off.BART_VOCAB_SIZE == BartConfig().vocab_size == 50265
    assert bart.model_max_length == 1024

    gpt2 = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    for text in ["Hello world", " Hello world", TEXTS[0] if TEXTS else "The cat sat."]:
        ids = bart(text).input_ids
        assert ids[0] == bart.bos_token_id and ids[-1] == bart.eos_token_id
        assert ids[1:-1] == [i + 4 for i in gpt2(text).input_ids]  # the same BPE, ids shifted past the 4 specials
    assert bart("Hello <mask> world").input_ids[2] == 50264
    assert bart("a b", text_target="c d").labels[-1] == bart.eos_token_id
    round_trips(bart, TEXTS, sentencepiece=False)

    config = BartConfig(vocab_size=tok_off.vocab_size(bart_dir), d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    forward(config, bart("Hello <mask> world").input_ids + [len(bart) - 1], bart(text_target="Hello").input_ids)


@needs_shared(LAMBADA_FILE)
def test_mbart50_language_codes_and_src_tgt_lang(mbart50_dir):
    from transformers import MBartConfig
    from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES, MBart50Tokenizer

    assert tuple(FAIRSEQ_LANGUAGE_CODES) == tok_off.MBART50_LANGUAGE_CODES
    mbart = load(mbart50_dir)
    assert isinstance(mbart, MBart50Tokenizer)
    assert (mbart.bos_token_id, mbart.pad_token_id, mbart.eos_token_id, mbart.unk_token_id) == (0, 1, 2, 3)
    assert len(mbart) == tok_off.vocab_size(mbart50_dir) == tok_off.MBART50_VOCAB_SIZE == 1054
    codes = mbart.convert_tokens_to_ids(list(tok_off.MBART50_LANGUAGE_CODES))
    first = tok_off.MBART50_PIECES + 1  # after the fairseq-shifted pieces, as 250001 = ar_AR in mbart-large-50
    assert codes == list(range(first, first + 52))
    assert [tok_off.mbart50_language_id(c) for c in ("en_XX", "de_DE", "ro_RO")] == [1004, 1003, 1020]
    assert mbart.convert_tokens_to_ids("<mask>") == mbart.mask_token_id == len(mbart) - 1
    assert mbart.model_max_length == 1024

    en, de, ro = mbart.convert_tokens_to_ids(["en_XX", "de_DE", "ro_RO"])
    enc = mbart("Hello world")  # src_lang defaults to en_XX: [en_XX] text </s>
    assert mbart.src_lang == "en_XX" and enc.input_ids[0] == en and enc.input_ids[-1] == mbart.eos_token_id
    assert mbart.decode(enc.input_ids, skip_special_tokens=True) == "Hello world"
    assert mbart.decode(enc.input_ids).startswith("en_XX")
    round_trips(mbart, TEXTS, sentencepiece=True)

    pair = load(mbart50_dir, src_lang="de_DE", tgt_lang="ro_RO")
    both = pair("Hallo Welt", text_target="Salut lume")
    assert both.input_ids[0] == de and both.input_ids[-1] == pair.eos_token_id
    assert both.labels[0] == ro and both.labels[-1] == pair.eos_token_id
    assert pair.decode(both.labels, skip_special_tokens=True) == "Salut lume"
    pair.src_lang = "en_XX"
    assert pair("Hello").input_ids[0] == en

    config = MBartConfig(vocab_size=tok_off.vocab_size(mbart50_dir), d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                         decoder_ffn_dim=32, forced_bos_token_id=ro)
    forward(config, both.input_ids + [mbart.mask_token_id], both.labels)
