"""The static KV cache the frameworks backend steps over with --cuda-graph, and the CUDA graphs (issue 11).

On the CPU the static step is forced (the backend takes it for CUDA graphs only), so that everything but the
capture runs here: the same tokens as Hugging Face `generate()` for every family that can step over a static cache,
greedy and beams, padded batches, generations of different lengths one after another over the same buffers.
The `gpu` tests capture and replay the graphs.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import SHARED_DATA, TRAINED_TINY_GPT2, needs_shared
from family_examples import FAMILY_EXAMPLES
from test_cli import run_cli
from test_generation_parity import _model_with_likely_eos

import nndf
import nndf.generation
from nndf.backends import frameworks
from nndf.backends.cuda_graphs import EAGER_MASKS_CAPTURABLE_SINCE, eager_masks_copy_from_host
from nndf.errors import UsageError

STATIC_FAMILIES = [family for family in FAMILY_EXAMPLES if family not in ("GPTNeo", "BLIP")]  # BLIP: its own test


@pytest.fixture
def static_steps(monkeypatch):
    """The frameworks backend steps over a static cache as it does with --cuda-graph."""
    monkeypatch.setattr(frameworks, "static_steps", lambda *args: True)


def _padded(lengths: list[int], vocab: int = 900, left: bool = True, seed: int = 1):
    """Random prompts of these lengths in one padded batch (pad id 3, inside every tiny vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 3, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[row, span] = torch.randint(4, vocab, (n,), generator=g)
        mask[row, span] = 1
    return ids, mask


def _prompts(model, batch: int = 2):
    """A padded batch the family's loop takes: decoder-only prompts padded on the left, encoder inputs on the
    right (a shorter second row either way)."""
    return _padded([7, 4][:batch], left=not model.architecture.has_encoder)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_static_steps_give_hf_tokens(static_steps, family_dirs, family, num_beams):
    model = nndf.load(family, torch_dir=str(family_dirs[family]), device="cpu")
    assert isinstance(model.decoder.session, frameworks.StaticTorchSession)
    ids, mask = _prompts(model)
    ours = model.generate(ids, mask, max_new_tokens=12, min_new_tokens=12, num_beams=num_beams)
    reference = model.hf_generate(ids, mask, max_new_tokens=12, min_new_tokens=12, num_beams=num_beams)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("family", ["GPT2", "BLOOM", "T5"])
def test_static_step_logits_equal_the_dynamic_ones(static_steps, family_dirs, family, monkeypatch):
    static = nndf.load(family, torch_dir=str(family_dirs[family]), device="cpu")
    monkeypatch.setattr(frameworks, "static_steps", lambda *args: False)
    dynamic = nndf.load(family, loaded=static.loaded)
    assert isinstance(static.decoder.session, frameworks.StaticTorchSession)
    assert not isinstance(dynamic.decoder.session, frameworks.StaticTorchSession)
    ids = torch.randint(3, 900, (2, 11), generator=torch.Generator().manual_seed(3))
    if static.architecture.has_encoder:
        args = (ids, ids[:, :6])
    else:
        args = (ids,)
    torch.testing.assert_close(static.decoder.logits(*args), dynamic.decoder.logits(*args), atol=1e-5, rtol=1e-5)


def test_static_buffers_are_reused_across_generations(static_steps, family_dirs):
    """Longer, then shorter, then beams: one set of buffers per number of rows, and each generation sees only its
    own positions (the mask's tail left by a longer generation is cleared)."""
    model = nndf.load("GPT2", torch_dir=str(family_dirs["GPT2"]), device="cpu")
    session = model.decoder.session
    long_ids, long_mask = _padded([20, 13])
    short_ids, short_mask = _padded([3, 5])
    for ids, mask, beams in [(long_ids, long_mask, 1), (short_ids, short_mask, 1), (short_ids, short_mask, 2)]:
        ours = model.generate(ids, mask, max_new_tokens=9, min_new_tokens=9, num_beams=beams)
        assert torch.equal(ours, model.hf_generate(ids, mask, max_new_tokens=9, min_new_tokens=9, num_beams=beams))
    assert sorted(session._buffers) == [2, 4]  # rows: batch 2, and batch 2 x 2 beams
    buffers = session._buffers[2].kv
    model.generate(short_ids, short_mask, max_new_tokens=4)
    assert session._buffers[2].kv is buffers
    assert buffers["past_key_values.0.key"].shape[2] == model.shapes.total.max


def test_blip_captions_over_a_static_cache(static_steps, blip_dir):
    model = nndf.load("BLIP", torch_dir=str(blip_dir), device="cpu")
    assert isinstance(model.decoder.session, frameworks.StaticTorchSession)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for beams in (1, 2):
        ours = model.generate(pixel_values=pixels, max_new_tokens=10, num_beams=beams)
        assert torch.equal(ours, model.hf_generate(pixel_values=pixels, max_new_tokens=10, num_beams=beams))


# Ops that read a device tensor on the host (`.item()`, truth tests, data-dependent shapes) or copy host data in
# (`torch.tensor(...)`): on CUDA, a graph capture fails on each of them and the step falls back to eager.
HOST_ROUND_TRIPS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "lift_fresh", "lift_fresh_copy"}


