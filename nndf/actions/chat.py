"""`chat`: read prompts from stdin and print each backend's reply and time, until `exit`, end of input or Ctrl-C."""

from __future__ import annotations

import sys
import time

from nndf.actions.common import describe, encode_prompts, open_models
from nndf.results import Column, Result

EXIT_WORDS = {"exit", "quit"}


def add_arguments(parser) -> None:
    from nndf.backends import BACKENDS

    parser.add_argument("--compare", nargs="+", metavar="BACKEND", default=[],
                        help=f"also answer with these backends, side by side ({', '.join(BACKENDS)})")
    parser.set_defaults(output_seq_len=32)


def _prompts(stream):
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
        if not line:
            return
        prompt = line.rstrip("\n")
        if prompt.strip().lower() in EXIT_WORDS:
            return
        if prompt.strip():
            yield prompt


def run(args, stream=None) -> list[Result]:
    args.backends = list(dict.fromkeys(list(args.backends) + list(args.compare)))
    models = open_models(args)
    tokenizer = models[0].tokenizer
    stream = sys.stdin if stream is None else stream
    rows = []
    width = max(len(m.backend) for m in models)
    print(f"chat with {models[0].variant.name} on {', '.join(m.backend for m in models)}; "
          "type a prompt, or 'exit' to end", flush=True)
    try:
        for prompt in _prompts(stream):
            ids, mask = encode_prompts(tokenizer, [prompt], use_mask=True, pad_side=models[0].architecture.pad_side)
            for model in models:
                started = time.perf_counter()
                out = model.generate(ids, mask, max_new_tokens=args.output_seq_len, num_beams=args.num_beams)
                seconds = time.perf_counter() - started
                new = model.new_tokens(out, ids)[0]
                reply = tokenizer.decode(new, skip_special_tokens=True)
                print(f"[{model.backend:<{width}}] {seconds * 1e3:8.1f} ms | {reply.strip()}", flush=True)
                rows.append({"prompt": prompt, "backend": model.backend, "ms": seconds * 1e3,
                             "new_tokens": int(new.shape[0]), "reply": reply})
    except KeyboardInterrupt:
        print()
    columns = [Column("backend", "backend"), Column("ms", "time", "{:.1f}", "ms"),
               Column("new_tokens", "tokens"), Column("prompt", "prompt")]
    title = f"chat {models[0].spec.family} {models[0].variant.name}: {len(rows)} replies"
    return [Result("chat", title, columns, rows, describe(models[0]))]
