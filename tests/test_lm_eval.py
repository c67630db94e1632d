"""Our backends as an lm-evaluation-harness model, proved against lm-eval 0.4.13's own `hf` model (HFLM) on the same
models, requests and local LAMBADA passages:

- `lambada_openai` (lm-eval's own task definition, reading a local file as `--dataset-file` makes it): HFLM and
  `NndfLM` on frameworks and onnxrt give the same acc and perplexity to 1e-6 relative, and `run.py accuracy`'s
  lm-eval columns equal them (GPT-2, a Llama-class decoder, T5; BART and mBART, whose forward shifts its own
  labels, on frameworks: the encoder-decoder scoring is one code path over any backend's logits, which T5 proves
  on onnxrt here, and tests/test_seq2seq.py proves BART's onnxrt logits equal PyTorch's);
- `loglikelihood_rolling` and `generate_until` (stop sequences, max tokens) equal HFLM's on the same requests.

A family joins with one entry in CASES (its model folder in MODEL_DIRS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import LAMBADA_FILE, SHARED_DATA, TRAINED_TINY_GPT2

pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval[hf] (the test extra) is absent")
if not SHARED_DATA.exists():
    pytest.skip(f"{SHARED_DATA} is absent (../shared/data is not beside this checkout)", allow_module_level=True)


@dataclass(frozen=True)
class Case:
    family: str
    model: str  # a key of MODEL_DIRS
    lines: tuple[int, int]  # LAMBADA lines scored (0-based, end excluded)
    hf_backend: str  # lm-eval's hf model: "causal" or "seq2seq"
    backends: tuple[str, ...] = ("frameworks", "onnxrt")
    min_acc: float = 0.0  # a trained model must get some passages right, so that acc is compared for real


# The trained tiny GPT-2 memorised lines 2500-2999: of 2490-2519 it knows 20 and not the first 10.
CASES = {
    "gpt2-random": Case("GPT2", "tiny-gpt2", (0, 20), "causal"),
    "gpt2-trained": Case("GPT2", "trained-gpt2", (2490, 2520), "causal", min_acc=0.6),
    # a tokenizer that prepends BOS, as OPT's and Llama's do: lm-eval scores the passage after it
    "gpt2-bos": Case("GPT2", "tiny-gpt2-bos", (0, 20), "causal", backends=("frameworks",)),
    # a Llama-class decoder (grouped-query attention, llama3 rope scaling, tied head) with a BOS-prepending tokenizer
    "llama": Case("Llama", "tiny-llama", (0, 20), "causal"),
    "t5": Case("T5", "T5", (0, 20), "seq2seq"),
    "bart": Case("BART", "BART", (0, 20), "seq2seq", backends=("frameworks",)),
    "mbart": Case("BART", "mBART", (0, 20), "seq2seq", backends=("frameworks",)),
}

# model name -> the folder, from the session fixtures of conftest.py (built once per session)
MODEL_DIRS = {
    "tiny-gpt2": lambda request: request.getfixturevalue("tiny_gpt2_dir"),
    "trained-gpt2": lambda request: TRAINED_TINY_GPT2,
    "tiny-gpt2-bos": lambda request: request.getfixturevalue("tiny_gpt2_bos_dir"),
    "tiny-llama": lambda request: request.getfixturevalue("tiny_llama_dir"),
    "T5": lambda request: request.getfixturevalue("text_models")["T5"],
    "BART": lambda request: request.getfixturevalue("text_models")["BART"],
    "mBART": lambda request: request.getfixturevalue("text_models")["mBART"],
}


@pytest.fixture(scope="module")
def tiny_gpt2_bos_dir(tiny_gpt2_dir, tmp_path_factory) -> Path:
    """The tiny random GPT-2 with GPT-2's tokenizer made to prepend BOS (`add_bos_token`, as OPT's does)."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("bos") / "tiny-gpt2-bos"
    shutil.copytree(tiny_gpt2_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir, add_bos_token=True)
    assert tokenizer("a b")["input_ids"][0] == tokenizer.bos_token_id
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """The tiny Llama of tests/family_examples.py with a vocabulary that holds GPT-2's tokenizer's ids, and that
    tokenizer made to prepend BOS, as Llama's own tokenizers do."""
    from transformers import AutoTokenizer

    from conftest import build_tiny
    from family_examples import CONSTANTS_DRAWN, FAMILY_EXAMPLES

    config = dict(FAMILY_EXAMPLES["Llama"], vocab_size=50272, bos_token_id=50256, eos_token_id=50256)
    folder = build_tiny(tmp_path_factory.mktemp("llama"), "tiny-llama", config,
                        constants_drawn="Llama" in CONSTANTS_DRAWN)
    tokenizer = AutoTokenizer.from_pretrained(folder, add_bos_token=True)
    assert tokenizer("a b")["input_ids"][0] == tokenizer.bos_token_id
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lambada_tasks(tmp_path_factory, onnx_work_dir):
    """LAMBADA lines (start, end) -> lm-eval's `lambada_openai` reading them from a local file; the task index is
    built once per run (nndf.lm_eval_tasks keeps it in the shared working dir)."""
    from nndf.lm_eval_tasks import prepare_tasks

    root = tmp_path_factory.mktemp("lm-eval-tasks")
    lines = LAMBADA_FILE.read_text(encoding="utf-8").splitlines()
    made = {}

    def tasks(span: tuple[int, int]):
        if span not in made:
            data = root / f"lambada-{span[0]}-{span[1]}.jsonl"
            data.write_text("\n".join(lines[span[0]:span[1]]) + "\n", encoding="utf-8")
            folder = root / f"yaml-{span[0]}"
            folder.mkdir()
            made[span] = (prepare_tasks("lambada_openai", [str(data)], None, folder, onnx_work_dir), data)
        return made[span]

    return tasks


