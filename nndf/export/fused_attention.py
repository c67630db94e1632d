"""The shared-buffer KV layout: attention as ONNX Runtime's GroupQueryAttention, writing its cache in place.

The growing layout (`nndf.export.wrapper`'s default) concatenates every layer's past and new keys and values at
every step, as Optimum's graphs and `generate()`'s DynamicCache do: a decode step copies the whole cache once more.
In this layout each past input is one buffer of the generation's whole length, (rows, kv_heads, max_len, head_dim),
bound as both the past input and the present output of the com.microsoft GroupQueryAttention node (ONNX Runtime's
`past_present_share_buffer`, as ONNX Runtime GenAI's graphs run): the node writes the new positions into it and
reads the rest, so a step copies no cache. GroupQueryAttention takes multi-head attention as kv_heads = heads.

How the graph is made, without a copy of any family's attention: transformers' attention modules call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, mask, scaling=..., ...)` right
after `cache.update(...)`. Under `ATTENTION` below, a cache whose layers hand back the new keys and values unchanged
(`SharedBufferLayer`) and an attention function that calls `nndf::group_query_attention` (a torch custom op with a
plain PyTorch body, so that tracing and PyTorch runs work) over the layer's buffers; the dynamo exporter translates
the op to the ONNX node (`CUSTOM_TRANSLATION`). Queries and keys arrive already rotated (rotary, q/k norms, biases are
the model's own code), so the node is exported with `do_rotary=0`; nndf.export.ort_fusions then turns the model's
rotary ops into ONNX Runtime's RotaryEmbedding kernel, and where nothing stands between the projection and the
rotation, into the node's own rotary (`nndf.export.attention_inputs`).

Masking: the node masks causally by position and by `seqlens_k`, but it has no padding mask, and our loop pads
batched prompts on the left (as `generate()` does). The mask transformers builds for eager attention (additive,
per layer: padding, causality, sliding windows) goes in as the node's `attention_bias`, which ONNX Runtime's CPU
kernel adds to the scores, so left padding and windows are exact; every row then has the same total length (the
mask's), which is what `seqlens_k` and `total_sequence_length` say. Measured against a NumPy reference on ONNX
Runtime 1.32's CPU kernel: 4e-7 on left-padded prompts and the decode steps after them.

Which models: those whose attention goes through transformers' attention interface (`_supports_attention_backend`,
a property of the model class, not of a family name). Others (ALiBi in BLOOM, GPT-Neo's own attention) keep the
growing layout, and `layout_refusal` says why. The layout is the onnxrt backend's default on ONNX Runtime's CPU
provider (GPT-2 small: never slower, about 5% less per decode step at batch 4, 0-3% at batch 1: bench/README.md);
TensorRT engines are built from the growing graph.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers.cache_utils import Cache, DynamicLayer

ATTENTION = "nndf_gqa"  # the attn_implementation name the export registers
GROWING, SHARED = "growing", "shared"
LAYOUTS = (GROWING, SHARED)
OP_TYPE = "GroupQueryAttention"  # com.microsoft
MASKED = torch.finfo(torch.float32).min


def layout_refusal(model_class: type) -> str | None:
    """Why a model cannot use the shared-buffer layout, or None when it can."""
    if not getattr(model_class, "_supports_attention_backend", False):
        return (f"{model_class.__name__}'s attention does not go through transformers' attention interface "
                f"(its own attention code: ALiBi, or a module of its own), so it keeps the growing layout")
    return None


@torch.library.custom_op("nndf::group_query_attention", mutates_args=())
def group_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_key: torch.Tensor,
                          past_value: torch.Tensor, bias: torch.Tensor, num_heads: int, kv_num_heads: int,
                          scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupQueryAttention with a shared buffer, in PyTorch: query (b, s, heads * d), key and value (b, s, kv * d),
    buffers (b, kv, max_len, d), bias (b or 1, 1, s, t) with t the total length. The s new positions go to
    [t - s, t) of (copies of) the buffers; every query attends causally over [0, t), bias added after the softcap."""
    batch, new, _ = query.shape
    total = bias.shape[-1]
    head_dim = past_key.shape[-1]
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[:, :, total - new:total] = key.view(batch, new, kv_num_heads, head_dim).transpose(1, 2)
    present_value[:, :, total - new:total] = value.view(batch, new, kv_num_heads, head_dim).transpose(1, 2)
    groups = num_heads // kv_num_heads
    keys = present_key[:, :, :total].repeat_interleave(groups, dim=1)
    values = present_value[:, :, :total].repeat_interleave(groups, dim=1)
    q = query.view(batch, new, num_heads, head_dim).transpose(1, 2)
    scores = q @ keys.transpose(-1, -2) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    later = torch.arange(total)[None, :] > torch.arange(total - new, total)[:, None]
    scores = (scores + bias).masked_fill(later, MASKED)
    out = torch.softmax(scores, dim=-1) @ values
    return out.transpose(1, 2).reshape(batch, new, num_heads * head_dim), present_key, present_value


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, bias, num_heads, kv_num_heads, scale, softcap):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


