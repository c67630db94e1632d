"""Encoder-decoder families (T5, Flan-T5, BART, mBART) on frameworks and onnxrt: parity with Hugging Face
`generate()` token for token, the model's own generation rules, the three exported graphs and their checks."""

from __future__ import annotations

import pytest
import torch

import nndf
from conftest import build_tiny, copy_artifact, dump_optimized_graph
from family_examples import SEQ2SEQ_EXAMPLES
from sampling_checks import assert_samples_like_generate
from nndf.errors import UsageError
from nndf.backends import onnxrt

EXAMPLES = list(SEQ2SEQ_EXAMPLES)


def _prompts(seed: int = 7, vocab: int = 1000):
    """Batch 3 of prompts of different lengths (right-padded, as T5 and BART tokenizers pad) with masks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab - 1, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, 1), mask


def _load(example, backend, seq2seq_dirs, work, use_cache=True, **kwargs):
    family = SEQ2SEQ_EXAMPLES[example][0]
    return nndf.load(family, backend=backend, torch_dir=str(seq2seq_dirs[example]), use_cache=use_cache,
                     working_dir=str(work), device="cpu", **kwargs)


# Every example on both backends with the cache; without it, every example on frameworks and one T5 and one BART
# graph on onnxrt (each export of three graphs takes ~20 s on 2 cores).
PARITY_CASES = [(e, b, True) for e in EXAMPLES for b in ("frameworks", "onnxrt")] + \
    [(e, "frameworks", False) for e in EXAMPLES] + [("t5", "onnxrt", False), ("mbart", "onnxrt", False)]


@pytest.mark.parametrize("example, backend, use_cache", PARITY_CASES)
def test_seq2seq_parity_with_hf_generate(example, backend, use_cache, seq2seq_dirs, onnx_work_dir):
    """Whole decoder sequences equal generate()'s: greedy and 2 and 4 beams, batch 3 with masks; once under the
    model's own generation rules (BART's no-repeat 2-grams and forced EOS, mBART's forced first token) and once
    with a minimum length, so that random weights cannot end every row at once; and seeded sampling."""
    m = _load(example, backend, seq2seq_dirs, onnx_work_dir, use_cache)
    ids, mask = _prompts()
    for num_beams in (1, 2, 4):
        for min_new in (None, 9):
            ours = m.generate(ids, mask, max_new_tokens=10, min_new_tokens=min_new, num_beams=num_beams)
            reference = m.hf_generate(ids, mask, max_new_tokens=10, min_new_tokens=min_new, num_beams=num_beams)
            assert torch.equal(ours, reference), f"{example} {backend} beams={num_beams} min_new={min_new}"
            if min_new:
                assert ours.shape[1] >= 1 + min_new
    forced = m.loaded.generation_config.forced_bos_token_id
    if forced is not None:
        assert bool((ours[:, 1] == forced).all())  # mBART: the target language token comes first
    assert_samples_like_generate(m, input_ids=ids, attention_mask=mask, max_new_tokens=10)


@pytest.mark.parametrize("example", EXAMPLES)
def test_seq2seq_logits_match_pytorch(example, seq2seq_dirs, onnx_work_dir):
    """Teacher-forced decoder logits (what LAMBADA scoring reads) from the ONNX graphs equal PyTorch's."""
    m = _load(example, "onnxrt", seq2seq_dirs, onnx_work_dir)
    ids = torch.randint(4, 999, (1, 9), generator=torch.Generator().manual_seed(1))
    decoder_ids = torch.tensor([[m.decoder.start_token_id, 5, 17, 300, 42]])
    torch.testing.assert_close(m.logits(ids, decoder_ids), m.reference_logits(ids, decoder_ids), rtol=0, atol=1e-4)


