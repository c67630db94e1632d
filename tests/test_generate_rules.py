"""generate()'s generation-config rules given per call (no_repeat_ngram_size, min_length, length_penalty,
early_stopping, forced_eos_token_id) and a `generation_config=GenerationConfig(...)` object: the loop's tokens are
those of transformers' generate() given the same, on frameworks and onnxrt (nndf.call_config)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

import nndf
from nndf.errors import UsageError

NEW = 12


def _batch(lengths=(5, 9, 3), seed: int = 1):
    """Left-padded random prompts of the tiny GPT-2's vocabulary, with their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 50256, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(0, 50256, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


@pytest.fixture(scope="module", params=["frameworks", "onnxrt"])
def model(request, tiny_gpt2_dir, onnx_work_dir):
    """The tiny GPT-2 on each backend (onnxrt: the suite's shared export, as tests/test_sampling.py loads it)."""
    return nndf.load("GPT2", backend=request.param, torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                     device="cpu")


@pytest.fixture(scope="module")
def frameworks(tiny_gpt2_dir):
    return nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")


@pytest.fixture(scope="module")
def prompts(model):
    """The prompts and an EOS id that greedy search emits early (the tiny model never emits its own), so that the
    length rules have rows that end to act on."""
    ids, mask = _batch()
    free = model.hf_generate(ids, mask, max_new_tokens=NEW)
    return ids, mask, int(free[1, ids.shape[1] + 2])


RULES = {
    "no-repeat": dict(no_repeat_ngram_size=2),
    "no-repeat-beams": dict(no_repeat_ngram_size=1, num_beams=3),
    "length-penalty": dict(length_penalty=-2.0, num_beams=4),
    "min-length": dict(min_length=9 + 10),
    "forced-eos": dict(forced_eos_token_id=7),
    "forced-eos-beams": dict(forced_eos_token_id=[7, 9], num_beams=2),
}


@pytest.mark.parametrize("rules", RULES.values(), ids=RULES)
def test_rules_per_call_give_generates_tokens(model, prompts, rules):
    ids, mask, eos = prompts
    ours = model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, **rules)
    assert torch.equal(ours, model.hf_generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, **rules))
    plain = model.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, num_beams=rules.get("num_beams", 1))
    assert not torch.equal(ours, plain), "the rule changed nothing: the test lost its point"


def test_length_penalty_and_early_stopping_steer_beams_as_generate(model, prompts):
    """Each early-stopping mode with a length penalty, where ending at the first `beams` finished hypotheses
    (early_stopping=True) keeps another sequence than searching on (an EOS the beams reach late)."""
    ids, mask, _ = prompts
    search = dict(max_new_tokens=NEW, num_beams=3, no_repeat_ngram_size=1)
    eos = int(model.hf_generate(ids, mask, **search)[0, ids.shape[1] + 8])
    outs = {}
    for early in (True, False, "never"):
        outs[early] = model.generate(ids, mask, eos_token_id=eos, length_penalty=2.0, early_stopping=early, **search)
        assert torch.equal(outs[early], model.hf_generate(ids, mask, eos_token_id=eos, length_penalty=2.0,
                                                          early_stopping=early, **search)), early
    assert not torch.equal(outs[True], outs[False]), "early stopping changed nothing: the test lost its point"


def test_a_generation_config_object_is_generates(model, prompts):
    """A passed config stands in for the model's (its beams too: num_beams left out is the config's),
    its unset fields the model's; a keyword still overrides it; the object is left as it was. The reference is
    transformers' generate() itself, given the same."""
    ids, mask, _ = prompts
    config = GenerationConfig(num_beams=3, no_repeat_ngram_size=1, max_new_tokens=8, length_penalty=0.5)
    before = config.to_dict()
    reference = model.loaded.model
    ours = model.generate(ids, mask, generation_config=config)
    assert torch.equal(ours, reference.generate(ids, attention_mask=mask, generation_config=config))
    assert not torch.equal(ours, model.generate(ids, mask, max_new_tokens=8, no_repeat_ngram_size=1))  # beams count
    overridden = model.generate(ids, mask, generation_config=config, no_repeat_ngram_size=0, max_new_tokens=5)
    assert torch.equal(overridden, reference.generate(ids, attention_mask=mask, generation_config=config,
                                                      no_repeat_ngram_size=0, max_new_tokens=5))
    assert overridden.shape[1] == ids.shape[1] + 5
    assert not torch.equal(overridden, ours[:, :overridden.shape[1]])
    assert config.to_dict() == before
    assert torch.equal(model.hf_generate(ids, mask, generation_config=config), ours)


