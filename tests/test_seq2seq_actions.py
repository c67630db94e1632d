"""Every action on the encoder-decoder families, through the command line, with real-layout tokenizers made
offline (tests/tokenizers_offline.py): T5 with a SentencePiece model, BART with GPT-2's byte-level BPE (the
`text_models` fixture of conftest.py)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import nndf
from conftest import LAMBADA_FILE


@pytest.mark.parametrize("family", ["T5", "BART"])
def test_every_action_runs_for_encoder_decoder_families(family, text_models, onnx_work_dir, capsys, monkeypatch):
    from nndf.cli import main

    model = ["--torch-dir", str(text_models[family]), "--working-dir", str(onnx_work_dir)]
    fast = ["--iterations", "1", "--warmup", "0"]
    backends = ["frameworks", "onnxrt"] if family == "T5" else ["frameworks"]  # one export (~20 s) is enough
    runs = [
        ["benchmark", family, *backends, *model, "--input-seq-len", "6", "--output-seq-len", "3", *fast],
        ["run", family, "frameworks", *model, "--output-seq-len", "4", *fast],
        ["compare", family, *backends, *model, "--output-seq-len", "4", *fast],
        ["accuracy", family, *backends, *model, "--dataset-file", str(LAMBADA_FILE), "--num-samples", "3"],
        ["chat", family, "frameworks", *model, "--output-seq-len", "3"],
    ]
    if family == "T5":
        runs.append(["export", family, "onnxrt", *model])
    outputs = {}
    for argv in runs:
        monkeypatch.setattr(sys, "stdin", io.StringIO("translate English to German: Hello\nexit\n"))
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"{argv[0]}: {err}"
        assert f"{argv[0]} " in out
        outputs[argv[0]] = out
    bench = outputs["benchmark"]
    assert "6 encoder + 3 new tokens" in bench and "encoder (ms)" in bench and "(HF generate)" in bench
    assert "the passage without its last word goes to the encoder" in outputs["accuracy"]
    if family == "T5":
        assert "onnxrt" in bench and "top-1 = PyTorch" in outputs["accuracy"]
        assert outputs["export"].count(".onnx") == 3  # encoder, cross-attention cache generator, decoder
    assert "translate English to German: Hello" in outputs["chat"] or "[frameworks]" in outputs["chat"]


def test_info_lists_the_three_graphs(text_models, capsys):
    from nndf.cli import main

    argv = ["benchmark", "T5", "frameworks", "--torch-dir", str(text_models["T5"]), "--input-seq-len", "6",
            "--output-seq-len", "3", "--iterations", "1", "--warmup", "0", "--info"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in ("encoder: input_ids, attention_mask", "cross: cross.{0..1}.key|value", "decoder: past_key_values"):
        assert line in out


def test_seq2seq_lambada_scores_the_target_word_on_the_decoder(text_models):
    """lm-eval's seq2seq pairing: the context encoded with the tokenizer's special tokens, the target without (no
    </s> is scored); a model whose logits put each target token first is right on every passage, with perplexity 1."""
    import torch

    from nndf.lambada import read_jsonl_texts
    from nndf.loading import load_tokenizer
    from nndf.registry import get_spec
    from nndf.seq2seq.evaluation import encode_pair, evaluate_lambada_seq2seq

    tokenizer = load_tokenizer(str(text_models["T5"]), get_spec("T5"))
    texts = read_jsonl_texts(LAMBADA_FILE)[:4]
    context, target = encode_pair(tokenizer, texts[0], 512)
    assert context[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in target
    assert tokenizer.decode(target).strip() == texts[0].split(" ")[-1]

    pairs = [encode_pair(tokenizer, t, 512) for t in texts]

    def oracle(encoder_ids, encoder_mask, decoder_ids):
        logits = torch.zeros(encoder_ids.shape[0], decoder_ids.shape[1], 1100)
        for row, (ids, mask) in enumerate(zip(encoder_ids.tolist(), encoder_mask.tolist())):
            ctx = ids[: sum(mask)]
            want = next(target for context, target in pairs if context == ctx)
            logits[row, torch.arange(len(want)), torch.tensor(want)] = 50.0
        return logits

    for batch_size in (1, 3):
        metrics = evaluate_lambada_seq2seq(texts, tokenizer, oracle, decoder_inputs=lambda t: [0, *t[:-1]],
                                           max_positions=512, progress=False, batch_size=batch_size)
        assert metrics.lm_eval_accuracy == 1.0 and metrics.top1 == 1.0
        assert metrics.lm_eval_perplexity == pytest.approx(1.0, abs=1e-6)


def test_seq2seq_lambada_in_batches_equals_one_passage_at_a_time(text_models):
    """Contexts of different lengths padded into one batch: the encoder's mask keeps the padding out of the encoder
    and of cross-attention, so every figure equals the one-by-one figures (to float32 rounding)."""
    import nndf
    from nndf.lambada import read_jsonl_texts

    model = nndf.load("T5", backend="frameworks", torch_dir=str(text_models["T5"]))
    texts = read_jsonl_texts(LAMBADA_FILE)[:6]
    one = model.architecture.lambada(texts, model, 1, 5, batch_size=1).as_dict()
    batched = model.architecture.lambada(texts, model, 1, 5, batch_size=4).as_dict()
    assert batched == pytest.approx(one, rel=1e-5, nan_ok=True)
    fidelity = model.architecture.fidelity(texts, model, batch_size=4)  # our steps against HF's forward, batched
    assert fidelity.top1_agreement == 1.0 and fidelity.mean_kl < 1e-9


def test_a_triton_folder_of_an_encoder_decoder_model_runs_its_three_graphs(text_models, onnx_work_dir, tmp_path,
                                                                           capsys):
    """`triton` writes the encoder, cache generator and decoder graphs beside the config and tokenizer (no weights);
    the folder, loaded as the served model loads it, generates what our loop generates directly. The continuous
    scheduler (the default) is refused with the one that serves it."""
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the triton and test extras) is absent")
    from nndf.actions.common import encode_prompts
    from nndf.cli import main
    from nndf.triton import validate_repository
    from nndf.triton.served import load_served

    base = ["triton", "T5", "onnxrt", "--torch-dir", str(text_models["T5"]), "--working-dir", str(onnx_work_dir),
            "-o", str(tmp_path / "models")]
    assert main(base) == 2
    assert "T5 is encoder-decoder: serve it with --scheduler sequential" in capsys.readouterr().err
    assert main([*base, "--scheduler", "sequential", "--name", "t5"]) == 0
    validate_repository(tmp_path / "models")
    version = tmp_path / "models" / "t5" / "1"
    assert not list((version / "hf").glob("*.safetensors"))
    settings, served = load_served(version, str(tmp_path / "work"))
    assert set(settings["graphs"]) == {"encoder_onnx", "cache_generator_onnx", "decoder_onnx"}
    assert all(str(path).startswith(str(version)) for path in served.artifacts)
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # nothing exported
    direct = nndf.load("T5", torch_dir=str(text_models["T5"]), backend="onnxrt", working_dir=str(onnx_work_dir))
    ids, mask = encode_prompts(direct.tokenizer, ["translate English to German: Hello", "Hi"], use_mask=True,
                               pad_side="right")
    assert torch.equal(served.generate(ids, mask, max_new_tokens=5), direct.generate(ids, mask, max_new_tokens=5))