def test_bart_large_cnn_generation_config_gives_generate_tokens(seq2seq_dirs, onnx_work_dir):
    """bart-large-cnn's own rules (4 beams, no repeated 3-grams, min length 56, length penalty 2, early stopping,
    forced BOS and EOS) from the registry: our loop with no overrides equals plain `model.generate()`."""
    from nndf.loading import known_generation_config
    from nndf.registry import resolve

    _spec, variant = resolve("BART", "bart-large-cnn")
    ids, mask = _prompts(seed=3)
    for backend in ("frameworks", "onnxrt"):
        m = _load("bart", backend, seq2seq_dirs, onnx_work_dir)
        model = m.loaded.model
        before = model.generation_config
        model.generation_config = known_generation_config(variant, model.config)
        try:
            assert m.generation_options(60, None, None).num_beams == 4
            ours = m.generate(ids, mask, max_new_tokens=60, min_new_tokens=None, num_beams=None)
            with torch.inference_mode():
                reference = model.generate(ids, attention_mask=mask, max_new_tokens=60)
        finally:
            model.generation_config = before
        assert torch.equal(ours, reference), backend
        assert ours.shape[1] >= 56 and bool((ours[:, 1] == 0).all())  # min length, forced BOS


def test_python_api_needs_no_tokenizer_and_returns_decoder_tokens(seq2seq_dirs):
    m = nndf.load("T5", torch_dir=str(seq2seq_dirs["t5"]), device="cpu")
    ids, mask = _prompts()
    out = m.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
    assert out.shape == (3, 6) and bool((out[:, 0] == 0).all())  # T5 starts from the pad token
    assert torch.equal(m.new_tokens(out, ids), out[:, 1:])
    assert [s.name for s in m.decoder.sessions] == ["frameworks"] * 3


def test_tgt_lang_forces_the_target_language(tmp_path_factory, onnx_work_dir):
    from tokenizers_offline import mbart50_language_id, mbart50_tokenizer_dir, vocab_size

    from conftest import SHARED_DATA

    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} is absent (../shared/data is not beside this checkout)")
    root = tmp_path_factory.mktemp("mbart")
    tokenizer = mbart50_tokenizer_dir(root / "tok")
    config = dict(SEQ2SEQ_EXAMPLES["mbart"][1], vocab_size=vocab_size(tokenizer))
    config.pop("forced_bos_token_id")
    folder = build_tiny(root, "mbart", config, tokenizer_dir=tokenizer)
    m = nndf.load("BART", torch_dir=str(folder), working_dir=str(onnx_work_dir), tgt_lang="de_DE", device="cpu")
    de = mbart50_language_id("de_DE")
    ids, mask = _prompts(vocab=1000)
    ours = m.generate(ids, mask, max_new_tokens=6, num_beams=2)
    assert bool((ours[:, 1] == de).all())
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=6, num_beams=2))
    with pytest.raises(UsageError, match="tgt_lang=.xx_XX. is not an mBART-50 language"):
        nndf.load("BART", torch_dir=str(folder), tgt_lang="xx_XX", device="cpu")
    with pytest.raises(UsageError, match="tgt_lang=.de_DE. applies to multilingual translation models"):
        nndf.load("GPT2", variant="gpt2", random_weights=True, tgt_lang="de_DE", device="cpu")
    with pytest.raises(UsageError, match="tgt_lang=.de_DE. applies to mBART-50 .* this bart model has no target"):
        nndf.load("BART", variant="bart-base", random_weights=True, tgt_lang="de_DE", device="cpu")