def evaluate(lm, tasks) -> dict:
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=tasks.specs, task_manager=tasks.manager, bootstrap_iters=0,
                                  log_samples=False)
    return out["results"]["lambada_openai"]


def hf_model(folder: Path, backend: str):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), backend=backend, batch_size=1, device="cpu")


@pytest.mark.parametrize("name", list(CASES))
def test_lambada_openai_equals_lm_eval_hf_model(name, request, lambada_tasks, onnx_work_dir):
    import nndf
    from nndf.lm_eval import NndfLM

    case = CASES[name]
    folder = MODEL_DIRS[case.model](request)
    tasks, data = lambada_tasks(case.lines)
    reference = evaluate(hf_model(folder, case.hf_backend), tasks)
    passages = case.lines[1] - case.lines[0]
    assert reference["sample_len"] == passages
    expected = (reference["acc,none"], reference["perplexity,none"])
    assert expected[0] >= case.min_acc
    loaded = None
    for backend in case.backends:
        model = nndf.load(case.family, backend=backend, torch_dir=str(folder), working_dir=str(onnx_work_dir),
                          loaded=loaded)
        loaded = model.loaded
        ours = evaluate(NndfLM(model, batch_size=8, progress=False), tasks)
        assert (ours["acc,none"], ours["perplexity,none"]) == pytest.approx(expected, rel=1e-6), backend

    [accuracy] = nndf.run("accuracy", case.family, *case.backends, torch_dir=str(folder), dataset_file=str(data),
                          working_dir=str(onnx_work_dir), batch_size=8)
    for row in accuracy.rows:
        assert row["samples"] == passages
        assert (row["lm_eval_accuracy"], row["lm_eval_perplexity"]) == pytest.approx(expected, rel=1e-6), row


