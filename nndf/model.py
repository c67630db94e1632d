"""The Python API: `nndf.load(...)` gives a `Model` whose `generate` runs the chosen backend.

    import nndf
    m = nndf.load("GPT2", variant="gpt2", backend="frameworks", random_weights=True)
    out = m.generate(input_ids, attention_mask=None, max_new_tokens=32, min_new_tokens=0, num_beams=1)

`out` holds whole sequences (prompt + new tokens), exactly as Hugging Face `generate()` returns them, and
`m.hf_generate(...)` runs Hugging Face `generate()` itself on the same PyTorch model, as the reference.
"""

from __future__ import annotations

from typing import Callable

import torch

from nndf.backends import BackendOptions, backend_module
from nndf.decoder import Decoder
from nndf.errors import UsageError
from nndf.generation import GenerationOptions, generate
from nndf.loading import LoadedModel, load_model
from nndf.registry import resolve
from nndf.spec import BuildSettings, ShapeSpec


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
        self.shapes = ShapeSpec.derive(settings, spec, loaded.config)
        session = backend_module(backend).open_session(loaded, settings, options)
        self.decoder = Decoder(session, self.shapes, spec.hooks)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def spec(self):
        return self.loaded.spec

    @property
    def variant(self):
        return self.loaded.variant

    @property
    def max_positions(self) -> int:
        return self.shapes.max_positions

    def generation_options(self, max_new_tokens: int, min_new_tokens: int = 0, num_beams: int = 1) -> GenerationOptions:
        """Options with the model's own EOS and pad tokens, as Hugging Face `generate()` would pick them."""
        gen_config = self.loaded.generation_config
        eos = gen_config.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return GenerationOptions(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            num_beams=num_beams,
            length_penalty=float(gen_config.length_penalty if gen_config.length_penalty is not None else 1.0),
            early_stopping=gen_config.early_stopping if gen_config.early_stopping is not None else False,
            eos_token_id=eos,
            pad_token_id=gen_config.pad_token_id,
        )

    def _check_length(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        total = input_ids.shape[1] + max_new_tokens
        if total > self.max_positions:
            raise UsageError(
                f"a prompt of {input_ids.shape[1]} tokens plus {max_new_tokens} new tokens is {total}, "
                f"more than the {self.max_positions} positions of this model"
            )

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        min_new_tokens: int = 0,
        num_beams: int = 1,
        on_token: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Generate with this backend through the shared loop; returns prompt + new tokens per row."""
        self._check_length(input_ids, max_new_tokens)
        options = self.generation_options(max_new_tokens, min_new_tokens, num_beams)
        return generate(self.decoder, input_ids, attention_mask, options, on_token).cpu()

    def hf_generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        min_new_tokens: int = 0,
        num_beams: int = 1,
        on_token: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Hugging Face `generate()` on the PyTorch model: the reference every backend is compared with.

        `on_token` is called from a logits processor, i.e. once per step right after the model's forward pass.
        """
        from transformers import LogitsProcessor, LogitsProcessorList

        class _Tick(LogitsProcessor):
            def __call__(self, ids, scores):
                on_token()
                return scores

        self._check_length(input_ids, max_new_tokens)
        options = self.generation_options(max_new_tokens, min_new_tokens, num_beams)
        model = self.loaded.model
        device = next(model.parameters()).device
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        with torch.inference_mode():
            out = model.generate(
                input_ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                min_new_tokens=min_new_tokens,
                num_beams=num_beams,
                do_sample=False,
                use_cache=self.settings.use_cache,
                pad_token_id=options.pad,
                logits_processor=LogitsProcessorList([_Tick()]) if on_token is not None else None,
            )
        return out.cpu()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float logits for every position of unpadded sequences, from this backend (for accuracy scoring)."""
        return self.decoder.logits(input_ids).cpu()

    def reference_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The same logits from the PyTorch model itself: what other backends' fidelity is judged against."""
        model = self.loaded.model
        with torch.inference_mode():
            return model(input_ids.to(next(model.parameters()).device)).logits.float().cpu()

    @property
    def is_reference(self) -> bool:
        """Whether this backend is the PyTorch model itself (its fidelity against PyTorch is trivially exact)."""
        return self.decoder.session.name == "frameworks"

    @property
    def artifacts(self) -> list[str]:
        """Files this backend runs (exported or quantized graphs, engines); empty for PyTorch."""
        return [str(p) for p in getattr(self.decoder.session, "artifacts", [])]


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
    threads: int | None = None,
    decoder_onnx: str | None = None,
) -> Model:
    """Load a model family's variant on a backend. `settings` overrides use_cache/fp16 when given.

    `quantize` ("int8" or "int4") quantizes the onnxrt backend's weights; `threads` sets intra-op threads;
    `decoder_onnx` runs a given ONNX file on onnxrt. `loaded` lets several backends share one PyTorch model.
    """
    options = BackendOptions(working_dir=working_dir, threads=threads, decoder_onnx=decoder_onnx, quantize=quantize)
    spec, var = resolve(family, variant)
    if settings is None:
        settings = BuildSettings(use_cache=use_cache, fp16=fp16)
    if loaded is None:
        device = torch.device(device) if device is not None else default_device()
        dtype = torch.float16 if settings.fp16 else torch.float32
        loaded = load_model(
            spec, var, torch_dir=torch_dir, random_weights=random_weights, tokenizer_dir=tokenizer_dir,
            dtype=dtype, device=device,
        )
    return Model(loaded, backend, settings, options)
