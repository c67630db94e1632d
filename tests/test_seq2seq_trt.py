"""Encoder-decoder families (T5, Flan-T5, BART, mBART) on the trt backend: three engines per model.

Without a GPU the backend runs against the fake TensorRT of `tests/fake_tensorrt.py` (its engines execute the
exported ONNX graphs with ONNX Runtime on the buffers the runner binds): tokens equal Hugging Face `generate()`'s,
engines are reused, given engines are checked by tensor names, and T5's feed-forward output stays fp32 in fp16
builds. The tests marked `gpu` build real engines (`python -m pytest -m gpu` on a GPU machine with TensorRT).
"""

from __future__ import annotations

import re
import sys

import onnx
import pytest
import torch

import nndf
from fake_tensorrt import DEVICE, FakeLayer, FakeNetwork, fake_gpu, fake_polygraphy, fake_tensorrt  # noqa: F401
from family_examples import SEQ2SEQ_EXAMPLES
from nndf.backends import BackendOptions
from nndf.backends import trt as trt_backend
from nndf.errors import UsageError
from nndf.export import engine_build, engine_cache
from nndf.export.engine_request import EngineRequest
from nndf.export.precision import module_nodes
from nndf.model import Model
from nndf.spec import BuildSettings
from nndf.workspace import read_metadata
from sampling_checks import assert_samples_like_generate
from test_seq2seq import EXAMPLES, _prompts
from test_trt import _needs_tensorrt

# Batch 3 (dynamic 1..3) with beams 2, prompts of 11 tokens (right-padded, with masks), 10 new tokens.
SETTINGS = dict(batch_size=3, num_beams=2, dynamic_batch=True, min_dynamic_batch=1, max_dynamic_batch=3,
                input_seq_len=11, output_seq_len=10, use_mask=True)
GRAPHS = ("encoder", "cross", "decoder")  # the order of Model.artifacts


def _load(example, seq2seq_dirs, work, device="cpu", loaded=None, **settings) -> Model:
    return nndf.load(SEQ2SEQ_EXAMPLES[example][0], backend="trt", torch_dir=str(seq2seq_dirs[example]),
                     working_dir=str(work), device=device, settings=BuildSettings(**{**SETTINGS, **settings}),
                     loaded=loaded)


def _check_example_on_trt(example, seq2seq_dirs, work, device, use_cache) -> Model:
    """Greedy and beam 2 over batch 3 of prompts of different lengths: the same tokens as `generate()` (also with a
    minimum length, so that random weights cannot end every row at once); teacher-forced logits as PyTorch's."""
    model = _load(example, seq2seq_dirs, work, device, use_cache=use_cache)
    ids, mask = _prompts()
    for num_beams in (1, 2):
        for min_new in (0, 9):
            ours = model.generate(ids, mask, max_new_tokens=10, min_new_tokens=min_new, num_beams=num_beams)
            reference = model.hf_generate(ids, mask, max_new_tokens=10, min_new_tokens=min_new, num_beams=num_beams)
            assert torch.equal(ours, reference), f"{example} beams={num_beams} min_new={min_new}"
    assert_samples_like_generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=10)
    decoder_ids = torch.tensor([[model.decoder.start_token_id, 5, 17, 300, 42]])
    torch.testing.assert_close(model.logits(ids[:1], decoder_ids), model.reference_logits(ids[:1], decoder_ids),
                               rtol=0, atol=1e-4)
    return model


# Every family with the KV cache; without it, T5 and mBART only (flan-t5 and BART differ from them in configs that
# the cached runs cover, and the cache-less engines take the same path for all four): ~30 s each on 2 cores, the
# cache-less exports being those of tests/test_seq2seq.py's cache-less onnxrt cases.
FAKE_ENGINE_CASES = [pytest.param(e, True, id=f"{e}-cache") for e in EXAMPLES] + \
    [pytest.param(e, False, id=f"{e}-no-cache") for e in ("t5", "mbart")]


