"""`chat` as a user meets it: streamed replies, the conversation it remembers (chat template or plain turns),
/reset, truncation, stop strings, seeded sampling, and Ctrl-C in a real terminal (a pseudo-terminal)."""

from __future__ import annotations

import io
import json
import os
import re
import select
import shutil
import signal
import sys
import time

import pytest
import torch

import nndf
from conftest import REPO, TINY_GPT2, TOKENIZER_DIR, build_tiny, needs_shared
from nndf.actions.chat import one_line
from nndf.conversation import TURN_SEPARATOR
from nndf.errors import UsageError
from nndf.model import Model
from nndf.streaming import cleans_up_spaces

pytestmark = needs_shared(TOKENIZER_DIR)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def prompts(monkeypatch) -> list[list[int]]:
    """The input ids of every generate() call the chat makes, in order."""
    seen: list[list[int]] = []
    original = Model.generate

    def spy(self, input_ids=None, *args, **kwargs):
        seen.append(input_ids[0].tolist())
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(Model, "generate", spy)
    return seen


def _chat(folder, lines: list[str], **flags):
    flags.setdefault("output_seq_len", 6)
    [result] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(folder), input="".join(f"{x}\n" for x in lines),
                        **flags)
    return result.rows


def test_plain_turns_are_remembered_and_reset(tiny_gpt2_dir, prompts):
    """A model without a chat template: each turn is the line and its continuation, turns a blank line apart;
    /reset starts again; --no-history answers each line alone."""
    tokenizer = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu").tokenizer
    rows = _chat(tiny_gpt2_dir, ["The capital of France is", "And of Germany", "/reset", "Hello"],
                 system="A quiz.")
    first, second = rows[0]["reply"], rows[1]["reply"]
    assert prompts == [tokenizer("A quiz." + TURN_SEPARATOR + "The capital of France is")["input_ids"],
                       tokenizer(TURN_SEPARATOR.join(["A quiz.", "The capital of France is" + first,
                                                      "And of Germany"]))["input_ids"],
                       tokenizer("A quiz." + TURN_SEPARATOR + "Hello")["input_ids"]]
    prompts.clear()
    _chat(tiny_gpt2_dir, ["The capital of France is", "And of Germany"], history=False)
    assert prompts == [tokenizer("The capital of France is")["input_ids"], tokenizer("And of Germany")["input_ids"]]
    assert second  # the remembered reply is the text generated (a continuation, its leading space kept)


def test_chat_template_with_system_message(tiny_gpt2_dir, tmp_path, prompts):
    folder = tmp_path / "templated"
    shutil.copytree(tiny_gpt2_dir, folder)
    tokenizer = nndf.load("GPT2", torch_dir=str(folder), device="cpu").tokenizer
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    rows = _chat(folder, ["hi", "how are you"], system="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": rows[0]["reply"].strip()},
                {"role": "user", "content": "how are you"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert prompts[1] == list(expected)
    assert tokenizer.decode(prompts[1]).startswith("<|system|>Be brief.\n<|user|>hi\n<|assistant|>")


NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate') }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}"
             "{% endfor %}{% if add_generation_prompt %}<model>{% endif %}")


def test_a_template_that_refuses_a_system_message_is_one_sentence_before_any_export(tiny_gpt2_dir, tmp_path):
    """Gemma's instruction-tuned templates raise 'System role not supported': --system was a jinja traceback after
    the exports. Without --system the same template chats."""
    folder = tmp_path / "gemma-like"
    shutil.copytree(tiny_gpt2_dir, folder)
    tokenizer = nndf.load("GPT2", torch_dir=str(folder), device="cpu").tokenizer
    tokenizer.chat_template = NO_SYSTEM
    tokenizer.save_pretrained(folder)
    work = tmp_path / "work"
    with pytest.raises(UsageError, match=r"^--system: this model's chat template refuses the conversation \(System "
                                         r"role not supported\); leave --system out"):
        nndf.run("chat", "GPT2", "onnxrt", torch_dir=str(folder), working_dir=str(work), system="Be brief.",
                 input="hi\n")
    assert not work.exists()
    assert len(_chat(folder, ["hi", "and again"])) == 2

