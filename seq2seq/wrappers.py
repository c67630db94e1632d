"""An encoder-decoder model as three modules with flat, named tensor inputs and outputs.

The frameworks backend runs these modules step by step and the ONNX exporter traces the very same ones, so the two
cannot drift apart. All three call the Hugging Face model's own forward (never a copy of its layers), so every
family's quirks (T5's relative attention buckets and scaled tied head, BART's learned positions and final logits
bias, mBART's pre-norm layers) stay Hugging Face's code:

- `EncoderWrapper`: `input_ids, attention_mask -> encoder_hidden_states`.
- `CrossCacheWrapper`: `encoder_hidden_states -> cross.{i}.key, cross.{i}.value` for every decoder layer. It runs
  the decoder over one placeholder token with an empty cache and reads the cross-attention keys and values the
  model's attention layers store there; nothing else it computes reaches an output, so the exported graph keeps
  only the key and value projections.
- `DecoderWrapper`: `input_ids, encoder_attention_mask, logits_to_keep, cross..., past... -> logits, present...`.
  The cross keys and values go into the cache object as already computed (`is_updated`), so the model never
  projects the encoder states again. The model still wants encoder hidden states to size the encoder mask; it gets
  a zero-strided placeholder of the right batch and length (an `expand` of one zero: no memory, no data read).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, EncoderDecoderCache

from nndf.export.wrapper import StepWrapper, flat_layers, past_as_cache, returned_cache, with_cache
from nndf.kvcache import KINDS, past_names, present_names


def cross_name(layer: int, kind: str) -> str:
    return f"cross.{layer}.{kind}"


def cross_names(num_layers: int) -> list[str]:
    return [cross_name(i, k) for i in range(num_layers) for k in KINDS]


ENCODER_IO = (("input_ids", "attention_mask"), ("encoder_hidden_states",))


def cross_io(num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("encoder_hidden_states",), tuple(cross_names(num_layers))


def decoder_io(num_layers: int, use_cache: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The decoder graph's names: the cross keys and values are inputs with or without the self-attention cache."""
    inputs = ["input_ids", "encoder_attention_mask", "logits_to_keep", *cross_names(num_layers)]
    outputs = ["logits"]
    if use_cache:
        inputs += past_names(num_layers)
        outputs += present_names(num_layers)
    return tuple(inputs), tuple(outputs)


def graph_io(num_layers: int, use_cache: bool) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """(inputs, outputs) of each of the three graphs, keyed by graph name."""
    return {"encoder": ENCODER_IO, "cross": cross_io(num_layers), "decoder": decoder_io(num_layers, use_cache)}


class EncoderWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = model.get_encoder()
        self.input_names, self.output_names = ENCODER_IO
        self.eval()

    def forward(self, input_ids, attention_mask):
        return (self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,)


class CrossCacheWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.input_names, self.output_names = cross_io(num_layers)
        self.eval()

    def run_decoder(self, input_ids, encoder_hidden_states, cache):
        """One decoder step over `encoder_hidden_states` that fills `cache` (the model's own call)."""
        return self.model(encoder_outputs=(encoder_hidden_states,), decoder_input_ids=input_ids, use_cache=True,
                          **with_cache(self.model, cache))

    def forward(self, encoder_hidden_states):
        rows = encoder_hidden_states.shape[0]
        placeholder = torch.zeros((rows, 1), dtype=torch.long, device=encoder_hidden_states.device)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out = self.run_decoder(placeholder, encoder_hidden_states, cache)
        return flat_layers(returned_cache(out).cross_attention_cache, self.num_layers)


def self_attention_part(cache: EncoderDecoderCache):
    """The part of an encoder-decoder cache that a step adds to."""
    return cache.self_attention_cache


def cross_attention_cache(cross, self_attention, num_layers: int) -> EncoderDecoderCache:
    """A cache whose cross-attention part holds the given keys and values as already computed (`is_updated`), so
    the model reads them instead of projecting encoder states, and whose self-attention part is `self_attention`."""
    cache = EncoderDecoderCache(self_attention, DynamicCache())
    cache.cross_attention_cache = past_as_cache(cross)
    cache.is_updated = {layer: True for layer in range(num_layers)}
    return cache


