"""The Python API: `nndf.load(...)` gives a `Model` whose `generate` runs the chosen backend.

    import nndf
    m = nndf.load("GPT2", variant="gpt2", backend="frameworks", random_weights=True)
    out = m.generate(input_ids, attention_mask=None, max_new_tokens=32, min_new_tokens=0, num_beams=1)

`out` holds exactly what Hugging Face `generate()` returns (prompt + new tokens for a decoder-only model, the
decoder's tokens from its start token for an encoder-decoder one such as T5), and `m.hf_generate(...)` runs
Hugging Face `generate()` itself on the same PyTorch model, as the reference. The model's own generation config
(beams, sampling, no-repeat n-grams, minimum length, forced tokens) applies unless an argument overrides it, as in
`generate()`; so do its length and special-token keywords (`max_new_tokens`, else `max_length`, else the
generation config's, else 20 new tokens; `eos_token_id`, `pad_token_id`), its rules per call
(`no_repeat_ngram_size`, `min_length`, `length_penalty`, `early_stopping`, `forced_eos_token_id`) and a
`generation_config=GenerationConfig(...)` that stands in for the model's (keywords still override it:
nndf.call_config). Sampling takes `generate()`'s keywords plus a seed, and a streamer gets the tokens as they come:

    out = m.generate(input_ids, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1,
                     seed=4321, streamer=transformers.TextStreamer(m.tokenizer), stop_strings=["\n"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Callable

import torch

from nndf.architectures import architecture
from nndf.backends import RUNS_ONNX_FILES, RUNS_TORCH_MODEL, BackendOptions, split_backend
from nndf.errors import HarnessError, UsageError
from nndf.call_config import (call_generation_config, generation_options, options_under, warn_unfeasible,
                               warn_unused)
from nndf.generate_arguments import (RULE_KEYWORDS, bos_prompt, check_prompt_tensors, check_stop_strings,
                                     check_streamer, new_token_budget, warn_right_padding)
from nndf.generation import GenerationOptions, generate
from nndf.keyword_terms import speaks_keywords
from nndf.option_checks import check_load_arguments, check_unused_options
from nndf.loading import LoadedModel, load_model
from nndf.reference import pytorch_logits
from nndf.registry import resolve
from nndf.spec import BuildSettings


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Model:
    """A loaded model on one backend, with the one generation loop and the Hugging Face reference beside it."""

    def __init__(self, loaded: LoadedModel, backend: str, settings: BuildSettings,
                 options: BackendOptions = BackendOptions()) -> None:
        spec = loaded.spec
        if backend not in spec.backends:
            raise UsageError(
                f"backend '{backend}' does not support the {spec.family} family; allowed: {', '.join(spec.backends)}"
            )
        self.loaded = loaded
        self.backend = backend
        self.settings = settings
        self.options = options
        self.forced_bos_token_id: int | None = None  # the target language of a multilingual model (--tgt-lang)
        self.architecture = architecture(spec)
        self.shapes = self.architecture.derive_shapes(settings, spec, loaded.config)
        building = contextlib.nullcontext() if backend in RUNS_TORCH_MODEL else loaded.weights_for_build()
        with building:
            self.decoder = self.architecture.open_decoder(loaded, backend, settings, options, self.shapes)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def processor(self):
        """The model's processor (BLIP: images and text); a text model's is its tokenizer."""
        return self.loaded.processor

    @property
    def spec(self):
        return self.loaded.spec

    @property
    def variant(self):
        return self.loaded.variant

    @property
    def max_positions(self) -> int:
        return self.shapes.max_positions

    def generation_options(self, max_new_tokens: int, min_new_tokens: int | None = None, num_beams: int | None = None,
                           forced_bos_token_id: int | None = None, **decoding) -> GenerationOptions:
        """Options from the model's own generation config, as Hugging Face `generate()` would pick them; the
        arguments override it (None: the config's value). `decoding`: `generate()`'s sampling keywords,
        `repetition_penalty`, `seed` (nndf.sampling), the rules and a `generation_config` object over the model's
        (nndf.call_config), the same None rule."""
        return generation_options(self, max_new_tokens, min_new_tokens, num_beams, forced_bos_token_id, **decoding)

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        num_beams: int | None = None,
        on_token: Callable[[], None] | None = None,
        forced_bos_token_id: int | None = None,
        on_encoded: Callable[[], None] | None = None,
        pixel_values: torch.Tensor | None = None,
        stopping: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
        *,
        streamer=None,
        stop_strings: str | list[str] | None = None,
        **decoding,
    ) -> torch.Tensor:
        """Generate with this backend through the shared loop; returns what `generate()` returns (see the module).

        `num_beams` / `min_new_tokens` None (their default) take the generation config's, as `generate()` does
        (a `generation_config` object's over the model's: nndf.call_config); `forced_bos_token_id` overrides the
        config's (mBART's target language); `pixel_values` are an image-to-text model's images (BLIP), and its
        `input_ids` an optional text prefix, as its `generate()` takes them; `stopping` ends rows early in greedy
        search, as `generate(stopping_criteria=...)` does (lm-eval's stop sequences).

        `decoding` takes `generate()`'s keywords with their meanings: `do_sample`, `temperature` (0: greedy),
        `top_k`, `top_p`, `min_p`, `typical_p`, `repetition_penalty` (None: the generation config's, then
        transformers' defaults), and `seed`: an int S draws what `torch.manual_seed(S)` before `generate()` draws,
        without changing the global random state; a `torch.Generator` is drawn from (and left advanced); None
        draws from the global generator, as `generate()` does. `sampling_stream="fast"` draws from the same
        distribution with a random stream of this harness's own (`nndf.fast_draw`: far cheaper on the CPU, and a
        seed repeats its tokens, but they are not `generate()`'s). `streamer` is `generate(streamer=...)`'s (put/end:
        `TextStreamer`, `TextIteratorStreamer`); `stop_strings` ends a row at the token that completes one of them
        (that token may run past it), as `generate(stop_strings=..., tokenizer=...)` does (with this model's
        tokenizer). The rules
        `no_repeat_ngram_size`, `min_length`, `length_penalty`, `early_stopping`, `forced_eos_token_id` and a
        `generation_config` object mean what they mean to `generate()` (None: the model's generation config's)."""
        attention_mask = check_prompt_tensors(input_ids, attention_mask, image=pixel_values is not None)
        warn_right_padding(self.architecture, attention_mask)
        gen = call_generation_config(self.loaded.generation_config, decoding.get("generation_config"))
        input_ids = bos_prompt(input_ids, attention_mask, gen, self.architecture.takes_images)
        max_new_tokens = new_token_budget(self.architecture, self.loaded, input_ids, max_new_tokens,
                                          decoding.get("max_length"), gen)
        options = options_under(gen, self, max_new_tokens, min_new_tokens, num_beams, forced_bos_token_id, **decoding)
        warn_unused(decoding, options)
        warn_unfeasible(options, self.architecture.prompt_length(input_ids, self.loaded))
        ids, mask, encoder_inputs = self.architecture.prompt(self.loaded, input_ids, attention_mask, pixel_values)
        self.architecture.check_length(ids.shape[1], max_new_tokens, self.shapes)
        self.architecture.check_token_ids(ids, self.shapes)
        stopping = self._with_stop_strings(stopping, stop_strings)
        return generate(self.decoder, ids, mask, options, on_token, on_encoded, encoder_inputs, stopping,
                        streamer).cpu()

    def _with_stop_strings(self, stopping, stop_strings):
        """`stopping` and the criteria of `stop_strings` (`stop_criteria`) together."""
        criteria = self.stop_criteria(stop_strings)
        if criteria is None:
            return stopping
        if stopping is not None:
            criteria.append(stopping)
        return criteria

    def stop_criteria(self, stop_strings: str | list[str] | None):
        """transformers' own StopStringCriteria for `stop_strings` with this model's tokenizer, as generate() builds
        it (a `StoppingCriteriaList`: `criteria(tokens, scores)` says per row whether its last token completed one
        of them); None for no stop strings. A continuous batch's `Request(stopping=...)` takes it too."""
        if not stop_strings:
            return None
        check_stop_strings(stop_strings)
        from transformers import StoppingCriteriaList, StopStringCriteria

        return StoppingCriteriaList([StopStringCriteria(self.tokenizer, stop_strings)])

    def hf_generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        num_beams: int | None = None,
        on_token: Callable[[], None] | None = None,
        forced_bos_token_id: int | None = None,
        on_encoded: Callable[[], None] | None = None,
        pixel_values: torch.Tensor | None = None,
        *,
        streamer=None,
        stop_strings: str | list[str] | None = None,
        **decoding,
    ) -> torch.Tensor:
        """Hugging Face `generate()` on the PyTorch model: the reference every backend is compared with.

        `on_token` is called from a logits processor, i.e. once per step right after the model's forward pass;
        `on_encoded` from a hook after an encoder-decoder model's encoder has run.
        Arguments left None are not passed, so `generate()` takes them from the model's generation config.
        `decoding` as `generate` takes it; an int `seed` is `torch.manual_seed(seed)` right before `generate()`,
        and temperature 0 is `do_sample=False` (which is what it means here; `generate()` refuses it);
        `sampling_stream` is the loop's alone (generate() always draws from PyTorch's generator, as it does).
        """
        from transformers import LogitsProcessor, LogitsProcessorList

        class _Tick(LogitsProcessor):
            def __call__(self, ids, scores):
                on_token()
                return scores

        attention_mask = check_prompt_tensors(input_ids, attention_mask, image=pixel_values is not None)
        check_streamer(streamer)
        check_stop_strings(stop_strings)
        gen = call_generation_config(self.loaded.generation_config, decoding.get("generation_config"))
        input_ids = bos_prompt(input_ids, attention_mask, gen, self.architecture.takes_images)
        max_new_tokens = new_token_budget(self.architecture, self.loaded, input_ids, max_new_tokens,
                                          decoding.pop("max_length", None), gen)
        ids, _, encoder_inputs = self.architecture.prompt(self.loaded, input_ids, attention_mask, pixel_values)
        self.architecture.check_length(ids.shape[1], max_new_tokens, self.shapes)
        self.architecture.check_token_ids(ids, self.shapes)
        options = options_under(gen, self, max_new_tokens, min_new_tokens, num_beams, forced_bos_token_id, **decoding)
        tokens = {key: decoding.pop(key) for key in ("eos_token_id", "pad_token_id", *RULE_KEYWORDS,
                                                     "generation_config") if decoding.get(key) is not None}
        seed = decoding.pop("seed", None)
        decoding.pop("sampling_stream", None)  # generate() draws from its own stream, whichever the loop's is
        if isinstance(seed, torch.Generator):
            raise UsageError("hf_generate draws from the global generator, as generate() does: give seed as an int")
        model = self.loaded.model
        device = next(model.parameters()).device
        if input_ids is not None and attention_mask is None and not self.architecture.takes_images:
            attention_mask = torch.ones_like(input_ids)
        given = {"min_new_tokens": min_new_tokens, "num_beams": num_beams, **tokens,
                 "forced_bos_token_id": options.forced_bos_token_id, "streamer": streamer,
                 **({"stop_strings": stop_strings, "tokenizer": self.tokenizer} if stop_strings else {})}
        # not sampling (temperature 0 included): of the decoding keywords only the repetition penalty applies
        penalty_only = {"repetition_penalty": decoding.get("repetition_penalty")}
        given.update(decoding if options.sampling.samples else penalty_only)
        given["do_sample"] = options.sampling.samples
        inputs = self.architecture.hf_inputs(input_ids, attention_mask, encoder_inputs, options.pad)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for key in inputs.keys() & given.keys():  # the inputs already carry the pad id (the caller's included)
            given.pop(key)
        encoder = self.spec.hooks.encoder_module(model) if self.architecture.has_encoder else None
        hook = None
        if encoder is not None and on_encoded is not None:
            hook = encoder.register_forward_hook(lambda *_: on_encoded())
        try:
            if seed is not None:
                torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    use_cache=self.settings.use_cache,
                    logits_processor=LogitsProcessorList([_Tick()]) if on_token is not None else None,
                    **{k: v for k, v in given.items() if v is not None},
                )
        finally:
            if hook is not None:
                hook.remove()
        return out.cpu()

    def caption(self, images, prompt: str | None = None, max_new_tokens: int = 30,
                num_beams: int | None = None) -> list[str]:
        """Captions of image files (or folders of them) through this backend: the processor's pixels, `prompt` as
        the text prefix of every caption (None: none), decoded as Hugging Face's examples decode them (prefix and
        caption, without special tokens)."""
        from nndf.images import caption_inputs, image_files

        if not self.architecture.takes_images:
            raise UsageError(f"{self.spec.family} reads text; caption() applies to image-to-text families (BLIP)")
        paths = [images] if isinstance(images, (str, bytes)) or hasattr(images, "__fspath__") else list(images)
        inputs = caption_inputs(self.processor, image_files(paths, flag="image"), prompt)
        out = self.generate(**inputs, max_new_tokens=max_new_tokens, num_beams=num_beams)
        return [text.strip() for text in self.tokenizer.batch_decode(out, skip_special_tokens=True)]

    def new_tokens(self, output: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The generated tokens of a `generate()` output for these inputs (what a reply or a label is made of)."""
        return self.architecture.new_tokens(output, input_ids, self.loaded)

    def label_ids(self, prompt_ids: torch.Tensor, label: str) -> list[int]:
        """The tokens a checkpoint label expects this model to generate for `prompt_ids`."""
        return self.architecture.label_ids(self.tokenizer, prompt_ids, label)

    def logits(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None, *,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Float logits for every position of sequences padded on the right (`attention_mask`; none: unpadded),
        from this backend (for accuracy scoring); an encoder-decoder model scores `decoder_input_ids`
        (teacher-forced) given `input_ids` on its encoder, `attention_mask` being the encoder's."""
        extra = () if decoder_input_ids is None else (decoder_input_ids,)
        mask = {} if attention_mask is None else {"attention_mask": attention_mask}
        return self.decoder.logits(input_ids, *extra, **mask).cpu()

    def reference_logits(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None, *,
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same logits from the PyTorch model itself: what other backends' fidelity is judged against."""
        return pytorch_logits(self.loaded.model, input_ids, decoder_input_ids, attention_mask)

    @property
    def is_reference(self) -> bool:
        """Whether this backend is the PyTorch model itself (its fidelity against PyTorch is trivially exact)."""
        return self.decoder.session.name == "frameworks"

    @property
    def artifacts(self) -> list[str]:
        """Files this backend runs (exported or quantized graphs, engines); empty for PyTorch."""
        return [str(p) for session in self.decoder.sessions for p in getattr(session, "artifacts", [])]


def target_language_token(loaded: LoadedModel, code: str) -> int:
    """The forced first token for `--tgt-lang CODE`, from the model's tokenizer when one loads, else the family's
    own table; a family without target languages says so."""
    try:
        tokenizer = loaded.tokenizer
    except HarnessError:
        tokenizer = None
    return loaded.spec.hooks.language_token_id(code, tokenizer, loaded.config)


def load(
    family: str,
    variant: str | None = None,
    backend: str = "frameworks",
    torch_dir: str | None = None,
    random_weights: bool = False,
    working_dir: str = "temp",
    use_cache: bool = True,
    fp16: bool = False,
    tokenizer_dir: str | None = None,
    settings: BuildSettings | None = None,
    device: str | torch.device | None = None,
    loaded: LoadedModel | None = None,
    quantize: str | None = None,
    block_size: int | None = None,
    int8_method: str | None = None,
    threads: int | None = None,
    decoder_onnx: str | None = None,
    encoder_onnx: str | None = None,
    cache_generator_onnx: str | None = None,
    tgt_lang: str | None = None,
    cuda_graph: bool = False,
    kv_layout: str | None = None,
) -> Model:
    """Load a model family's variant on a backend. `settings` overrides use_cache/fp16 when given.

    The weights: `torch_dir` (a local Hugging Face folder), else `random_weights=True` (the variant's known config,
    drawn with seed 0, offline), else the hub's checkpoint of `variant`; loaded only when something needs them.
    `tokenizer_dir`: a tokenizer folder (offline random weights have none of their own). `device`: "cpu" or "cuda"
    (default: a CUDA GPU when there is one). `working_dir`: where exports and engines are kept and reused.

    `quantize` ("int8" or "int4") quantizes the onnxrt backend's weights (as does a backend named "onnxrt-int8"),
    in blocks of `block_size` (default: the kind's, nndf.export.quantize), int8 by `int8_method` ("matmul_nbits"
    or "dynamic"; default: the CPU's, as --int8-method); `threads` sets intra-op threads;
    `decoder_onnx` runs a given ONNX file on onnxrt (and an encoder-decoder's `encoder_onnx` and
    `cache_generator_onnx`, as their flags; all three given: nothing is exported). `loaded` lets several backends
    share one PyTorch model.
    `tgt_lang` (mBART-50, e.g. "de_DE") makes every generation start with that language's token. `cuda_graph`
    replays decode steps as CUDA graphs (frameworks and trt on a CUDA GPU). `kv_layout` ("shared" or "growing") is
    the onnxrt decoder graph's KV cache layout (`nndf.export.fused_attention`; default shared where the model allows).
    An option the backend would not use is refused, as on the command line; usage errors name the keywords.
    """
    check_load_arguments(family, backend, device, threads, settings, working_dir,
                         dict(random_weights=random_weights, use_cache=use_cache, fp16=fp16, cuda_graph=cuda_graph))
    backend, named_quantization = split_backend(backend)  # "onnxrt-int8" as on the command line
    if named_quantization is not None and quantize not in (None, named_quantization):
        raise UsageError(f"backend '{backend}-{named_quantization}' and quantize='{quantize}' disagree; give one")
    quantize = quantize or named_quantization
    if quantize is not None and backend not in RUNS_ONNX_FILES:  # as the command line's --int8 / --int4
        raise UsageError(f"quantize='{quantize}' applies to the {', '.join(RUNS_ONNX_FILES)} backend (its exported "
                         f"graph), not {backend}")
    if block_size is not None and quantize is None:
        raise UsageError("block_size applies to quantized weights; give quantize='int8' or 'int4' too")
    if int8_method is not None and quantize != "int8":
        raise UsageError("int8_method applies to int8 weights; give quantize='int8' (or the backend 'onnxrt-int8')")
    given = {"decoder_onnx": decoder_onnx, "encoder_onnx": encoder_onnx, "cache_generator_onnx": cache_generator_onnx}
    options = BackendOptions(working_dir=working_dir, threads=threads, quantize=quantize, block_size=block_size,
                             int8_method=int8_method,
                             cuda_graph=cuda_graph, kv_layout=kv_layout or "shared", **given)
    spec, var = resolve(family, variant)
    if settings is None:
        settings = BuildSettings(use_cache=use_cache, fp16=fp16)
    check_unused_options(backend, spec, settings, given, cuda_graph, kv_layout)
    if loaded is None:
        device = torch.device(device) if device is not None else default_device()
        if device.type == "cuda" and not torch.cuda.is_available():  # else an AssertionError from deep in torch
            raise HarnessError(f"device='{device}' but this torch ({torch.__version__}) sees no CUDA GPU; give "
                               "device='cpu', or leave device out (a GPU when there is one)")
        dtype = torch.float16 if settings.fp16 else torch.float32
        loaded = load_model(
            spec, var, torch_dir=torch_dir, random_weights=random_weights, tokenizer_dir=tokenizer_dir,
            dtype=dtype, device=device,
        )
    model = Model(loaded, backend, settings, options)
    if tgt_lang is not None:
        model.forced_bos_token_id = target_language_token(loaded, tgt_lang)
    return model


# Its usage errors name its keywords and BuildSettings' fields, not the command line's flags.
load = speaks_keywords(set(inspect.signature(load).parameters) | {f.name for f in dataclasses.fields(BuildSettings)})(
    load)