def test_oldest_turns_are_dropped_when_the_history_no_longer_fits(tiny_gpt2_dir, prompts, capsys):
    """128 positions, 40 new tokens: the second turn's prompt would be too long with the first, so the first goes;
    the user is told once."""
    tokenizer = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu").tokenizer
    line = " ".join(["word"] * 30)
    assert len(tokenizer(line)["input_ids"]) == 30
    rows = _chat(tiny_gpt2_dir, [line, line, line, "/reset", line, line], output_seq_len=40)
    out = capsys.readouterr().out
    whole = tokenizer(line + rows[0]["reply"] + TURN_SEPARATOR + line)["input_ids"]
    assert len(whole) + 40 > 128 and prompts == [tokenizer(line)["input_ids"]] * 5
    # once per conversation: /reset begins a new one, told again when it too no longer fits
    told = "note: the conversation no longer fits the model's 128 positions with 40 new tokens"
    assert out.count(told) == 2 and out.index(told) < out.index("(the conversation is forgotten)") < out.rindex(told)


def test_stop_strings_end_a_reply_as_generate_does(tiny_gpt2_dir):
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    ids = m.tokenizer("The capital of France is", return_tensors="pt").input_ids
    free = m.tokenizer.decode(m.generate(ids, max_new_tokens=12)[0, ids.shape[1]:])
    stop = free[len(free) // 2: len(free) // 2 + 3]
    rows = _chat(tiny_gpt2_dir, ["The capital of France is"], output_seq_len=12, stop=[stop])
    expected = m.hf_generate(ids, max_new_tokens=12, stop_strings=[stop])
    assert rows[0]["reply"] == m.tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    assert stop in rows[0]["reply"] and len(rows[0]["reply"]) < len(free)


def test_streamed_output_and_the_one_line_form(tiny_gpt2_dir, capsys):
    rows = _chat(tiny_gpt2_dir, ["The capital of France is"], output_seq_len=5)
    out = capsys.readouterr().out
    reply = rows[0]["reply"]
    assert f"[frameworks] {reply.strip()}\n" in out
    assert re.search(r"^ {13}\(5 tokens in [\d.]+ ms, [\d.]+ tok/s, first token [\d.]+ ms\)$", out, re.M)
    _chat(tiny_gpt2_dir, ["The capital of France is"], output_seq_len=5, stream=False)
    assert re.search(rf"^\[frameworks\] +[\d.]+ ms \| {re.escape(one_line(reply))}$", capsys.readouterr().out, re.M)
    assert one_line(" two\nlines\r\nand more\n") == "two\\nlines\\nand more"  # one line per reply, for scripts


def test_seeded_sampling_repeats_and_backends_agree(tiny_gpt2_dir, onnx_work_dir, capsys, no_cuda):
    """--seed S: each backend draws from its own generator seeded S once per chat, so fp32 backends give the same
    replies, and the same chat again gives them again; without --seed the banner shows the seed drawn. On one device:
    frameworks on a GPU draws from CUDA's generator, as generate() there does (a gpu test)."""
    lines = ["The capital of France is", "And of Germany"]
    [result] = nndf.run("chat", "GPT2", "frameworks", "onnxrt", torch_dir=str(tiny_gpt2_dir), output_seq_len=8,
                        working_dir=str(onnx_work_dir), do_sample=True, top_k=0, seed=77,
                        input="\n".join(lines) + "\n")
    replies = [row["reply"] for row in result.rows]
    assert replies[0] == replies[1] and replies[2] == replies[3] and replies[0] != replies[2]
    assert "sampling (temperature 1, seed 77)" in result.title
    # What the chat means by the seed: one torch.manual_seed(77), then one generate() per turn.
    m = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu")
    torch.manual_seed(77)
    first = m.hf_generate(m.tokenizer(lines[0], return_tensors="pt").input_ids, max_new_tokens=8, do_sample=True,
                          top_k=0)
    assert m.tokenizer.decode(first[0, -8:], skip_special_tokens=True) == replies[0]
    capsys.readouterr()
    [unseeded] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), output_seq_len=8,
                          do_sample=True, input=lines[0] + "\n")
    seed = int(re.search(r"seed (\d+)\)", capsys.readouterr().out).group(1))
    [again] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), output_seq_len=8,
                       do_sample=True, seed=seed, input=lines[0] + "\n")
    assert again.rows[0]["reply"] == unseeded.rows[0]["reply"]