def _contrib_op():
    """GroupQueryAttention as an onnxscript op. ONNX itself has no schema for ONNX Runtime's contrib ops, so the op
    carries one of its own: the inputs up to `attention_bias` and the attributes used here, as ONNX Runtime
    1.32 declares them (the full schema has more optional inputs after these)."""
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset

    single, optional = OpSchema.FormalParameterOption.Single, OpSchema.FormalParameterOption.Optional
    inputs = [("query", single, "T"), ("key", optional, "T"), ("value", optional, "T"), ("past_key", optional, "T"),
              ("past_value", optional, "T"), ("seqlens_k", single, "M"), ("total_sequence_length", single, "M"),
              ("cos_cache", optional, "T"), ("sin_cache", optional, "T"), ("position_ids", optional, "P"),
              ("attention_bias", optional, "T")]
    outputs = [("output", single, "T"), ("present_key", single, "T"), ("present_value", single, "T")]
    attribute = OpSchema.AttrType
    schema = OpSchema(
        OP_TYPE, "com.microsoft", 1,
        inputs=[OpSchema.FormalParameter(name, kind, param_option=option) for name, option, kind in inputs],
        outputs=[OpSchema.FormalParameter(name, kind, param_option=option) for name, option, kind in outputs],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""),
                          ("P", ["tensor(int64)"], "")],
        attributes=[OpSchema.Attribute("num_heads", attribute.INT, ""),
                    OpSchema.Attribute("kv_num_heads", attribute.INT, ""),
                    OpSchema.Attribute("scale", attribute.FLOAT, ""),
                    OpSchema.Attribute("softcap", attribute.FLOAT, "")])
    return Op(Opset("com.microsoft", 1), OP_TYPE, schema)


def _onnx_group_query_attention(query, key, value, past_key, past_value, bias, num_heads: int, kv_num_heads: int,
                                scale: float, softcap: float):
    """The op as ONNX: com.microsoft GroupQueryAttention, `total_sequence_length` the bias's last dimension and
    `seqlens_k` (total - 1) for every row (left padding is masked by the bias, so all rows have the same length).
    Both come from the bias alone (it has a row per sequence: `shared_buffer_attention`), which every layer shares,
    so the graph computes them once."""
    from onnxscript import opset18 as op

    total = op.Squeeze(op.Shape(bias, start=3, end=4), [0])  # int64 scalar
    seqlens = op.Cast(op.Expand(op.Sub(total, op.Constant(value_int=1)), op.Shape(bias, start=0, end=1)), to=6)
    total = op.Cast(total, to=6)  # int32, as the op's M
    return _contrib_op()(query, key, value, past_key, past_value, seqlens, total, None, None, None, bias,
                         num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, softcap=softcap)


CUSTOM_TRANSLATION = {torch.ops.nndf.group_query_attention.default: _onnx_group_query_attention}

_ACTIVE: contextvars.ContextVar[Cache | None] = contextvars.ContextVar("nndf_shared_cache", default=None)


def shared_buffer_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                            **kwargs):
    """transformers' attention-function signature over the active shared-buffer cache: query (b, heads, s, d) and the
    new key and value (b, kv, s, d) as the module computed them; returns (b, s, heads, d) and no weights. Sliding
    windows are in `attention_mask` (transformers builds it per layer), so the node's own window stays off."""
    cache = _ACTIVE.get()
    if cache is None or attention_mask is None:
        raise RuntimeError("shared-buffer attention runs only inside `shared_buffer_cache` with a mask")
    layer = cache.layers[module.layer_idx]
    batch, heads, new, head_dim = query.shape
    kv_heads = key.shape[1]
    flat = lambda t: t.transpose(1, 2).reshape(batch, new, -1)  # noqa: E731
    bias = attention_mask.to(query.dtype).expand(batch, -1, -1, -1)  # a row per sequence: the node's lengths
    out, layer.keys, layer.values = torch.ops.nndf.group_query_attention(
        flat(query), flat(key), flat(value), layer.keys, layer.values, bias,
        heads, kv_heads, float(scaling if scaling is not None else head_dim ** -0.5), float(softcap or 0.0))
    return out.view(batch, new, heads, head_dim), None


def register() -> None:
    """Make `ATTENTION` an attn_implementation transformers knows, with its additive eager mask. Called by the
    export that uses it, not at import: the registry lives in transformers' modeling code, whose import costs
    about 1.5 s and 110 MB that loading an already exported graph does not need."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTENTION, shared_buffer_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


class SharedBufferLayer(DynamicLayer):
    """A layer over a whole-length buffer: `update` hands the new keys and values on unchanged (the attention op
    writes them into the buffer), and the layer reports `past_length` positions (the mask's length less the new
    tokens), so that transformers' positions and masks are those of the growing layout."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_length) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.past_length = past_length

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self):
        return self.past_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past_length + query_length, 0


def shared_buffer_cache(past, past_length) -> Cache:
    """A cache over the given buffers (keys and values of each layer, in turn) holding `past_length` positions."""
    return Cache(layers=[SharedBufferLayer(past[2 * i], past[2 * i + 1], past_length) for i in range(len(past) // 2)])


@contextlib.contextmanager
def active(cache: Cache):
    """Let `shared_buffer_attention` find `cache` during the model's forward."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)

