"""Continuous batching (nndf.continuous): requests that join a running batch and leave it get, token for token, the
answer they get alone, on every backend and KV layout; cancelled and failing requests end alone."""

from __future__ import annotations

import threading

import pytest
import torch

import nndf
from nndf.continuous import BatchWorker, ContinuousBatcher, Request
from nndf.errors import UsageError
from nndf.export.quantize import KINDS, MATMUL_OP
from nndf.generation import GenerationOptions, generate
from nndf.rowcache import RowCache
from conftest import TOKENIZER_DIR, needs_shared

BACKENDS = [("onnxrt", {}), ("onnxrt", {"kv_layout": "growing"}), ("frameworks", {})]


def prompts(vocab: int, lengths, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, n), generator=generator) for n in lengths]


def alone(model, prompt, options: GenerationOptions) -> list[int]:
    out = generate(model.decoder, prompt, torch.ones_like(prompt), options)
    return out[0, prompt.shape[1]:].tolist()


def batched(model, asks, max_rows: int, first_capacity: int = 16):
    """Each request submitted a step or two after the one before (so it joins a running batch); the requests and
    the most rows that were ever in flight together."""
    batcher = ContinuousBatcher(model, max_rows=max_rows, first_capacity=first_capacity)
    requests, most = [], 0
    for index, (prompt, options) in enumerate(asks):
        requests.append(batcher.submit(Request(prompt, options)))
        for _ in range(1 + index % 2):
            batcher.step()
            most = max(most, len(batcher.active))
    while batcher.busy:
        batcher.step()
        most = max(most, len(batcher.active))
    return requests, most, batcher


@pytest.mark.parametrize("backend,kwargs", BACKENDS, ids=["onnxrt-shared", "onnxrt-growing", "frameworks"])
def test_rows_that_join_and_leave_get_their_answers_alone(backend, kwargs, tiny_gpt2_dir, onnx_work_dir):
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend=backend, working_dir=str(onnx_work_dir),
                      **kwargs)
    # prompts longer than the batch's first 16 columns (it grows, and rows move right), lengths 1 to 20
    asks = [(p, model.generation_options(n)) for p, n in
            zip(prompts(1000, (5, 17, 3, 30, 9, 12, 40, 2)), (7, 3, 12, 5, 20, 1, 9, 15))]
    requests, most, batcher = batched(model, asks, max_rows=3)
    assert [r.new_tokens for r in requests] == [alone(model, p, o) for p, o in asks]
    assert most == 3 and batcher.cache.capacity > 16 and not batcher.active
    assert all(r.done.is_set() and r.error is None and not r.cancelled for r in requests)


def test_each_row_keeps_its_own_settings(tiny_gpt2_dir, onnx_work_dir):
    """Seeded sampling (on either stream), repetition penalty, minimum length, its own EOS, beams: each as it
    would be alone."""
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir))
    p = prompts(1000, (6, 11, 4, 9, 7, 3, 8), seed=1)
    greedy = alone(model, p[3], model.generation_options(10))
    asks = [(p[0], model.generation_options(12, do_sample=True, temperature=0.7, top_k=30, seed=5)),
            (p[1], model.generation_options(8, repetition_penalty=1.3)),
            (p[2], model.generation_options(9, min_new_tokens=4, do_sample=True, seed=2)),
            (p[3], GenerationOptions(max_new_tokens=10, eos_token_id=greedy[4])),  # ends early, at that token
            (p[4], model.generation_options(5, num_beams=2)),
            (p[5], model.generation_options(6)),
            (p[6], model.generation_options(11, do_sample=True, seed=3, sampling_stream="fast"))]
    requests, most, _ = batched(model, asks, max_rows=4)
    assert [r.new_tokens for r in requests] == [alone(model, q, o) for q, o in asks]
    assert requests[3].new_tokens == greedy[: greedy.index(greedy[4]) + 1] and most > 1


