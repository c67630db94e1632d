"""`chat`: read prompts from stdin and print each backend's reply as it is generated, then its time and tokens/s,
until `exit` (or `/exit`), end of input or Ctrl-C at the prompt.

A text model remembers the conversation (nndf.conversation): its tokenizer's chat template with `--system TEXT`,
or plain text turns for a model without one; `/reset` forgets it, and when the history no longer fits the model's
positions the oldest turns are dropped (said once). `--no-history` answers each line on its own. Tokens are picked
as the model's generation config and the sampling flags say; each backend draws from its own generator seeded with
the same seed once per chat, as `torch.manual_seed(seed)` before a series of `generate()` calls would, so that
backends whose logits agree give the same replies. `--stop TEXT` ends a reply as `generate(stop_strings=...)` does.
Ctrl-C during a reply stops it (what was generated stays in the history) and the chat goes on.

`--no-stream` prints each reply once it is complete, on one line with its time (line breaks written as \\n), as
scripts read it. Beam search cannot stream (as with `generate()`), so its replies print that way too.

An image-to-text family (BLIP) reads lines of `IMAGE_PATH [text prefix]`, or with `--image PATH` lines of text
prefixes for that image (an empty line captions it without one); it has no history. A line that cannot be answered
(a missing or non-image file, an empty prompt, a prompt longer than the model's positions, a line that is not
UTF-8) is reported, and the chat goes on with the next line.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from nndf.actions.common import (add_image_argument, compared_backends, decoding_flags, decoding_note, describe,
                                 generation_inputs, given_images, label, open_models)
from nndf.architectures import architecture
from nndf.conversation import Conversation
from nndf.errors import UsageError
from nndf.images import image_files
from nndf.interrupt import StopOnInterrupt, Stopped
from nndf.measure import StepTimer
from nndf.progress import counted
from nndf.registry import resolve
from nndf.results import Column, Result
from nndf.streaming import ReplyStreamer, cleans_up_spaces

SAMPLES = True
COMPARES = True  # backends as positionals and/or --compare (nndf.cli)
EXIT_WORDS = {"exit", "quit", "/exit", "/quit"}
RESET = "/reset"
UNUSED_FLAGS = {  # nndf.cli.check_unused_flags
    "batch_size": "it answers one conversation, one reply at a time",
    "input_seq_len": "its prompt is the conversation so far, whose oldest turns are dropped when it outgrows the "
                     "model's positions",
    "use_mask": "it always feeds a mask",
}


def add_arguments(parser) -> None:
    add_image_argument(parser, "image-to-text families (BLIP): caption this image, reading text prefixes from stdin")
    c = parser.add_argument_group("conversation")
    c.add_argument("--system", metavar="TEXT", help="the system message (chat template), or the first paragraph of "
                   "the conversation for a model without a template")
    c.add_argument("--stop", metavar="TEXT", action="append", default=[],
                   help="end a reply at the token that completes TEXT (it may run past it), as "
                   "generate(stop_strings=...) does (the reply keeps it); repeat for several; \\n and \\t are read as newline and tab")
    c.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print each reply as it is generated, then its time and tokens/s (default); --no-stream: "
                   "each reply once complete, on one line with its time (its line breaks written as \\n)")
    c.add_argument("--history", action=argparse.BooleanOptionalAction, default=True,
                   help="remember the conversation (default); --no-history: answer each line on its own")
    parser.set_defaults(output_seq_len=32)


def _prompts(stream, keep_empty: bool = False, refused=lambda: None):
    """Prompts typed by the user; stops at an exit word, end of input or Ctrl-C. A line that is not UTF-8 is said
    and counted (`refused()`) as a prompt refused, as one too long for the model is."""
    interactive = stream.isatty()
    while True:
        if interactive:
            print("prompt> ", end="", flush=True)
        try:
            line = stream.readline()
        except KeyboardInterrupt:
            print()
            return
        except UnicodeDecodeError:
            print("error: that line is not UTF-8 text; type it again", flush=True)
            refused()
            continue
        if not line:
            return
        prompt = line.removesuffix("\n").removesuffix("\r")  # a file with Windows line ends, piped in
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, kept as surrogates by the stream's decoder
            print("error: that line is not UTF-8 text; type it again", flush=True)
            refused()
            continue
        if prompt.strip().lower() in EXIT_WORDS:
            return
        if prompt.strip() or keep_empty:
            yield prompt


def one_line(text: str) -> str:
    """A reply as `--no-stream` prints it, on one line for scripts: stripped, its line breaks written as \\n."""
    return text.strip().replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n")


def _image_line(line: str, given) -> tuple[str, object]:
    """(text prefix, image file) of a chat line: `IMAGE_PATH [prefix]`, or the whole line as the prefix for the
    image given with --image."""
    if given is not None:
        return line.strip(), given[0]
    path, _, prefix = line.strip().partition(" ")
    return prefix.strip(), image_files([path], flag="image")[0]


def _stop_strings(texts: list[str]) -> list[str]:
    stops = [text.replace("\\n", "\n").replace("\\t", "\t") for text in texts]
    if any(not stop for stop in stops):
        raise UsageError("--stop takes a non-empty TEXT")
    return stops


class _Chat:
    """What one chat keeps between lines: the models, each backend's conversation and random generator."""

    def __init__(self, args, models) -> None:
        self.args = args
        self.models = models
        self.width = max(len(label(m)) for m in models)
        self.decoding = decoding_flags(args)
        self.picked = decoding_note(models[0], self.decoding, args.num_beams)  # refuses beams with sampling
        first = models[0]
        remembers = args.history and not first.architecture.takes_images
        continues = first.architecture.reply_continues_prompt
        self.conversations = [Conversation(first.tokenizer, args.system, continues) if remembers else None
                              for _ in models]
        self.refused = 0  # prompts answered with an error line instead of a reply
        seed = self.decoding["seed"]
        self.generators = [torch.Generator(device=m.decoder.device).manual_seed(seed) for m in models]
        self.stops = _stop_strings(args.stop)
        # asked once, before the chat begins (decoding may print a tokenizer's warning, better not inside a reply)
        self.cleans_up = cleans_up_spaces(first.tokenizer)
        self.told_truncation = False
        self.rows: list[dict] = []

    def refuse(self) -> None:
        """Count a prompt answered with an error line instead of a reply (the closing note says how many)."""
        self.refused += 1

    def inputs(self, index: int, line: str, given) -> tuple[dict, str]:
        """`generate()`'s inputs for a line (the conversation so far with it, its oldest turns dropped as needed),
        and the line as the results table shows it."""
        model, conversation = self.models[index], self.conversations[index]
        if conversation is None:
            prompt, image = _image_line(line, given) if model.architecture.takes_images else (line, None)
            shown = f"{image.name} {prompt}".strip() if image is not None else prompt
            return generation_inputs(model, prompt, image, use_mask=True), shown
        dropped = 0  # the oldest turns left out; forgotten only once the rest fits (a refused line keeps them)
        while True:
            ids = conversation.prompt_ids(line, dropped)
            try:
                model.architecture.check_length(len(ids), self.args.output_seq_len, model.shapes)
                break
            except UsageError:
                if dropped == len(conversation.turns):
                    raise
                dropped += 1
        if dropped:
            conversation.forget_oldest(dropped)
            if not self.told_truncation:
                print(f"note: the conversation no longer fits the model's {model.max_positions} positions with "
                      f"{self.args.output_seq_len} new tokens; its oldest turns are dropped from now on", flush=True)
                self.told_truncation = True
        ids = torch.tensor([ids])
        model.architecture.check_token_ids(ids, model.shapes)  # before the reply's label is printed
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, line

    def answer(self, index: int, line: str, inputs: dict, asked: str, began: float, interrupt) -> bool:
        """Generate and print one backend's reply, remember it; False when the user stopped it (Ctrl-C: `interrupt`,
        a StopOnInterrupt around the line's replies). `began`: when this backend's turn began (before its prompt
        was built), from which the first text shown is timed."""
        model, args = self.models[index], self.args
        name = f"[{label(model):<{self.width}}]"
        streams = args.stream and args.num_beams == 1  # beam search cannot stream
        if streams:
            print(name + " ", end="", flush=True)
        try:
            reply = self._generate(index, inputs, _terminal_writer() if streams else None, interrupt)
        except UsageError:
            if streams:
                print(flush=True)
            raise
        text = model.tokenizer.decode(reply.tokens, skip_special_tokens=True)
        first_ms = None if reply.first_token_s is None else reply.first_token_s * 1e3
        rate = len(reply.tokens) / reply.seconds
        if streams:
            ended = "stopped: " if reply.stopped else ""
            first = "" if first_ms is None else f", first token {first_ms:.1f} ms"
            print(f"\n{' ' * len(name)} ({ended}{counted(len(reply.tokens), 'token')} in {reply.seconds * 1e3:.1f} ms, "
                  f"{rate:.1f} tok/s{first})", flush=True)
        else:
            print(f"{name} {reply.seconds * 1e3:8.1f} ms | {one_line(text)}" + " (stopped)" * reply.stopped, flush=True)
        if self.conversations[index] is not None:
            self.conversations[index].remember(line, text)
        shown_ms = None if reply.first_text_at is None or not streams else (reply.first_text_at - began) * 1e3
        self.rows.append({"prompt": asked, "backend": label(model), "ms": reply.seconds * 1e3,
                          "first_token_ms": first_ms, "first_text_ms": shown_ms, "new_tokens": len(reply.tokens),
                          "tokens_per_s": rate, "reply": text, "stopped": reply.stopped})
        return not reply.stopped

    def _generate(self, index: int, inputs: dict, write, interrupt) -> "_Reply":
        """One reply: streamed to `write` (None: not shown while generated), stopped between tokens once
        `interrupt` has seen Ctrl-C."""
        model, args = self.models[index], self.args
        streamer = ReplyStreamer(model.tokenizer, write or (lambda text: None), cleans_up=self.cleans_up)
        timer = StepTimer(model.decoder.device)
        stopped = False

        def on_token() -> None:
            timer.mark()
            interrupt.check()

        started = time.perf_counter()
        timer.start()
        try:
            out = model.generate(**inputs, max_new_tokens=args.output_seq_len, num_beams=args.num_beams,
                                 on_token=on_token, streamer=streamer if args.num_beams == 1 else None,
                                 stop_strings=self.stops or None, **dict(self.decoding, seed=self.generators[index]))
            tokens = model.new_tokens(out, inputs.get("input_ids"))[0].tolist()
        except Stopped:  # what was streamed so far is the reply: shown whole, as its end shows a finished one's
            streamer.end()
            stopped, tokens = True, streamer.tokens
        return _Reply(tokens, stopped, time.perf_counter() - started, timer.time_to_first_token,
                      streamer.first_text_at)