@pytest.fixture(scope="module")
def generative_seq2seq(request, tmp_path_factory) -> dict[str, Path]:
    """T5 and BART that generate ordinary words (untied LM heads; T5 with wider weights), with the real-layout
    tokenizers of `text_models`: the tied tiny models repeat their start token or end at once."""
    from transformers import AutoTokenizer

    from conftest import build_tiny
    from family_examples import SEQ2SEQ_EXAMPLES

    text_models = request.getfixturevalue("text_models")
    root = tmp_path_factory.mktemp("generative-seq2seq")
    made = {}
    for family, example, extra in (("T5", "flan-t5", {"initializer_factor": 5.0}), ("BART", "bart", {})):
        tokenizer = AutoTokenizer.from_pretrained(text_models[family])
        config = dict(SEQ2SEQ_EXAMPLES[example][1], vocab_size=len(tokenizer), tie_word_embeddings=False, **extra)
        made[family] = build_tiny(root, example, config)
        tokenizer.save_pretrained(made[family])
    return made


GENERATION_CASES = {  # family, model folder (a fixture key), backends, context characters
    "gpt2-trained": ("GPT2", "trained", ("frameworks", "onnxrt"), 160),
    "t5": ("T5", "T5", ("frameworks",), 60),
    "bart": ("BART", "BART", ("frameworks",), 60),
}


def requests(context_chars: int):
    """Rolling texts (one longer than the models' positions: several windows) and generation requests: memorised
    passages the trained GPT-2 continues up to a stop sequence, and stop sequences that end mid-word. Contexts are
    the first `context_chars` characters (an encoder-decoder's hf model generates as many tokens as the context has
    before it looks for a stop sequence, so shorter contexts keep those runs short)."""
    from lm_eval.api.instance import Instance

    from nndf.lambada import read_jsonl_texts

    texts = read_jsonl_texts(LAMBADA_FILE)
    known = texts[2500:2504]
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(known + [" ".join(known)])]
    at_words = {"until": [",", ".", "\n\n"], "max_gen_toks": 16}
    mid_word = {"until": ["e", "\n"], "do_sample": False, "max_gen_toks": 12}
    generate = [Instance("generate_until", {}, (text[:context_chars], at_words), i) for i, text in enumerate(known)]
    generate += [Instance("generate_until", {}, (text[:context_chars // 2], mid_word), 10 + i)
                 for i, text in enumerate(known)]
    return rolling, generate


@pytest.mark.parametrize("name", list(GENERATION_CASES))
def test_rolling_loglikelihood_and_generate_until_equal_lm_eval_hf_model(name, request, onnx_work_dir):
    import nndf
    from nndf.lm_eval import NndfLM

    family, key, backends, context_chars = GENERATION_CASES[name]
    folder = TRAINED_TINY_GPT2 if key == "trained" else request.getfixturevalue("generative_seq2seq")[key]
    hf = hf_model(folder, "causal" if family == "GPT2" else "seq2seq")
    rolling, generate = requests(context_chars)
    expected_rolling = hf.loglikelihood_rolling(rolling, disable_tqdm=True)
    expected_text = hf.generate_until(generate, disable_tqdm=True)
    assert any(expected_text) and len(set(expected_text)) > 2  # words, not empty or one repeated answer
    loaded = None
    for backend in backends:
        model = nndf.load(family, backend=backend, torch_dir=str(folder), working_dir=str(onnx_work_dir),
                          loaded=loaded)
        loaded = model.loaded
        lm = NndfLM(model, batch_size=4, progress=False)
        assert lm.loglikelihood_rolling(rolling) == pytest.approx(expected_rolling, rel=1e-6), backend
        assert lm.generate_until(generate) == expected_text, backend
    if family == "GPT2":  # memorised continuations reach a stop sequence before 16 tokens
        assert any(len(model.tokenizer(text)["input_ids"]) < 16 for text in expected_text[:4])


def test_image_to_text_family_is_refused_in_one_sentence(blip_dir):
    import nndf
    from nndf.errors import UsageError
    from nndf.lm_eval import NndfLM

    model = nndf.load("BLIP", backend="frameworks", torch_dir=str(blip_dir))
    with pytest.raises(UsageError, match="BLIP reads images .* evaluate does not apply"):
        NndfLM(model)
