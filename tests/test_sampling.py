"""Sampling in the one loop, on the tiny GPT-2: the processors and warpers generate() builds, the generation config's
defaults, what the seed means, greedy equivalence, EOS and stop strings under sampling, and one-sentence refusals.
Seeded parity for every family and backend is in the families' parity tests (tests/sampling_checks.py)."""

from __future__ import annotations

import pytest
import torch

import nndf
from nndf.errors import UsageError
from sampling_checks import EVERY_WARPER, FLAT, assert_samples_like_generate
from test_generation_parity import _batch
from conftest import TOKENIZER_DIR, needs_shared


@pytest.fixture(scope="module")
def model(tiny_gpt2_dir):
    return nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")


def _describe(processors) -> list[tuple]:
    """Each processor's class and the settings that shape the scores."""
    keys = ("penalty", "ngram_size", "temperature", "top_k", "top_p", "min_p", "mass", "min_tokens_to_keep")
    return [(_transformers_class(p), *(getattr(p, k, None) for k in keys)) for p in processors]


def _transformers_class(processor) -> str:
    """The transformers class a processor is or derives from (nndf.processors computes some of them faster)."""
    return next(c.__name__ for c in type(processor).__mro__ if c.__module__.startswith("transformers."))


@pytest.mark.parametrize("settings", [
    dict(do_sample=True),  # generate()'s defaults: top-k 50
    dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, typical_p=0.9, repetition_penalty=1.2),
    dict(do_sample=False, repetition_penalty=1.5, top_k=3),  # warpers only when sampling
])
def test_processors_are_the_ones_generate_builds(model, settings, monkeypatch):
    """Our list against the one generate() itself builds (GenerationMixin._get_logits_processor, spied on: a
    private method, read here only to check our order and settings)."""
    hf_model = model.loaded.model
    built = []
    original = hf_model._get_logits_processor
    monkeypatch.setattr(hf_model, "_get_logits_processor", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    ids, mask = _batch([5, 9, 3])
    # min_new_tokens None: with 0, generate() adds a MinLength processor that bans EOS up to the prompt's length
    # (a no-op), which our list leaves out (nndf.generation)
    model.hf_generate(ids, mask, max_new_tokens=2, min_new_tokens=None, seed=0, **settings)
    options = model.generation_options(2, None, 1, **settings)
    # the last warper, top-k, is applied by the draw itself (Sampling.drawn_top_k)
    drawn = options.sampling.chooser().top_k_warper
    ours = options.processors(ids.shape[1], mask)
    theirs = built[0]
    assert _describe(ours + ([drawn] if drawn is not None else [])) == _describe(theirs)
    if "repetition_penalty" in settings:  # the left padding it skips, from the mask (transformers >= 5.23; none before)
        skipped, expected = ours[0].prompt_ignore_length, theirs[0].prompt_ignore_length
        assert (skipped is None and expected is None) or torch.equal(skipped, expected)


@pytest.mark.parametrize("backend", ["frameworks", "onnxrt"])
@pytest.mark.parametrize("settings", [FLAT, EVERY_WARPER], ids=["flat", "every-warper"])
def test_every_warper_samples_like_generate(tiny_gpt2_dir, onnx_work_dir, backend, settings):
    """Batch 3 with left padding; greedy search's tokens differ (the draw decided)."""
    m = nndf.load("GPT2", backend=backend, torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                  device="cpu")
    ids, mask = _batch([5, 9, 3])
    sampled = assert_samples_like_generate(m, max_new_tokens=10, settings=settings, input_ids=ids,
                                           attention_mask=mask)
    assert not torch.equal(sampled, m.generate(ids, mask, max_new_tokens=10))


def test_a_generation_config_that_samples_samples_by_default(tiny_gpt2_dir):
    """do_sample=True and top_k in the model's generation config: generate() samples without being asked, and so
    does our loop (from the same global generator when no seed is given); do_sample=False overrides it."""
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    m.loaded.model.generation_config.do_sample = True
    m.loaded.model.generation_config.top_k = 7
    assert m.generation_options(4).sampling.describe() == "sampling (temperature 1, top-k 7)"
    ids, mask = _batch([5, 9, 3])
    torch.manual_seed(21)
    ours = m.generate(ids, mask, max_new_tokens=10)
    torch.manual_seed(21)
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=10))
    greedy = m.generate(ids, mask, max_new_tokens=10, do_sample=False)
    assert not torch.equal(ours, greedy)
    assert torch.equal(greedy, m.hf_generate(ids, mask, max_new_tokens=10, do_sample=False))