@dataclass
class _Reply:
    tokens: list[int]
    stopped: bool
    seconds: float
    first_token_s: float | None  # from the generate() call to the first token chosen (as benchmark times it)
    first_text_at: float | None  # time.perf_counter() when its first text was shown


def _terminal_writer():
    """Writes a streamed reply to stdout, flushed at each token, without the space a continuation starts with."""
    written = []

    def write(text: str) -> None:
        if not written:
            text = text.lstrip()
        written.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    return write


def run(args, stream=None) -> list[Result]:
    compared_backends(args)
    spec, _ = resolve(args.model, args.variant)
    given = given_images(args, spec)
    if given is not None and len(given) > 1:
        raise UsageError(f"chat --image takes one image (it got {len(given)}); name the others on the lines you type, "
                         "as IMAGE_PATH [text prefix]")
    if args.stop and args.num_beams > 1:
        raise UsageError("--stop ends greedy or sampled replies; beam search (--num-beams > 1) ends at EOS only")
    _stop_strings(args.stop)
    takes_images = architecture(spec).takes_images
    if args.system and (takes_images or not args.history):
        raise UsageError("--system is part of a conversation; this chat has none (--no-history, or an image-to-text "
                         "family)")
    check = None if not args.system else \
        lambda loaded, shapes: Conversation(loaded.tokenizer, args.system).check_system()  # before any export
    models = open_models(args, needs_text=True, check_inputs=check)
    chat = _Chat(args, models)
    first = models[0]
    stream = sys.stdin if stream is None else stream
    ask = ("type a text prefix (or an empty line) for the image" if given else "type IMAGE_PATH [text prefix]") \
        if takes_images else "type a prompt"
    memory = "" if chat.conversations[0] is None else f", {RESET} forgets the conversation"
    print(f"chat with {first.loaded.name} on {', '.join(label(m) for m in models)}, {chat.picked}; {ask}{memory}, "
          "or 'exit' to end", flush=True)
    try:
        for line in _prompts(stream, keep_empty=given is not None, refused=chat.refuse):
            command = line.strip().lower()
            if command == RESET:
                for conversation in filter(None, chat.conversations):
                    conversation.reset()
                chat.told_truncation = False  # a new conversation: told again once it no longer fits
                print("(the conversation is forgotten)" if chat.conversations[0] else "(this chat keeps no "
                      "conversation)", flush=True)
                continue
            if command.startswith("/") and " " not in command and not takes_images:
                print(f"error: unknown command {line.strip()}; the commands are {RESET} and /exit", flush=True)
                continue
            with StopOnInterrupt() as interrupt:  # from the line read on, Ctrl-C stops its replies, not the chat
                for index in range(len(models)):
                    try:
                        began = time.perf_counter()
                        inputs, asked = chat.inputs(index, line, given)
                        answered = chat.answer(index, line, inputs, asked, began, interrupt)
                    except UsageError as exc:  # a line that cannot be answered: report it, go on with the next one
                        print(f"error: {exc}", flush=True)
                        chat.refuse()
                        break
                    if not answered:
                        break
    except KeyboardInterrupt:
        print()
    columns = [Column("backend", "backend"), Column("ms", "time", "{:.1f}", "ms"),
               Column("first_token_ms", "first token", "{:.1f}", "ms"),
               Column("first_text_ms", "first text shown", "{:.1f}", "ms"), Column("new_tokens", "tokens"),
               Column("tokens_per_s", "speed", "{:.1f}", "tok/s"), Column("prompt", "prompt")]
    replies = counted(len(chat.rows), "reply", "replies")
    title = f"chat {first.spec.family} {first.loaded.name}: {replies}, {chat.picked}"
    notes = [] if chat.rows else [f"no replies: {counted(chat.refused, 'prompt was', 'prompts were')} refused (the "
                                  "errors above)" if chat.refused else
                                  "no replies: the input ended, or /exit came, before a prompt"]
    if any(row["first_text_ms"] is not None for row in chat.rows):
        notes.append("first text shown: from reading the line (an image's loading and processing included) to the "
                     "first text printed; time and first token: from the start of generation")
    return [Result("chat", title, columns, chat.rows, describe(*models), notes)]
