"""The fp16 check: after an fp16 build, the engines' logits are compared with an fp32 copy of the PyTorch model.

It scores through the same `logits` the accuracy action uses (`Decoder.logits` for a decoder-only model,
`Seq2SeqDecoder.logits` for an encoder-decoder one, whose encoder and cross-attention engines then count too).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from nndf.reference import pytorch_logits

FP16_LOGIT_BOUND = 0.01
"""The largest logit difference an fp16 engine may show against fp32 PyTorch, relative to the logits' scale.

After each fp16 build, a few seeded prompts are scored by the engine and by an fp32 copy of the PyTorch model on
the CPU; the measure is max |fp16 - fp32| over every position and vocabulary entry, divided by max |fp32|. fp16
keeps about 3 significant decimal digits, so rounding alone accounts for ~0.05% of the scale; above 1% the engine
has lost real accuracy (an overflow in a layer norm or in attention, say) and its tokens can differ from
PyTorch's. The check warns with the measured value (and the top-1 agreement) when the bound is exceeded.
"""


@dataclass(frozen=True)
class Fidelity:
    """How far a backend's logits are from the fp32 reference over a few prompts."""

    max_abs_diff: float
    scale: float  # max |reference logit|
    top1_agreement: float
    positions: int

    @property
    def relative(self) -> float:
        return self.max_abs_diff / max(self.scale, 1e-12)

    def as_dict(self) -> dict:
        return {"max_abs_diff": self.max_abs_diff, "scale": self.scale, "relative": self.relative,
                "top1_agreement": self.top1_agreement, "positions": self.positions, "bound": FP16_LOGIT_BOUND}


def logit_fidelity(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Fidelity:
    """Max absolute difference, reference scale and top-1 agreement over (got, expected) logit pairs."""
    diff = scale = 0.0
    agree = total = 0
    for got, expected in pairs:
        got, expected = got.float(), expected.float()
        diff = max(diff, float((got - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += got.shape[0] * got.shape[1]
    return Fidelity(diff, scale, agree / max(total, 1), total)


def fp16_warning(fidelity: Fidelity, bound: float = FP16_LOGIT_BOUND) -> str | None:
    """The warning to print when fp16 logits are further from fp32 than `bound` allows, else None."""
    if fidelity.relative <= bound:
        return None
    return (f"warning: the fp16 engine's logits differ from fp32 PyTorch by up to {fidelity.max_abs_diff:.4g} "
            f"({fidelity.relative:.2%} of the logits' scale {fidelity.scale:.4g}, bound {bound:.0%}); top-1 agreement "
            f"{fidelity.top1_agreement:.1%} over {fidelity.positions} positions: prefer the fp32 engine for accuracy")


def fp32_cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of `model` on the CPU, made tensor by tensor (no second copy on the GPU; ties kept)."""
    memo = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        cpu = tensor.detach().to("cpu", torch.float32 if tensor.is_floating_point() else tensor.dtype)
        memo[id(tensor)] = torch.nn.Parameter(cpu, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) \
            else cpu
    clone = copy.deepcopy(model, memo)
    return clone.eval()


def fp16_check(decoder, model: torch.nn.Module, batches, reference_logits=None) -> Fidelity:
    """Score each batch of inputs through `decoder.logits(*inputs)` (a `Decoder`, or a `Seq2SeqDecoder` given
    encoder and decoder ids, over the engines) and through `reference_logits(copy, *inputs)` on an fp32 CPU copy
    of `model` (default `nndf.reference.pytorch_logits`); compare."""
    reference = fp32_cpu_copy(model)
    reference_logits = reference_logits or pytorch_logits
    pairs = [(decoder.logits(*inputs).float().cpu().clone(), reference_logits(reference, *inputs))
             for inputs in batches]
    return logit_fidelity(pairs)
