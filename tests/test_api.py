"""nndf.run: every command-line action from Python, with the command line's flags, checks and tables."""

from __future__ import annotations

import pytest

import nndf
from nndf.errors import UsageError
from nndf.spec import BuildSettings
from conftest import TOKENIZER_DIR, needs_shared

FAST = dict(iterations=1, warmup=0)


def test_benchmark_from_python_returns_the_table(tiny_gpt2_dir):
    results = nndf.run("benchmark", "GPT2", "frameworks", torch_dir=tiny_gpt2_dir, input_seq_len=6, output_seq_len=3,
                       use_cache=True, random_weights=False, **FAST)
    [result] = results
    assert [row["backend"] for row in result.rows] == ["frameworks", "frameworks (HF generate)"]
    assert result.rows[0]["decode_ms"] > 0
    assert "6 prompt + 3 new tokens" in result.render()


@needs_shared(TOKENIZER_DIR)
def test_chat_from_python_answers_the_given_lines(tiny_gpt2_dir, capsys):
    """Values that start with a dash (a Markdown rule as a stop string, a system message) stay values: the command
    line would read `--stop --` as a missing value. `help=True` prints the action's help and returns no table
    (argparse alone would end the process)."""
    [result] = nndf.run("chat", "GPT2", "frameworks", torch_dir=tiny_gpt2_dir, output_seq_len=3,
                        input=["Hello there", "The cat"], stop=["---", "-x"], system="-v")
    assert [row["prompt"] for row in result.rows] == ["Hello there", "The cat"]
    assert all(row["new_tokens"] == 3 for row in result.rows)
    assert nndf.run("chat", help=True) == [] and "--stop TEXT" in capsys.readouterr().out


@pytest.mark.parametrize("call, message", [
    (lambda: nndf.run("fly", "GPT2", "frameworks"), "unknown action 'fly'"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", bogus=1),
     r"^bogus= is not a flag of benchmark; see python run.py benchmark --help$"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", output_len=8),
     r"output_len= is not a flag of benchmark \(did you mean output_seq_len=\?\)"),
    (lambda: nndf.run("chat", "GPT2", "frameworks", max_new_tokens=8),  # generate()'s name, not triton's flag
     r"^max_new_tokens= is not a flag of chat \(write output_seq_len= here: max_new_tokens is its name in "
     r"generate\(\)\); "),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", topN=8), r"topN= is not a flag of benchmark \(it is a flag "
                                                                  r"of accuracy\)"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", iterations=True),
     r"^iterations= takes a value \(a number, a word or a path; a list for several\), not True$"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", fp16="yes"), "^fp16= takes True or False, not 'yes'$"),
    (lambda: nndf.run("chat", "GPT2", "frameworks", input=[1, 2]), r"input= takes the chat's lines as one string"),
    (lambda: nndf.run("chat", "GPT2", "frameworks", stop=["--"]), r"^stop= cannot take '--'"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", iterations="many"), "invalid int value: 'many'"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", input="hi"), "input= is for chat"),
    (lambda: nndf.run("accuracy", "GPT2", "frameworks", num_beams=4), "--num-beams does not apply to accuracy"),
    # was argparse's "argument BACKEND: invalid lower value: ['frameworks', 'onnxrt']"
    (lambda: nndf.run("benchmark", "GPT2", ["frameworks", "onnxrt"]),
     r"^backends are separate arguments, not a list: nndf.run\('benchmark', MODEL, 'frameworks', 'onnxrt', ...\)"),
    (lambda: nndf.run("benchmark", "GPT2", 3), r"^the model family and backends are names \(strings\), got 3$"),
    (lambda: nndf.run("benchmark", "GPT2", "frameworks", iterations=[1, 2]),  # was "unrecognized arguments: 2"
     r"^iterations= takes one value, not a list: got \[1, 2\]$"),
    (lambda: nndf.run(["benchmark"]), r"^unknown action '\['benchmark'\]'; allowed: benchmark, "),  # was a TypeError
    (lambda: nndf.run("export", "GPT2", "onnxrt", o="out"),  # was "(did you mean =?)", from the short flag -o
     r"^o= is not a flag of export \(did you mean output=\?\); see python run.py export --help$"),
])
def test_bad_calls_raise_the_command_lines_sentence(call, message):
    with pytest.raises(UsageError, match=message):
        call()