def test_commands_and_refusals(tiny_gpt2_dir, capsys):
    rows = _chat(tiny_gpt2_dir, ["/help", "/exit", "never read"])
    assert rows == [] and "error: unknown command /help; the commands are /reset and /exit" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--stop ends greedy or sampled replies"):
        _chat(tiny_gpt2_dir, ["hi"], stop=["x"], num_beams=2)
    with pytest.raises(UsageError, match="sampling with beam search is not built"):
        _chat(tiny_gpt2_dir, ["hi"], do_sample=True, num_beams=2)
    with pytest.raises(UsageError, match="--system is part of a conversation"):
        _chat(tiny_gpt2_dir, ["hi"], system="x", history=False)


# --- in a terminal ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_enough_gpt2(tmp_path_factory):
    """A small GPT-2 with 1024 positions: a 900-token reply takes about a second on the CPU, time enough to press
    Ctrl-C in the middle of it."""
    config = dict(TINY_GPT2, n_positions=1024, n_embd=64)
    return build_tiny(tmp_path_factory.mktemp("pty"), "gpt2-1024", config)


def _read_until(fd, pattern: str, seconds: float, seen: bytearray) -> re.Match:
    """Read the terminal until `pattern` matches what it showed since `seen` was empty (or fail after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        found = re.search(pattern, seen.decode("utf-8", "replace"), re.S)
        if found:
            return found
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} in the terminal after {seconds} s: {seen.decode('utf-8', 'replace')!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                pass


def test_a_terminal_sees_tokens_before_the_reply_ends_and_ctrl_c_stops_only_the_reply(slow_enough_gpt2):
    """chat in a pseudo-terminal: the reply's first words show while it is being generated (Ctrl-C, typed as soon
    as they show, stops the reply before its 900 tokens), the chat goes on to the next prompt, and /exit ends it."""
    import pty

    argv = [sys.executable, str(REPO / "run.py"), "chat", "GPT2", "frameworks", "--torch-dir", str(slow_enough_gpt2),
            "--output-seq-len", "900", "--do-sample", "--top-k", "0", "--seed", "3", "--threads", "1"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and controlling terminal
        os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
        os.execv(sys.executable, argv)
    seen = bytearray()
    try:
        _read_until(fd, r"prompt> $", 120, seen)
        seen.clear()
        os.write(fd, b"Once upon a time\n")
        _read_until(fd, r"\[frameworks\] \S", 60, seen)  # the first text of the reply
        os.write(fd, b"\x03")  # Ctrl-C, as the terminal sends it
        stopped = _read_until(fd, r"\(stopped: (\d+) tokens? in .*?prompt> $", 60, seen)
        assert int(stopped.group(1)) < 900
        seen.clear()
        os.write(fd, b"/exit\n")
        _read_until(fd, r"chat GPT2 gpt2-1024: 1 reply,", 60, seen)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_a_chat_without_prompts_says_so_and_timed_replies_say_what_first_text_counts(tiny_gpt2_dir, monkeypatch):
    [empty] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), input="/exit\n")
    assert empty.rows == [] and empty.notes == ["no replies: the input ended, or /exit came, before a prompt"]
    [refused] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), output_seq_len=2,
                         input=["word " * 200])  # more than the tiny model's 128 positions
    assert refused.rows == [] and refused.notes == ["no replies: 1 prompt was refused (the errors above)"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe not text\n"), encoding="utf-8",
                                                       errors="surrogateescape"))  # a line that is not UTF-8
    [not_text] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir))
    assert not_text.rows == [] and not_text.notes == ["no replies: 1 prompt was refused (the errors above)"]
    [one] = nndf.run("chat", "GPT2", "frameworks", torch_dir=str(tiny_gpt2_dir), output_seq_len=2, input=["Hi"])
    assert len(one.rows) == 1 and one.notes[0].startswith("first text shown: from reading the line")


def test_lines_with_windows_line_ends_are_the_lines_typed(tiny_gpt2_dir, prompts):
    """A file written on Windows piped in: each prompt is its line without the carriage return, which would
    otherwise be the prompt's last token and change the reply."""
    tokenizer = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu").tokenizer
    rows = _chat(tiny_gpt2_dir, ["The capital of France is\r"], history=False)
    assert prompts == [tokenizer("The capital of France is")["input_ids"]]
    assert rows[0]["prompt"] == "The capital of France is"


