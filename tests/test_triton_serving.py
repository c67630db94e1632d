"""Triton serving generation under load, for real on this CPU: continuous batching, streaming and faults.

One tritonserver (pytriton's, tests/triton_server.py) serves the tiny GPT-2's `gpt2` model (continuous scheduler,
at most 3 rows in flight) and its decoupled twin `gpt2_stream`, in explicit model-control mode so that a test can
reload it. Every answer is compared with `Model.generate` on that prompt alone, with the same settings: a
request's answer must not depend on what it was batched with.
"""

from __future__ import annotations

import platform
import queue
import threading
import time

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
from nndf.cli import main as run_py  # noqa: E402
from triton_server import triton_server, triton_venv  # noqa: E402
from conftest import TOKENIZER_DIR, needs_shared  # noqa: E402

pytestmark = needs_shared(TOKENIZER_DIR)  # the served models tokenize with the real GPT-2 tokenizer

LONG = 100  # new tokens of a request that is still running while others come and go (the model has 128 positions)
SETTINGS = {"MAX_NEW_TOKENS": ("INT32", np.int32), "NUM_BEAMS": ("INT32", np.int32), "DO_SAMPLE": ("BOOL", bool),
            "TEMPERATURE": ("FP32", np.float32), "TOP_K": ("INT32", np.int32), "SEED": ("INT64", np.int64)}
KEYWORDS = {"MAX_NEW_TOKENS": "max_new_tokens", "NUM_BEAMS": "num_beams", "DO_SAMPLE": "do_sample",
            "TEMPERATURE": "temperature", "TOP_K": "top_k", "SEED": "seed"}


def write_repository(tiny_gpt2_dir, onnx_work_dir, repository):
    code = run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir", str(onnx_work_dir),
                   "-o", str(repository), "--name", "gpt2", "--max-batch-size", "4", "--max-rows", "3",
                   "--max-new-tokens", "8", "--streaming", "--max-queue-delay-us", "500"])
    assert code == 0


@pytest.fixture(scope="module")
def served(tiny_gpt2_dir, onnx_work_dir, tmp_path_factory):
    triton_venv()  # first: a machine that cannot create it skips before the export
    root = tmp_path_factory.mktemp("triton-serving")
    write_repository(tiny_gpt2_dir, onnx_work_dir, root / "models")
    with triton_server(root / "models", root, timeout=120,
                       extra_args=("--model-control-mode=explicit", "--load-model=*")) as urls:
        yield urls


@pytest.fixture(scope="module")
def direct(tiny_gpt2_dir, onnx_work_dir):
    """prompt, settings -> the text `Model.generate` gives that prompt alone (the served graph, in this process)."""
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir))

    def answer(prompt: str, **settings) -> str:
        keywords = {KEYWORDS[name]: value for name, value in settings.items()}
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, **{"max_new_tokens": 8, **keywords})
        return model.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return answer


def inputs(module, prompts, **settings):
    text = module.InferInput("TEXT", [len(prompts), 1], "BYTES")
    text.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object).reshape(-1, 1))
    found = [text]
    for name, value in settings.items():
        kind, dtype = SETTINGS[name]
        tensor = module.InferInput(name, [len(prompts), 1], kind)
        tensor.set_data_from_numpy(np.full((len(prompts), 1), value, dtype=dtype))
        found.append(tensor)
    return found


def ask(served, prompts, model="gpt2", **settings) -> list[str]:
    client = httpclient.InferenceServerClient(served["http"], network_timeout=120)
    try:
        rows = client.infer(model, inputs(httpclient, prompts, **settings)).as_numpy("GENERATED").reshape(-1)
        return [row.decode() for row in rows]
    finally:
        client.close()


class Stream:
    """One gRPC stream to `gpt2_stream`: the pieces of text as they come, and whether the final flag came."""

    def __init__(self, served):
        self.client = grpcclient.InferenceServerClient(served["grpc"])
        self.events = queue.Queue()
        self.ended_at = None  # when the final flag (or an error) arrived
        self.client.start_stream(callback=self._arrived)

    def _arrived(self, result, error):
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            self.ended_at = time.monotonic()
        self.events.put((result, error))

    def send(self, prompt, **settings):
        self.client.async_stream_infer("gpt2_stream", inputs(grpcclient, [prompt], **settings),
                                       enable_empty_final_response=True)

    def next(self, timeout=60):
        """("piece", text), ("final", None) or ("error", message)."""
        result, error = self.events.get(timeout=timeout)
        if error is not None:
            return "error", str(error)
        if result.get_response().parameters["triton_final_response"].bool_param:
            assert result.as_numpy("GENERATED") is None, "the final response must be empty"
            return "final", None
        return "piece", result.as_numpy("GENERATED").reshape(-1)[0].decode()

    def text(self, timeout=60) -> tuple[str, int]:
        """The whole streamed text (until the final flag) and how many pieces it came in."""
        pieces = []
        while True:
            kind, value = self.next(timeout)
            assert kind != "error", value
            if kind == "final":
                return "".join(pieces), len(pieces)
            pieces.append(value)

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def test_a_request_joins_a_running_batch_and_leaves_before_it(served, direct):
    """A long request, then a short one right after: the short one shares the long one's steps and ends first (one
    request at a time would end the long one first)."""
    long_prompt, short_prompt = "Once upon a time there was a king", "Hello"
    long, short = Stream(served), Stream(served)
    try:
        long.send(long_prompt, MAX_NEW_TOKENS=LONG)
        short.send(short_prompt, MAX_NEW_TOKENS=2)
        assert short.text()[0] == direct(short_prompt, MAX_NEW_TOKENS=2)
        assert long.text()[0] == direct(long_prompt, MAX_NEW_TOKENS=LONG)
        assert short.ended_at < long.ended_at, "the short request waited for the long one to finish"
    finally:
        long.close()
        short.close()