def test_seed_means_manual_seed_before_generate(model):
    ids, mask = _batch([5, 9, 3])
    state = torch.get_rng_state()
    first = model.generate(ids, mask, max_new_tokens=10, do_sample=True, seed=5)
    assert torch.equal(torch.get_rng_state(), state), "seed=S must leave the global generator as it was"
    assert torch.equal(first, model.generate(ids, mask, max_new_tokens=10, do_sample=True, seed=5))
    assert not torch.equal(first, model.generate(ids, mask, max_new_tokens=10, do_sample=True, seed=6))
    torch.manual_seed(5)
    assert torch.equal(first, model.generate(ids, mask, max_new_tokens=10, do_sample=True))  # the global one
    # A generator continues across calls, as one torch.manual_seed before two generate() calls does.
    generator = torch.Generator().manual_seed(9)
    ours = [model.generate(ids, mask, max_new_tokens=6, do_sample=True, seed=generator) for _ in range(2)]
    torch.manual_seed(9)
    theirs = [model.hf_generate(ids, mask, max_new_tokens=6, do_sample=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and not torch.equal(ours[0], ours[1])


def test_temperature_zero_and_do_sample_false_are_greedy(model):
    ids, mask = _batch([5, 9, 3])
    greedy = model.hf_generate(ids, mask, max_new_tokens=10)
    for settings in (dict(do_sample=True, temperature=0.0, seed=1), dict(do_sample=False, top_k=3, seed=1),
                     dict(temperature=0.5, top_p=0.5)):  # sampling flags without do_sample: greedy, as generate()
        assert torch.equal(model.generate(ids, mask, max_new_tokens=10, **settings), greedy), settings
    assert model.generation_options(4, do_sample=True, temperature=0).sampling.describe() == "greedy"


def test_sampled_eos_ends_rows_and_pads_like_generate(tiny_gpt2_dir):
    """An EOS the draw picks early: rows end there, padded after, as generate() pads them."""
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids, mask = _batch([5, 9, 3])
    free = m.generate(ids, mask, max_new_tokens=12, do_sample=True, top_k=3, seed=2)
    eos = int(free[1, ids.shape[1] + 2])
    m.loaded.model.generation_config.eos_token_id = eos
    m.loaded.model.generation_config.pad_token_id = None
    ours = m.generate(ids, mask, max_new_tokens=12, do_sample=True, top_k=3, seed=2)
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=12, do_sample=True, top_k=3, seed=2))
    assert (ours[1, ids.shape[1] + 2:] == eos).all()


@needs_shared(TOKENIZER_DIR)
def test_stop_strings_end_rows_like_generate(model):
    """generate(stop_strings=..., tokenizer=...) with transformers' StopStringCriteria: greedy and sampled."""
    tokenizer = model.tokenizer
    ids, mask = _batch([5, 9, 3])
    for settings in ({}, dict(do_sample=True, top_k=5, seed=4)):
        free = model.generate(ids, mask, max_new_tokens=12, **settings)
        stop = tokenizer.decode(free[0, ids.shape[1] + 3: ids.shape[1] + 5])[1:]  # text that ends row 0 early
        ours = model.generate(ids, mask, max_new_tokens=12, stop_strings=[stop], **settings)
        assert torch.equal(ours, model.hf_generate(ids, mask, max_new_tokens=12, stop_strings=[stop], **settings))
        assert tokenizer.decode(ours[0, ids.shape[1]:]).find(stop) >= 0 and not torch.equal(ours, free)


