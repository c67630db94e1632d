"""A decoder-only model as a module with flat tensor inputs and outputs.

Hugging Face models take and return cache objects; ONNX graphs and TensorRT engines take and return plain named
tensors. This wrapper is the one bridge: positional inputs `input_ids, attention_mask, [position_ids,] logits_to_keep,
past...` and outputs `logits, present...`, in the order of `kvcache.past_names` / `present_names`. The frameworks backend
runs it step by step, and the ONNX exporter traces exactly the same module, so the two cannot drift apart.

A *static* step (the frameworks backend on CUDA, and its CUDA graphs) takes the KV buffers at their full,
preallocated length plus `past_length`, writes the new positions into them in place (transformers' `StaticLayer`
over our buffers) and returns the logits alone: every shape stays the same from one decode step to the next.

A *shared-buffer* step (`layout="shared"`, the onnxrt graph's default) takes each past as a buffer of the whole
generation's length and returns it as the present, written in place by ONNX Runtime's GroupQueryAttention
(`nndf.export.fused_attention`); the number of positions it holds is the mask's length less the new tokens.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticLayer

from nndf.export.kept_rows import kept_rows
from nndf.kvcache import KINDS, PAST_LENGTH, past_names, present_names


@functools.cache
def accepts(model_class: type, argument: str) -> bool:
    """Whether the model's forward takes `argument` (models with ALiBi take no position ids, for example). Cached:
    `with_cache` asks at every step, and reading a signature costs ~30 us."""
    return argument in inspect.signature(model_class.forward).parameters


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The keyword that hands `cache` to the model's forward: `cache` from transformers 5.24 on (where
    `past_key_values` is deprecated, to be removed in 5.40), `past_key_values` before."""
    return {"cache" if accepts(type(model), "cache") else "past_key_values": cache}


def returned_cache(out):
    """The cache a forward returned: `out.cache` from transformers 5.24 on, `out.past_key_values` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def decoder_io(model_class: type, num_layers: int, use_cache: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The input and output names of the decoder graph of such a model, known without loading its weights."""
    inputs = ["input_ids", "attention_mask"] + (["position_ids"] if accepts(model_class, "position_ids") else [])
    inputs.append("logits_to_keep")
    outputs = ["logits"]
    if use_cache:
        inputs += past_names(num_layers)
        outputs += present_names(num_layers)
    return tuple(inputs), tuple(outputs)


