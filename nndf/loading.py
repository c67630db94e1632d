"""Model and tokenizer from one of three sources: a hub id, a local folder (--torch-dir), or random weights.

Random weights are built from the variant's known config, so every variant runs offline (benchmarks do not care
what the weights are), drawn once from one seeded generator with transformers' own distributions
(`nndf.random_weights`). The hub path is the ordinary transformers one; its failures (offline, unknown id) become
one sentence that says which flag to use instead.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nndf.errors import HarnessError, UsageError
from nndf.heap import empty_tensors, release_freed_heap
from nndf.random_weights import DRAW_REVISION, build_random_model, check_memory, weight_bytes
from nndf.spec import ModelSpec, Variant


@dataclass(eq=False)
class LoadedModel:
    """A model's config, where its weights come from, and the PyTorch model itself loaded on first use.

    The weights are loaded only when something needs them (the PyTorch backend, an export, the Hugging Face
    reference): a run of ONNX Runtime or TensorRT on artifacts that are already built never holds a second copy of
    the weights in memory. The tokenizer is also loaded on first use.
    """

    spec: ModelSpec
    variant: Variant
    config: object
    source: str
    tokenizer_source: str | None
    weights_id: str  # identifies the weights for artifact names: a changed checkpoint never reuses an export
    loader: Callable[[], torch.nn.Module]
    _model: torch.nn.Module | None = None
    _model_uses: int = 0  # how often `model` was asked for: whether a block built something from the weights
    _tokenizer: object = None
    _processor: object = None
    _generation_config: object = None  # read without the weights (`generation_config`)
    folder: Path | None = None  # --torch-dir's folder

    @property
    def name(self) -> str:
        """What titles call the model: the variant's name, or a local folder's (a --torch-dir model is its own
        checkpoint; the variant is then the family's default unless --variant named one)."""
        return (self.folder.name if self.folder is not None else "") or self.variant.name

    @property
    def model(self) -> torch.nn.Module:
        self._model_uses += 1
        if self._model is None:
            started = time.perf_counter()
            print(f"loading {self.name} weights: {self.source} ...", file=sys.stderr, flush=True)
            model = self.loader()
            model.eval()
            self._model = model
            print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        return self._model

    @contextlib.contextmanager
    def weights_for_build(self):
        """A block that may load the PyTorch weights only to build from them (an ONNX export, TensorRT's fp16
        check): weights it loaded are let go when it ends, and the heap the build freed goes back to the OS, so a run
        that exports holds no more memory afterwards than a run on the graphs already built. Weights loaded before
        the block (the frameworks backend's) stay; a later use loads them again. The garbage collection before the
        heap goes back (an export leaves reference cycles; it takes ~0.1 s) is made only where the block used the
        weights."""
        loaded_before, uses = self._model is not None, self._model_uses
        try:
            yield
        finally:
            if not loaded_before and self._model is not None:  # an export loaded them (a built graph needs none)
                empty_tensors(self._model)  # the exporter's leftovers still point at them
                self._model = None
            release_freed_heap(collect=self._model_uses != uses)

    @property
    def model_class(self) -> type:
        """The PyTorch class the weights load into, known without loading them."""
        if self._model is not None:
            return type(self._model)
        return _transformers_class(self.spec.auto_class)._model_mapping[type(self.config)]

    @property
    def generation_config(self):
        """Generation defaults (EOS, pad, length penalty) as the loaded model would have them; without the weights,
        read once and kept (every `generate` asks: building it anew cost 3.6 ms of a GPT-2 first token)."""
        if self._model is not None:
            return self._model.generation_config
        if self._generation_config is None:
            from transformers import GenerationConfig

            # the --torch-dir folder's own, not the tokenizer folder's (as from_pretrained: the file, else what the
            # model config implies); without a folder, the registry's
            config = known_generation_config(self.variant, self.config) if self.folder is None else \
                GenerationConfig.from_pretrained(self.folder) if (self.folder / "generation_config.json").is_file() \
                else GenerationConfig.from_model_config(self.config)
            self._generation_config = config
        return self._generation_config

    @property
    def tokenizer(self):
        """The tokenizer; a HarnessError names --tokenizer-dir when none can be found (offline random weights), a
        UsageError when it has more tokens than the model's vocabulary (a text whose ids run past it would fail in
        the middle of a run, at the first such word)."""
        if self._tokenizer is None:
            tokenizer = load_tokenizer(self.tokenizer_source, self.spec)
            vocab = self.spec.hooks.vocab_size(self.config)
            if len(tokenizer) > vocab:
                raise UsageError(f"the tokenizer of {self.tokenizer_source} has {len(tokenizer)} tokens, more than "
                                 f"the {vocab} of {self.name}'s vocabulary; is it this model's tokenizer "
                                 "(--tokenizer-dir, tokenizer_dir=)?")
            self._tokenizer = tokenizer
        return self._tokenizer

    @property
    def processor(self):
        """The model's processor (images and text for BLIP): the hub's or the folder's, else the family's own
        built from its config around `tokenizer` (`FamilyHooks.build_processor`)."""
        if self._processor is None:
            self._processor = load_processor(self.tokenizer_source, self.spec, self.config, lambda: self.tokenizer)
        return self._processor


def _transformers_class(name: str):
    import transformers

    return getattr(transformers, name)


def known_config(variant: Variant):
    """The variant's config from the registry's data, without touching the hub; a UsageError for a hub id that the
    family does not list (it has no known config)."""
    from transformers import AutoConfig

    if not variant.has_known_config:
        raise UsageError(f"--random-weights builds a listed variant from its known config, and {variant.hub_id} has "
                         "none (`run.py list` shows the listed ones): drop --random-weights to load it from the hub or "
                         "its cache, or give a local copy with --torch-dir")
    config_args = copy.deepcopy(dict(variant.config))  # transformers writes into nested dicts (rope_scaling)
    return AutoConfig.for_model(config_args.pop("model_type"), **config_args)


def known_generation_config(variant: Variant, config):
    """The generation config a checkpoint has on the hub, as far as the registry knows it (`Variant.generation`),
    else what transformers derives from the model config."""
    from transformers import GenerationConfig

    if variant.generation:
        return GenerationConfig(**variant.generation)
    return GenerationConfig.from_model_config(config)


def load_config(spec: ModelSpec, variant: Variant, *, torch_dir: str | None = None, random_weights: bool = False):
    """The config the model will have, cheaply, so that flags can be checked before a slow weight load.

    For a hub model that cannot be reached, the variant's known config stands in (the load will then fail
    with its own message).
    """
    from transformers import AutoConfig

    if torch_dir is not None:
        if not (Path(torch_dir) / "config.json").is_file():
            raise UsageError(f"--torch-dir {torch_dir} is not a Hugging Face model folder (no config.json in it)")
        try:
            config = AutoConfig.from_pretrained(torch_dir)
        except (OSError, ValueError, KeyError) as exc:  # not JSON, no model_type transformers knows, a key it needs
            raise _unreadable_config(f"--torch-dir {torch_dir}", exc) from None
        return check_architecture(spec, config, f"--torch-dir {torch_dir}")
    if not random_weights:
        try:
            config = AutoConfig.from_pretrained(variant.hub_id)
            return config if variant.has_known_config else check_architecture(spec, config, f"--variant {variant.hub_id}")
        except OSError as exc:
            if not variant.has_known_config:
                _hub_failure(variant, exc)
        except (ValueError, KeyError) as exc:  # the hub's config.json, read, but not one transformers can take
            raise _unreadable_config(f"--variant {variant.hub_id}", exc) from None
    return known_config(variant)


def _unreadable_config(source: str, exc: Exception) -> UsageError:
    """One sentence for a config.json transformers cannot take: not JSON, a model_type it does not know, or a key
    it needs missing (Phi-3's early 'su' longrope: a KeyError, whose message is the key quoted)."""
    reason = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    return UsageError(f"{source}: its config.json cannot be read ({reason.splitlines()[0]})")


def check_architecture(spec: ModelSpec, config, source: str):
    """`config` when it has one of the family's architectures (model types), else a UsageError naming the family
    that runs it. `source` says where the config came from: an unlisted hub id (`--variant org/x`) or a local folder
    (`--torch-dir DIR`, which would otherwise run, and be named, as the family's default variant). Weights quantized
    for a library of their own (GPTQ, AWQ, bitsandbytes: `quantization_config`) are refused too, before the load
    fails on that library's import; our exports are traced from full-precision weights."""
    quantized = getattr(config, "quantization_config", None)
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    if method is not None:
        raise UsageError(f"{source} holds weights quantized with {method} (its config's quantization_config), which "
                         "this harness cannot load or export; give the full-precision checkpoint (the onnxrt-int8 and "
                         "onnxrt-int4 backends quantize it for ONNX Runtime)")
    if not spec.model_types or config.model_type in spec.model_types:
        return config
    from nndf.registry import family_of_model_type

    owner = family_of_model_type(config.model_type)
    text = getattr(config, "text_config", None)
    if owner:
        hint = f"; run it as {owner}"
    elif getattr(config, "vision_config", None) is not None and text is not None:  # Gemma 3 4B+, Mistral 3, LLaVA
        language = family_of_model_type(getattr(text, "model_type", None))
        hint = (f"; it reads images and text (a vision encoder beside a {text.model_type} language model), which no "
                "family here runs (the image-to-text family is BLIP)"
                + (f"; a text-only {text.model_type} checkpoint runs as {language}" if language else ""))
    elif not getattr(config, "is_encoder_decoder", False) and not getattr(config, "is_decoder", False) and \
            any(a.endswith(("ForMaskedLM", "Model", "ForSequenceClassification", "ForTokenClassification",
                             "ForQuestionAnswering")) for a in getattr(config, "architectures", None) or ()):
        hint = "; an encoder model converts with: python run.py convert -m FOLDER (as transformer-deploy's)"
    else:
        hint = ""
    raise UsageError(f"{source} is a model of type {config.model_type}, not one of the {spec.family} "
                     f"family's ({', '.join(spec.model_types)}){hint}")


def load_model(
    spec: ModelSpec,
    variant: Variant,
    *,
    torch_dir: str | None = None,
    random_weights: bool = False,
    tokenizer_dir: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """`variant` of `spec` from the chosen source, weights loaded on first use in eval mode, on `device` in `dtype`.

    The config is read now (a hub model that cannot be reached fails here, with the flags to use instead).
    """
    auto = _transformers_class(spec.auto_class)
    if torch_dir is not None and random_weights:
        raise UsageError("--torch-dir and --random-weights exclude each other; give one of them")
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise UsageError(f"--tokenizer-dir {tokenizer_dir} does not exist")
    if tokenizer_dir is not None and not _has_tokenizer(Path(tokenizer_dir)):  # else another tokenizer would stand in
        raise UsageError(f"--tokenizer-dir {tokenizer_dir} holds no tokenizer (no {', '.join(TOKENIZER_FILES)}); "
                         "give a folder that a tokenizer's save_pretrained() wrote")
    if torch_dir is not None:
        folder = Path(torch_dir)
        config = load_config(spec, variant, torch_dir=torch_dir)
        source = f"local folder {folder}"
        weights_id = f"dir:{folder.resolve()}:{_files_signature(folder)}"
        tokenizer_source = tokenizer_dir or (str(folder) if _has_tokenizer(folder) else spec.default_tokenizer)

        def loader():
            if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):  # else an OSError traceback
                raise UsageError(f"--torch-dir {torch_dir} holds no weights (no model.safetensors or "
                                 "pytorch_model.bin, whole or sharded); give a folder that a model's save_pretrained() "
                                 "wrote, or --random-weights without --torch-dir")
            return auto.from_pretrained(folder, dtype=dtype).to(device)
    elif random_weights:
        config = known_config(variant)
        source = f"random weights (seed {seed}) from the known {variant.name} config"
        weights_id = f"random:{variant.name}:seed={seed}:draw={DRAW_REVISION}:{sorted(variant.config.items())}"
        tokenizer_source = tokenizer_dir or variant.hub_id

        built_on = torch.device(device).type
        if built_on != "cpu":  # the same seed draws other numbers on another device's generator
            weights_id += f":built-on-{built_on}"

        def loader():
            # Built where the weights will live, in their dtype (building on the CPU and moving took minutes for
            # gpt2-xl on a GPU machine, issue 11), each weight drawn once with transformers' distributions.
            check_memory(weight_bytes(auto, known_config(variant), dtype), device, variant.name)
            model = build_random_model(auto, known_config(variant), dtype=dtype, device=device, seed=seed)
            model.generation_config = known_generation_config(variant, model.config)
            return model
    else:
        config = _hub_config(variant)
        if not variant.has_known_config:
            config = check_architecture(spec, config, f"--variant {variant.hub_id}")
        source = f"hub {variant.hub_id}"
        weights_id = f"hub:{variant.hub_id}@{getattr(config, '_commit_hash', None)}"
        tokenizer_source = tokenizer_dir or variant.hub_id

        def loader():
            return _from_hub(auto, variant, dtype).to(device)
    if dtype != torch.float32:  # exports are fp32 copies of the loaded weights: fp16-rounded ones are other weights
        weights_id += f":{str(dtype).replace('torch.', '')}"
    return LoadedModel(spec, variant, config, source, tokenizer_source, weights_id, loader,
                       folder=Path(torch_dir).resolve() if torch_dir is not None else None)


def _hub_config(variant: Variant):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(variant.hub_id)
    except OSError as exc:
        _hub_failure(variant, exc)


def _files_signature(folder: Path) -> str:
    """Size and modification time of a folder's files: cheap, and changes whenever a checkpoint is rewritten. The
    time in nanoseconds: a rewrite of the same size within the second it was written (whole seconds missed it) is a
    change too."""
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()]
    return str(stats)


