"""`chat`: read prompts from stdin and print each backend's reply and time, until `exit`, end of input or Ctrl-C.

An image-to-text family (BLIP) reads lines of `IMAGE_PATH [text prefix]`, or with `--image PATH` lines of text
prefixes for that image (an empty line captions it without one). A line that cannot be answered (a missing or
non-image file, an empty prompt, a prompt longer than the model's positions, a line that is not UTF-8) is reported,
and the chat goes on with the next line.
"""

from __future__ import annotations

import sys
import time

from nndf.actions.common import (add_image_argument, describe, generation_inputs, given_images, label,
                                 open_models)
from nndf.errors import UsageError
from nndf.images import image_files
from nndf.registry import resolve
from nndf.results import Column, Result

EXIT_WORDS = {"exit", "quit"}


def add_arguments(parser) -> None:
    from nndf.backends import BACKENDS

    parser.add_argument("--compare", nargs="+", metavar="BACKEND", default=[],
                        help=f"also answer with these backends, side by side ({', '.join(BACKENDS)})")
    add_image_argument(parser, "image-to-text families (BLIP): caption this image, reading text prefixes from stdin")
    parser.set_defaults(output_seq_len=32)


def _prompts(stream, keep_empty: bool = False):
    """Prompts typed by the user; stops at an exit word, end of input or Ctrl-C."""
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
            continue
        if not line:
            return
        prompt = line.rstrip("\n")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8, kept as surrogates by the stream's decoder
            print("error: that line is not UTF-8 text; type it again", flush=True)
            continue
        if prompt.strip().lower() in EXIT_WORDS:
            return
        if prompt.strip() or keep_empty:
            yield prompt


def _image_line(line: str, given) -> tuple[str, object]:
    """(text prefix, image file) of a chat line: `IMAGE_PATH [prefix]`, or the whole line as the prefix for the
    image given with --image."""
    if given is not None:
        return line.strip(), given[0]
    path, _, prefix = line.strip().partition(" ")
    return prefix.strip(), image_files([path], flag="image")[0]


def run(args, stream=None) -> list[Result]:
    args.backends = list(dict.fromkeys(list(args.backends) + list(args.compare)))
    spec, _ = resolve(args.model, args.variant)
    given = given_images(args, spec)
    if given is not None and len(given) > 1:
        raise UsageError(f"chat --image takes one image (it got {len(given)}); name the others on the lines you type, "
                         "as IMAGE_PATH [text prefix]")
    models = open_models(args)
    first = models[0]
    takes_images = first.architecture.takes_images
    tokenizer = first.tokenizer
    stream = sys.stdin if stream is None else stream
    rows = []
    width = max(len(label(m)) for m in models)
    ask = ("type a text prefix (or an empty line) for the image" if given else "type IMAGE_PATH [text prefix]") \
        if takes_images else "type a prompt"
    print(f"chat with {first.variant.name} on {', '.join(label(m) for m in models)}; {ask}, or 'exit' to end",
          flush=True)
    try:
        for line in _prompts(stream, keep_empty=given is not None):
            try:
                prompt, image = _image_line(line, given) if takes_images else (line, None)
                inputs = generation_inputs(first, prompt, image, use_mask=True)
            except UsageError as exc:
                print(f"error: {exc}", flush=True)
                continue
            for model in models:
                started = time.perf_counter()
                try:
                    out = model.generate(**inputs, max_new_tokens=args.output_seq_len, num_beams=args.num_beams)
                except UsageError as exc:  # a prompt too long for the model: report it, go on with the next line
                    print(f"error: {exc}", flush=True)
                    break
                seconds = time.perf_counter() - started
                new = model.new_tokens(out, inputs.get("input_ids"))[0]
                reply = tokenizer.decode(new, skip_special_tokens=True)
                print(f"[{label(model):<{width}}] {seconds * 1e3:8.1f} ms | {reply.strip()}", flush=True)
                shown = f"{image.name} {prompt}".strip() if image is not None else prompt
                rows.append({"prompt": shown, "backend": label(model), "ms": seconds * 1e3,
                             "new_tokens": int(new.shape[0]), "reply": reply})
    except KeyboardInterrupt:
        print()
    columns = [Column("backend", "backend"), Column("ms", "time", "{:.1f}", "ms"),
               Column("new_tokens", "tokens"), Column("prompt", "prompt")]
    title = f"chat {first.spec.family} {first.variant.name}: {len(rows)} replies"
    return [Result("chat", title, columns, rows, describe(first))]