def test_export_holds_three_graphs_reused_shared_and_rebuilt_when_truncated(seq2seq_dirs, onnx_work_dir, tmp_path,
                                                                           capsys):
    import onnx

    from nndf.seq2seq.export import export_seq2seq

    m = _load("bart", "frameworks", seq2seq_dirs, onnx_work_dir)
    shared = export_seq2seq(m.loaded, True, onnx_work_dir)
    # damaged in a working dir of its own (other tests, in other workers too, read the shared one): a copy
    work = tmp_path / "work"
    copy_artifact(shared.folder, work)
    capsys.readouterr()
    export = export_seq2seq(m.loaded, True, work)
    assert export.folder == work / shared.folder.name
    assert capsys.readouterr().err == ""  # the copy is reused: nothing exported
    assert export_seq2seq(m.loaded, True, work) == export
    assert capsys.readouterr().err == ""  # reused: nothing exported
    ops = {name: [n.op_type for n in onnx.load(str(g.graph), load_external_data=False).graph.node]
           for name, g in export.graphs.items()}
    layers = 2
    assert ops["cross"].count("MatMul") == 2 * layers  # only the key and value projections
    # the decoder never projects the encoder states: per layer 4 self + 2 cross (q, o) projections, 2 + 2 attention
    # products, 2 feed-forward; plus the LM head
    assert ops["decoder"].count("MatMul") == 12 * layers + 1

    # Without cache: the encoder's and the cache generator's graphs are the cached export's, copied, and only the
    # decoder's is traced; the tokens are generate()'s.
    cacheless = export_seq2seq(m.loaded, False, work)
    err = capsys.readouterr().err
    assert "  decoder.onnx exported" in err and "encoder.onnx exported" not in err and "cross.onnx exported" not in err
    for graph in ("encoder", "cross"):
        assert f"  {graph}.onnx copied from {export.folder}" in err
        files = [p.name for p in export.folder.iterdir() if p.name.startswith(f"{graph}.onnx")]
        assert files and all((cacheless.folder / f).read_bytes() == (export.folder / f).read_bytes() for f in files)
    model = nndf.load("BART", backend="onnxrt", loaded=m.loaded, use_cache=False, working_dir=str(work))
    ids, mask = _prompts()
    assert torch.equal(model.generate(ids, mask, max_new_tokens=8, num_beams=2),
                       model.hf_generate(ids, mask, max_new_tokens=8, num_beams=2))
    capsys.readouterr()

    # A truncated graph: the export is rebuilt, the other two graphs copied from the cache-less export.
    data = export.folder / "decoder.onnx.data"
    data.write_bytes(data.read_bytes()[:-8])
    export_seq2seq(m.loaded, True, work)
    err = capsys.readouterr().err
    assert f"rebuilding {export.folder}: decoder.onnx.data is missing or truncated" in err
    assert f"  encoder.onnx copied from {cacheless.folder}" in err and "  decoder.onnx exported" in err


def test_given_graphs_are_checked_by_tensor_names(seq2seq_dirs, onnx_work_dir):
    """--encoder-onnx / --cache-generator-onnx / --decoder-onnx run given files, each checked by its names."""
    from nndf.backends import BackendOptions
    from nndf.model import Model
    from nndf.seq2seq.export import export_seq2seq

    m = _load("t5", "frameworks", seq2seq_dirs, onnx_work_dir)
    graphs = {name: str(g.graph) for name, g in export_seq2seq(m.loaded, True, onnx_work_dir).graphs.items()}
    given = BackendOptions(working_dir="/nonexistent", encoder_onnx=graphs["encoder"],
                           cache_generator_onnx=graphs["cross"], decoder_onnx=graphs["decoder"])
    ours = Model(m.loaded, "onnxrt", m.settings, given)
    assert ours.artifacts == [graphs["encoder"], graphs["cross"], graphs["decoder"]]
    ids, mask = _prompts()
    assert torch.equal(ours.generate(ids, mask, max_new_tokens=4), m.hf_generate(ids, mask, max_new_tokens=4))
    swapped = BackendOptions(working_dir=str(onnx_work_dir), encoder_onnx=graphs["decoder"])
    with pytest.raises(UsageError, match=f"{graphs['decoder']} does not have the encoder's inputs and outputs"):
        Model(m.loaded, "onnxrt", m.settings, swapped)
    with pytest.raises(UsageError, match="--cache-generator-onnx /missing.onnx does not exist"):
        Model(m.loaded, "onnxrt", m.settings, BackendOptions(cache_generator_onnx="/missing.onnx"))