def test_a_cuda_device_without_one_is_a_sentence(tiny_gpt2_dir, monkeypatch):
    import torch

    from nndf.errors import HarnessError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is present
    with pytest.raises(HarnessError, match=r"^device='cuda' but this torch \(.*\) sees no CUDA GPU; give device='cpu'"):
        nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cuda")


def test_load_takes_the_quantized_backend_names(tiny_gpt2_dir):
    reference = nndf.load("GPT2", backend="frameworks", torch_dir=tiny_gpt2_dir)
    with pytest.raises(UsageError, match="backend 'onnxrt-int8' and quantize='int4' disagree"):
        nndf.load("GPT2", backend="onnxrt-int8", quantize="int4", loaded=reference.loaded)
    with pytest.raises(UsageError, match=r"quantize='int8' applies to the onnxrt backend \(its exported graph\), "
                                         "not frameworks"):
        nndf.load("GPT2", backend="frameworks", quantize="int8", torch_dir=str(tiny_gpt2_dir))
    with pytest.raises(UsageError, match="a quantized backend is one of: onnxrt-int8, onnxrt-int4"):
        nndf.load("GPT2", backend="frameworks-int8", loaded=reference.loaded)


@pytest.mark.parametrize("kwargs, message", [
    # the command line's checks, in the keywords' terms
    (dict(settings=BuildSettings(output_seq_len=100000)),
     "^output_seq_len=100000 leaves no position for a prompt: this model has 128 positions"),
    (dict(backend="onnxrt", fp16=True), "^fp16=True on the onnxrt backend .* use quantize='int8' or quantize='int4' "),
    (dict(tokenizer_dir="/etc"), r"^tokenizer_dir='/etc' holds no tokenizer"),
    # options the backend would not use
    (dict(decoder_onnx="/x.onnx"), "^decoder_onnx= runs a given ONNX file on the onnxrt backend; frameworks does not"),
    (dict(backend="onnxrt", cuda_graph=True),
     "^cuda_graph=True applies to the frameworks and trt backends, not onnxrt"),
    (dict(kv_layout="growing"), "^kv_layout lays out the onnxrt backend's graph, and no onnxrt backend is asked for$"),
    (dict(backend="onnxrt", kv_layout="shared", use_cache=False),
     "^kv_layout='shared' lays out the decoder's KV cache, and use_cache=False exports a graph without one"),
])
def test_load_refuses_in_its_keywords_terms(tiny_gpt2_dir, kwargs, message):
    with pytest.raises(UsageError, match=message):
        nndf.load("GPT2", **dict(dict(torch_dir=str(tiny_gpt2_dir), device="cpu"), **kwargs))


@pytest.mark.parametrize("kwargs, message", [
    (dict(family=None), r"^family must be a family name such as 'GPT2' \(nndf.run\('list'\) lists them\), got None$"),
    (dict(backend=None), "^backend must be a backend name such as 'frameworks', 'onnxrt' or 'onnxrt-int8', got None$"),
    (dict(use_cache="no"), "^use_cache must be True or False, got 'no'$"),  # truthy: it kept the cache on
    (dict(fp16="yes"), "^fp16 must be True or False, got 'yes'$"),
    (dict(device="gpu"), r"^device must be 'cpu', 'cuda' or 'cuda:N' \(or a torch.device\), got 'gpu'$"),
    (dict(threads="2"), "^threads must be a whole number of at least 1, got '2'$"),
    (dict(settings={"use_cache": False}), "^settings must be an nndf.spec.BuildSettings, got a dict"),
    (dict(working_dir=__file__), r"^working_dir .*test_api.py is a file; it takes a folder \(created if missing\)$"),
    (dict(working_dir=None), "^working_dir must be a folder's path, got None$"),
])
def test_load_refuses_arguments_of_the_wrong_kind(tiny_gpt2_dir, kwargs, message):
    """Each was an AttributeError, RuntimeError, TypeError or FileExistsError from inside, or (a truthy string for
    a switch) silently read as True; now one sentence naming the keyword and what it takes."""
    kwargs = dict(dict(family="GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu"), **kwargs)
    with pytest.raises(UsageError, match=message):
        nndf.load(kwargs.pop("family"), **kwargs)


