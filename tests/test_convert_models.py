"""convert_model and the models it takes (issue 12): how many positions a model takes, read from its config and
its position table on any device; relative-position models without that cap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_convert import TINY

from nndf.convert.cli import main as convert_model

FAST = ["--nb-measures", "3", "--warmup", "1"]


def _save(folder: Path, **config) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(vocab_size=30522, num_labels=3, **config)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return folder


def test_positions_a_padding_row_takes_are_refused_before_the_weights_load(minilm_dir, tmp_path, capsys,
                                                                            monkeypatch):
    """RoBERTa numbers its positions from padding_idx + 1: of its 130 max_position_embeddings 128 take tokens. -s
    129 or 130 passed the config's check, and PyTorch then failed on the check inputs: an IndexError on the CPU,
    a device-side assert on CUDA (the process unusable after it). It is refused from the config and the table."""
    from nndf.convert import cli

    model = _save(tmp_path / "roberta", **TINY["roberta"])  # 130 positions, pad_token_id 1
    monkeypatch.setattr(cli, "load_task_model", lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
    for longest in ("129", "130"):
        code = convert_model(["-m", str(model), "-t", str(minilm_dir), "-o", str(tmp_path / "out"),
                              "-s", "1", "8", longest, *FAST])
        err = capsys.readouterr().err
        assert code == 2 and f"-s/--seq-len MAX {longest} exceeds the 128 positions of {model} " \
            "(max_position_embeddings 130, less the 2 rows its position table keeps before the first position)" \
            in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_served_tokenizer_stops_at_the_positions_a_padding_row_leaves(minilm_dir, tmp_path):
    """With another model's tokenizer (-t, 512 tokens) the tokenize model cut texts at max_position_embeddings
    (130), two past RoBERTa's last position: the served model failed every text of 129 tokens or more."""
    from transformers import AutoTokenizer

    model = _save(tmp_path / "roberta", **TINY["roberta"])
    out = tmp_path / "out"
    assert convert_model(["-m", str(model), "-t", str(minilm_dir), "-o", str(out), "-s", "1", "8", "128",
                          *FAST]) == 0
    served = AutoTokenizer.from_pretrained(str(out / "transformer_onnx_tokenize" / "1" / "tokenizer"))
    assert len(served([" ".join(["river"] * 300)], truncation=True)["input_ids"][0]) == 128


DEBERTA = dict(model_type="deberta-v2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64, relative_attention=True, position_buckets=16,
               pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True, type_vocab_size=0)


def test_relative_position_models_take_texts_past_max_position_embeddings(minilm_dir, tmp_path, capsys):
    """DeBERTa-v2/v3 add no absolute positions (position_biased_input false): transformers runs them at any length
    (relative positions bucketed), yet -s past max_position_embeddings was refused and the served tokenizer cut
    texts there. With an absolute table (position_biased_input true) the cap stays."""
    import onnxruntime as ort
    import transformers
    from transformers import AutoTokenizer

    relative = _save(tmp_path / "deberta", **DEBERTA, position_biased_input=False)
    out = tmp_path / "out"
    assert convert_model(["-m", str(relative), "-t", str(minilm_dir), "-o", str(out), "-s", "1", "8", "96",
                          "--atol", "1e-4", *FAST]) == 0, capsys.readouterr().err
    served = AutoTokenizer.from_pretrained(str(out / "transformer_onnx_tokenize" / "1" / "tokenizer"))
    tokens = served([" ".join(["river"] * 150)], truncation=True, return_tensors="np")
    assert tokens["input_ids"].shape == (1, 152)  # the tokenizer's own limit (512), not the 64 positions
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {i.name: tokens[i.name].astype(np.int64) for i in session.get_inputs()})[0]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(relative).eval()
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(tokens[k]) for k in ("input_ids", "attention_mask")}).logits
    np.testing.assert_allclose(ours, expected.numpy(), atol=1e-4)

    absolute = _save(tmp_path / "deberta-absolute", **DEBERTA, position_biased_input=True)
    code = convert_model(["-m", str(absolute), "-t", str(minilm_dir), "-o", str(tmp_path / "a"), "-s", "1", "8",
                          "96", *FAST])
    assert code == 2 and "-s/--seq-len MAX 96 exceeds the 64 positions of" in capsys.readouterr().err