def test_generation_config_lengths_and_sampling_as_generate(frameworks):
    """A config's max_new_tokens wins over a max_length keyword (generate() warns, and takes it); its min_length
    counts when min_new_tokens is left at its default; its sampling settings sample (seeded as generate())."""
    m = frameworks
    ids, mask = _batch()
    free = m.hf_generate(ids, mask, max_new_tokens=NEW)
    eos = int(free[1, ids.shape[1] + 2])
    config = GenerationConfig(max_new_tokens=5, min_length=ids.shape[1] + 4, eos_token_id=eos, do_sample=True,
                              top_k=5)
    torch.manual_seed(3)
    theirs = m.loaded.model.generate(ids, attention_mask=mask, generation_config=config, max_length=30)
    ours = m.generate(ids, mask, generation_config=config, max_length=30, seed=3)
    assert torch.equal(ours, theirs) and ours.shape[1] == ids.shape[1] + 5
    assert not (ours[:, ids.shape[1]:ids.shape[1] + 4] == eos).any()


def test_a_config_like_the_models_own_changes_nothing(model, prompts):
    """The model's own generation config passed back (its output_attentions and the like included) is no refusal
    and gives the tokens of no config at all."""
    ids, mask, _ = prompts
    own = copy.deepcopy(model.loaded.generation_config)
    assert torch.equal(model.generate(ids, mask, max_new_tokens=6, generation_config=own),
                       model.generate(ids, mask, max_new_tokens=6))


def test_the_rules_no_longer_refused_and_beam_rules_warn_with_one_beam(frameworks):
    """The five rules were refused ("this rule is read from the model's generation_config.json"); given with one
    beam, length_penalty and early_stopping get generate()'s warning that they may be ignored."""
    import warnings

    m = frameworks
    ids, mask = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.generate(ids, mask, max_new_tokens=2, length_penalty=0.8, early_stopping=True, min_length=3,
                   no_repeat_ngram_size=3, forced_eos_token_id=5, generation_config=GenerationConfig())
    [warning] = [w for w in caught if "may be ignored" in str(w.message)]
    assert "['length_penalty', 'early_stopping'] (num_beams is 1" in str(warning.message)
    assert warning.filename == __file__