@pytest.mark.parametrize("example, use_cache", FAKE_ENGINE_CASES)
def test_fake_engines_tokens_equal_hf_generate(fake_gpu, example, use_cache, seq2seq_dirs, onnx_work_dir):
    model = _check_example_on_trt(example, seq2seq_dirs, onnx_work_dir, "cpu", use_cache)
    family = SEQ2SEQ_EXAMPLES[example][0]
    # engines are named after the model: a --torch-dir model's is its folder's name
    assert [r.stem for r in fake_gpu] == [f"{family}-{model.loaded.name}-{graph}" for graph in GRAPHS]
    assert [r.graph for r in fake_gpu] == list(GRAPHS) and all(not r.fp32_layers for r in fake_gpu)
    encoder, cross, decoder = model.decoder.sessions
    assert {s.name for s in (encoder, cross, decoder)} == {"trt"} and len(encoder.io.profiles) == 1
    assert [a.rsplit("/", 1)[-1].split("-tf32-")[0] for a in model.artifacts] == [r.stem for r in fake_gpu]
    assert len(decoder.io.profiles) == (2 if use_cache else 1)
    assert {call for call in decoder._context.calls if call[0] == "profile"} == \
        {("profile", index) for index in range(len(decoder.io.profiles))}  # first step, then generation
    # The encoder's mask and the cross keys and values ride along every step bound as they are, never copied.
    assert not [name for name in decoder._staging.buffers if name.startswith("cross.") or name.startswith("encoder")]


def test_fake_engines_reused_and_given(fake_gpu, seq2seq_dirs, onnx_work_dir, tmp_path, capsys):
    model = _load("t5", seq2seq_dirs, onnx_work_dir, engine_postfix="-given")
    engines = dict(zip(GRAPHS, model.artifacts))
    assert len(fake_gpu) == 3 and "building a TensorRT engine" in capsys.readouterr().err
    again = _load("t5", seq2seq_dirs, onnx_work_dir, engine_postfix="-given")
    assert again.artifacts == model.artifacts and len(fake_gpu) == 3 and "building" not in capsys.readouterr().err
    ids, mask = _prompts()
    expected = again.generate(ids, mask, max_new_tokens=6)
    assert again.loaded._model is None, "the PyTorch weights were loaded although the engines were reusable"
    notes = again.decoder.session.info_notes
    assert notes[0] == f"TensorRT engine: {engines['decoder']}" and "--onnx=" in notes[1] and "decoder.onnx" in notes[1]

    def given(settings=model.settings, work=onnx_work_dir, **paths):
        return Model(model.loaded, "trt", settings, BackendOptions(working_dir=str(work), **paths))

    every = given(work=tmp_path, encoder_engine=engines["encoder"], cache_generator_engine=engines["cross"],
                  decoder_engine=engines["decoder"])
    assert every.artifacts == model.artifacts and torch.equal(every.generate(ids, mask, max_new_tokens=6), expected)
    assert list(tmp_path.iterdir()) == [], "nothing is exported or built when every engine is given"
    assert given(encoder_engine=engines["encoder"]).artifacts == model.artifacts and len(fake_gpu) == 3
    for flag, graph, role in (("encoder_engine", "decoder", "encoder"),
                              ("cache_generator_engine", "encoder", "cross-attention cache generator"),
                              ("decoder_engine", "cross", "decoder")):
        with pytest.raises(UsageError, match=f"^--{flag.replace('_', '-')} .* does not have the {role}'s inputs"):
            given(**{flag: engines[graph]})
    with pytest.raises(UsageError, match="^--cache-generator-engine /missing.engine does not exist"):
        given(work=tmp_path, cache_generator_engine="/missing.engine")  # checked before any export
    longer = BuildSettings(**{**SETTINGS, "input_seq_len": 20})
    with pytest.raises(UsageError, match=r"^--encoder-engine .* has no optimization profile .* input_ids needs "
                                         r"1x1..3x20 .* or drop --encoder-engine to build one"):
        given(longer, encoder_engine=engines["encoder"])


def test_fake_fp16_t5_keeps_feed_forward_output_in_fp32(fake_gpu, seq2seq_dirs, onnx_work_dir, capsys):
    """Static batch 1 with 2 beams: the fp16 check scores one row on every engine (teacher-forced). The weights are
    loaded in fp32 (an fp16 load would export fp16-rounded weights into the shared export)."""
    settings = dict(fp16=True, batch_size=1, dynamic_batch=False, min_dynamic_batch=None, max_dynamic_batch=None,
                    output_seq_len=6)
    fp32 = nndf.load("T5", backend="frameworks", torch_dir=str(seq2seq_dirs["t5"]), device="cpu").loaded
    model = _load("t5", seq2seq_dirs, onnx_work_dir, loaded=fp32, **settings)
    requests = {request.graph: request for request in fake_gpu}
    assert all(request.fp16 and "-fp16-" in path for request, path in zip(fake_gpu, model.artifacts))
    for graph in ("encoder", "decoder"):
        nodes = module_nodes(requests[graph].onnx_path, ("DenseReluDense.wo",))
        assert requests[graph].fp32_layers == nodes and len(nodes) == 2  # one per layer of the tiny T5
        graph_nodes = onnx.load(str(requests[graph].onnx_path), load_external_data=False).graph.node
        assert {n.op_type for n in graph_nodes if n.name in nodes} == {"MatMul"}
        assert engine_cache.engine_settings(requests[graph], DEVICE)["fp32_layers"] == list(nodes)
    assert requests["cross"].fp32_layers == () and "fp32_layers" not in engine_cache.engine_settings(
        requests["cross"], DEVICE)
    assert f"--layerPrecisions={requests['encoder'].fp32_layers[0]}:fp32," in model.decoder.encoder.info_notes[1]
    check = read_metadata(model.artifacts[2])["fp16_check"]
    assert check["relative"] < trt_backend.FP16_LOGIT_BOUND and check["positions"] == 2 * 7  # encoder 8 and 11
    assert "checking the fp16 engine's logits against fp32 PyTorch" in capsys.readouterr().err
    _load("t5", seq2seq_dirs, onnx_work_dir, loaded=fp32, **settings)
    assert len(fake_gpu) == 3 and "checking" not in capsys.readouterr().err


