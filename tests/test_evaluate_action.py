"""`run.py evaluate`: lm-eval's own table per backend and each metric against the first backend, from the command
line and from Python; local task data; one sentence for a task that needs the hub offline, for a missing lm-eval,
and for bad task flags, each before any model loads."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import LAMBADA_FILE, SHARED_DATA, TRAINED_TINY_GPT2

from nndf.errors import UsageError

pytest.importorskip("lm_eval", reason="lm-eval (the eval and test extras) is absent")
from nndf.lm_eval_index import defaults_root  # noqa: E402

LAMBADA_YAML = defaults_root() / "lambada" / "lambada_openai.yaml"  # lm-eval's own task file
if not SHARED_DATA.exists():
    pytest.skip(f"{SHARED_DATA} is absent (../shared/data is not beside this checkout)", allow_module_level=True)


@pytest.fixture(scope="module")
def passages(tmp_path_factory):
    """20 LAMBADA passages the trained tiny GPT-2 partly knows (it memorised lines 2500-2999)."""
    path = tmp_path_factory.mktemp("evaluate") / "lambada-2490.jsonl"
    lines = LAMBADA_FILE.read_text(encoding="utf-8").splitlines()[2490:2510]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_evaluate_prints_lm_eval_tables_and_each_metric_against_the_first_backend(passages, onnx_work_dir, tmp_path,
                                                                                  capsys):
    from nndf.cli import main

    report = tmp_path / "evaluate.json"
    code = main(["evaluate", "GPT2", "frameworks", "onnxrt", "onnxrt-int8", "--torch-dir", str(TRAINED_TINY_GPT2),
                 "--working-dir", str(onnx_work_dir), "--tasks", "lambada_openai", "--dataset-file", str(passages),
                 "--bootstrap-iters", "10", "--json", str(report)])
    out, err = capsys.readouterr()
    assert code == 0, err
    for backend in ("frameworks", "onnxrt", "onnxrt int8"):
        assert f"evaluate GPT2 lambada-tiny-gpt2 on {backend}: lm-evaluation-harness 0.4.13" in out
    # lm-eval's own table, once per backend
    assert out.count("|lambada_openai|") == 3 and out.count("|Version|Filter|n-shot|") == 3
    assert "bootstrapping" not in out and "evaluating lambada_openai on onnxrt int8 (3 of 3)" in err
    assert "each metric against frameworks" in out and "onnxrt int8 - frameworks" in out

    results = json.loads(report.read_text())["results"]
    tables, difference = results[:3], results[3]
    values = [{(r["metric"]): r["value"] for r in table["rows"]} for table in tables]
    for table, value in zip(tables, values):
        lm = table["lm_eval"]["results"]["lambada_openai"]  # lm-eval's results, kept whole
        assert lm["acc,none"] == value["acc ↑"] and lm["perplexity,none"] == value["perplexity ↓"]
        assert table["lm_eval"]["n-samples"]["lambada_openai"]["effective"] == 20
    assert 0.4 < values[0]["acc ↑"] < 1  # 10 of the 20 passages were memorised: a real accuracy
    # ONNX Runtime fp32: the same accuracy, and the perplexity to fp32 rounding (an exp of summed log-likelihoods,
    # 1.3e-6 apart on an AVX2-only CPU whose kernels round otherwise than AVX-512's)
    assert values[1]["acc ↑"] == values[0]["acc ↑"]
    assert values[1]["perplexity ↓"] == pytest.approx(values[0]["perplexity ↓"], rel=1e-5)
    for row in difference["rows"]:
        metric = row["metric"]
        assert row["v0"] == values[0][metric] and row["v2"] == values[2][metric]
        assert row["d2"] == pytest.approx(values[2][metric] - values[0][metric])


def test_evaluate_from_python_returns_the_tables(passages, tiny_gpt2_dir, onnx_work_dir):
    import nndf

    results = nndf.run("evaluate", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), tasks="lambada_openai",
                       dataset_file=[f"lambada_openai={passages}"], limit=5, bootstrap_iters=0,
                       working_dir=str(onnx_work_dir))
    [table] = results  # one backend: no difference table
    assert {row["metric"] for row in table.rows} == {"acc ↑", "perplexity ↓"}
    assert table.lm_eval["results"]["lambada_openai"]["sample_len"] == 5
    assert "|lambada_openai|" in table.render() and "--limit 5" in table.render()


def test_seed_seeds_lm_eval_as_its_own_seed_flag(passages, tiny_gpt2_dir, onnx_work_dir):
    """--seed was accepted and ignored: lm-eval drew its few-shot examples with its default seeds whatever it was."""
    import nndf

    [table] = nndf.run("evaluate", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), tasks="lambada_openai",
                       dataset_file=[str(passages)], limit=2, num_fewshot=1, bootstrap_iters=0, seed=7,
                       working_dir=str(onnx_work_dir))
    config = table.lm_eval["config"]
    assert [config[key] for key in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")] == [7, 7, 7, 7]
    assert table.context["seed"] == 7


def test_a_seed_numpy_cannot_take_is_one_sentence_before_any_model_loads(tiny_gpt2_dir, capsys):
    """It passed the CLI's own check (below 2**63) and stopped lm-eval with numpy's ValueError after the load."""
    from nndf.cli import main

    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--tasks", "lambada_openai",
                 "--seed", str(2**32)])
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: --seed seeds lm-eval's numpy generator too, which takes 0 to 2**32 - 1; got "
                                 "4294967296\n")


def test_include_path_runs_task_folders_with_rolling_and_generation_tasks(passages, tmp_path, onnx_work_dir, capsys):
    """lm-eval's --include-path: task YAMLs reading local files, here a rolling-perplexity task (as WikiText) and a
    generation task with stop sequences (as GSM8K), beside a --dataset-file task."""
    from nndf.cli import main

    data = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(passages)}}, "test_split": "test"}
    tasks = {
        "rolling_local": dict(data, output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                              metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity")]),
        "generate_local": dict(data, output_type="generate_until", doc_to_text="{{text.split(' ')[:-1]|join(' ')}}",
                               doc_to_target="{{' '+text.split(' ')[-1]}}",
                               generation_kwargs={"until": ["\n", ".", ","], "max_gen_toks": 8},
                               metric_list=[{"metric": "exact_match", "aggregation": "mean",
                                             "higher_is_better": True}]),
    }
    for name, config in tasks.items():  # JSON is YAML
        (tmp_path / f"{name}.yaml").write_text(json.dumps(dict(config, task=name)))
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(TRAINED_TINY_GPT2), "--tasks",
                 "rolling_local,generate_local,lambada_openai", "--include-path", str(tmp_path), "--dataset-file",
                 f"lambada_openai={passages}", "--limit", "4", "--bootstrap-iters", "0", "--working-dir",
                 str(onnx_work_dir)])
    out, err = capsys.readouterr()
    assert code == 0, err
    for cell in ("|rolling_local", "|word_perplexity", "|byte_perplexity", "|generate_local", "|exact_match",
                 "|lambada_openai"):
        assert cell in out, cell


@pytest.mark.parametrize(("generation", "message"), [
    ({"do_sample": True, "temperature": 0.7}, "lm-eval task sampled_local asks for sampled generation"),
    ({"top_p": 0.9}, "lm-eval task sampled_local's generation_kwargs ['top_p'] are not supported"),
])
def test_a_generation_task_that_samples_is_refused_before_any_model_loads(generation, message, passages, tmp_path,
                                                                          tiny_gpt2_dir, onnx_work_dir, capsys):
    """The loop generates greedily: a task whose generation_kwargs sample is refused in one sentence naming it,
    from its config, before the weights load and the graphs export (it used to come after, at its first request)."""
    from nndf.cli import main

    task = {"task": "sampled_local", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
            "dataset_kwargs": {"data_files": {"test": str(passages)}}, "doc_to_text": "{{text}}",
            "doc_to_target": "{{text}}", "generation_kwargs": {"until": ["\n"], **generation},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    (tmp_path / "sampled_local.yaml").write_text(json.dumps(task))  # JSON is YAML
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--tasks", "sampled_local",
                 "--include-path", str(tmp_path), "--limit", "1", "--working-dir", str(onnx_work_dir)])
    err = capsys.readouterr().err
    assert code == 1 and f"error: {message}" in err
    assert "loading" not in err  # before any model


def test_a_task_that_needs_the_hub_offline_is_one_sentence(tiny_gpt2_dir, onnx_work_dir, monkeypatch, capsys):
    from nndf.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--tasks", "lambada_openai",
                 "--working-dir", str(onnx_work_dir)])
    err = capsys.readouterr().err
    assert code == 1
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert error == [
        "error: lm-eval task lambada_openai reads its data set EleutherAI/lambada_openai from the Hugging Face hub, "
        "which cannot be reached (HF_HUB_OFFLINE is set); give the data as a local file with --dataset-file "
        "TASK=FILE (json/jsonl, csv or parquet; e.g. lambada_openai=lambada_test.jsonl) or a task folder with "
        "--include-path DIR whose YAML reads local files (dataset_path: json, dataset_kwargs: {data_files: ...})"]
    assert "loading" not in err  # before any model


@pytest.mark.parametrize(("tasks", "message"), [
    ("lambada", "error: lm-eval tag lambada runs task lambada_openai, whose data set EleutherAI/lambada_openai is on "
                "the Hugging Face hub, which cannot be reached (HF_HUB_OFFLINE is set); name its tasks "
                "(lambada_openai, lambada_standard) in --tasks and give each a local file with --dataset-file"),
    ("mmlu", "error: lm-eval group mmlu runs task mmlu_abstract_algebra, whose data set cais/mmlu is on the Hugging "
             "Face hub, which cannot be reached (HF_HUB_OFFLINE is set); name its tasks (mmlu_abstract_algebra, "
             "mmlu_anatomy, mmlu_astronomy, mmlu_college_biology and 53 more) in --tasks"),
])
def test_a_group_whose_tasks_need_the_hub_offline_names_the_task_and_the_way_around(tasks, message, tiny_gpt2_dir,
                                                                                   onnx_work_dir, monkeypatch, capsys):
    """A group or tag takes no --dataset-file itself: the sentence names the task whose data set is on the hub and
    says to name the group's tasks, each with its file (it was the generic "could not be loaded" sentence)."""
    from nndf.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--tasks", tasks,
                 "--working-dir", str(onnx_work_dir)])
    err = capsys.readouterr().err
    assert code == 1 and message in err, err
    assert "loading" not in err  # before any model