def test_stop_strings_end_encoder_decoder_rows_like_generate(text_models):
    """The same on BART (Triton's sequential model serves T5 and BART with STOP): the criteria read the decoder's
    tokens, start token included, as generate()'s do. (EOS banned for 10 tokens: this tiny BART ends at once.)"""
    m = nndf.load("BART", torch_dir=str(text_models["BART"]), device="cpu")
    enc = m.tokenizer(["The house is wonderful and the garden is big.", "Hello"], return_tensors="pt", padding=True)
    length = dict(max_new_tokens=12, min_new_tokens=10)
    free = m.generate(enc.input_ids, enc.attention_mask, **length)
    stop = next(text for text in m.tokenizer.batch_decode(free[0, 4:, None]) if text.strip())
    ours = m.generate(enc.input_ids, enc.attention_mask, stop_strings=[stop], **length)
    expected = m.hf_generate(enc.input_ids, enc.attention_mask, stop_strings=[stop], **length)
    assert torch.equal(ours, expected) and ours.shape[1] < free.shape[1]


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-1.0), "temperature (--temperature) must be a number >= 0 (0: greedy), got -1.0"),
    (dict(top_k=-2), "top_k (--top-k) must be a whole number >= 0 (0: off), got -2"),
    (dict(top_p=1.5), "top_p (--top-p) must be a number from 0 to 1 (1: off), got 1.5"),
    (dict(min_p=2.0), "min_p (--min-p) must be a number from 0 to 1, got 2.0"),
    (dict(typical_p=0.0), "typical_p (--typical-p) must be a number above 0 and at most 1 (1: off), got 0.0"),
    (dict(repetition_penalty=0.0), "repetition_penalty (--repetition-penalty) must be a number above 0 (1: off), "
                                   "got 0.0"),
    (dict(seed=-3), "seed (--seed) must be a whole number from 0 to 2**63 - 1 or a torch.Generator, got -3"),
    (dict(do_sample=True, num_beams=2), "sampling with beam search is not built: sample with num_beams=1 "
                                        "(--num-beams 1), or search beams with do_sample=False (--no-do-sample)"),
    (dict(top_kk=3), "generate() got unknown keyword(s) top_kk; besides input_ids, attention_mask, pixel_values, "
                     "max_new_tokens, min_new_tokens, num_beams, streamer, stop_strings, generation_config, "
                     "max_length, eos_token_id, pad_token_id, no_repeat_ngram_size, min_length, length_penalty, "
                     "early_stopping, forced_eos_token_id, it takes the decoding keywords do_sample, temperature, "
                     "top_k, top_p, min_p, "
                     "typical_p, repetition_penalty, seed, sampling_stream (num_return_sequences, output_scores and "
                     "return_dict_in_generate are not built: the result is generate()'s token tensor)"),
    (dict(use_cache=False), "generate() got use_cache=, which this loop does not take: the cache is the build's: "
                            "nndf.load(..., use_cache=False)"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be a whole number >= 0 (0: off), got -1"),
    (dict(attention_mask=torch.tensor([[1.0, 0.5, 1.0]])), "attention_mask must hold integer token ids or 0/1 flags; "
                                                           "got torch.float32"),
    (dict(do_sample="yes"), "do_sample (--do-sample) must be True or False, got 'yes'"),
    (dict(num_beams=1.5), "num_beams must be a whole number, got 1.5"),
    (dict(max_new_tokens=4.5), "max_new_tokens must be a whole number, got 4.5"),
    (dict(input_ids=[[1, 2, 3]]), "input_ids must be a torch tensor (batch x length), as generate() takes it; got a "
                                  "list (torch.tensor([[...]]) makes one)"),
    (dict(input_ids=torch.tensor([1, 2, 3])), "input_ids must be 2-D (batch x length); got shape (3,) "
                                              "(.unsqueeze(0) makes a batch of one)"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]])), "input_ids must hold integer token ids or 0/1 flags; got "
                                                 "torch.float32"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids is empty: a prompt needs at least one token "
                                                          "(a BOS token, say)"),
    (dict(attention_mask=torch.ones(1, 2, dtype=torch.long)), "attention_mask has shape (1, 2) and input_ids (1, 3); "
                                                              "they must match"),
    (dict(sampling_stream="quick"), "sampling_stream (--sampling-stream) must be one of generate, fast, got 'quick'"),
])
def test_bad_settings_are_one_sentence(model, settings, message):
    settings = {"input_ids": torch.tensor([[1, 2, 3]]), "max_new_tokens": 2, **settings}
    with pytest.raises(UsageError) as caught:
        model.generate(**settings)
    assert str(caught.value) == message