def test_fp16_build_pins_the_named_layers_to_fp32(tmp_path, monkeypatch):
    """The build marks each named node's layers (and its parser-suffixed helper layers) fp32 and obeys it; other
    layers and non-float outputs stay as they are; a tf32 build marks nothing."""
    names = ("node_linear_5", "node_Shape_3", "node_add")
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    for fp16 in (True, False):
        seen, messages = {}, []
        layers = [FakeLayer("node_linear_5", "float32"), FakeLayer("node_linear_5_17", "float32", "int64"),
                  FakeLayer("node_linear_55", "float32"), FakeLayer("node_Shape_3", "int64"),
                  FakeLayer("node_add", "float16")]
        monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", fake_polygraphy(b"E", seen, FakeNetwork(layers)))
        request = EngineRequest(stem="T5-t5-small-encoder", graph="encoder", onnx_path=tmp_path / "encoder.onnx",
                                onnx_id="x", input_names=("input_ids",), output_names=("encoder_hidden_states",),
                                profiles=[{"input_ids": ((1, 1), (1, 4), (1, 8))}], fp16=fp16, fp32_layers=names)
        engine_build.build_engine(request, tmp_path / f"{fp16}.engine", tmp_path / "c", {}, messages.append)
        marked = [layer.name for layer in layers if layer.precision == "float32"]
        assert seen["create"].get("precision_constraints") == ("obey" if fp16 else None)
        assert ("  3 layers of 3 ONNX nodes kept in fp32" in messages) == fp16
        if not fp16:
            assert marked == [] and all(layer.output_types == {} for layer in layers)
            continue
        assert marked == ["node_linear_5", "node_linear_5_17", "node_add"]
        assert [layer.output_types for layer in layers] == [{0: "float32"}, {0: "float32"}, {}, {}, {0: "float32"}]
        # the engine records the layers it pinned, and the trtexec command names exactly those (trtexec matches
        # layer names exactly, so the request's node names alone would miss node_linear_5_17)
        pinned = read_metadata(tmp_path / "True.engine")[engine_build.PINNED_LAYERS_KEY]
        assert pinned == marked
        command = engine_build.trtexec_command(request, "e", fp32_layers=tuple(pinned))
        assert "--layerPrecisions=node_linear_5:fp32,node_linear_5_17:fp32,node_add:fp32 " in command


def test_module_nodes_from_exporter_metadata(tmp_path):
    """Nodes are found by the module scopes the exporter records (as a list, or in the older namespace string)."""
    from onnx import helper

    def node(name, **metadata):
        made = helper.make_node("Identity", ["x"], [name + "_out"], name=name)
        helper.set_metadata_props(made, metadata)
        return made

    wo = "['', 'encoder', 'encoder.block.0.layer.1.DenseReluDense', 'encoder.block.0.layer.1.DenseReluDense.wo', 'mm']"
    nodes = [node("a", **{"pkg.torch.onnx.name_scopes": wo}),
             node("b", **{"pkg.torch.onnx.name_scopes": wo.replace("DenseReluDense.wo", "DenseReluDense.wi")}),
             node("c", namespace=": Wrapper/decoder.block.1.layer.2.DenseReluDense.wo: Linear/linear_9: aten.linear"),
             node("d", namespace=": Wrapper/decoder.block.1.layer.2.my_DenseReluDense.wo: Linear/linear_9: aten"),
             node("e")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])], [])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, ir_version=10), str(path))
    assert module_nodes(path, ("DenseReluDense.wo",)) == ("a", "c")
    assert module_nodes(path, ("DenseReluDense",)) == ("a", "b", "c")  # modules below it count too
    assert module_nodes(path, ("layer.2.DenseReluDense", "wi")) == ("b", "c")
    assert module_nodes(path, ()) == ()