def test_bart_sessions_leave_residual_adds_and_layer_norms_apart_on_the_cpu(seq2seq_dirs, onnx_work_dir, tmp_path,
                                                                         monkeypatch):
    """BART's post-norm layers end in a residual Add and a LayerNormalization, which ONNX Runtime's
    SkipLayerNormFusion fuses at load into SkipLayerNormalization, whose CPU kernel is the slower
    (nndf.backends.ort_runtime): on the CPU our sessions keep them apart; the graph ONNX Runtime optimized shows what
    each session runs."""
    import onnx

    from nndf.seq2seq.export import export_seq2seq

    m = _load("bart", "frameworks", seq2seq_dirs, onnx_work_dir)
    optimized = tmp_path / "optimized.onnx"
    dump_optimized_graph(monkeypatch, onnxrt, optimized)
    for name, graph in export_seq2seq(m.loaded, True, onnx_work_dir).graphs.items():
        model = onnx.load(str(graph.graph), load_external_data=False)
        if not any(node.op_type == "LayerNormalization" for node in model.graph.node):
            continue  # the cache generator: projections only
        session = onnxrt.OrtSession(graph.graph, [i.name for i in model.graph.input],
                                    [o.name for o in model.graph.output], role=name)
        assert session.provider == "CPUExecutionProvider"
        ran = [node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node]
        assert "LayerNormalization" in ran and "SkipLayerNormalization" not in ran, name


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_graphs_replace_every_weight_matmul(kind, seq2seq_dirs, onnx_work_dir):
    import onnx

    m = _load("flan-t5", "onnxrt", seq2seq_dirs, onnx_work_dir, quantize=kind)
    assert len(m.artifacts) == 3 and all(kind in a for a in m.artifacts)
    for artifact in m.artifacts:
        model = onnx.load(artifact, load_external_data=False)
        weights = {i.name for i in model.graph.initializer if len(i.dims) == 2 and i.data_type == onnx.TensorProto.FLOAT}
        assert not [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights], artifact
    ids, mask = _prompts()
    assert m.generate(ids, mask, max_new_tokens=4, min_new_tokens=4).shape == (3, 5)


def test_length_flags_are_checked_per_side(capsys):
    """The encoder's and the decoder's lengths are each checked against their positions, before any weights load."""
    from nndf.cli import main

    t5 = ["benchmark", "T5", "frameworks", "--variant", "t5-small", "--random-weights"]
    assert main([*t5, "--input-seq-len", "600"]) == 2
    assert "--input-seq-len 600 exceeds the 512 positions of this model's encoder" in capsys.readouterr().err
    assert main([*t5, "--input-seq-len", "500", "--output-seq-len", "512"]) == 2
    assert "--output-seq-len 512 plus the decoder's start token exceeds the 512 positions" in capsys.readouterr().err
    from nndf.loading import known_config
    from nndf.registry import resolve
    from nndf.seq2seq.shapes import Seq2SeqShapeSpec
    from nndf.spec import BuildSettings

    spec, variant = resolve("BART", "bart-base")
    shapes = Seq2SeqShapeSpec.derive(BuildSettings(input_seq_len=1000, output_seq_len=600), spec,
                                     known_config(variant))  # 1000 + 600 is fine: the two sides have a window each
    assert (shapes.encoder.max, shapes.total.max) == (1000, 601)