def test_without_lm_eval_evaluate_names_the_extra(tiny_gpt2_dir, monkeypatch, capsys):
    from nndf.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--tasks", "lambada_openai"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: evaluate needs lm-evaluation-harness, which is not installed")
    assert "install the 'eval' extra" in err and "loading" not in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--tasks", "lambada_opnai"], "'lambada_opnai' is not an lm-eval task, group or tag (nor a task YAML file); "
                                   "did you mean lambada_openai"),
    (["--tasks", "lambada", "--dataset-file", str(LAMBADA_FILE)], "--dataset-file applies to a single task, and "
                                                                   "'lambada' is a group or tag"),
    (["--tasks", "lambada_openai,hellaswag", "--dataset-file", str(LAMBADA_FILE)], "does not say which of the tasks"),
    (["--tasks", "lambada_openai", "--dataset-file", "hellaswag=x.jsonl"], "names task 'hellaswag', which is not "
                                                                           "among --tasks"),
    (["--tasks", "lambada_openai", "--dataset-file", str(SHARED_DATA / "README.md")], "is not one of the readable"),
    (["--tasks", "lambada_openai", "--limit", "0"], "--limit must be positive, got 0\n"),  # it said "got 0.0"
    (["--tasks", "lambada_openai", "--limit", "-3"], "--limit must be positive, got -3\n"),
    # a second file for one task: the last one used to win unsaid (--limit 1: without the check it runs, briefly)
    (["--tasks", "lambada_openai", "--dataset-file", f"lambada_openai={LAMBADA_FILE}", f"lambada_openai={LAMBADA_FILE}",
      "--limit", "1"], "--dataset-file gives task 'lambada_openai' a second file"),
    # --tasks takes a task YAML file; --dataset-file for it was a KeyError traceback
    (["--tasks", str(LAMBADA_YAML), "--dataset-file", str(LAMBADA_FILE), "--limit", "1"],
     f"--dataset-file applies to an lm-eval task name, and '{LAMBADA_YAML}' is a task YAML file"),
    (["--tasks", ","], "--tasks names no task"),
    # empty paths: "--dataset-file :  is not a file", and '' for --include-path indexed the current folder
    (["--tasks", "lambada_openai", "--dataset-file", ""], "--dataset-file '' names no file; write it as [TASK=]FILE"),
    (["--tasks", "lambada_openai", "--dataset-file", "lambada_openai="], "--dataset-file 'lambada_openai=' names no"),
    (["--tasks", "lambada_openai", "--include-path", ""], "--include-path is empty; it takes a folder of lm-eval"),
])
def test_bad_task_flags_are_one_sentence_before_any_model_loads(flags, message, tiny_gpt2_dir, onnx_work_dir, capsys):
    from nndf.cli import main

    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",
                 str(onnx_work_dir), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "loading" not in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "abc", "2.5"])