def test_a_float_mask_of_zeros_and_ones_is_taken_as_generate_takes_it(model):
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert torch.equal(model.generate(ids, mask.float(), max_new_tokens=3), model.generate(ids, mask, max_new_tokens=3))


def test_draw_keywords_without_sampling_warn_as_generate_does_and_decode_greedily(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.warns(UserWarning, match=r"not valid and may be ignored: \['temperature', 'top_k'\] \(do_sample is "
                                         r"off"):
        warned = model.generate(ids, max_new_tokens=4, temperature=0.5, top_k=5)
    assert torch.equal(warned, model.generate(ids, max_new_tokens=4))


@needs_shared(TOKENIZER_DIR)
def test_beam_search_neither_streams_nor_stops_on_strings(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(UsageError, match="beam search"):
        model.generate(ids, max_new_tokens=2, num_beams=2, streamer=object())
    with pytest.raises(UsageError, match="beam search"):
        model.generate(ids, max_new_tokens=2, num_beams=2, stop_strings=["x"])


@pytest.mark.gpu
def test_gpu_seeded_sampling_equals_generate(tiny_gpt2_dir):
    """On CUDA the draw comes from a CUDA generator: seed=S must still draw what torch.manual_seed(S) gives
    generate() there."""
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cuda")
    ids, mask = _batch([5, 9, 3])
    for settings in (FLAT, EVERY_WARPER):
        assert_samples_like_generate(m, max_new_tokens=10, settings=settings, input_ids=ids, attention_mask=mask)


# --- command line -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature (--temperature) must be a number >= 0 (0: greedy), got -1.0"),
    (["--top-p", "1.5"], "top_p (--top-p) must be a number from 0 to 1 (1: off), got 1.5"),
    (["--repetition-penalty", "0"], "repetition_penalty (--repetition-penalty) must be a number above 0"),
    (["--seed", "-1"], "--seed must be a whole number from 0 to 2**63 - 1, got -1"),  # the command line's terms
    (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    (["--no-do-sample", "--temperature", "0.5", "--top-k", "4"],
     "--temperature and --top-k shape sampled draws, and this run does not sample (--no-do-sample was given)"),
])
def test_sampling_flags_are_checked_before_the_model_loads(capsys, argv, message):
    from nndf.cli import main

    code = main(["benchmark", "GPT2", "frameworks", "--variant", "gpt2-xl", *argv])  # the hub is never asked
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_draw_flags_on_a_model_that_does_not_sample_are_refused(capsys, tiny_gpt2_dir):
    """generate() warns and decodes greedily when given a temperature without do_sample; the command line refuses
    (the model's generation config is read after the load, before anything runs)."""
    from nndf.cli import main

    code = main(["benchmark", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--top-p", "0.9"])
    out, err = capsys.readouterr()
    assert code == 2 and ("--top-p shapes sampled draws, and this run does not sample (the model's generation "
                          "config does not sample): add --do-sample, or leave it out") in err
    assert "timing" not in err and "benchmark GPT2" not in out


@needs_shared(TOKENIZER_DIR)
def test_benchmark_and_run_say_whether_they_sample(capsys, tiny_gpt2_dir):
    """The header says how tokens are picked; the sampled benchmark's HF generate row draws with the same seed."""
    from nndf.cli import main

    fast = ["--torch-dir", str(tiny_gpt2_dir), "--iterations", "1", "--warmup", "0"]
    assert main(["benchmark", "GPT2", "frameworks", *fast, "--input-seq-len", "4", "--output-seq-len", "3",
                 "--do-sample", "--top-p", "0.9", "--seed", "8"]) == 0
    out = capsys.readouterr().out
    assert "3 new tokens, sampling (temperature 1, top-k 50, top-p 0.9, seed 8), fp32" in out
    assert "frameworks (HF generate)" in out
    assert main(["run", "GPT2", "frameworks", *fast, "--output-seq-len", "3"]) == 0
    assert "checkpoint samples, greedy" in capsys.readouterr().out
    assert main(["compare", "GPT2", "frameworks", *fast, "--output-seq-len", "3", "--num-beams", "2"]) == 0
    assert "compare GPT2 tiny-gpt2: frameworks, frameworks (HF generate); beams 2" in capsys.readouterr().out