def test_lengths_that_cannot_both_hold_warn_as_generate_does(frameworks):
    """A config's max_new_tokens overriding a max_length keyword, and a min_length past the longest output, are
    told (generate() logs the first and warns the second) from the caller's line, and the tokens stay generate()'s;
    lengths that agree say nothing."""
    import warnings

    m = frameworks
    ids, mask = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = m.generate(ids, mask, generation_config=GenerationConfig(max_new_tokens=3), max_length=30)
        long_min = m.generate(ids, mask, max_new_tokens=3, min_length=ids.shape[1] + 4)
        m.generate(ids, mask, max_new_tokens=3, min_length=ids.shape[1] + 3)
    said = [str(w.message) for w in caught if w.filename == __file__]
    assert said == [
        "Both max_new_tokens (=3, the generation config's) and max_length (=30) are set; max_new_tokens takes "
        "precedence, as in generate(). Give max_new_tokens=N to set the length",
        f"Unfeasible length constraints: min_length ({ids.shape[1] + 4}) is larger than the maximum possible length "
        f"({ids.shape[1] + 3}: {ids.shape[1]} prompt tokens + max_new_tokens 3). Generation will stop at the maximum "
        "length; lower min_length or raise max_new_tokens"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(ours, m.loaded.model.generate(ids, attention_mask=mask, max_length=30,
                                                         generation_config=GenerationConfig(max_new_tokens=3)))
        assert torch.equal(long_min, m.loaded.model.generate(ids, attention_mask=mask, max_new_tokens=3,
                                                             min_length=ids.shape[1] + 4))


@pytest.mark.parametrize("settings, message", [
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be a whole number >= 0 (0: off), got -1"),
    (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size must be a whole number >= 0 (0: off), got 2.5"),
    (dict(min_length=-3), "min_length must be a whole number >= 0 (counted with the prompt; 0: off), got -3"),
    (dict(length_penalty="long"), "length_penalty must be a number (1: none; above: longer beams), got 'long'"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never', got 'sometimes'"),
    (dict(forced_eos_token_id=50257), "forced_eos_token_id must be a token id (0 to 50256) or a list of them, got "
                                      "50257"),
    (dict(forced_eos_token_id=[3, -1]), "forced_eos_token_id must be a token id (0 to 50256) or a list of them, "
                                        "got [3, -1]"),
    (dict(generation_config={"num_beams": 2}), "generation_config must be a transformers GenerationConfig, as "
                                               "generate() takes it; got a dict (GenerationConfig(num_beams=4, ...) "
                                               "makes one; or give the settings as keywords)"),
    (dict(generation_config=GenerationConfig(no_repeat_ngram_size=-2)), "no_repeat_ngram_size must be a whole "
                                                                        "number >= 0 (0: off), got -2"),
    (dict(generation_config=GenerationConfig(num_return_sequences=2, num_beams=2)),
     "generate() got a generation_config with num_return_sequences=2, which this loop does not build (the result "
     "is generate()'s token tensor, one sequence per prompt); leave it unset"),
    (dict(generation_config=GenerationConfig(suppress_tokens=[5])),
     "generate() got a generation_config with suppress_tokens=[5], which this loop does not build (it builds "
     "lengths, num_beams, the sampling settings, repetition_penalty, eos/pad tokens, no_repeat_ngram_size, "
     "min_length, length_penalty, early_stopping and forced BOS/EOS tokens); leave it unset"),
    (dict(generation_config=GenerationConfig(stop_strings=["."])),
     "generate() got a generation_config with stop_strings=['.'], which this loop does not build (give "
     "stop_strings= to generate() itself (it uses the model's tokenizer)); leave it unset"),
])
def test_bad_rules_are_one_sentence(frameworks, settings, message):
    with pytest.raises(UsageError) as caught:
        frameworks.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **settings)
    assert str(caught.value) == message


def test_bart_takes_the_rules_per_call(seq2seq_dirs):
    """The tiny BART (its config: no repeated 2-grams, a forced EOS) on frameworks: the call's rules over its own
    (a minimum length keeps its random weights from ending every row at once)."""
    m = nndf.load("BART", torch_dir=str(seq2seq_dirs["bart"]), device="cpu")
    ids = torch.randint(4, 999, (2, 9), generator=torch.Generator().manual_seed(7))
    for rule, others in (
        (dict(no_repeat_ngram_size=0), dict(min_new_tokens=9)),  # off: the model's own 2-gram rule lifted
        (dict(min_length=8), {}),  # min_new_tokens left at its default: min_length rules, as in generate()
        (dict(forced_eos_token_id=5), dict(num_beams=2, min_new_tokens=9)),
        (dict(generation_config=GenerationConfig(num_beams=2, min_new_tokens=9, no_repeat_ngram_size=1)), {}),
    ):
        ours = m.generate(ids, max_new_tokens=10, **rule, **others)
        assert torch.equal(ours, m.hf_generate(ids, max_new_tokens=10, **rule, **others)), rule
        assert not torch.equal(ours, m.generate(ids, max_new_tokens=10, **others)), f"{rule} changed nothing"


def test_beams_and_minimum_left_out_are_the_model_generation_configs(tmp_path, tiny_gpt2_dir, prompts):
    """A checkpoint whose generation config searches with beams and a minimum length (bart-large-cnn: 4 beams,
    min_length 56): `m.generate(ids)` with neither given is `model.generate(ids)`, beams and minimum included."""
    import shutil

    folder = tmp_path / "beamed"
    shutil.copytree(tiny_gpt2_dir, folder)
    config = GenerationConfig.from_pretrained(folder)
    config.update(num_beams=3, min_length=14)
    config.save_pretrained(folder)
    ids, mask, eos = prompts
    m = nndf.load("GPT2", torch_dir=str(folder), device="cpu")
    ours = m.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    assert torch.equal(ours, m.loaded.model.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos))
    assert not torch.equal(ours, m.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, num_beams=1,
                                            min_new_tokens=0))


def test_the_generation_config_is_read_once_without_the_weights(tmp_path, tiny_gpt2_dir):
    """A graph backend never loads the weights, and every `generate` call asks for the model's generation config:
    it is read from the folder once (building it again cost milliseconds of each first token), and it is the
    folder's, as the loaded model's would be."""
    import shutil

    from nndf.loading import load_model
    from nndf.registry import resolve

    folder = tmp_path / "beamed"
    shutil.copytree(tiny_gpt2_dir, folder)
    config = GenerationConfig.from_pretrained(folder)
    config.update(num_beams=3)
    config.save_pretrained(folder)
    spec, variant = resolve("GPT2", None)
    loaded = load_model(spec, variant, torch_dir=str(folder))
    first = loaded.generation_config
    assert first.num_beams == 3 and loaded.generation_config is first and loaded._model is None
    assert loaded.model.generation_config.num_beams == 3  # the weights' own, once loaded
