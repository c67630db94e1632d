"""`accuracy`: LAMBADA on each backend: NVIDIA's top-N accuracy and token/sequence perplexity beside
lm-evaluation-harness's `lambada_openai` acc and ppl (equal to lm-eval 0.4.13's own `hf` model's figures).

What each column scores: `nndf.evaluation` (decoder-only models), `nndf.seq2seq.evaluation` (encoder-decoder models:
the target word's own tokens on the decoder); the note under the table says it too.
"""

from __future__ import annotations

import argparse
import math

from nndf.actions.common import data_seed, describe, label, open_models, say
from nndf.errors import UsageError
from nndf.interrupt import KeepOnInterrupt
from nndf.results import Column, Result


# Passages per forward pass unless --batch-size says otherwise: a small model on the CPU scores ~6x faster in
# batches of 16 than one by one (bench/accuracy_batches.py), and the figures do not depend on it.
DEFAULT_BATCH_SIZE = 16
BATCH_HELP = ("passages per forward pass, padded on the right with a mask and grouped by length; the figures do not "
              "depend on it")


# Perplexities to 6 significant digits: they come from float32 logits, good to about 7, whose last bits differ
# between backends and library versions; a weak model's lm-eval perplexity used to print as 872597754.21.
PPL = "{:#.6g}"  # six digits always (57550.0 beside 57715.8, not 57550)

UNUSED_FLAGS = {  # nndf.cli.check_unused_flags
    "num_beams": "it scores each passage's next tokens in one forward pass and generates nothing",
    "output_seq_len": "it scores each passage's next tokens in one forward pass and generates nothing",
    "input_seq_len": "it scores whole passages, each at its own length (up to the model's positions)",
    "use_mask": "it always feeds a mask (passages of one length are padded together)",
    "tgt_lang": "the decoder scores the target word's own tokens, with no language code (as lm-evaluation-harness)",
}


def add_arguments(parser) -> None:
    a = parser.add_argument_group("accuracy")
    a.add_argument("--dataset-file", metavar="PATH",
                   help="LAMBADA as jsonl with a \"text\" field per line (default: EleutherAI/lambada_openai from the hub)")
    a.add_argument("--num-samples", type=int,
                   help="score a seeded random sample of this many passages (default, or 0: all)")
    a.add_argument("--tokens-to-generate", type=int, default=1,
                   help="target tokens at the end of each passage for the NVIDIA-demo metrics (default 1)")
    a.add_argument("--topN", type=int, default=5, help="N of the top-N accuracy besides top-1 and top-10 (default 5)")
    a.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True,
                   help="score every backend but frameworks against PyTorch too (its top-1 agreement and KL on the "
                   "same passages): a second, PyTorch pass over them (default on; --no-fidelity skips it)")