def test_a_limit_that_is_not_a_finite_number_is_one_sentence_naming_what_it_takes(value, tiny_gpt2_dir, capsys):
    """NaN and infinity passed float() and stopped lm-eval after the models loaded; 'abc' named `_limit`; 2.5 is
    neither a count nor a share (lm-eval took 2 documents while the results said --limit 2.5)."""
    from nndf.cli import main

    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--tasks", "lambada_openai",
                 f"--limit={value}"])
    err = capsys.readouterr().err
    assert code == 2
    assert (f"error: argument --limit: a number of documents per task (e.g. 200) or a share of them below 1 "
            f"(e.g. 0.1), not '{value}'\n") in err
    assert "_limit" not in err and "loading" not in err


def test_a_limit_that_is_not_finite_from_python_is_refused_before_any_model_loads(tiny_gpt2_dir, capsys):
    import nndf

    with pytest.raises(UsageError, match=r"--limit: a number of documents per task .*, not 'nan'"):
        nndf.run("evaluate", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), tasks="lambada_openai",
                 limit=float("nan"))
    assert "loading" not in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty; lm-eval task lambada_openai's prompts read the field(s) text of each row"),
    ("\n\n", "contains no rows; lm-eval task lambada_openai's prompts read the field(s) text of each row"),
    ('{"text": "a b c"}\nnot json\n', "line 2 is not valid JSON (Expecting value); lm-eval task lambada_openai's"),
    ('{"text": "a b c"}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
    ('{"text": "a b c"}\n{"txt": "a b c"}\n', 'line 2 has no "text" field, which lm-eval task lambada_openai\'s '
                                               'prompt reads (text)'),
])
def test_a_malformed_dataset_file_names_file_and_line_before_any_model_loads(content, message, tiny_gpt2_dir,
                                                                              onnx_work_dir, tmp_path, capsys):
    """These gave exit 1 and 'could not be loaded (StopIteration) ... give the data with --dataset-file'."""
    from nndf.cli import main

    data = tmp_path / "bad.jsonl"
    data.write_text(content, encoding="utf-8")
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",
                 str(onnx_work_dir), "--tasks", "lambada_openai", "--dataset-file", str(data)])
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error) == 1, err
    assert f"dataset file {data.resolve()} " in error[0] and message in error[0]
    assert "StopIteration" not in err and "--dataset-file TASK=FILE" not in err and "loading" not in err


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.csv", "txt\na b c\n", '(its header row) has no "text" field, which lm-eval task lambada_openai\'s prompt'),
    ("bad.parquet", "not parquet", "lm-eval task lambada_openai could not read --dataset-file "),
])
def test_a_dataset_file_of_another_kind_that_cannot_serve_says_so(name, content, message, tiny_gpt2_dir,
                                                                  onnx_work_dir, tmp_path, capsys):
    """A file lm-eval cannot read is the user's to fix (exit 2), not advice to give the --dataset-file just given."""
    from nndf.cli import main

    data = tmp_path / name
    data.write_text(content, encoding="utf-8")
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(tiny_gpt2_dir), "--working-dir",
                 str(onnx_work_dir), "--tasks", "lambada_openai", "--dataset-file", str(data)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and str(data.resolve()) in err, err
    assert "--dataset-file TASK=FILE" not in err and "loading" not in err