class DecoderWrapper(StepWrapper):
    def __init__(self, model: torch.nn.Module, num_layers: int, use_cache: bool, static: bool = False) -> None:
        super().__init__(model, num_layers, use_cache, static)
        self.input_names, self.output_names = self.step_io(decoder_io(num_layers, use_cache))
        self.eval()

    def forward(self, input_ids, encoder_attention_mask, logits_to_keep, *rest):
        count = 2 * self.num_layers
        self_attention = self.self_attention_cache(rest[count:], input_ids)
        cache = cross_attention_cache(rest[:count], self_attention, self.num_layers)
        rows, length = encoder_attention_mask.shape
        placeholder = rest[0].new_zeros(()).expand(rows, length, 1)  # sizes the encoder mask only
        out = self.model(encoder_outputs=(placeholder,), attention_mask=encoder_attention_mask,
                         decoder_input_ids=input_ids, use_cache=True, **with_cache(self.model, cache),
                         **self.keep_kwargs(logits_to_keep), **self.static_decoder_mask(input_ids, rest[count:]))
        return self.step_outputs(out, logits_to_keep, self_attention_part)

    def static_decoder_mask(self, input_ids, past) -> dict:
        """A static step's decoder mask: ones over the whole buffer (a zero-strided `expand`), where the causal
        mask at the step's positions hides the unfilled tail. Without one, BART's decoder sizes a mask of ones from
        the cache's length, a tensor here: a host read that a CUDA graph cannot capture."""
        if not self.static:
            return {}
        return {"decoder_attention_mask": input_ids.new_ones(()).expand(input_ids.shape[0], past[0].shape[2])}


class TextGraphs:
    """The three graphs of a text encoder-decoder model (T5, BART): names, wrappers and tracing examples."""

    kind = "seq2seq"  # names the export folder
    encoder_role = "encoder"  # how messages name the first graph

    def io(self, hooks, config, use_cache: bool) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        return graph_io(hooks.num_layers(config), use_cache)

    def wrappers(self, model, hooks, use_cache: bool, static: bool = False) -> dict[str, torch.nn.Module]:
        """The three modules; `static`: the decoder as a static step (see `nndf.export.wrapper`)."""
        layers = hooks.num_layers(model.config)
        return {"encoder": EncoderWrapper(model), "cross": CrossCacheWrapper(model, layers),
                "decoder": DecoderWrapper(model, layers, use_cache, static)}

    def examples(self, model, hooks, use_cache: bool) -> dict[str, tuple[tuple, dict]]:
        """Example inputs (batch 2, 5 encoder tokens, 3 new decoder tokens, 4 past) and dynamic shapes per graph,
        with named dimensions whose ranges keep every length within the model's positions (tracing facts only)."""
        from torch.export import Dim

        config = model.config
        layers, heads, head_dim = hooks.num_layers(config), hooks.kv_heads(config), hooks.head_dim(config)
        positions = hooks.max_positions(config)
        new_max = max(positions // 2, 3) if use_cache else positions
        batch_dim, encoder_dim = Dim("batch"), Dim("encoder_sequence", max=max(positions, 5))
        sequence, kept = Dim("sequence", max=new_max), Dim("kept", max=new_max)
        past_dim = Dim("past_sequence", max=max(positions - new_max, 4))
        batch, enc, new, past = 2, 5, 3, 4 if use_cache else 0
        ids = torch.randint(0, int(config.vocab_size), (batch, enc))
        mask = torch.ones(batch, enc, dtype=torch.long)
        hidden = EncoderWrapper(model)(ids, mask)[0].detach()
        cross = [torch.randn(batch, heads, enc, head_dim) for _ in range(2 * layers)]
        pasts = [torch.randn(batch, heads, past, head_dim) for _ in range(2 * layers)] if use_cache else []
        seq = {0: batch_dim, 1: encoder_dim}
        rest = tuple([{0: batch_dim, 2: encoder_dim}] * len(cross) + [{0: batch_dim, 2: past_dim}] * len(pasts))
        decoder_args = (torch.randint(0, int(config.vocab_size), (batch, new)), mask, torch.arange(new), *cross, *pasts)
        return {
            "encoder": ((ids, mask), {"input_ids": seq, "attention_mask": seq}),
            "cross": ((hidden,), {"encoder_hidden_states": seq}),
            "decoder": (decoder_args, {"input_ids": {0: batch_dim, 1: sequence}, "encoder_attention_mask": seq,
                                       "logits_to_keep": {0: kept}, "rest": rest}),
        }