def test_llama_with_grouped_query_attention(family_dirs, onnx_work_dir):
    model = nndf.load("Llama", torch_dir=str(family_dirs["Llama"]), backend="onnxrt", working_dir=str(onnx_work_dir))
    asks = [(p, model.generation_options(n)) for p, n in zip(prompts(1000, (4, 13, 7, 21)), (9, 4, 11, 6))]
    requests, most, _ = batched(model, asks, max_rows=2, first_capacity=8)
    assert [r.new_tokens for r in requests] == [alone(model, p, o) for p, o in asks] and most == 2


class BreakingStreamer:
    """A streamer whose client goes away: `put` fails from the `after`-th new token on."""

    def __init__(self, after: int):
        self.after, self.tokens = after, -1  # the first put is the prompt

    def put(self, value):
        self.tokens += 1
        if self.tokens >= self.after:
            raise ConnectionError("the client is gone")

    def end(self):
        raise AssertionError("a failed request's streamer must not be ended")


def test_a_cancelled_or_failing_request_ends_alone(tiny_gpt2_dir, onnx_work_dir):
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir))
    p = prompts(1000, (5, 8, 6))
    options = model.generation_options(12)
    batcher = ContinuousBatcher(model, max_rows=3)
    leaving = Request(p[0], options, is_cancelled=lambda: len(leaving.new_tokens) >= 3)
    failing = Request(p[1], options, streamer=BreakingStreamer(after=3))
    staying = Request(p[2], options)
    gone = Request(p[2], options, is_cancelled=lambda: 1 / 0)  # its client cannot even be asked: it has left
    for request in (leaving, failing, staying, gone):
        batcher.submit(request)
    batcher.step()
    assert len(batcher.active) == 3
    batcher.run_until_idle()
    assert leaving.cancelled and 3 <= len(leaving.new_tokens) < 12 and leaving.error is None
    assert isinstance(failing.error, ConnectionError) and len(failing.new_tokens) == 3
    assert staying.new_tokens == alone(model, p[2], options) and staying.error is None and not staying.cancelled
    assert gone.cancelled and gone.new_tokens == [] and gone.done.is_set()
    with pytest.raises(UsageError, match="more than the 128 positions of this model"):
        batcher.submit(Request(p[0], model.generation_options(200)))


@needs_shared(TOKENIZER_DIR)
def test_a_row_ends_at_its_stop_string_as_generate_ends_it(tiny_gpt2_dir, onnx_work_dir):
    """`Request(stopping=Model.stop_criteria(...))`: the row ends where `Model.generate(stop_strings=...)` ends it,
    its neighbours go on; with beams it is refused, as generate() refuses it."""
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir))
    p = prompts(1000, (5, 8), seed=4)
    options = model.generation_options(12)
    free = alone(model, p[0], options)
    stop = next(text for text in (model.tokenizer.decode(free[i:i + 1]) for i in range(3, 12)) if text.strip())
    expected = model.new_tokens(model.generate(p[0], max_new_tokens=12, stop_strings=[stop]), p[0])[0].tolist()
    assert len(expected) < 12 and stop in model.tokenizer.decode(expected)  # the stop string ends it early
    batcher = ContinuousBatcher(model, max_rows=2)
    stopped = batcher.submit(Request(p[0], options, stopping=model.stop_criteria([stop])))
    neighbour = batcher.submit(Request(p[1], options))
    batcher.run_until_idle()
    assert stopped.new_tokens == expected and neighbour.new_tokens == alone(model, p[1], options)
    with pytest.raises(UsageError, match="stop strings.* apply to greedy search and sampling"):
        batcher.submit(Request(p[0], model.generation_options(4, num_beams=2), stopping=model.stop_criteria(["a"])))