def test_load_refuses_a_kv_layout_for_an_encoder_decoder_model():
    with pytest.raises(UsageError, match="^kv_layout applies to decoder-only models; BART's encoder-decoder graphs"):
        nndf.load("BART", variant="bart-base", backend="onnxrt", random_weights=True, kv_layout="growing")


def test_a_plot_file_leaves_pyplots_backend_alone(tmp_path):
    """Writing --plot's PNG must not switch a notebook's inline backend to Agg (its later plots would vanish)."""
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from nndf.plots import plot_bars

    plt.switch_backend("svg")
    try:
        plot_bars(str(tmp_path / "p.png"), "t", [{"backend": "a", "x": 1.0}], [("x", "x", None)])
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        plt.switch_backend("agg")


def test_a_panel_no_backend_has_a_figure_for_says_so():
    """--output-seq-len 1 has no decode step: its panel said nothing, over an axis of made-up ticks."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from nndf.plots import draw_bars

    fig = Figure()
    draw_bars(fig, "t", [{"backend": "a", "x": 1.0, "decode": None}], [("x", "x", None), ("decode", "decode", None)])
    measured, empty = fig.axes
    assert [t.get_text() for t in measured.texts] == ["1"]  # the bar's own label
    assert [t.get_text() for t in empty.texts] == ["not measured in this run"]


def test_a_benchmark_of_one_new_token_says_why_it_has_no_decode_step(tiny_gpt2_dir, tmp_path, monkeypatch):
    """--output-seq-len 1: the decode column is '-' and the plot's panel empty; both now say why."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    import nndf.actions.benchmark
    from nndf.plots import draw_bars

    drawn = []
    monkeypatch.setattr(nndf.actions.benchmark, "plot_bars", lambda *args: drawn.append(args))
    [table] = nndf.run("benchmark", "GPT2", "frameworks", torch_dir=tiny_gpt2_dir, input_seq_len=6, output_seq_len=1,
                       iterations=1, warmup=0, plot=str(tmp_path / "b.png"))
    assert {row["decode_ms"] for row in table.rows} == {None}
    assert "decode step: '-': one new token (--output-seq-len 1) has no decode step to time." in table.notes
    [(_, title, rows, panels)] = drawn
    fig = Figure()
    draw_bars(fig, title, rows, panels)
    assert [t.get_text().replace("\n", " ") for t in fig.axes[0].texts] == [
        "one new token (--output-seq-len 1) has no decode step to time"]