def run(args) -> list[Result]:
    from nndf.architectures import architecture
    from nndf.evaluation import MAX_PPL, check_lambada_settings
    from nndf.lambada import load_lambada, sample_texts
    from nndf.loading import load_config
    from nndf.registry import resolve

    spec, variant = resolve(args.model, args.variant)
    scores = architecture(spec)
    scores.check_lambada(spec)
    if args.tokens_to_generate != 1 and not scores.lambada_tokens_to_generate:
        raise UsageError(f"--tokens-to-generate does not apply to {spec.family}: an encoder-decoder model's decoder "
                         "scores the target word's own tokens (as lm-evaluation-harness does)")
    if args.num_samples is not None and args.num_samples < 0:
        raise UsageError(f"--num-samples must be 0 (all) or more, got {args.num_samples}")
    check_lambada_settings(args.tokens_to_generate, args.topN)
    # the vocabulary and positions from the config, read cheaply: a top-N covering the vocabulary (always 100%) and
    # target tokens that leave no position for a context (every passage skipped) are refused before the load
    config = load_config(spec, variant, torch_dir=args.torch_dir, random_weights=args.random_weights)
    vocab = spec.hooks.vocab_size(config)
    if args.topN >= vocab:
        raise UsageError(f"--topN {args.topN} covers all {vocab} tokens of this model's vocabulary (its top-N would "
                         f"always be 100%); give less than {vocab}")
    positions = spec.hooks.max_positions(config) if scores.lambada_tokens_to_generate else None
    if positions is not None and args.tokens_to_generate >= positions:
        raise UsageError(f"--tokens-to-generate {args.tokens_to_generate} leaves no position for a passage's context "
                         f"in this model's {positions}; give less than {positions}")
    texts: list[str] = []
    models = open_models(args, needs_text=True, before_load=lambda: texts.extend(load_lambada(args.dataset_file)))
    chosen = [text for _, text in sample_texts(texts, args.num_samples, seed=data_seed(args))]
    def score(model) -> dict:
        say(f"scoring {len(chosen)} LAMBADA passages on {label(model)}")
        metrics = model.architecture.lambada(chosen, model, args.tokens_to_generate, args.topN, args.batch_size)
        return dict(backend=label(model), **metrics.as_dict())

    keep = KeepOnInterrupt()
    rows = keep.each(models, "scoring", "not scored", score, name=label)
    judged = [(row, model) for row, model in zip(rows, models) if args.fidelity and not model.is_reference]
    if judged and not keep.stopped:
        names = ", ".join(label(model) for _, model in judged)
        say(f"fidelity: comparing the logits of {names} with PyTorch's on the same passages, one more PyTorch pass "
            "(--no-fidelity skips it)")
        fidelities = []
        with keep.guard("comparing logits with PyTorch's (fidelity)", kept=True,
                        missing="no top-1 agreement or KL columns (--no-fidelity leaves that pass out)"):
            fidelities = models[0].architecture.fidelities(chosen, [model for _, model in judged], args.batch_size)
        for (row, _), fidelity in zip(judged, fidelities):
            row.update(top1_agreement=fidelity.top1_agreement, mean_kl=fidelity.mean_kl)
    n = args.topN
    columns = [
        Column("backend", "backend"),
        Column("samples", "passages"),
        *top_columns(n),
        Column("token_perplexity", "token ppl", PPL),
        Column("sequence_perplexity", "seq ppl", PPL),
        Column("lm_eval_accuracy", "lm-eval acc", "{:.2%}"),
        Column("lm_eval_perplexity", "lm-eval ppl", PPL),
    ]
    if any("top1_agreement" in row for row in rows):
        columns += [Column("top1_agreement", "top-1 = PyTorch", "{:.2%}"), Column("mean_kl", "KL vs PyTorch", "{:.2e}")]
    notes = [models[0].architecture.lambada_note(args.tokens_to_generate)]
    cut = max((row.get("cut_passages", 0) for row in rows), default=0)
    if cut:
        notes.append(f"{cut} of the {len(chosen)} passages are longer than the model's {models[0].max_positions} "
                     "positions and were cut as each tool cuts them: the NVIDIA-demo columns from the right (so the "
                     "last tokens they score are not the passage's end), lm-eval's from the start of the context")
    if args.num_samples and args.num_samples > len(texts):
        notes.append(f"--num-samples {args.num_samples} asked for more passages than the data set's {len(texts)}: "
                     "all of them were scored")
    if all(isinstance(row.get("top1"), float) and math.isnan(row["top1"]) for row in rows):
        notes.append(f"no passage has more than the {args.tokens_to_generate} target token(s) of "
                     "--tokens-to-generate, so the NVIDIA-demo columns (top-N, token and seq ppl) have nothing to "
                     "average (-)")
    capped = [column.header for column in columns if column.key in ("token_perplexity", "sequence_perplexity")
              and any(row.get(column.key) == MAX_PPL for row in rows)]
    if capped:
        notes.append(f"{MAX_PPL:g} under {' and '.join(capped)} is the cap of NVIDIA's demo (it reports "
                     f"min(perplexity, {MAX_PPL:g})), not a measured value: the perplexity is at least that; lm-eval "
                     "ppl has no cap.")
    if any("top1_agreement" in row for row in rows):
        notes.append("top-1 = PyTorch: share of all positions whose next-token argmax equals the PyTorch model's; "
                     "KL vs PyTorch: mean KL(PyTorch || backend) per position, both from one more pass over the "
                     "passages on PyTorch, which --no-fidelity skips. On random weights the logits are nearly flat, "
                     "so quantized agreement says little there: judge fidelity on trained weights.")
    notes += keep.notes()
    first = models[0]
    title = f"accuracy {first.spec.family} {first.loaded.name}: LAMBADA, {sample_words(len(chosen), len(texts), args)}"
    context = dict(describe(*models), dataset=args.dataset_file or "EleutherAI/lambada_openai",
                   num_samples=len(chosen), passages_in_dataset=len(texts),
                   sample="random" if len(chosen) < len(texts) else "all", sample_seed=data_seed(args),
                   tokens_to_generate=args.tokens_to_generate, topN=n)
    return keep.finish([Result("accuracy", title, columns, rows, context, notes)])


def top_columns(n: int) -> list[Column]:
    """top-1, top-N and top-10 in increasing N; a --topN of 1 or 10 is that column once, not a second one of the
    same header (the JSON rows keep `topN` whatever N is)."""
    keys = {1: "top1", 10: "top10"}
    keys.setdefault(n, "topN")
    return [Column(key, f"top-{k}", "{:.2%}") for k, key in sorted(keys.items())]


def sample_words(chosen: int, available: int, args) -> str:
    """How many passages were scored and how they were chosen, so that a run can be repeated: `sample_texts` draws
    a seeded random sample (in data set order) when --num-samples is below the data set's size."""
    passages = f"{chosen} passage{'' if chosen == 1 else 's'}"
    if chosen >= available:
        return f"{passages} (all)"
    return f"{passages} of {available}, drawn at random with --seed {data_seed(args)}"