def test_concurrent_requests_with_their_own_settings_get_their_own_answers(served, direct):
    """Seven clients at once (more than the 3 rows: some wait for a row): greedy, sampled with a seed, beams, two
    rows in one request, different lengths; and one that fails, which must not disturb the others."""
    asks = [("The capital of France is", {"MAX_NEW_TOKENS": 12}),
            ("Hello", {}),
            ("A long time ago in a galaxy far, far away", {"MAX_NEW_TOKENS": 5}),
            ("Sampled text", {"DO_SAMPLE": True, "TEMPERATURE": 0.8, "TOP_K": 20, "SEED": 7, "MAX_NEW_TOKENS": 10}),
            ("Beams", {"NUM_BEAMS": 2, "MAX_NEW_TOKENS": 4}),
            (("First row", "Second row of the same request"), {"MAX_NEW_TOKENS": 6}),
            ("Too long", {"MAX_NEW_TOKENS": 500})]
    answers = [None] * len(asks)
    start = threading.Barrier(len(asks))

    def client(index):
        prompt, settings = asks[index]
        start.wait()
        try:
            answers[index] = ask(served, list(prompt) if isinstance(prompt, tuple) else [prompt], **settings)
        except InferenceServerException as exc:
            answers[index] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for (prompt, settings), answer in zip(asks[:-1], answers[:-1]):
        prompts = prompt if isinstance(prompt, tuple) else (prompt,)
        assert answer == [direct(p, **settings) for p in prompts], (prompt, settings)
    assert isinstance(answers[-1], InferenceServerException)
    assert "more than the 128 positions of this model" in str(answers[-1])


def test_streaming_sends_each_piece_then_an_empty_final_response(served, direct):
    stream = Stream(served)
    try:
        prompt = "The weather today"
        stream.send(prompt, MAX_NEW_TOKENS=12)
        text, pieces = stream.text()
        assert text == direct(prompt, MAX_NEW_TOKENS=12)
        assert pieces > 1, "the text came in one piece: it was not streamed"
        stream.send(prompt, NUM_BEAMS=2)  # beam search cannot stream: the request's error, the stream goes on
        kind, message = stream.next()
        assert kind == "error" and "beam search (num_beams > 1) cannot stream" in message
    finally:
        stream.close()


def test_a_client_that_leaves_frees_its_row(served, direct):
    stream = Stream(served)
    stream.send("A story that nobody will read to the end", MAX_NEW_TOKENS=LONG)
    assert stream.next()[0] == "piece"
    stream.close(cancel=True)
    deadline = time.monotonic() + 30
    while "was cancelled after" not in served["log"].read_text():
        assert time.monotonic() < deadline, "the server never noticed the cancelled request"
        time.sleep(0.2)
    assert ask(served, ["Still serving"]) == [direct("Still serving")]


def test_a_reload_keeps_the_answers_of_queued_requests(served, direct):
    """Reloading the model (explicit model control) while requests run and wait: each still gets its answer."""
    prompts = [f"Request number {i} asks" for i in range(5)]
    client = grpcclient.InferenceServerClient(served["grpc"])
    done = queue.Queue()
    try:
        for prompt in prompts:
            client.async_infer("gpt2", inputs(grpcclient, [prompt], MAX_NEW_TOKENS=40),
                               callback=lambda result, error, prompt=prompt: done.put((prompt, result, error)))
        client.load_model("gpt2")  # returns once the new instance serves; the old one finishes its requests
        got = {}
        for _ in prompts:
            prompt, result, error = done.get(timeout=120)
            assert error is None, error
            got[prompt] = result.as_numpy("GENERATED").reshape(-1)[0].decode()
        assert got == {p: direct(p, MAX_NEW_TOKENS=40) for p in prompts}
        assert client.is_model_ready("gpt2")
    finally:
        client.close()


def test_kill_9_ends_every_waiting_client_with_an_error(tiny_gpt2_dir, onnx_work_dir, tmp_path):
    write_repository(tiny_gpt2_dir, onnx_work_dir, tmp_path / "models")
    outcomes = queue.Queue()
    with triton_server(tmp_path / "models", tmp_path, timeout=120) as urls:
        def http_client(index):
            try:
                ask(urls, [f"Client {index} waits"], MAX_NEW_TOKENS=LONG)
                outcomes.put("answered")
            except Exception as exc:  # noqa: BLE001 - any error is what the client must get
                outcomes.put(f"error: {type(exc).__name__}")

        threads = [threading.Thread(target=http_client, args=(i,), daemon=True) for i in range(4)]
        stream = Stream(urls)
        stream.send("A streamed answer cut short", MAX_NEW_TOKENS=LONG)
        assert stream.next()[0] == "piece"
        for thread in threads:
            thread.start()
        time.sleep(0.05)  # the requests reach the server (3 rows: one of them waits for a row)
        urls["process"].kill()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads), "a client hung after the server died"
        kind, _ = stream.next(timeout=30)
        while kind != "error":  # pieces (or its end) sent before the kill may still be in flight
            kind, _ = stream.next(timeout=30)
        stream.client.close()
    results = [outcomes.get_nowait() for _ in range(outcomes.qsize())]
    assert len(results) == 4 and all(r.startswith("error") or r == "answered" for r in results)
    assert any(r.startswith("error") for r in results)