class _CtrlCAfter:
    """Stands in for StopOnInterrupt: Ctrl-C pressed as the sixth token of a reply is generated."""

    def __enter__(self):
        self.tokens = 0
        return self

    def __exit__(self, *exc):
        return None

    def check(self):
        from nndf.interrupt import Stopped

        self.tokens += 1
        if self.tokens == 6:
            raise Stopped()


def test_a_reply_stopped_by_ctrl_c_shows_all_it_keeps(text_models, tmp_path, monkeypatch, capsys):
    """A tokenizer that cleans up spaces holds back the last characters of a streamed reply until the reply ends;
    a reply stopped by Ctrl-C ends too: what the terminal shows of it is the text the conversation keeps."""
    import nndf.actions.chat as chat

    folder = tmp_path / "t5"
    shutil.copytree(text_models["T5"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())  # (save_pretrained() drops the flag)
    config["clean_up_tokenization_spaces"] = True  # as the hub's t5-small tokenizer config has it
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert cleans_up_spaces(nndf.load("T5", torch_dir=str(folder), device="cpu").tokenizer)
    monkeypatch.setattr(chat, "StopOnInterrupt", _CtrlCAfter)
    [result] = nndf.run("chat", "T5", "frameworks", torch_dir=str(folder), output_seq_len=12, do_sample=True,
                        top_k=0, seed=1, input="translate English to German: That is good.\n")  # greedy: pad only
    [row] = result.rows
    assert row["stopped"] and row["new_tokens"] == 5 and row["reply"].strip()
    shown = capsys.readouterr().out.split("[frameworks] ", 1)[1].split("\n", 1)[0]
    assert shown == row["reply"].strip()


def test_a_line_too_long_for_the_model_costs_no_turns(tiny_gpt2_dir, prompts, capsys):
    """A line that cannot fit the model's positions even alone is refused; the conversation before it is kept (not
    dropped turn by turn while looking for room), and nothing is said of dropping turns."""
    tokenizer = nndf.load("GPT2", torch_dir=str(tiny_gpt2_dir), device="cpu").tokenizer
    rows = _chat(tiny_gpt2_dir, ["The capital of France is", " ".join(["word"] * 200), "And of Germany"],
                 output_seq_len=4)
    out = capsys.readouterr().out
    assert "error: a prompt of 200 tokens plus 4 new tokens is 204, more than the 128 positions" in out
    assert "no longer fits" not in out and len(rows) == 2
    assert prompts[-1] == tokenizer("The capital of France is" + rows[0]["reply"] + TURN_SEPARATOR +
                                    "And of Germany")["input_ids"]
