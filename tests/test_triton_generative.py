"""`run.py triton`: a generative model served by Triton with our loop (text in, text out), for real on this CPU.

The tiny GPT-2's onnxrt graph goes into a Python-backend model (nndf/triton/generation_model.py) that pytriton's
tritonserver runs (tests/triton_server.py); its answers over HTTP and gRPC must be the text our loop generates
directly, greedy and with beams, and bad requests must each get an error while the server keeps serving.
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

import nndf  # noqa: E402
from nndf.actions.common import encode_prompts  # noqa: E402
from nndf.cli import main as run_py  # noqa: E402
from nndf.triton import validate_repository  # noqa: E402
from nndf.triton.repository import explicit_load_flags  # noqa: E402
from triton_server import triton_server, triton_venv  # noqa: E402
from conftest import TOKENIZER_DIR, needs_shared  # noqa: E402

pytestmark = needs_shared(TOKENIZER_DIR)  # the served models tokenize with the real GPT-2 tokenizer

PROMPTS = ["The capital of France is", "Hello"]


@pytest.fixture(scope="module")
def served(tiny_gpt2_dir, onnx_work_dir, tmp_path_factory):
    triton_venv()  # first: a machine that cannot create it skips before the export
    root = tmp_path_factory.mktemp("triton-gpt2")
    repository = root / "models"
    code = run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",
                   str(onnx_work_dir), "-o", str(repository), "--name", "gpt2", "--max-batch-size", "4",
                   "--max-new-tokens", "6"])
    assert code == 0
    code = run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",  # the same graph
                   str(onnx_work_dir), "-o", str(repository), "--name", "gpt2_seq", "--max-batch-size", "4",
                   "--scheduler", "sequential"])
    assert code == 0
    validate_repository(repository)
    # a folder that is not a model, as users leave in -o: the command names it and says to serve only its models
    # (tests/test_triton_action.py), and served so the server starts with it there
    (repository / "notes").mkdir()
    flags = tuple(explicit_load_flags(repository).split())
    assert flags == ("--model-control-mode=explicit", "--load-model=gpt2", "--load-model=gpt2_seq")
    with triton_server(repository, root, timeout=120, extra_args=flags) as urls:
        yield urls


def direct(tiny_gpt2_dir, onnx_work_dir, prompts, max_new_tokens, num_beams=1, **settings):
    """What our loop generates from the same graph without Triton: the new text of each prompt."""
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir))
    ids, mask = encode_prompts(model.tokenizer, prompts, use_mask=True, pad_side="left")
    out = model.generate(ids, mask, max_new_tokens=max_new_tokens, num_beams=num_beams, **settings)
    return model.tokenizer.batch_decode(model.new_tokens(out, ids), skip_special_tokens=True)


def inputs(module, prompts, max_new_tokens=None, num_beams=None):
    text = module.InferInput("TEXT", [len(prompts), 1], "BYTES")
    text.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object).reshape(-1, 1))
    found = [text]
    for name, value in (("MAX_NEW_TOKENS", max_new_tokens), ("NUM_BEAMS", num_beams)):
        if value is not None:
            tensor = module.InferInput(name, [len(prompts), 1], "INT32")
            tensor.set_data_from_numpy(np.full((len(prompts), 1), value, dtype=np.int32))
            found.append(tensor)
    return found


def ask(served, module, prompts, **settings):
    client = module.InferenceServerClient(served["grpc" if module is grpcclient else "http"])
    try:
        rows = client.infer("gpt2", inputs(module, prompts, **settings)).as_numpy("GENERATED").reshape(-1)
        return [row.decode() for row in rows]
    finally:
        client.close()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_text_in_text_out_equals_our_loop(served, module, tiny_gpt2_dir, onnx_work_dir):
    assert ask(served, module, PROMPTS) == direct(tiny_gpt2_dir, onnx_work_dir, PROMPTS, 6)
    assert ask(served, module, PROMPTS, max_new_tokens=3, num_beams=2) == direct(tiny_gpt2_dir, onnx_work_dir,
                                                                                 PROMPTS, 3, num_beams=2)


def tensor(name, values, kind, dtype):
    found = httpclient.InferInput(name, [len(values), 1], kind)
    found.set_data_from_numpy(np.array(values, dtype=dtype).reshape(-1, 1))
    return found


def stops(strings, rows):
    found = httpclient.InferInput("STOP", [rows, len(strings)], "BYTES")
    found.set_data_from_numpy(np.array([[text.encode() for text in strings]] * rows, dtype=object))
    return found


def test_stop_strings_and_a_minimum_length_end_rows_as_generate_does(served, tiny_gpt2_dir, onnx_work_dir):
    """STOP (several per row) and MIN_NEW_TOKENS reach the loop: on the continuous and the sequential model the text
    is `Model.generate(stop_strings=..., min_new_tokens=...)`'s, which ends the first row early."""
    free = direct(tiny_gpt2_dir, onnx_work_dir, PROMPTS, 8)
    middle = len(free[0]) // 2
    stop = free[0][middle: middle + 2]
    assert stop.strip(), free
    settings = {"stop_strings": [stop, "\u2603"], "min_new_tokens": 2}
    expected = direct(tiny_gpt2_dir, onnx_work_dir, PROMPTS, 8, **settings)
    assert expected[0] != free[0] and stop in expected[0]  # (a token may run past it: generate() stops there too)
    client = httpclient.InferenceServerClient(served["http"])
    try:
        for name in ("gpt2", "gpt2_seq"):
            request = inputs(httpclient, PROMPTS, max_new_tokens=8) + [
                stops(settings["stop_strings"], len(PROMPTS)), tensor("MIN_NEW_TOKENS", [2, 2], "INT32", np.int32)]
            rows = client.infer(name, request).as_numpy("GENERATED").reshape(-1)
            assert [row.decode() for row in rows] == expected, name
    finally:
        client.close()