@pytest.mark.parametrize("argv, message", [
    (["--encoder-engine", "e.engine"], "^--encoder-engine applies to the trt backend; add trt"),
    (["--cache-generator-engine", "c.engine"], "^--cache-generator-engine applies to the trt backend"),
    (["--cache-generator-onnx", "c.onnx"], "^--cache-generator-onnx applies to the onnxrt backend"),
])
def test_cli_engine_and_onnx_flags_name_their_backend(argv, message, capsys):
    """Said before the given file's absence (it was "e.engine does not exist", for a flag that would not be used)."""
    from nndf.actions.common import backend_options
    from nndf.cli import build_parser, main

    backend = "onnxrt" if "engine" in argv[0] else "trt"
    assert main(["benchmark", "T5", backend, "--variant", "t5-small", "--random-weights", *argv]) == 2
    assert re.search(message, capsys.readouterr().err.removeprefix("error: "))
    other = "trt" if backend == "onnxrt" else "onnxrt"
    options = backend_options(build_parser().parse_args(["benchmark", "T5", other, *argv]))
    assert getattr(options, argv[0][2:].replace("-", "_")) == argv[1]


def test_cli_export_builds_three_engines_and_info_shows_each(fake_gpu, seq2seq_dirs, onnx_work_dir, capsys):
    from nndf.cli import main

    code = main(["export", "BART", "trt", "--torch-dir", str(seq2seq_dirs["bart"]), "--working-dir",
                 str(onnx_work_dir), "--input-seq-len", "11", "--output-seq-len", "10", "--info"])
    out = capsys.readouterr().out
    assert code == 0 and [r.graph for r in fake_gpu] == list(GRAPHS)
    for graph in GRAPHS:
        assert out.count(f"-{graph}-tf32-") >= 2  # the export table and the --info note
        assert f"/{graph}.onnx --saveEngine=" in out  # each engine's trtexec command


# --- real TensorRT on a GPU: `python -m pytest -m gpu` ---------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_work(tmp_path_factory):
    return tmp_path_factory.mktemp("trt-seq2seq-gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("example", EXAMPLES)
def test_gpu_fp32_engines_tokens_equal_hf_generate(example, use_cache, seq2seq_dirs, gpu_work, monkeypatch):
    _needs_tensorrt()
    monkeypatch.setattr(trt_backend, "USE_TF32", False)  # bit-level parity needs true fp32 matrix products
    _check_example_on_trt(example, seq2seq_dirs, gpu_work, "cuda", use_cache)


@pytest.mark.gpu
def test_gpu_engines_reused_and_given(seq2seq_dirs, gpu_work, capsys):
    _needs_tensorrt()
    first = _load("bart", seq2seq_dirs, gpu_work, "cuda")
    capsys.readouterr()
    again = _load("bart", seq2seq_dirs, gpu_work, "cuda")
    assert again.artifacts == first.artifacts and "building" not in capsys.readouterr().err
    engines = dict(zip(GRAPHS, first.artifacts))
    given = Model(first.loaded, "trt", first.settings, BackendOptions(
        working_dir=str(gpu_work), encoder_engine=engines["encoder"], cache_generator_engine=engines["cross"],
        decoder_engine=engines["decoder"]))
    ids, mask = _prompts()
    assert torch.equal(given.generate(ids, mask, max_new_tokens=6), first.generate(ids, mask, max_new_tokens=6))
    with pytest.raises(UsageError, match="does not have the encoder's inputs and outputs"):
        Model(first.loaded, "trt", first.settings, BackendOptions(working_dir=str(gpu_work),
                                                                  encoder_engine=engines["decoder"]))


@pytest.mark.gpu
def test_gpu_t5_fp16_engines_logits_within_bound(seq2seq_dirs, gpu_work):
    _needs_tensorrt()
    fp32 = nndf.load("T5", backend="frameworks", torch_dir=str(seq2seq_dirs["t5"]), device="cuda").loaded
    model = _load("t5", seq2seq_dirs, gpu_work, "cuda", loaded=fp32, fp16=True)
    check = read_metadata(model.artifacts[2])["fp16_check"]
    assert check["relative"] <= trt_backend.FP16_LOGIT_BOUND, check
    ids, mask = _prompts()
    assert model.generate(ids, mask, max_new_tokens=6).shape[0] == 3