# Files of which a Hugging Face tokenizer folder has at least one (fast, slow BPE, WordPiece, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")


# What a checkpoint folder holds its weights in (one file, or shards with an index), as from_pretrained reads them.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _from_hub(auto, variant: Variant, dtype: torch.dtype):
    try:
        return auto.from_pretrained(variant.hub_id, dtype=dtype)
    except OSError as exc:
        _hub_failure(variant, exc)


def _hub_failure(variant: Variant, exc: OSError):
    """One sentence for a model the hub cannot give us, naming the flags that avoid the hub."""
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    why = "HF_HUB_OFFLINE=1 is set and it is not in the local cache" if offline else f"{exc}".splitlines()[0]
    instead = (" or --random-weights to build it from its known config" if variant.has_known_config else
               " (it is not a listed variant, so there is no known config to build it from)")
    raise HarnessError(
        f"could not load '{variant.hub_id}' from the Hugging Face hub ({why}); pass --torch-dir DIR for a local copy"
        f"{instead}"
    ) from None


def without_ignored_cleanup(tokenizer):
    """The tokenizer with `clean_up_tokenization_spaces` off where transformers ignores it anyway, so that decoding
    no longer warns about it.

    GPT-2's (and other BPE) tokenizer files ask for the clean-up; transformers 5.24 and later skip it for a BPE
    tokenizer unless told otherwise (`clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`)
    and say so at the first decode: a paragraph about a setting the user never chose, in the middle of a chat. The
    text decoded is the same either way. Older transformers, which apply the clean-up, are left to apply it."""
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if forced is False and getattr(tokenizer, "clean_up_tokenization_spaces", False) and backend is not None \
            and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def load_tokenizer(source: str | None, spec: ModelSpec):
    """A tokenizer from a folder or hub id; offline without a cached copy, a HarnessError naming --tokenizer-dir."""
    from transformers import AutoTokenizer

    candidates = list(dict.fromkeys(s for s in (source, spec.default_tokenizer) if s))
    for candidate in candidates:
        try:
            return without_ignored_cleanup(AutoTokenizer.from_pretrained(candidate))
        except (OSError, ValueError):
            continue
    fallback = spec.hooks.offline_tokenizer()
    if fallback is not None:
        return without_ignored_cleanup(fallback)
    tried = ", ".join(candidates) or "nothing"
    raise HarnessError(
        f"no tokenizer could be loaded (tried {tried}); give a Hugging Face tokenizer folder: --tokenizer-dir DIR "
        "(nndf.load(..., tokenizer_dir=DIR) in Python)"
    )


def load_processor(source: str | None, spec: ModelSpec, config, tokenizer: Callable[[], object]):
    """A processor from a folder or hub id that has one, else the family's own around the tokenizer (also when the
    folder holds a tokenizer alone: AutoProcessor then returns just that tokenizer)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase

    for candidate in [s for s in (source, spec.default_tokenizer) if s]:
        try:
            processor = AutoProcessor.from_pretrained(candidate)
        except (OSError, ValueError, TypeError):
            continue
        if isinstance(processor, PreTrainedTokenizerBase):
            return spec.hooks.build_processor(config, processor)
        return processor
    return spec.hooks.build_processor(config, tokenizer())