class _HostRoundTrips(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.steps = 0  # decode steps watched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in HOST_ROUND_TRIPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _skip_if_eager_masks_copy_in(model) -> None:
    """transformers before `EAGER_MASKS_CAPTURABLE_SINCE` builds eager attention masks with a host copy no capture
    allows (BLOOM, BLIP): there the graphs fall back to eager, as the warning says."""
    if eager_masks_copy_from_host() and model.loaded.model.config._attn_implementation == "eager":
        pytest.skip(f"transformers {transformers.__version__} copies a host scalar into eager attention masks (fixed in "
                    f"{EAGER_MASKS_CAPTURABLE_SINCE}): no CUDA graph can capture such a step")


def _decode_steps_watched(model, monkeypatch) -> _HostRoundTrips:
    """Runs the model's decode steps under the watch, as during a CUDA graph capture (transformers skips its
    data-dependent shortcuts while a stream captures)."""
    session, watch = model.decoder.session, _HostRoundTrips()

    def step(*args):
        watch.steps += 1
        with monkeypatch.context() as capturing, watch:
            capturing.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            return session.wrapper(*args)

    session.graphs = frameworks.StepGraphs(step, torch.device("cpu"), [])  # disabled on the CPU: it calls `step`
    return watch


@pytest.mark.parametrize("family", [*STATIC_FAMILIES, "BLIP"])
def test_static_decode_step_makes_no_host_round_trip(static_steps, family_dirs, blip_dir, family, monkeypatch):
    """What a CUDA graph can capture, checked on the CPU: BART's decoder once sized a mask of ones from the cache's
    length (a tensor) and BLOOM's eager mask copied a host scalar in (transformers < 5.21): both fell back to eager."""
    if family == "BLIP":
        model = nndf.load("BLIP", torch_dir=str(blip_dir), device="cpu")
        _skip_if_eager_masks_copy_in(model)
        watch = _decode_steps_watched(model, monkeypatch)
        model.generate(pixel_values=torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                       max_new_tokens=4, min_new_tokens=4)
    else:
        model = nndf.load(family, torch_dir=str(family_dirs[family]), device="cpu")
        _skip_if_eager_masks_copy_in(model)
        watch = _decode_steps_watched(model, monkeypatch)
        model.generate(*_prompts(model), max_new_tokens=4, min_new_tokens=4)
    assert watch.steps >= 3 and watch.seen == []  # 4 new tokens: 3 decode steps after a prompt (4 for seq2seq)


@needs_shared(TRAINED_TINY_GPT2)
def test_lazy_stop_check_cuts_what_ran_past_the_end(monkeypatch):
    """On a GPU greedy search reads "all ended?" every few tokens only; the steps run after the end are cut off, so
    the sequences are generate()'s, whatever step the last row ended at (before, at or after a check). The small
    trained GPT-2 recites a LAMBADA passage, so each of its next tokens can be made the EOS of a shorter run."""
    model = nndf.load("GPT2", torch_dir=str(TRAINED_TINY_GPT2), device="cpu")
    config = model.loaded.model.generation_config
    text = json.loads((SHARED_DATA / "lambada" / "lambada_test.jsonl").read_text().splitlines()[2600])["text"]
    rows = [model.tokenizer(text[:n])["input_ids"] for n in (80, 60)]
    width = max(map(len, rows))
    ids = {"input_ids": torch.tensor([[50256] * (width - len(r)) + r for r in rows]),
           "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])}
    free = model.hf_generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=12)[:, -12:].tolist()
    ends = set()
    for step in range(12):
        eos = free[0][step]
        if eos in free[0][:step]:
            continue
        config.eos_token_id, config.pad_token_id = eos, 50256
        reference = model.hf_generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=12)
        ends.add(reference.shape[1])
        for every in (1, 3, 5, 8, 64):
            monkeypatch.setattr(nndf.generation, "stop_check_interval", lambda device, n=every: n)
            ours = model.generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=12)
            assert torch.equal(ours, reference), (step, every)
    assert len(ends) >= 3, "EOS should end the generations at several different steps"


def test_gpt_neo_is_refused_a_static_cache(family_dirs):
    model = nndf.load("GPTNeo", torch_dir=str(family_dirs["GPTNeo"]), device="cpu")
    refusal = model.spec.hooks.static_cache_refusal(model.loaded.model)
    assert refusal.startswith("GPTNeoForCausalLM cannot step over a static KV cache")
    assert not isinstance(model.decoder.session, frameworks.StaticTorchSession)
    gpt2 = nndf.load("GPT2", torch_dir=str(family_dirs["GPT2"]), device="cpu")
    assert gpt2.spec.hooks.static_cache_refusal(gpt2.loaded.model) is None
    assert not isinstance(gpt2.decoder.session, frameworks.StaticTorchSession)  # only --cuda-graph takes it