def test_the_worker_serves_threads_and_finishes_what_was_submitted_when_closed(tiny_gpt2_dir, onnx_work_dir):
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), backend="onnxrt", working_dir=str(onnx_work_dir))
    worker = BatchWorker(ContinuousBatcher(model, max_rows=2))
    asks = [(p, model.generation_options(6 + i)) for i, p in enumerate(prompts(1000, (3, 9, 5, 7, 4)))]
    requests = [None] * len(asks)

    def client(index):
        requests[index] = worker.submit(Request(*asks[index]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert worker.close(timeout=60)  # returns once every submitted request has ended
    assert [r.new_tokens for r in requests] == [alone(model, p, o) for p, o in asks]
    with pytest.raises(UsageError, match="unloading"):
        worker.submit(Request(*asks[0]))


def test_the_row_cache_keeps_rows_right_aligned():
    """Keys = 1 + the position within the row, so where each row's positions sit is visible."""
    cache = RowCache(num_layers=1, kv_heads=1, head_dim=1, max_rows=3, capacity=4, max_capacity=12, in_place=False)

    def pasts(length):
        values = torch.arange(1, length + 1, dtype=torch.float32).view(1, 1, length, 1)
        return {"past_key_values.0.key": values, "past_key_values.0.value": -values}

    def keys():
        return cache.buffers["past_key_values.0.key"][: cache.rows, 0, : cache.length, 0].tolist()

    cache.admit(pasts(2), 2)
    cache.admit(pasts(5), 5)  # longer than the batch: the first row moves right, the buffers grow
    assert keys() == [[0, 0, 0, 1, 2], [1, 2, 3, 4, 5]] and cache.capacity == 8
    assert cache.mask[:2, :5].tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    cache.admit(pasts(1), 1)
    assert cache.retire(1) == 2  # the last row moves into the freed one
    assert keys() == [[0, 0, 0, 1, 2], [0, 0, 0, 0, 1]] and cache.padding() == 3
    cache.length = 8  # as after three decode steps: full, and the common padding is what can go
    cache.make_room(1)
    assert cache.length == 5 and cache.capacity == 8 and keys()[0][:2] == [1, 2]


def test_models_a_batch_cannot_serve_are_refused(seq2seq_dirs):
    model = nndf.load("T5", torch_dir=str(seq2seq_dirs["t5"]), device="cpu")
    with pytest.raises(UsageError, match="continuous batching serves decoder-only models"):
        ContinuousBatcher(model, max_rows=2)


@needs_shared(TOKENIZER_DIR)
def test_the_served_model_keeps_the_sampling_stream_it_was_written_with(tiny_gpt2_dir, onnx_work_dir, tmp_path):
    """Also: a quantized backend name serves its graph (as --int8 does), and the model is named after the
    --torch-dir folder, as the title names it."""
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the triton and test extras) is absent")
    import json

    import onnx

    from nndf.cli import main as run_py

    assert run_py(["triton", "GPT2", "onnxrt-int8", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",
                   str(onnx_work_dir), "-o", str(tmp_path / "models"), "--sampling-stream", "fast"]) == 0
    (settings,) = (tmp_path / "models").rglob("nndf.json")
    assert settings.parent.parent.name == tiny_gpt2_dir.name  # tiny-gpt2, not the variant's gpt2
    assert json.loads(settings.read_text())["defaults"]["sampling_stream"] == "fast"
    graph = onnx.load(settings.parent / "decoder" / "decoder.onnx", load_external_data=False)
    assert MATMUL_OP[KINDS["int8"]["method"]] in {node.op_type for node in graph.graph.node}  # the CPU's int8


@pytest.mark.parametrize("flags,message", [
    (["--scheduler", "sequential", "--streaming"], "--streaming needs --scheduler continuous"),
    (["--scheduler", "sequential", "--max-rows", "4"], "--max-rows applies to --scheduler continuous"),
    (["--scheduler", "sequential", "--max-queue-delay-us", "100"],
     "--max-queue-delay-us applies to --scheduler continuous"),
    (["--max-rows", "0"], "--max-rows must be at least 1, got 0"),
    (["--max-queue-delay-us", "-5"], "--max-queue-delay-us must be 0 or more, got -5"),
    (["--sampling-stream", "quick"], "argument --sampling-stream: invalid choice: 'quick' (choose from"),
])
def test_bad_serving_flags_are_one_sentence(flags, message, tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys):
    from nndf.cli import main as run_py

    code = run_py(["triton", "GPT2", "onnxrt", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",
                   str(onnx_work_dir), "-o", str(tmp_path / "models"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "loading" not in err  # refused before the model loads
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
