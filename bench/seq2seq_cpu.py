#!/usr/bin/env python
"""Encoder-decoder speed on the CPU (T5, BART, BLIP), side by side in one run: Hugging Face eager generate(), our
loop on ONNX Runtime (fp32 / int8), and Hugging Face Optimum's ORTModelForSeq2SeqLM (not for BLIP: Optimum does not
export it).

    HF_HUB_OFFLINE=1 python bench/seq2seq_cpu.py                      # t5-small, random weights, b1 and b4
    HF_HUB_OFFLINE=1 python bench/seq2seq_cpu.py --family BART --variant bart-base --rounds 3
    HF_HUB_OFFLINE=1 python bench/seq2seq_cpu.py --family BLIP --variant blip-image-captioning-base

It measures as bench/decoder_cpu.py does (bench/harness/, described in bench/README.md): one worker process per
engine on the same saved weights, the Optimum one in its own virtual environment, a warm-up, interleaved rounds on
the same seeded random encoder input (BLIP: seeded random pixels of its image size, no text prefix), greedy with
exactly --output-len new tokens. Per engine and batch: time in the encoder's forward (where the engine lets us reach
it), decode ms/step, first token (encoder included), tokens/s, and whether the new tokens equal hf's; each worker's
peak memory; ratios last, then the goals. What a family changes (default variant, engines and output length, goals,
the class hf loads, its encoder, its inputs) is one entry of FAMILIES.

Nothing here imports nndf, torch or transformers at import time: the same file is the Optimum worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/harness, also when this file is loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import driver  # noqa: E402
from harness.bench import Bench, Family  # noqa: E402
from harness.worker import CallTimer, GenerateRunner, NndfRunner, optimum_runner, versions  # noqa: E402

DEFAULT_ENGINES = ("hf", "onnxrt", "onnxrt-int8", "optimum")
ENGINE_HELP = {
    "hf": "Hugging Face eager generate() with KV cache on AutoModelForSeq2SeqLM (BLIP: AutoModelForImageTextToText; "
          "PyTorch, transformers 5.x)",
    "nndf-frameworks": "our generation loop on PyTorch",
    "onnxrt": "our generation loop on ONNX Runtime, fp32",
    "onnxrt-int8": "our generation loop on ONNX Runtime, int8 weights",
    "optimum": "Hugging Face Optimum ORTModelForSeq2SeqLM (KV cache), in its own virtual environment (not BLIP)",
}
QUANTIZE = {"onnxrt-int8": "int8"}

# (engine, batch, metric, reference, op, target): end-to-end tokens/s, the encoder included, at both batch sizes.
GOALS = tuple(
    [("onnxrt", b, "tok_s", ref, ">=", target) for b in (1, 4) for ref, target in (("hf", 1.6), ("optimum", 1.15))]
    + [("onnxrt-int8", b, "tok_s", "hf", ">=", 3.0) for b in (1, 4)]
)

# T5 and BART: encoder token ids in, AutoModelForSeq2SeqLM's encoder timed. Each other family is one entry of
# FAMILIES (its fields left None keep these).
SEQ2SEQ = Family(inputs="tokens", hf_class="AutoModelForSeq2SeqLM", hf_encoder=lambda model: model.get_encoder(),
                 hf_pad=True)
FAMILIES = {
    # Image captioning: seeded random pixels of the image size (384x384), 20 new tokens (a caption's length), the
    # vision encoder timed; its generate() ends at [SEP] and pads with [PAD] whatever the generation config says.
    "BLIP": Family(
        variant="blip-image-captioning-base", engines=("hf", "onnxrt", "onnxrt-int8"), output_len=20,
        note="Optimum does not export BLIP", refused=("optimum",), goals=(("onnxrt", 1, "tok_s", "hf", ">=", 1.4),), inputs="pixels",
        hf_class="AutoModelForImageTextToText", hf_encoder=lambda model: model.vision_model, hf_pad=False,
        generation=lambda config: {"eos_token_id": config["text_config"]["sep_token_id"],
                                   "pad_token_id": config["text_config"]["pad_token_id"]},
    ),
}

# Generation config entries that change what greedy decoding produces; the header shows the weights' values.
GENERATION_KEYS = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "forced_bos_token_id",
                   "forced_eos_token_id", "no_repeat_ngram_size", "repetition_penalty", "suppress_tokens",
                   "begin_suppress_tokens", "bad_words_ids")


def _time_encoder(runner, encoder, method: str = "forward") -> None:
    """Time `encoder.method`: forward of a torch module or of Optimum's ORTEncoder (both call self.forward), run of
    the encoder session our loop drives (encoder only: the cross-attention cache generator is left out, as HF and
    Optimum compute the cross keys and values in their first decoder step)."""
    runner.encoder = CallTimer()
    runner.encoder.wrap(encoder, method)


def make_runner(args):
    """hf: transformers' own generate() on the saved folder (the family's auto class); optimum: ORTModelForSeq2SeqLM
    (its own venv); our loop: nndf.load."""
    if args.worker == "optimum":
        runner = optimum_runner(args, "ORTModelForSeq2SeqLM", seq2seq=True)
        if runner is not None:
            _time_encoder(runner, runner.model.get_encoder())
        return runner
    if args.worker == "hf":
        import torch
        import transformers

        family = BENCH.for_family(args.family).family
        if args.threads:
            torch.set_num_threads(args.threads)
        model = getattr(transformers, family.hf_class).from_pretrained(args.weights_dir).eval()
        runner = GenerateRunner(model, seq2seq=True, pad=family.hf_pad)
        runner.versions = dict(versions(["torch", "transformers"]), torch_threads=torch.get_num_threads(),
                               attention=model.config._attn_implementation)
        _time_encoder(runner, family.hf_encoder(model))
        return runner
    runner = NndfRunner(args, QUANTIZE, seq2seq=True)
    encoder = getattr(runner.model.decoder, "encoder", None)  # the encoder's session, where the Model exposes one
    if callable(getattr(encoder, "run", None)):
        _time_encoder(runner, encoder, "run")
    return runner


def check_lengths(config: dict, args) -> str | None:
    """Encoder tokens and the decoder's start token + new tokens must fit the positions (BLIP: its text decoder's;
    its inputs are pixels)."""
    text = config.get("text_config") or config
    positions = text.get("max_position_embeddings") or text.get("n_positions")
    tokens_in = BENCH.for_family(args.family).family.inputs == "tokens"
    if positions and max(args.input_len if tokens_in else 0, args.output_len + 1) > positions:
        given = f"--input-len {args.input_len} and --output-len {args.output_len}" if tokens_in else \
            f"--output-len {args.output_len}"
        return f"{given} (+ the decoder start token) must each fit the {positions} positions of this model"
    return None


BENCH = Bench(
    name="seq2seq_cpu",
    script=Path(__file__).resolve(),
    description="Encoder-decoder speed on the CPU (T5, BART, BLIP), side by side in one run: Hugging Face eager "
                "generate(), our loop on ONNX Runtime fp32/int8, and Optimum's ORTModelForSeq2SeqLM (not BLIP). "
                "Report on stdout, progress on stderr.",
    engine_help=ENGINE_HELP,
    default_engines=DEFAULT_ENGINES,
    goals=GOALS,
    table_metrics=("encoder_ms", "step_ms", "ttft_ms", "tok_s"),
    ratio_metrics=lambda batch: ("tok_s", "step_ms"),
    make_runner=make_runner,
    check_lengths=check_lengths,
    default_family="T5",
    default_variant="t5-small",
    quantize=QUANTIZE,
    input_word="encoder",
    generation_keys=GENERATION_KEYS,
    family=SEQ2SEQ,
    families=FAMILIES,
)

if __name__ == "__main__":
    sys.exit(driver.main(BENCH))
