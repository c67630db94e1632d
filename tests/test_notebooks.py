"""The notebooks in notebooks/ run top to bottom (nbclient) on tiny settings, and are stored without outputs.

Each notebook's first code cell is tagged `parameters`; the test inserts a cell right after it that sets tiny
settings (a tiny model folder, a few tokens, two timed runs), as papermill does, and executes the notebook in a
kernel from its own folder (so its `../../shared/data` paths resolve). Any cell error fails the test with the
cell's traceback. The GPT-2 notebooks run the shared trained tiny GPT-2 (it has the real tokenizer, which their
chat and generations need), so one working dir for the module lets the second reuse the first's export.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO, SHARED_DATA, TRAINED_TINY_GPT2, build_tiny

nbformat = pytest.importorskip("nbformat", reason="nbformat and nbclient are in the test extra")
nbclient = pytest.importorskip("nbclient", reason="nbformat and nbclient are in the test extra")

NOTEBOOKS = REPO / "notebooks"
EXPECTED = ("playground.ipynb", "GPT2.ipynb", "BART.ipynb")
TIMEOUT_S = 300  # per cell

needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.exists(),
    reason=f"{SHARED_DATA} is absent (../shared/data is not beside this checkout): the notebooks' tiny settings use "
           "its trained tiny GPT-2 and GPT-2 tokenizer")


def _read(name: str):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _parameters_index(nb) -> int:
    return next(i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", []))


def test_notebooks_are_stored_without_outputs_and_have_a_parameters_cell():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert set(EXPECTED) <= set(found), f"missing notebooks: {set(EXPECTED) - set(found)}"
    for name in found:
        nb = _read(name)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []), f"{name}: the first code cell is not tagged parameters"
        for cell in code:
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: a cell keeps its outputs"
        source = "\n".join(cell.source for cell in code)
        # The public API only: nndf.run and nndf.load (and what they return), no module of the package itself.
        assert set(re.findall(r"\bnndf\.(\w+)", source)) <= {"run", "load"}, f"{name}: uses more than nndf.run/load"
        assert not re.search(r"^\s*from nndf\b", source, re.M), f"{name}: imports from inside nndf"


@pytest.fixture(scope="module")
def work_dir(onnx_work_dir):
    """The session's shared working dir: the GPT-2 notebooks run the trained tiny GPT-2, whose export (and int8
    graph) other tests make there too (tests/test_quantize.py, test_lm_eval.py, test_evaluate_action.py)."""
    return onnx_work_dir


@pytest.fixture(scope="module")
def tiny_bart_dir(tmp_path_factory):
    """A tiny BART whose vocabulary holds the offline BART tokenizer's ids, with that tokenizer in the folder."""
    from family_examples import SEQ2SEQ_EXAMPLES
    from tokenizers_offline import bart_tokenizer_dir, vocab_size

    root = tmp_path_factory.mktemp("notebooks-bart")
    tokenizer = bart_tokenizer_dir(root / "bart-tok")
    _family, config = SEQ2SEQ_EXAMPLES["bart"]
    return build_tiny(root, "bart", dict(config, vocab_size=vocab_size(tokenizer)), tokenizer_dir=tokenizer)


def execute(name: str, settings: dict, monkeypatch):
    """Run the notebook with `settings` assigned right after its parameters cell; return the executed notebook."""
    nb = _read(name)
    source = "# injected by tests/test_notebooks.py\n" + "\n".join(f"{k} = {v!r}" for k, v in settings.items())
    nb.cells.insert(_parameters_index(nb) + 1,
                    nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits the environment: no hub
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # a cell error raises CellExecutionError with the cell's traceback
    return nb


def _text(nb) -> str:
    return "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.outputs)


TINY = dict(BATCH_SIZE=1, INPUT_SEQ_LEN=6, OUTPUT_SEQ_LEN=4, ITERATIONS=2, WARMUP=0)


@needs_shared_data
def test_playground_runs(work_dir, monkeypatch):
    nb = execute("playground.ipynb", dict(TINY, TORCH_DIR=str(TRAINED_TINY_GPT2), WORKING_DIR=str(work_dir),
                                         BACKENDS=["frameworks", "onnxrt"], PROMPTS=["The capital of France is"],
                                         CHAT_TOKENS=4), monkeypatch)
    text = _text(nb)
    assert "benchmark GPT2" in text and "chat GPT2" in text and "onnxrt" in text
    assert "onnxrt       =  generate()" in text  # fp32 ONNX Runtime gives Hugging Face generate()'s tokens
    assert "onnxrt       =  generate(do_sample=True) after torch.manual_seed(4321)" in text  # seeded sampling too
    assert "sampling (temperature 0.8, top-k 40, top-p 0.9, seed 4321)" in text  # the sampled chat
    assert re.search(r"\(4 tokens in [\d.]+ ms, [\d.]+ tok/s", text)  # the chat streamed its replies
    assert _images(nb) == 1


@needs_shared_data
def test_gpt2_notebook_runs(work_dir, monkeypatch):
    # int4 left out: its quantization and rows run the same cells as int8's (tests/test_quantize.py covers int4)
    nb = execute("GPT2.ipynb", dict(TINY, TORCH_DIR=str(TRAINED_TINY_GPT2), WORKING_DIR=str(work_dir),
                                    BACKENDS=["frameworks", "onnxrt", "onnxrt-int8"], LAMBADA_SAMPLES=8,
                                    GENERATIONS=1, PROMPT_TOKENS=8, NEW_TOKENS=4), monkeypatch)
    text = _text(nb)
    assert text.count("onnxrt int8") >= 3  # export, benchmark and accuracy tables
    assert "accuracy GPT2" in text and "LAMBADA" in text
    assert _images(nb) == 2


@needs_shared_data
def test_bart_notebook_runs(tiny_bart_dir, work_dir, monkeypatch):
    # frameworks only: exporting BART's three graphs costs ~30 s here, and BART on onnxrt is tested in
    # test_seq2seq*.py; the notebook's cells run the same code for every backend in BACKENDS.
    nb = execute("BART.ipynb", dict(TINY, INPUT_SEQ_LEN=12, TORCH_DIR=str(tiny_bart_dir), WORKING_DIR=str(work_dir),
                                    BACKENDS=["frameworks"], NUM_BEAMS=2, SUMMARY_TOKENS=6), monkeypatch)
    text = _text(nb)
    assert "encoder (ms)" in text and "beams 2" in text
    assert re.search(r"^frameworks\s+=\s", text, re.M)  # beam search in our loop equals generate()'s tokens
    assert _images(nb) == 1