def _older_sentence_transformers_folder(minilm_dir: Path, folder: Path) -> Path:
    """all-MiniLM-L6-v2 as sentence-transformers before v2 saved it: modules.json over 0_Transformer/ (the
    transformers config, weights and tokenizer) and 1_Pooling/, no config.json at the top."""
    import json
    import shutil

    (folder / "0_Transformer").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "sentence_bert_config.json", "special_tokens_map.json",
                 "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, folder / "0_Transformer" / name)
    shutil.copytree(minilm_dir / "1_Pooling", folder / "1_Pooling")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return folder


def test_an_older_sentence_transformers_folder_converts_as_sentence_transformers_loads_it(minilm_dir, tmp_path,
                                                                                         capsys):
    """A folder of modules in 0_Transformer/ and 1_Pooling/ (sentence-transformers before v2; its own loader reads
    it) was refused for its missing config.json. It converts, and the served model embeds a long text as
    sentence-transformers does: its tokenizer (from 0_Transformer/), cut at its max_seq_length (256)."""
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    older = _older_sentence_transformers_folder(minilm_dir, tmp_path / "older")
    out = tmp_path / "out"
    assert convert_model(["-m", str(older), "--task", "embedding", "-o", str(out), "-s", "1", "8", "300",
                          "--atol", "1e-4", *FAST]) == 0, capsys.readouterr().err
    text = " ".join(f"word{i} river mountain" for i in range(150))  # about 600 tokens
    served = AutoTokenizer.from_pretrained(str(out / "transformer_onnx_tokenize" / "1" / "tokenizer"))
    tokens = served([text], padding=True, truncation=True, return_tensors="np")
    assert tokens["input_ids"].shape == (1, 256)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {i.name: tokens[i.name].astype(np.int64) for i in session.get_inputs()})[0]
    reference = SentenceTransformer(str(older), device="cpu").encode([text], convert_to_numpy=True)
    np.testing.assert_allclose(ours, reference, atol=1e-5)  # no 2_Normalize here: mean pooling as it is


def test_an_embedding_model_is_served_with_its_own_tokenizer(minilm_dir, tmp_path, capsys):
    """--task embedding with -t: the served tokenizer was -t's, while the sentence-transformers model (whose
    embeddings are converted) tokenizes with its own; a cased -t for this uncased model converted, and every
    served embedding of capitalised text was another. -t is refused unless it tokenizes as the model's own."""
    import json
    import shutil

    cased = tmp_path / "cased"
    cased.mkdir()
    for name in ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, cased / name)
    same = shutil.copytree(cased, tmp_path / "same")
    spec = json.loads((cased / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = False
    (cased / "tokenizer.json").write_text(json.dumps(spec))
    settings = json.loads((cased / "tokenizer_config.json").read_text())
    (cased / "tokenizer_config.json").write_text(json.dumps(dict(settings, do_lower_case=False)))
    out = tmp_path / "out"
    code = convert_model(["-m", str(minilm_dir), "-t", str(cased), "--task", "embedding", "-o", str(out), *FAST])
    err = capsys.readouterr().err
    assert code == 2 and f"-t/--tokenizer {cased} tokenizes texts otherwise than the sentence-transformers model " \
        f"{minilm_dir} does with its own tokenizer" in err and "Traceback" not in err, err
    assert not out.exists()
    assert convert_model(["-m", str(minilm_dir), "-t", str(same), "--task", "embedding", "--backend", "pytorch",
                          "-o", str(out), *FAST]) == 0  # the same tokenizer elsewhere
