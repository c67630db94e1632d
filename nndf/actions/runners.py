"""What gets timed: one `Runner` per way of generating, and one function that times any of them.

Each backend's Model is a runner through the shared loop; a backend that declares `MEASURE_HF_GENERATE` (the
PyTorch one) adds Hugging Face `generate()` on the same model as a second runner, which is the figure users
compare against.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from nndf.backends import backend_module
from nndf.measure import PeakMemory, StepTimer, Timing, TimingSettings, time_calls
from nndf.actions.common import label
from nndf.model import Model


@dataclass
class Runner:
    label: str
    model: Model
    generate: Callable[..., torch.Tensor]
    is_hf_generate: bool = False  # Hugging Face generate() itself: what users compare against


def runners_for(models: list[Model]) -> list[Runner]:
    runners = []
    for model in models:
        runners.append(Runner(label(model), model, model.generate))
        if getattr(backend_module(model.backend), "MEASURE_HF_GENERATE", False):
            runners.append(Runner(f"{model.backend} (HF generate)", model, model.hf_generate, is_hf_generate=True))
    return runners


@dataclass
class GenerationTiming:
    """End-to-end latency samples and, from the same calls, time to first token and per-step decode time."""

    latency: Timing
    encoder: list[float]  # an encoder-decoder model's encoder time per call (empty for decoder-only models)
    first_token: list[float]
    decode_steps: list[float]
    peak_bytes: int | None
    output: torch.Tensor

    @property
    def encoder_median(self) -> float | None:
        return statistics.median(self.encoder) if self.encoder else None

    @property
    def first_token_median(self) -> float:
        return statistics.median(self.first_token)

    @property
    def decode_step_median(self) -> float | None:
        return statistics.median(self.decode_steps) if self.decode_steps else None


def _sync(device: torch.device) -> Callable[[], None] | None:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def time_generation(
    runner: Runner,
    inputs: dict,
    max_new_tokens: int,
    min_new_tokens: int | None,
    num_beams: int,
    timing: TimingSettings,
    progress: bool = True,
    decoding: dict | None = None,
) -> GenerationTiming:
    """Time `runner` on `inputs` (`generate()`'s: input_ids, attention_mask, pixel_values) with `timing`,
    collecting first-token and decode-step times from every timed call. `decoding`: the sampling keywords and
    seed (`Model.generate`'s), the same for every call, so that every call draws the same tokens."""
    device = runner.model.decoder.device
    timer = StepTimer(device)
    encoder: list[float] = []
    first_token: list[float] = []
    decode_steps: list[float] = []
    outputs: list[torch.Tensor] = []

    def call() -> None:
        timer.start()
        outputs[:] = [
            runner.generate(**inputs, max_new_tokens=max_new_tokens,
                            min_new_tokens=min_new_tokens, num_beams=num_beams, on_token=timer.mark,
                            on_encoded=timer.mark_encoded if runner.model.architecture.has_encoder else None,
                            **(decoding or {}))
        ]
        if timer.encoder_time is not None:
            encoder.append(timer.encoder_time)
        if timer.time_to_first_token is not None:
            first_token.append(timer.time_to_first_token)
        if timer.decode_step_median is not None:
            decode_steps.append(timer.decode_step_median)

    with PeakMemory(device=device) as memory:
        latency = time_calls(call, timing, sync=_sync(device), progress=progress, desc=runner.label)
    # Warm-up calls also appended step times; keep only those of the timed calls.
    timed_calls = len(latency.samples) * timing.number
    return GenerationTiming(
        latency=latency,
        encoder=encoder[-timed_calls:],
        first_token=first_token[-timed_calls:],
        decode_steps=decode_steps[-timed_calls:],
        peak_bytes=memory.peak_bytes,
        output=outputs[0],
    )
