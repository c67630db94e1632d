"""transformers' logits processors as the loop applies them, with the per-step cost of the cheap ones kept cheap.

The loop builds `generate()`'s processors from transformers' own classes (`GenerationOptions.processors`). Two of
them, the minimum-length EOS bans, rebuild an arange over the vocabulary, a `torch.isin` over it and a copy of the
scores at every step, before and after the minimum is reached: 0.6 ms of a 21 ms GPT-2 step on ONNX Runtime
(`bench/onnxrt_io.py`), where every benchmark pays it (its generations are forced to an exact length). The
subclasses here compute the same scores (the EOS ids set to -inf while the minimum is not reached, the scores
unchanged after) by indexing the EOS ids alone. Sampling's top-k warper (`generate()`'s default, k 50) is
computed here in place with numpy's selection (`FastTopK`). `tests/test_sampling.py` checks each against its
transformers parent.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, TopKLogitsWarper


class PlainProcessors(list):
    """transformers' processors applied in order, as `LogitsProcessorList(tokens, scores)` applies them, without its
    per-call `inspect.signature` of every processor (it looks for processors that take extra keywords: none of
    those built here do), which costs more per decode step than most of the processors themselves."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class _EosBan:
    """Sets the EOS ids that index the scores' vocabulary to -inf (one `index_fill_`), as `torch.where(isin(...))`
    does; the ids that fit are worked out once per vocabulary size and device, not at every step.

    In place: the loop hands the processors scores of its own (a step's logits, read once), and a copy of the
    vocabulary's scores per step, allocated and written right after the step, cost ~90 us of a 18 ms GPT-2 step."""

    eos_token_id: torch.Tensor

    def banned(self, scores: torch.Tensor) -> torch.Tensor:
        key = (scores.shape[-1], scores.device)
        cached = getattr(self, "_fitting_eos", None)
        if cached is None or cached[0] != key:
            eos = self.eos_token_id.to(scores.device)
            cached = self._fitting_eos = (key, eos[(eos >= 0) & (eos < scores.shape[-1])])
        return scores.index_fill_(-1, cached[1], -math.inf)


class FastMinLength(_EosBan, MinLengthLogitsProcessor):
    """`MinLengthLogitsProcessor`: EOS banned while the sequences are shorter than `min_length`."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.banned(scores) if input_ids.shape[-1] < self.min_length else scores


class FastMinNewTokensLength(_EosBan, MinNewTokensLengthLogitsProcessor):
    """`MinNewTokensLengthLogitsProcessor`: EOS banned until `min_new_tokens` tokens follow the prompt."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_length_to_skip < self.min_new_tokens:
            return self.banned(scores)
        return scores


class FastTopK(TopKLogitsWarper):
    """`TopKLogitsWarper`: every score below the k-th largest set to `filter_value`, in place, the k-th largest found
    by numpy's selection (`np.partition`, the same value as `torch.topk`'s k-th, ties and NaN ranked alike) on float
    CPU scores. transformers' own sorts the k largest and allocates a mask and a copy of the scores: 0.5 ms per row
    of GPT-2's 50257 on the AVX2 machine, about the draw's own cost (`bench/sampling_cpu.py`). Elsewhere (CUDA,
    half precision) it is the parent's."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.device.type != "cpu" or scores.requires_grad or scores.dtype not in (torch.float32, torch.float64):
            return super().__call__(input_ids, scores)
        k = min(self.top_k, scores.shape[-1])
        values = scores.numpy()
        kth = np.partition(values, -k, axis=-1)[..., -k:-k + 1 or None]
        values[values < kth] = self.filter_value
        return scores