def past_as_cache(past) -> DynamicCache:
    """A DynamicCache of full-length layers that hold the given past tensors as they are.

    Every layer keeps every position, also where the model attends over a sliding window (Mistral, Gemma 2's local
    layers): transformers' windowed layer (`DynamicSlidingWindowLayer`, what `DynamicCache(config=...)` makes for
    them) returns past + new but keeps only the last window - 1 positions, which breaks the flat layout (each
    present = its past + the new positions) that every backend and graph shares. Over full-length layers the model
    masks the keys outside the window itself (its sliding-window mask is computed on absolute positions), so
    attention sees exactly the keys the windowed cache would have kept: the same result, at the price of a cache
    that grows past the window (GPT-Neo's local layers have always worked this way).

    `DynamicCache.update` would concatenate the tensors to an empty one, i.e. copy the whole past once more per
    step; setting the layers' tensors directly leaves the model's own concatenation as the only copy, as in
    `generate()`.
    """
    cache = DynamicCache()
    for layer in range(len(past) // 2):
        key, value = past[2 * layer], past[2 * layer + 1]
        plain = DynamicLayer()  # what lazy_initialization + update would leave, without their copies
        plain.dtype, plain.device, plain.is_initialized = key.dtype, key.device, True
        plain.keys, plain.values = key, value
        cache.layers.append(plain)
    return cache


class BufferLayer(StaticLayer):
    """transformers' `StaticLayer` over buffers it is given. A step writes its keys and values at `positions`
    (computed once per step, shared by every layer) and attends over the whole buffer; `cumulative_length` is the
    step's past length, which the model reads for its positions, never advanced here (nothing per layer but the
    two writes). Initialised here rather than by `lazy_initialization`, which would allocate new buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_length: torch.Tensor,
                 positions: torch.Tensor) -> None:
        CacheLayerMixin.__init__(self)
        self.max_cache_len = keys.shape[2]
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size, self.num_heads = keys.shape[0], keys.shape[1]
        self.k_head_dim, self.v_head_dim = keys.shape[3], values.shape[3]
        self.cumulative_length = past_length
        self.positions = positions
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values


def static_as_cache(past, past_length: torch.Tensor, new_tokens: int) -> Cache:
    """A cache over the given full-length buffers, as they are, whose layers write `new_tokens` positions at
    `past_length` (a 0-d tensor on the buffers' device), which is left as it was."""
    positions = torch.arange(new_tokens, device=past_length.device) + past_length
    return Cache(layers=[BufferLayer(past[2 * i], past[2 * i + 1], past_length, positions)
                         for i in range(len(past) // 2)])


def flat_layers(cache, num_layers: int) -> tuple[torch.Tensor, ...]:
    """A cache's keys and values as flat tensors, layer by layer, in the order of `past_names` / `present_names`."""
    return tuple(getattr(cache.layers[layer], kind + "s") for layer in range(num_layers) for kind in KINDS)


class StepWrapper(torch.nn.Module):
    """What every flat-tensor decoder step shares: the model, its layer count, and `logits_to_keep`.

    `logits_to_keep` (int64 positions) selects the rows of logits computed: the last one while generating (the LM
    head over the whole prompt is wasted work), all of them when scoring a text. Models that take it slice before
    their head; for the others the logits are sliced after it.
    """

    def __init__(self, model: torch.nn.Module, num_layers: int, use_cache: bool, static: bool = False,
                 layout: str = "growing") -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.use_cache = use_cache
        self.static = static and use_cache
        # "shared": each past is a whole-length buffer that the attention writes in place (nndf.export.fused_attention;
        # the model must then run that module's attention implementation, as the export sets it)
        self.shared = layout == "shared" and use_cache and not self.static
        self.slices_before_head = accepts(type(model), "logits_to_keep")

    def step_io(self, io: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The graph's (inputs, outputs); a static step also takes `past_length` and returns the logits alone."""
        inputs, outputs = io
        if self.static:
            return (*inputs, PAST_LENGTH), ("logits",)
        return tuple(inputs), tuple(outputs)

    def self_attention_cache(self, past, input_ids: torch.Tensor, total_length=None):
        """The self-attention cache over `past` (with `past_length` last in a static step, which writes
        `input_ids`' positions); an empty one without a cache. A shared-buffer cache holds `total_length` (the
        mask's length) less the new tokens."""
        if self.shared:
            from nndf.export.fused_attention import shared_buffer_cache

            return shared_buffer_cache(past, total_length - input_ids.shape[1])
        if self.static:
            return static_as_cache(past[:-1], past[-1], input_ids.shape[1])
        if not self.use_cache:
            return DynamicCache()
        return past_as_cache(past)

    def attention_over(self, cache):
        """The context the model's forward runs in: the shared-buffer attention finds its cache there."""
        if not self.shared:
            return contextlib.nullcontext()
        from nndf.export.fused_attention import active

        return active(cache)

    def keep_kwargs(self, keep: torch.Tensor) -> dict:
        return {"logits_to_keep": keep} if self.slices_before_head else {}

    def kept_logits(self, logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return logits if self.slices_before_head else logits.index_select(1, keep)

    def step_outputs(self, out, keep: torch.Tensor, self_attention=lambda cache: cache) -> tuple[torch.Tensor, ...]:
        """`logits, present...`; `self_attention` picks the self-attention part of the returned cache (an
        encoder-decoder's also holds the cross-attention keys and values, which are not new)."""
        logits = self.kept_logits(out.logits, keep)
        if not self.use_cache or self.static:
            return (logits,)
        return (logits, *flat_layers(self_attention(returned_cache(out)), self.num_layers))


class DecoderWrapper(StepWrapper):
    """`forward(input_ids, attention_mask, [position_ids], *past) -> (logits, *present)` over a causal LM."""

    def __init__(self, model: torch.nn.Module, num_layers: int, use_cache: bool, static: bool = False,
                 layout: str = "growing") -> None:
        super().__init__(model, num_layers, use_cache, static, layout)
        self.with_position_ids = accepts(type(model), "position_ids")
        self.input_names, self.output_names = self.step_io(decoder_io(type(model), num_layers, use_cache))
        # set by the export while its last layer has the kept-rows hooks (nndf.export.kept_rows); a frameworks
        # step, which has none, does not enter their context
        self.keeps_rows = False
        self.eval()

    def forward(self, input_ids, attention_mask, *rest):
        extra = {}
        if self.with_position_ids:
            extra["position_ids"], rest = rest[0], rest[1:]
        keep, rest = rest[0], rest[1:]
        extra.update(self.keep_kwargs(keep))
        cache = self.self_attention_cache(rest, input_ids, attention_mask.shape[1]) if self.use_cache else None
        with self.attention_over(cache), kept_rows(keep) if self.keeps_rows else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=self.use_cache,
                **with_cache(self.model, cache),
                **extra,
            )
        return self.step_outputs(out, keep)
