"""The fp16 check: after an fp16 build, the engine's logits are compared with an fp32 copy of the PyTorch model."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from nndf.spec import ShapeSpec

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


def fp16_check(session, shapes: ShapeSpec, hooks, model: torch.nn.Module, lengths=(8, 16, 32),
               seed: int = 0) -> Fidelity:
    """Score seeded prompts with `session` (through the shared Decoder) and with fp32 PyTorch; compare."""
    from nndf.decoder import Decoder

    decoder = Decoder(session, shapes, hooks)
    reference = fp32_cpu_copy(model)
    generator = torch.Generator().manual_seed(seed)
    rows = shapes.rows.min
    pairs = []
    for length in sorted({min(n, shapes.prompt.max) for n in lengths}):
        ids = torch.randint(0, shapes.vocab_size, (rows, length), generator=generator)
        got = decoder.logits(ids).float().cpu().clone()
        with torch.inference_mode():
            expected = reference(ids).logits.float()
        pairs.append((got, expected))
    return logit_fidelity(pairs)