def test_cuda_graph_without_a_gpu_is_one_sentence(capsys, tiny_gpt2_dir, no_cuda):
    code, _, err = run_cli(capsys, "run", "GPT2", "frameworks", "--torch-dir", tiny_gpt2_dir, "--cuda-graph")
    assert code == 2
    assert "--cuda-graph replays decode steps on a CUDA GPU, and none is visible to PyTorch here" in err
    assert "Traceback" not in err and "loading" not in err  # said before the load
    code, _, err = run_cli(capsys, "benchmark", "GPT2", "onnxrt", "--torch-dir", tiny_gpt2_dir, "--cuda-graph")
    assert code == 2 and "--cuda-graph applies to the frameworks and trt backends" in err
    with pytest.raises(UsageError, match="on a CUDA GPU"):
        nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu", cuda_graph=True)


def test_cuda_graphs_are_skipped_on_the_cpu():
    """The capture machinery itself needs CUDA; on the CPU it runs the step as it is (its replays are gpu tests)."""
    calls = []
    graphs = frameworks.StepGraphs(lambda *args: calls.append(args) or (args[0] + 1,), torch.device("cpu"), [])
    assert not graphs.enabled
    assert torch.equal(graphs.run([torch.ones(2)])[0], torch.full((2,), 2.0))
    assert len(calls) == 1 and graphs.captured == 0


# --- on a CUDA GPU -----------------------------------------------------------------------------------------------

def _gpu_model(family_dirs, family, **kwargs):
    return nndf.load(family, torch_dir=str(family_dirs[family]), device="cuda", **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("family", ["GPT2", "OPT", "BLOOM", "GPTNeoX", "T5", "BART"])
def test_gpu_cuda_graphs_give_hf_tokens(family_dirs, family, num_beams):
    model = _gpu_model(family_dirs, family, cuda_graph=True)
    _skip_if_eager_masks_copy_in(model)
    session = model.decoder.session
    assert isinstance(session, frameworks.StaticTorchSession) and session.graphs.enabled
    ids, mask = _prompts(model)
    for _ in range(2):  # the second generation replays the graphs the first captured
        ours = model.generate(ids, mask, max_new_tokens=12, min_new_tokens=12, num_beams=num_beams)
        assert torch.equal(ours, model.hf_generate(ids, mask, max_new_tokens=12, min_new_tokens=12,
                                                   num_beams=num_beams))
    assert session.graphs.enabled and session.graphs.captured >= 1


@pytest.mark.gpu
def test_gpu_cuda_graphs_stop_at_eos_like_hf(tiny_gpt2_dir):
    _, ids, mask, eos = _model_with_likely_eos(tiny_gpt2_dir)
    model = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cuda", cuda_graph=True)
    model.loaded.model.generation_config.eos_token_id = eos
    model.loaded.model.generation_config.pad_token_id = None
    for beams in (1, 3):
        assert torch.equal(model.generate(ids, mask, max_new_tokens=12, num_beams=beams),
                           model.hf_generate(ids, mask, max_new_tokens=12, num_beams=beams))


@pytest.mark.gpu
def test_gpu_blip_captions_with_cuda_graphs(blip_dir):
    model = nndf.load("BLIP", torch_dir=str(blip_dir), device="cuda", cuda_graph=True)
    _skip_if_eager_masks_copy_in(model)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for beams in (1, 2):
        ours = model.generate(pixel_values=pixels, max_new_tokens=10, num_beams=beams)
        assert torch.equal(ours, model.hf_generate(pixel_values=pixels, max_new_tokens=10, num_beams=beams))
    assert model.decoder.session.graphs.captured >= 1


@pytest.mark.gpu
def test_gpu_eager_keeps_the_growing_cache_and_gpt_neo_refuses_graphs(family_dirs):
    assert not isinstance(_gpu_model(family_dirs, "GPT2").decoder.session, frameworks.StaticTorchSession)
    with pytest.raises(UsageError, match="GPTNeoForCausalLM cannot step over a static KV cache"):
        _gpu_model(family_dirs, "GPTNeo", cuda_graph=True)


@pytest.mark.gpu
def test_gpu_step_timer_reads_cuda_events(family_dirs):
    from nndf.measure import StepTimer

    model = _gpu_model(family_dirs, "GPT2", cuda_graph=True)
    ids, mask = _prompts(model, batch=1)
    timer = StepTimer(model.decoder.device)
    timer.start()
    model.generate(ids, mask, max_new_tokens=6, min_new_tokens=6, on_token=timer.mark)
    assert timer.marks == 6 and 0 < timer.time_to_first_token <= timer.total
    assert len(timer.step_times) == 5 and all(t > 0 for t in timer.step_times)