def _fp16_decoder(m, work):
    """The T5 example's three graphs converted to fp16 (T5's feed-forward output kept fp32), run on the CPU."""
    from nndf.backends.onnxrt import OrtSession
    from nndf.export.half import fp16_graph
    from nndf.seq2seq.decoder import Seq2SeqDecoder
    from nndf.seq2seq.export import export_seq2seq

    export = export_seq2seq(m.loaded, True, work)
    paths = {name: fp16_graph(g, m.spec.hooks.fp32_modules(), work) for name, g in export.graphs.items()}
    sessions = {name: OrtSession(paths[name], g.input_names, g.output_names, torch_outputs=name != "decoder")
                for name, g in export.graphs.items()}
    decoder = Seq2SeqDecoder(sessions["encoder"], sessions["cross"], sessions["decoder"], m.shapes, m.spec.hooks,
                             m.decoder.start_token_id)
    return export, paths, decoder


def test_fp16_graphs_keep_t5_feed_forward_output_in_fp32(seq2seq_dirs, onnx_work_dir):
    """ONNX Runtime's fp16 conversion gets T5's `DenseReluDense.wo` nodes on its block list: they compute in fp32
    (their weight is cast back to fp32), every other projection has fp16 weights; the logits stay within 1%."""
    import onnx

    from nndf.export.precision import module_nodes

    m = _load("t5", "frameworks", seq2seq_dirs, onnx_work_dir)
    export, paths, decoder = _fp16_decoder(m, onnx_work_dir)
    for graph in ("encoder", "decoder"):
        kept = set(module_nodes(export.graphs[graph].graph, ("DenseReluDense.wo",)))
        assert len(kept) == 2, graph  # one per layer
        model = onnx.load(str(paths[graph]), load_external_data=False)
        inits = {i.name: i.data_type for i in model.graph.initializer}
        producers = {o: n for n in model.graph.node for o in n.output}
        for node in model.graph.node:
            if node.op_type != "MatMul" or node.name not in kept:
                continue
            cast = producers[node.input[1]]
            assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT, node.name
        fp16 = [n for n in model.graph.node if n.op_type == "MatMul" and inits.get(n.input[1]) == onnx.TensorProto.FLOAT16]
        assert len(fp16) >= 4 * 2, graph
    ids = torch.randint(4, 999, (2, 9), generator=torch.Generator().manual_seed(2))
    decoder_ids = torch.tensor([[0, 5, 17, 300]] * 2)
    got, expected = decoder.logits(ids, decoder_ids), m.reference_logits(ids, decoder_ids)
    assert float((got - expected).abs().max()) <= 0.01 * float(expected.abs().max())


def test_fp16_on_onnxrt_without_a_gpu_is_one_clear_error(seq2seq_dirs, onnx_work_dir):
    if onnxrt._cuda_provider():
        pytest.skip("ONNX Runtime here runs on a GPU: the fp16 path runs (tests marked gpu)")
    with pytest.raises(UsageError, match="fp16=True on the onnxrt backend needs ONNX Runtime's CUDA provider"):
        _load("t5", "onnxrt", seq2seq_dirs, onnx_work_dir, fp16=True)


@pytest.mark.gpu
def test_gpu_fp16_onnxrt_t5_logits_within_one_percent(seq2seq_dirs, tmp_path):
    """On a GPU with onnxruntime-gpu: the fp16 T5 graphs on the CUDA provider, against fp32 PyTorch."""
    if not onnxrt._cuda_provider():
        pytest.skip("ONNX Runtime here has no CUDA provider (the onnxruntime-gpu extra)")
    m = nndf.load("T5", backend="onnxrt", torch_dir=str(seq2seq_dirs["t5"]), fp16=True, working_dir=str(tmp_path))
    reference = nndf.load("T5", torch_dir=str(seq2seq_dirs["t5"]), device="cpu")
    ids = torch.randint(4, 999, (2, 9), generator=torch.Generator().manual_seed(2))
    decoder_ids = torch.tensor([[0, 5, 17, 300]] * 2)
    got, expected = m.logits(ids, decoder_ids), reference.reference_logits(ids, decoder_ids)
    assert float((got - expected).abs().max()) <= 0.01 * float(expected.abs().max())