def test_bar_labels_have_no_exponent_and_a_wide_spread_stops_at_zero():
    """A 1119 ms decode step was labelled "1.12e+03", and a spread wider than its bar drew the axis below 0 ms."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from nndf.plots import draw_bars

    fig = Figure()
    rows = [{"backend": "a", "d": 1119.1, "s": 50.0}, {"backend": "b", "d": 645.0, "s": 700.0}]
    draw_bars(fig, "t", rows, [("d", "decode", "s")])
    [ax] = fig.axes
    assert [t.get_text() for t in ax.texts] == ["1119", "645"]
    assert ax.get_ylim()[0] >= 0


def test_generate_takes_generates_lengths_and_special_tokens(tiny_gpt2_dir):
    """`max_length`, the default length (20 new tokens, within the model's positions), `eos_token_id` and
    `pad_token_id` mean what they mean to transformers 5's generate(): the same tokens as generate() itself, called
    with no length at all, and the same refusal of a max_length the prompt already fills."""
    import warnings

    import torch

    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    default = m.generate(ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generate()'s advice to set max_new_tokens
        assert default.shape[1] == 4 + 20 and torch.equal(default, m.loaded.model.generate(ids, attention_mask=mask))
        long = torch.arange(120).unsqueeze(0)  # 120 of the tiny model's 128 positions: 8 new tokens, not 20
        assert m.generate(long).shape[1] == 128 == m.loaded.model.generate(long).shape[1]
        with pytest.raises(ValueError, match="max_length"):
            m.loaded.model.generate(ids, attention_mask=mask, max_length=4)
    assert m.generate(ids, mask, max_length=9).shape[1] == 9
    with pytest.raises(UsageError, match="the prompt is 4 tokens long and max_length is 4"):
        m.generate(ids, mask, max_length=4)
    eos = int(default[0, 6])  # a token the first row makes: ending there, with another pad id
    ours = m.generate(ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=3)
    assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=3))
    row = ours[0, 4:].tolist()  # the first row ends at its first eos; pads after it
    assert eos in row and set(row[row.index(eos) + 1:]) <= {3} and len(row) > row.index(eos) + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.generate(ids, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), max_new_tokens=2)
    assert any("right-padding was detected" in str(w.message) for w in caught)


def test_right_padded_rows_get_generates_tokens(tiny_gpt2_dir, onnx_work_dir):
    """A right-padded row (generate() warns, and goes on): transformers 5 gives its new columns the positions after
    its last prompt column's, a pad's 0, not the count of its real tokens; the loop does the same on every path
    (cache on and off, onnxrt, beams), so its tokens are generate()'s from the second new token on too."""
    import warnings

    import torch

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [14, 0, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generate()'s right-padding warning
        for backend, use_cache in (("frameworks", True), ("frameworks", False), ("onnxrt", True)):
            m = nndf.load("GPT2", backend=backend, torch_dir=str(tiny_gpt2_dir), use_cache=use_cache,
                          working_dir=str(onnx_work_dir))
            for beams in (1, 2):
                ours = m.generate(ids, mask, max_new_tokens=5, num_beams=beams)
                assert torch.equal(ours, m.hf_generate(ids, mask, max_new_tokens=5, num_beams=beams)), \
                    (backend, use_cache, beams)


@needs_shared(TOKENIZER_DIR)
def test_export_to_a_folder_runs_without_the_weights(tiny_gpt2_dir, onnx_work_dir, tmp_path, capsys):
    """`export ... -o DIR` (Optimum's save_pretrained): nndf.load_exported(DIR) gives generate()'s tokens from the
    folder alone (graph, config, tokenizer; no weight file in it), and writes nothing into it."""
    import torch

    folder = tmp_path / "exported"
    [table] = nndf.run("export", "GPT2", "onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
                       output=str(folder))
    assert any(f"standalone folder: {folder}" in note for note in table.notes)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    assert "nndf.json" in files and "hf/config.json" in files and "decoder/decoder.onnx" in files
    assert not [f for f in files if f.endswith((".safetensors", ".bin"))]
    m = nndf.load_exported(folder)
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    assert m.backend == "onnxrt" and torch.equal(m.generate(ids, max_new_tokens=6),
                                                 reference.hf_generate(ids, max_new_tokens=6))
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == files
    with pytest.raises(UsageError, match="is an exported folder: it holds the graphs, not the PyTorch weights"):
        m.hf_generate(ids, max_new_tokens=2)  # not hf/'s missing weight file
    capsys.readouterr()
    nndf.run("export", "GPT2", "onnxrt", torch_dir=str(tiny_gpt2_dir), working_dir=str(onnx_work_dir),
             output=str(tmp_path / "again"))  # the export reused: no weights read for the folder's files either
    assert "weights" not in capsys.readouterr().err
    assert (tmp_path / "again" / "hf" / "generation_config.json").read_text() == \
        (folder / "hf" / "generation_config.json").read_text()
    with pytest.raises(UsageError, match="-o writes one onnxrt model"):
        nndf.run("export", "GPT2", "onnxrt", "trt", torch_dir=str(tiny_gpt2_dir), output=str(tmp_path / "x"))
    with pytest.raises(UsageError, match="is a folder of other files, which writing the export there would replace"):
        nndf.run("export", "GPT2", "onnxrt", torch_dir=str(tiny_gpt2_dir), output=str(tmp_path))
    with pytest.raises(UsageError, match="holds no nndf.json"):
        nndf.load_exported(tmp_path)


def test_a_folders_generation_rules_hold_before_its_weights_load(tmp_path):
    """The generation config of a --torch-dir folder without tokenizer files (run with --tokenizer-dir) is the
    folder's own even where the weights never load (a cached export, trt): it was read from the tokenizer's folder,
    so mBART's forced language token and BART's no-repeat rule were lost there."""
    from conftest import build_tiny
    from family_examples import SEQ2SEQ_EXAMPLES
    from nndf.loading import load_model
    from nndf.registry import resolve

    folder = build_tiny(tmp_path, "mbart", SEQ2SEQ_EXAMPLES["mbart"][1])
    loaded = load_model(*resolve("BART", None), torch_dir=str(folder))
    assert loaded.generation_config.forced_bos_token_id == 250 and loaded._model is None
