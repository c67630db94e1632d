"""convert_model / `run.py convert` (issue 12): a real sentence-transformers model and tiny BERT-like ones through
every CPU backend, each checked against PyTorch; bad flags; what is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LAMBADA_FILE, TOKENIZER_DIR, dump_optimized_graph, needs_shared
from fake_tensorrt import fake_gpu  # noqa: F401  (a fixture)

from nndf.backends.ort_runtime import ort_version
from nndf.cli import main as run_py
from nndf.convert.cli import main as convert_model

FAST = ["--nb-measures", "3", "--warmup", "1"]
# ONNX Runtime 1.31's transformer optimizer fuses this torch's BERT attention; 1.30's fuses none and leaves one more
# LayerNormalization (the rows still agree)
OPTIMIZER_FUSES_THIS_EXPORT = ort_version() >= (1, 31)


@pytest.fixture(scope="module")
def minilm_converted(minilm_dir, tmp_path_factory):
    """all-MiniLM-L6-v2 converted once with int8 (CPU): plain, optimized and int8 graphs, and the JSON report."""
    out = tmp_path_factory.mktemp("converted")
    report = out / "report.json"
    code = convert_model(["-m", str(minilm_dir), "--task", "embedding", "--backend", "onnx", "pytorch", "-q",
                          "-o", str(out / "repo"), "-b", "1", "2", "4", "-s", "1", "16", "128", "--json", str(report),
                          *FAST])
    assert code == 0
    return out / "repo", json.loads(report.read_text())


def test_minilm_converts_with_every_cpu_backend_within_tolerance(minilm_converted, capsys):
    repo, report = minilm_converted
    assert set(report["backends"]) == {"Pytorch (FP32)", "ONNX Runtime (FP32)", "ONNX Runtime (optimized)",
                                       "ONNX Runtime (INT-8)"}
    for name in ("ONNX Runtime (FP32)", "ONNX Runtime (optimized)"):
        assert report["backends"][name]["max_abs_diff"] < 1e-5, name
    # ONNX Runtime's optimizer fused every layer's attention (it does only from eager attention's export); on the
    # CPU each residual Add and LayerNorm stay apart (SkipLayerNormalization's CPU kernel is the slower), in the
    # graph and in the session that runs it
    assert "SkipLayerNormalization" not in report["fusions"]
    if OPTIMIZER_FUSES_THIS_EXPORT:
        assert report["fusions"]["Attention"] == 6 and report["fusions"]["LayerNormalization"] == 12
    assert report["backends"]["ONNX Runtime (INT-8)"]["mean_cosine"] > 0.98
    for name in ("model-original.onnx", "model.onnx", "model-int8.onnx"):
        assert (repo / name).stat().st_size > 1_000_000
    assert not list(repo.glob("*.tmp")) and not list(repo.glob(".*.tmp"))


def test_the_json_report_is_strict_json_with_the_printed_timings(minilm_dir, tmp_path, capsys):
    """With one measure the spread is unknown: the report held `"stdev": NaN`, which is no JSON (jq, JSON.parse and
    Python's strict parsing refuse it), and it lacked the 95p and 99p that the latency line prints."""
    import re

    report = tmp_path / "report.json"
    assert convert_model(["-m", str(minilm_dir), "--task", "embedding", "--backend", "pytorch", "-o",
                          str(tmp_path / "out"), "--nb-measures", "1", "--warmup", "0", "--json", str(report)]) == 0
    printed = dict(re.findall(r"(\w+)=([-\d.]+)(?:ms)?", capsys.readouterr().out.split("[Pytorch (FP32)] ")[1]))
    timing = json.loads(report.read_text(), parse_constant=pytest.fail)["backends"]["Pytorch (FP32)"]["timing_ms"]
    assert timing["stdev"] is None and printed.pop("sd") == "-"
    assert {k: f"{v:.2f}" for k, v in timing.items() if v is not None} == printed


def test_the_pytorch_row_of_the_differences_says_it_is_a_second_run(minilm_dir, tmp_path, capsys):
    """"Pytorch (FP32)  max |diff| vs PyTorch 1.30e-07" read as PyTorch against itself, nonzero, with nothing under
    the table to say it is a second run against the reference (the README said it, the output did not)."""
    assert convert_model(["-m", str(minilm_dir), "--task", "embedding", "--backend", "pytorch", "-o",
                          str(tmp_path / "out"), *FAST]) == 0
    out = capsys.readouterr().out
    assert ("Pytorch (FP32): a second PyTorch run against the first, the reference: this machine's run-to-run noise, "
            "the floor the other rows sit on") in out.split("max |diff| vs PyTorch")[1]


def _lambada_passages(count: int, start: int = 2500) -> list[str]:
    lines = LAMBADA_FILE.read_text().splitlines()[start:start + count]
    return [json.loads(line)["text"] for line in lines]


@needs_shared(LAMBADA_FILE)
def test_embeddings_of_real_text_equal_sentence_transformers_and_int8_stays_close(minilm_dir, minilm_converted):
    """On LAMBADA passages: the fp32 graphs give sentence-transformers' own embeddings (64 passages, within 1e-5), and
    int8's cosine similarity to them over 200 is reported and bounded (mean >= 0.99, worst >= 0.95)."""
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer

    repo, _ = minilm_converted
    texts = _lambada_passages(200)
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    reference = model.encode(texts, batch_size=16, convert_to_numpy=True)
    cosines = {}
    for graph in ("model-int8.onnx", "model-original.onnx", "model.onnx"):
        session = ort.InferenceSession(str(repo / graph), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        rows = []
        for start in range(0, len(texts), 16):
            tokens = model.tokenizer(texts[start:start + 16], padding=True, truncation=True,
                                     max_length=model.max_seq_length, return_tensors="np")
            rows.append(session.run(None, {n: tokens[n].astype(np.int64) for n in names})[0])
        ours = np.concatenate(rows)
        cos = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
        cosines[graph] = cos
        if graph != "model-int8.onnx":
            np.testing.assert_allclose(ours, reference, atol=1e-5)
        texts, reference = texts[:64], reference[:64]  # int8 gets all 200 passages, the fp32 graphs 64
    int8 = cosines["model-int8.onnx"]
    assert len(int8) == 200
    print(f"int8 cosine to fp32 over {len(int8)} LAMBADA passages: mean {int8.mean():.5f}, worst {int8.min():.5f}")
    assert int8.mean() >= 0.99 and int8.min() >= 0.95


def test_the_served_tokenizer_cuts_long_texts_where_sentence_transformers_does(minilm_dir, minilm_converted):
    """The Triton tokenize model cut texts at the tokenizer's 512 tokens where sentence-transformers cuts at its
    max_seq_length, 256: a long text's served embedding was another (cosine 0.92 to sentence-transformers')."""
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    repo, _ = minilm_converted
    text = " ".join(f"word{i} river mountain" for i in range(150))  # about 600 tokens
    served = AutoTokenizer.from_pretrained(str(repo / "transformer_onnx_tokenize" / "1" / "tokenizer"))
    tokens = served([text], padding=True, truncation=True, return_tensors="np")  # as tokenize_model.py calls it
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    assert tokens["input_ids"].shape == (1, model.max_seq_length) == (1, 256)
    session = ort.InferenceSession(str(repo / "model.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {i.name: tokens[i.name].astype(np.int64) for i in session.get_inputs()})[0]
    np.testing.assert_allclose(ours, model.encode([text], convert_to_numpy=True), atol=1e-5)


def test_the_served_tokenizer_cuts_texts_at_the_models_positions(minilm_dir, tmp_path, capsys, monkeypatch):
    """A model of 64 positions with another model's tokenizer (-t, 512 tokens): the Triton tokenize model passed
    texts of up to 512 tokens on, and the served model failed every text over 64 tokens (ONNX Runtime: 'input index
    out of range', HTTP 500). A model whose position ids overrun before max_position_embeddings in a way its position
    table does not show (RoBERTa's is read off its table, tests/test_convert_models.py: here that reading is turned
    off) was torch's IndexError traceback; it is one sentence naming -s, and no -o folder is left."""
    import onnxruntime as ort
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(vocab_size=30522, num_labels=3, **dict(TINY["bert"],
                                               max_position_embeddings=64))
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(tmp_path / "bert64")
    out = tmp_path / "out"
    assert convert_model(["-m", str(tmp_path / "bert64"), "-t", str(minilm_dir), "-o", str(out), "-s", "1", "8", "32",
                          *FAST]) == 0
    served = transformers.AutoTokenizer.from_pretrained(str(out / "transformer_onnx_tokenize" / "1" / "tokenizer"))
    tokens = served([" ".join(["river"] * 100)], padding=True, truncation=True, return_tensors="np")
    assert tokens["input_ids"].shape == (1, 64)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {i.name: tokens[i.name].astype(np.int64) for i in session.get_inputs()})[0]
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in tokens.items()}).logits.numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4)

    config = transformers.AutoConfig.for_model(vocab_size=30522, **TINY["roberta"])  # 130 positions, 128 usable
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "roberta")
    monkeypatch.setattr("nndf.convert.cli.usable_positions", lambda config, model=None: config.max_position_embeddings)
    capsys.readouterr()
    code = convert_model(["-m", str(tmp_path / "roberta"), "-t", str(minilm_dir), "-o", str(tmp_path / "r"),
                          "-s", "1", "8", "130", *FAST])
    err = capsys.readouterr().err
    assert code == 2 and "-s/--seq-len: PyTorch cannot run the model on 130 tokens (batch 1)" in err, err
    assert "Traceback" not in err and not (tmp_path / "r").exists()