def test_bad_requests_get_errors_and_the_server_keeps_serving(served):
    """Each bad request gets one error naming the input, as a client error (HTTP 400: the model's were 500, which
    says the server failed), and the server keeps serving."""
    client = httpclient.InferenceServerClient(served["http"])
    try:
        ids = tensor("TEXT", [1], "INT64", np.int64)
        beams = tensor("NUM_BEAMS", [1], "INT32", np.int32)
        cases = [(inputs(httpclient, PROMPTS, max_new_tokens=0), "MAX_NEW_TOKENS must be at least 1"),
                 (inputs(httpclient, PROMPTS * 3), "batch-size must be <= 4"),
                 (inputs(httpclient, [""]), "empty prompt"),
                 ([ids], "data-type is 'INT64'.*expects 'BYTES'"),
                 ([beams], "the TEXT input is missing"),
                 # nndf's own checks, said in the inputs' names
                 (inputs(httpclient, PROMPTS[:1]) + [tensor("DO_SAMPLE", [True], "BOOL", bool),
                                                     tensor("TEMPERATURE", [-1], "FP32", np.float32)],
                  r"TEMPERATURE must be a number >= 0 \(0: greedy\), got -1.0"),
                 ([tensor("TEXT", [b"\xff"], "BYTES", object)], "TEXT row 0 is not UTF-8 text"),
                 # one request's rows share its settings: a second row's own value was silently the first's
                 (inputs(httpclient, PROMPTS) + [tensor("MAX_NEW_TOKENS", [2, 5], "INT32", np.int32)],
                  r"MAX_NEW_TOKENS differs between the rows of one request \(2, 5\)"),
                 # a row per beam: more beams than the rows the server generates at once would take every row's memory
                 (inputs(httpclient, PROMPTS[:1], num_beams=5),
                  "NUM_BEAMS 5 is more than the 4 rows this model generates at once; ask for at most 4"),
                 # said in the inputs' names and values, not the command line's flags
                 (inputs(httpclient, PROMPTS[:1], num_beams=2) + [tensor("DO_SAMPLE", [True], "BOOL", bool)],
                  "sample with NUM_BEAMS 1, or search beams with DO_SAMPLE false$"),
                 (inputs(httpclient, PROMPTS[:1]) + [tensor("SEED", [-1], "INT64", np.int64)],
                  "SEED must be a whole number from 0 to 2.*63 - 1, got -1$"),
                 # generate() would ignore a temperature without sampling; a client who sent one expects a change
                 (inputs(httpclient, PROMPTS[:1]) + [tensor("TEMPERATURE", [0.5], "FP32", np.float32)],
                  r"TEMPERATURE shapes sampled draws, and this request does not sample \(the model's generation "
                  r"config does not sample\): send DO_SAMPLE true"),
                 (inputs(httpclient, PROMPTS[:1]) + [tensor("DO_SAMPLE", [False], "BOOL", bool),
                                                     tensor("TOP_K", [5], "INT32", np.int32)],
                  r"TOP_K shapes sampled draws, and this request does not sample \(DO_SAMPLE is false\): send "
                  "DO_SAMPLE true, or leave it out$"),
                 (inputs(httpclient, PROMPTS[:1], max_new_tokens=3) + [tensor("MIN_NEW_TOKENS", [9], "INT32", np.int32)],
                  r"MIN_NEW_TOKENS must lie in 0..MAX_NEW_TOKENS \(3\), got 9"),
                 (inputs(httpclient, PROMPTS[:1]) + [stops([""], 1)], "STOP holds an empty string"),
                 (inputs(httpclient, PROMPTS[:1], num_beams=2) + [stops(["."], 1)],
                  "stop strings.* apply to greedy search and sampling")]
        # the sequential model generates a request as one batch: its prompts times its beams are its rows
        cases = [(case, "gpt2") for case in cases] + [(
            (inputs(httpclient, PROMPTS, num_beams=3), "2 prompts with NUM_BEAMS 3 are 6 rows, more than the 4 this "
                                                       "model generates at once"), "gpt2_seq")]
        for (request, needle), name in cases:
            with pytest.raises(InferenceServerException, match=needle) as raised:
                client.infer(name, request)
            assert raised.value.status() == "400", (needle, raised.value.status())
        for name in ("gpt2", "gpt2_seq"):
            assert client.infer(name, inputs(httpclient, PROMPTS[:1], max_new_tokens=2)).as_numpy("GENERATED").shape \
                == (1, 1)
    finally:
        client.close()