def test_template_fields_are_what_a_task_prompt_reads_unless_it_rewrites_its_documents():
    from nndf.lm_eval_tasks import template_fields

    assert template_fields({"doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
                            "doc_to_target": "{{' '+text.split(' ')[-1]}}"}) == {"text"}
    assert template_fields({"doc_to_text": "Q: {{question}}", "doc_to_target": "answer",
                            "doc_to_choice": "{{[a, b]}}"}) == {"question", "a", "b"}
    assert template_fields({"doc_to_text": "{{query}}", "process_docs": "!function utils.process_docs"}) == set()
    assert template_fields({"doc_to_choice": "{{range(n)|list}}"}) == {"n"}  # range is Jinja's, not a field


def test_rows_come_in_lm_eval_tables_order_each_group_before_its_subtasks():
    """lm-eval's results dict holds the groups after their tasks; its table (and so ours, per backend and against
    the first backend) puts each group first, nested groups depth first. The order is lm-eval's own make_table's."""
    from lm_eval.utils import make_table

    from nndf.actions.evaluate import metric_rows

    metric = {"acc,none": 0.5, "acc_stderr,none": "N/A"}
    names = ["solo", "z_task", "b_task", "a_task", "inner", "outer"]  # tasks first, groups last, as lm-eval returns
    out = {"results": {name: dict(metric, alias=name) for name in names},
           "group_subtasks": {"outer": ["z_task", "inner"], "inner": ["b_task", "a_task"], "solo": []},
           "versions": {}, "n-shot": {}, "higher_is_better": {name: {"acc": True} for name in names}}
    printed = [line.split("|")[1].strip(" -") for line in make_table(out).splitlines()[2:]]
    assert printed == ["outer", "inner", "a_task", "b_task", "z_task", "solo"]
    assert [row["task"] for row in metric_rows(out)] == printed


def test_image_captioning_family_is_refused_before_loading(capsys):
    from nndf.cli import main

    code = main(["evaluate", "BLIP", "frameworks", "--random-weights", "--tasks", "lambada_openai"])
    err = capsys.readouterr().err
    assert code == 2 and "BLIP reads images" in err and "loading" not in err


def test_a_run_outside_a_git_repository_prints_no_git_error(passages, tmp_path, monkeypatch, capfd):
    """lm-eval records the working folder's git commit; run from a folder outside any repository, git's own
    "fatal: not a git repository (or any of the parent directories): .git" came out on stderr mid-run. The JSON
    keeps lm-eval's git_hash (None there)."""
    from nndf.cli import main

    folder = tmp_path / "not-a-repository"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no higher, whatever holds tmp_path
    code = main(["evaluate", "GPT2", "frameworks", "--torch-dir", str(TRAINED_TINY_GPT2), "--tasks", "lambada_openai",
                 "--dataset-file", str(passages), "--limit", "2", "--bootstrap-iters", "0", "--json", "out.json"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "not a git repository" not in err and "fatal" not in err
    assert json.loads((folder / "out.json").read_text())["results"][0]["lm_eval"]["git_hash"] is None