TINY = {  # tiny random configs of the other architectures, with BERT's uncased vocabulary (the MiniLM tokenizer)
    "bert": dict(model_type="bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "roberta": dict(model_type="roberta", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1),
    "distilbert": dict(model_type="distilbert", dim=32, n_layers=2, n_heads=4, hidden_dim=64),
}


@pytest.mark.parametrize("kind, task", [("bert", "classification"), ("roberta", "token-classification"),
                                        ("distilbert", "question-answering")])
def test_tiny_architectures_convert_for_each_task(kind, task, minilm_dir, tmp_path, capsys):
    import transformers

    auto = {"classification": "AutoModelForSequenceClassification",
            "token-classification": "AutoModelForTokenClassification",
            "question-answering": "AutoModelForQuestionAnswering"}[task]
    labels = 2 if task == "question-answering" else 3  # start and end logits
    config = transformers.AutoConfig.for_model(vocab_size=30522, num_labels=labels, **TINY[kind])
    torch.manual_seed(0)
    folder = tmp_path / kind
    getattr(transformers, auto).from_config(config).save_pretrained(folder)
    out, report = tmp_path / "out", tmp_path / "report.json"
    code = run_py(["convert", "-m", str(folder), "-t", str(minilm_dir), "--task", task, "-o", str(out),
                   "-b", "1", "2", "3", "-s", "2", "8", "24", "--atol", "1e-4", "--json", str(report), *FAST])
    printed = capsys.readouterr().out
    assert code == 0
    assert "[ONNX Runtime (optimized)] mean=" in printed and "99p=" in printed
    backends = json.loads(report.read_text())["backends"]
    assert all(b["max_abs_diff"] < 1e-4 for b in backends.values())
    if kind == "distilbert":  # no token_type_ids: the graph takes what the model takes
        import onnx

        assert [i.name for i in onnx.load(str(out / "model.onnx")).graph.input] == ["input_ids", "attention_mask"]
    if task == "question-answering":  # the Triton ensemble takes the question and its context, as transformer-deploy's
        from nndf.triton import validate_config

        ensemble = validate_config(out / "transformer_onnx_inference" / "config.pbtxt")
        assert [i.name for i in ensemble.input] == ["QUESTION", "CONTEXT"]


def _tiny_classifier(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(vocab_size=30522, num_labels=3, **TINY["bert"])
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return folder


def test_tensorrt_engine_through_the_fake_tensorrt(fake_gpu, minilm_dir, tmp_path, capsys):
    """--backend tensorrt on the CPU through the fake TensorRT over ONNX Runtime: one profile over -b / -s, the
    engine built by the engine cache into -o (reused on a second run), checked and timed like the others."""
    import dataclasses

    from transformers import AutoTokenizer

    from nndf.convert.cli import run
    from nndf.convert.options import parse

    model = _tiny_classifier(tmp_path / "bert")
    argv = ["-m", str(model), "-t", str(minilm_dir), "-o", str(tmp_path / "out"), "-d", "cpu",
            "-b", "1", "2", "3", "-s", "2", "8", "24", "--atol", "1e-4", *FAST]
    opts = dataclasses.replace(parse(argv), backends=("onnx", "tensorrt"))  # parse() wants a real GPU for it
    results = run(opts)
    assert results["backends"]["TensorRT (FP16)"]["max_abs_diff"] < 1e-4
    assert len(fake_gpu) == 1
    request = fake_gpu[0]
    assert request.profiles == [{name: ((1, 2), (2, 8), (3, 24))
                                 for name in ("input_ids", "token_type_ids", "attention_mask")}]
    assert request.onnx_path == tmp_path / "out" / "model-original.onnx" and request.fp16
    assert request.workspace_mib == 10000 and not request.int8  # -w reaches the build (its default)
    assert "[TensorRT (FP16)] mean=" in capsys.readouterr().out
    # the TensorRT model's tokenize model cuts texts at the profile's -s MAX (24), which the plan takes; a longer
    # text was the server's shape error. The ONNX graph's takes the tokenizer's whole length.
    served = {engine: AutoTokenizer.from_pretrained(str(tmp_path / "out" / f"transformer_{engine}_tokenize" / "1" /
                                                        "tokenizer")) for engine in ("onnx", "tensorrt")}
    text = " ".join(["river"] * 100)
    assert [served[e]([text], truncation=True)["input_ids"][0].__len__() for e in ("onnx", "tensorrt")] == [102, 24]
    # and pads shorter texts up to the profile's -s MIN (2), the fewest tokens the plan takes
    from nndf.triton import validate_config

    tokenize = {e: validate_config(tmp_path / "out" / f"transformer_{e}_tokenize" / "config.pbtxt").parameters
                for e in ("onnx", "tensorrt")}
    assert tokenize["tensorrt"]["min_length"].string_value == "2" and "min_length" not in tokenize["onnx"]
    run(opts)
    assert len(fake_gpu) == 1  # the engine was reused


def test_pytorch_fp16_is_timed_on_a_gpu_unless_fast(minilm_dir, tmp_path, monkeypatch):
    """README and transformer-deploy: on CUDA PyTorch fp16 is timed too and --fast skips it; it was timed only when
    --backend named pytorch, so the default --backend onnx had no fp16 row. (ONNX Runtime's CUDA sessions are
    replaced here by named stand-ins: what is tested is which engines are lined up.)"""
    import dataclasses

    from nndf.convert import cli
    from nndf.convert import engines as eng
    from nndf.convert.options import parse
    from nndf.convert.tasks import TASKS, TaskModule, load_task_model

    monkeypatch.setattr(eng, "ort_engine", lambda name, path, device, threads: eng.Engine(name, list, path))
    model = load_task_model(TASKS["classification"], str(_tiny_classifier(tmp_path / "bert")), "cpu")
    module = TaskModule(model, TASKS["classification"], ("input_ids", "attention_mask"))
    paths = {"original": tmp_path / "a.onnx", "optimized": tmp_path / "b.onnx"}
    opts = dataclasses.replace(parse(["-m", str(minilm_dir), "-d", "cpu"]), device="cuda")
    names = [e.name for e in cli._engines(opts, module, paths, tmp_path)]
    assert names == ["Pytorch (FP32)", "Pytorch (FP16)", "ONNX Runtime (FP32)", "ONNX Runtime (optimized, FP16)"]
    fast = dataclasses.replace(opts, fast=True)
    assert "Pytorch (FP16)" not in [e.name for e in cli._engines(fast, module, paths, tmp_path)]


def test_static_qdq_int8_for_tensorrt_stays_close(minilm_dir, tmp_path):
    """The GPU's int8 path: ONNX Runtime's static quantization in symmetric QDQ format (what TensorRT builds int8
    engines from), calibrated on the tokenized sample sentences; ONNX Runtime runs QDQ graphs on the CPU too, so
    its fidelity is checked here on held-out text."""
    import onnxruntime as ort
    from transformers import AutoTokenizer

    from nndf.convert import engines, graphs
    from nndf.convert.tasks import TASKS, TaskModule

    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(_tiny_classifier(tmp_path / "bert"))
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    module = TaskModule(model, TASKS["classification"], ("input_ids", "token_type_ids", "attention_mask"))
    example = engines.random_feeds(module.input_names, 2, 8, 30522, 0, "cpu")
    names = graphs.export_graph(module, example, tmp_path / "model.onnx")
    calibration = engines.text_feeds(tokenizer, names, engines.CALIBRATION_TEXTS, 4, 32)
    graphs.quantize_static_qdq(tmp_path / "model.onnx", tmp_path / "qdq.onnx", calibration)
    import onnx

    ops = {node.op_type for node in onnx.load(str(tmp_path / "qdq.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    held_out = engines.text_feeds(tokenizer, names, ["A sentence the calibration never saw, about rivers.",
                                                     "Numbers like 42 and 1999 appear here too."], 2, 32)[0]
    fp32 = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, held_out)
    int8 = ort.InferenceSession(str(tmp_path / "qdq.onnx"), providers=["CPUExecutionProvider"]).run(None, held_out)
    cosine = (fp32[0] * int8[0]).sum(1) / (np.linalg.norm(fp32[0], axis=1) * np.linalg.norm(int8[0], axis=1))
    assert cosine.min() > 0.98, cosine


def test_ctrl_c_is_one_line_without_a_traceback(minilm_dir, tmp_path, capsys, monkeypatch):
    """As run.py's actions: Ctrl-C during a conversion prints "interrupted" and exits 130."""
    import nndf.convert.cli

    def interrupted(opts):
        raise KeyboardInterrupt

    monkeypatch.setattr(nndf.convert.cli, "run", interrupted)
    code = convert_model(["-m", str(minilm_dir), "-o", str(tmp_path / "out")])
    assert code == 130 and capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"


def test_a_model_too_large_for_one_onnx_file_is_refused_before_the_export(minilm_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """Each graph is one file, which protobuf caps at 2 GiB: a larger model (XLM-R large) used to fail in the
    optimizer's save after a long export. The cap is lowered here to the tiny model's size."""
    from nndf.convert import graphs

    monkeypatch.setattr(graphs, "MAX_GRAPH_BYTES", 1000)
    out = tmp_path / "out"
    code = convert_model(["-m", str(_tiny_classifier(tmp_path / "bert")), "-t", str(minilm_dir), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "GiB of weights; convert writes each ONNX graph as one file, which protobuf caps at 2 GiB" \
        in err and "Traceback" not in err
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


def test_a_second_pytorch_run_over_atol_is_named_noise_not_an_unfaithful_conversion():
    from nndf.convert.engines import Engine
    from nndf.convert.report import check
    from nndf.errors import HarnessError

    reference = [[np.zeros((1, 4), dtype=np.float32)]]
    rerun = Engine("Pytorch (FP32)", lambda feeds: [np.full((1, 4), 1e-7, dtype=np.float32)], reruns_reference=True)
    with pytest.raises(HarnessError, match=r"a second PyTorch run's output 'logits' differs from the first's by up to "
                                           r"1e-07, more than --atol 1e-12: that is this machine's run-to-run noise"):
        check(rerun, [{}], reference, ("logits",), atol=1e-12)
    onnx_row = Engine("ONNX Runtime (FP32)", rerun.infer)
    with pytest.raises(HarnessError, match="the converted model is not faithful"):
        check(onnx_row, [{}], reference, ("logits",), atol=1e-12)
    misshapen = Engine("TensorRT (FP16)", lambda feeds: [np.zeros((1, 3), dtype=np.float32)])
    with pytest.raises(HarnessError, match=r"^\[TensorRT \(FP16\)\] an output has shape \(1, 3\) where PyTorch's"):
        check(misshapen, [{}], reference, ("logits",), atol=1)  # the backend was not named


def test_the_mean_cosine_never_exceeds_1():
    """A row compared with its equal came out a rounding step past 1 (1.0000000000000002 in the JSON report)."""
    from nndf.convert.report import compare

    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((1, 384)).astype(np.float32) for _ in range(20)]
    cosines = [compare([[row]], [[row.copy()]])[0].mean_cosine for row in rows]
    assert max(cosines) == 1.0 and min(cosines) > 1 - 1e-12
    assert compare([[rows[0]]], [[-rows[0]]])[0].mean_cosine == -1.0


@needs_shared(TOKENIZER_DIR)
def test_text_generation_converts_a_decoder_and_refuses_an_encoder(tiny_gpt2_dir, minilm_dir, tmp_path, capsys):
    """An encoder got a causal LM head of random weights and converted without a word; a decoder-only model
    converts, its logits within --atol of PyTorch's."""
    code = convert_model(["-m", str(minilm_dir), "--task", "text-generation", "-o", str(tmp_path / "enc")])
    assert code == 2 and "is a bert encoder; --task text-generation converts decoder-only language models" in \
        capsys.readouterr().err
    assert not (tmp_path / "enc").exists() or not any((tmp_path / "enc").iterdir())
    report = tmp_path / "report.json"
    code = convert_model(["-m", str(tiny_gpt2_dir), "--task", "text-generation", "-o", str(tmp_path / "dec"),
                          "-b", "1", "1", "2", "-s", "1", "8", "16", "--atol", "1e-4", "--json", str(report), *FAST])
    assert code == 0, capsys.readouterr().err
    backends = json.loads(report.read_text())["backends"]
    assert backends["ONNX Runtime (FP32)"]["max_abs_diff"] < 1e-4


def test_a_cpu_session_leaves_residual_adds_and_layer_norms_apart(minilm_converted, tmp_path, monkeypatch):
    """ONNX Runtime would fuse them into SkipLayerNormalization again when it loads the graph (its CPU kernel is the
    slower: nndf.backends.ort_runtime); the graph it optimized shows what the session runs."""
    import onnx

    import nndf.convert.engines as engines

    repo, _ = minilm_converted
    optimized = tmp_path / "optimized.onnx"
    dump_optimized_graph(monkeypatch, engines, optimized)
    engines.ort_engine("ONNX Runtime (optimized)", repo / "model.onnx", "cpu", 1)
    ran = [node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node]
    assert "SkipLayerNormalization" not in ran
    assert ran.count("LayerNormalization") == (12 if OPTIMIZER_FUSES_THIS_EXPORT else 13)
