"""The exported decoder's last layer runs past its attention on the kept rows alone, as llama.cpp does.

A step keeps the logits of `logits_to_keep`'s positions only (the last one while generating), yet transformers'
models run every position through every layer. All but the last layer must: their outputs are the next layer's
keys and values. The last layer's attention must too, since its keys and values go to the cache. But what follows
it in that layer (the residual, the norms, the MLP: three quarters of a layer's MatMul work) feeds nothing but the
kept logits. llama.cpp drops those rows at the last layer for the same reason ("output ids").

Here, without a copy of any family's layer code, by hooks on the last decoder layer and its attention while the
graph is traced:
- the layer's input becomes its kept rows, so the residual stream and the MLP carry those rows alone;
- its self-attention is handed every row, recomputed from the full input by the family's `pre_attention` hook
  (the layer's first norm in transformers' pre-norm layers), and returns the kept rows;
- the layer's output goes back to the input's shape, the kept rows written into a copy of the input, so that the
  model's own code after the layers (a final norm, GPT-2's view to the input's shape, its slicing for the head) runs
  unchanged; the other rows are read by nothing that reaches the kept logits.
With every position kept (scoring a text) the same graph computes every row. GPT-2 small, 64-token prompt: the
first token 3-7% shorter in fp32 and int4, the decode step unchanged (bench/README.md).

Which models: those whose layers transformers lists in `_no_split_modules` (one per hidden layer), with one
self-attention child (the child with a `layer_idx`) and a `pre_attention` their family knows, among the models
whose attention goes through transformers' attention interface (`layout_refusal`, as for the shared KV layout).
The others keep their last layer whole: BLOOM's attention adds the residual itself, so the layer's residual could
not carry fewer rows than its attention, and GPT-Neo's attention is a module of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from nndf.export.fused_attention import layout_refusal

# While a traced step runs: {"keep": the kept positions, "full": the last layer's full input}
_STEP: contextvars.ContextVar[dict | None] = contextvars.ContextVar("nndf_kept_rows", default=None)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order: the modules of the classes transformers keeps whole across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def self_attention(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's self-attention: its one child with a `layer_idx` (the index its cache update goes by)."""
    found = [child for child in layer.children() if hasattr(child, "layer_idx")]
    return found[0] if len(found) == 1 else None


def trimmed_layer(model: torch.nn.Module, num_layers: int, pre_attention) -> tuple | None:
    """(last layer, its self-attention, the function from its input to its attention's) where the export can run
    that layer on the kept rows, else None."""
    if layout_refusal(type(model)) is not None:
        return None
    layers = decoder_layers(model)
    if len(layers) != num_layers:
        return None
    attention = self_attention(layers[-1])
    before = pre_attention(layers[-1]) if attention is not None else None
    return None if before is None else (layers[-1], attention, before)


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    return ((hidden, *args[1:]), kwargs) if args else (args, dict(kwargs, hidden_states=hidden))


def _first(output, replace: Callable[[torch.Tensor], torch.Tensor]):
    """A module's output with its hidden states (the tensor, or a tuple's first item) replaced."""
    if isinstance(output, tuple):
        return (replace(output[0]), *output[1:])
    return replace(output)


@contextlib.contextmanager
def last_layer_on_kept_rows(model: torch.nn.Module, num_layers: int, pre_attention) -> Iterator[bool]:
    """While exporting: the hooks above on the model's last layer (yields whether it has them; they are removed
    after). They act only inside `kept_rows(keep)`, which the decoder wrapper's forward enters where the export set
    its `keeps_rows`."""
    found = trimmed_layer(model, num_layers, pre_attention)
    if found is None:
        yield False
        return
    layer, attention, before = found

    def layer_input(module, args, kwargs):
        step = _STEP.get()
        if step is None:
            return None
        step["full"] = _hidden(args, kwargs)
        return _with_hidden(args, kwargs, step["full"].index_select(1, step["keep"]))

    def attention_input(module, args, kwargs):
        step = _STEP.get()
        return None if step is None else _with_hidden(args, kwargs, before(step["full"]))

    def attention_output(module, args, kwargs, output):
        step = _STEP.get()
        return None if step is None else _first(output, lambda rows: rows.index_select(1, step["keep"]))

    def layer_output(module, args, kwargs, output):
        step = _STEP.get()
        return None if step is None else _first(output, lambda kept: step["full"].index_copy(1, step["keep"], kept))

    handles = [layer.register_forward_pre_hook(layer_input, with_kwargs=True),
               attention.register_forward_pre_hook(attention_input, with_kwargs=True),
               attention.register_forward_hook(attention_output, with_kwargs=True),
               layer.register_forward_hook(layer_output, with_kwargs=True)]
    try:
        yield True
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def kept_rows(keep: torch.Tensor) -> Iterator[None]:
    """The step's kept positions, for the hooks of `last_layer_on_kept_rows` (nothing happens without them)."""
    token = _STEP.set({"keep": keep})
    try:
        yield
    finally:
        _STEP.reset(token)
