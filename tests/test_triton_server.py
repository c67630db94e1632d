"""The repository served for real: pytriton's tritonserver on 127.0.0.1, queried over HTTP and gRPC with tritonclient.

A seeded tiny BERT with mean pooling (a sentence-transformers model) is converted by convert_model, which writes
the repository, and served by one server for the module (tests/triton_server.py; its first use creates
the server's venv, later runs reuse it). Text goes in, the mean-pooled embedding comes out, and must equal ONNX
Runtime's on the same tokenization. Malformed requests must each get an error while the server keeps serving.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest

pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
if platform.system() != "Linux" or platform.machine() != "x86_64":
    pytest.skip("pytriton's tritonserver binary is for Linux x86_64", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from nndf.triton import validate_repository  # noqa: E402
from triton_server import convert_tiny_encoder, triton_server, triton_venv  # noqa: E402

MAX_BATCH = 4
GRAPH_INPUTS: list[str] = []  # the converted graph's token inputs, read by the `served` fixture
ENSEMBLE = "transformer_onnx_inference"
MODEL = "transformer_onnx_model"
TEXTS = ["Triton serves the tokenizer and the graph as one ensemble.", "short", "naïve café, ÉCOLE!"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_dir):
    """{"http", "grpc": urls, "onnx", "tokenizer"}, with the server running for the whole module."""
    triton_venv()  # first: a machine that cannot create it skips before the export
    root = tmp_path_factory.mktemp("triton")
    repository, onnx_file, tokenizer_dir = convert_tiny_encoder(root, MAX_BATCH, minilm_dir)
    validate_repository(repository)
    import onnx

    GRAPH_INPUTS[:] = [i.name for i in onnx.load(str(onnx_file), load_external_data=False).graph.input]
    with triton_server(repository, root) as urls:
        yield dict(urls, onnx=onnx_file, tokenizer=tokenizer_dir)


def expected_embeddings(served, texts: list[str]) -> np.ndarray:
    """ONNX Runtime on the graph, fed the tokenizer's own encoding of `texts` (as the tokenize model makes it)."""
    import onnxruntime
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(str(served["tokenizer"]))(texts, padding=True, truncation=True,
                                                                      return_tensors="np")
    session = onnxruntime.InferenceSession(str(served["onnx"]), providers=["CPUExecutionProvider"])
    return session.run(["output"], {i.name: encoded[i.name].astype(np.int64) for i in session.get_inputs()})[0]


def text_input(module, texts, shape=None, datatype="BYTES"):
    tensor = module.InferInput("TEXT", list(shape or (len(texts), 1)), datatype)
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(shape or (-1, 1)))
    return tensor


def infer_over(module, protocol):
    """A call that sends texts to the ensemble over `protocol` with tritonclient's `module` for it."""
    def infer(served, texts):
        client = module.InferenceServerClient(served[protocol])
        try:
            return client.infer(ENSEMBLE, [text_input(module, texts)]).as_numpy("output")
        finally:
            client.close()
    return infer


infer_http, infer_grpc = infer_over(httpclient, "http"), infer_over(grpcclient, "grpc")


@pytest.mark.parametrize("infer", [infer_http, infer_grpc], ids=["http", "grpc"])
def test_text_in_embedding_out_equals_onnxruntime(served, infer):
    got = infer(served, TEXTS)
    expected = expected_embeddings(served, TEXTS)
    assert got.shape == (len(TEXTS), 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(infer(served, TEXTS[1:2]), expected_embeddings(served, TEXTS[1:2]), atol=1e-4, rtol=0)


def test_the_three_models_are_ready_with_the_configs_written(served):
    client = httpclient.InferenceServerClient(served["http"])
    try:
        for name in ("transformer_onnx_tokenize", MODEL, ENSEMBLE):
            assert client.is_model_ready(name), name
        config = client.get_model_config(MODEL)
        assert config["platform"] == "onnxruntime_onnx" and config["max_batch_size"] == MAX_BATCH
        assert [i["name"] for i in config["input"]] == GRAPH_INPUTS and "dynamic_batching" in config
    finally:
        client.close()


def malformed_requests():
    """(what is wrong, model, inputs builder, what Triton's answer must say): refused, for that reason."""
    def ids(module, name, shape, dtype=np.int64):
        tensor = module.InferInput(name, list(shape), "INT64" if dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(np.ones(shape, dtype=dtype))
        return tensor

    return [
        ("TEXT without its [1] axis", ENSEMBLE, lambda m: [text_input(m, TEXTS, shape=(3,))],
         r"unexpected shape for input 'TEXT'"),
        ("TEXT as INT64", ENSEMBLE, lambda m: [ids(m, "TEXT", (2, 1))], "data-type is 'INT64'.*expects 'BYTES'"),
        ("no input at all", ENSEMBLE, lambda m: [], "expected 1 inputs but got 0"),
        (f"batch of {MAX_BATCH + 1} > max_batch_size", ENSEMBLE, lambda m: [text_input(m, ["x"] * (MAX_BATCH + 1))],
         f"batch-size must be <= {MAX_BATCH}"),
        ("not UTF-8 text", ENSEMBLE, lambda m: [_raw_text(m, b"\xff\xfe")], "tokenization failed.*utf-8"),
        ("token ids as FP32", MODEL, lambda m: [ids(m, n, (1, 5), np.float32) for n in GRAPH_INPUTS],
         "data-type is 'FP32'.*expects 'INT64'"),
        ("attention_mask missing", MODEL, lambda m: [ids(m, "input_ids", (1, 5))],
         r"expected \d inputs but got 1"),
        ("an input the model does not have", MODEL, lambda m: [ids(m, n, (1, 5)) for n in GRAPH_INPUTS + ["x"]],
         r"expected \d inputs but got [34]"),
    ]


def _raw_text(module, raw: bytes):
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[raw]], dtype=object))
    return tensor


@pytest.mark.parametrize("client_module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_malformed_requests_each_get_an_error_and_the_server_keeps_serving(served, client_module):
    client = client_module.InferenceServerClient(served["http" if client_module is httpclient else "grpc"])
    try:
        for problem, model, inputs, answer in malformed_requests():
            with pytest.raises(InferenceServerException, match=answer):
                client.infer(model, inputs(client_module))
            assert client.is_server_live() and client.is_model_ready(ENSEMBLE), f"after {problem}"
        good = client.infer(ENSEMBLE, [text_input(client_module, TEXTS)]).as_numpy("output")
        np.testing.assert_allclose(good, expected_embeddings(served, TEXTS), atol=1e-4, rtol=0)
    finally:
        client.close()


def test_concurrent_requests_of_different_lengths_are_answered_each_with_its_own_embedding(served):
    """The dynamic batcher may merge requests; each answer must still be its own text's embedding."""
    client = httpclient.InferenceServerClient(served["http"], concurrency=len(TEXTS))
    try:
        pending = [client.async_infer(ENSEMBLE, [text_input(httpclient, [t])]) for t in TEXTS * 2]
        got = np.concatenate([p.get_result(timeout=30).as_numpy("output") for p in pending])
    finally:
        client.close()
    expected = np.concatenate([expected_embeddings(served, [t]) for t in TEXTS * 2])
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
