"""What an engine declares, and whether it fits its graph: plain data and torch, tested without a GPU.

- `EngineIO`: the engine's tensor names, dtypes and profile ranges, read once through the TensorRT 10 API
  (`num_io_tensors`, `get_tensor_name`, `get_tensor_mode`, `get_tensor_dtype`, `get_tensor_profile_shape`);
  `check_engine_io` compares them with the names of the graph it stands for (a decoder, an encoder-decoder
  model's encoder or cross-attention cache generator) and the profiles the ShapeSpec asks for.
- `choose_profile`: the context profile while the cache is empty, the generation profile afterwards (in general
  the first profile whose ranges hold every input shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from nndf.errors import HarnessError, UsageError

_TORCH_DTYPES = {
    "FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
    "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool,
}


def torch_dtype(trt_dtype) -> torch.dtype:
    """The torch dtype of a `trt.DataType` (matched by its member name, so no TensorRT import is needed)."""
    name = getattr(trt_dtype, "name", None) or str(trt_dtype).rsplit(".", 1)[-1]
    try:
        return _TORCH_DTYPES[str(name).upper()]
    except KeyError:
        raise HarnessError(f"the engine uses a tensor type ({name}) this runner does not handle") from None


Ranges = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class EngineIO:
    """An engine's named inputs and outputs with their dtypes, and each optimization profile's input ranges."""

    inputs: dict[str, torch.dtype]
    outputs: dict[str, torch.dtype]
    profiles: tuple[Ranges, ...]
    shape_inputs: tuple[str, ...] = ()

    @classmethod
    def read(cls, engine, trt) -> "EngineIO":
        """Read them through the TensorRT 10 name-based API (no binding indices)."""
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        modes = {name: engine.get_tensor_mode(name) for name in names}
        inputs = {n: torch_dtype(engine.get_tensor_dtype(n)) for n in names if modes[n] == trt.TensorIOMode.INPUT}
        outputs = {n: torch_dtype(engine.get_tensor_dtype(n)) for n in names if modes[n] == trt.TensorIOMode.OUTPUT}
        profiles = tuple(
            {name: tuple(tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, index))
             for name in inputs}
            for index in range(engine.num_optimization_profiles)
        )
        shape_inputs = tuple(n for n in inputs if engine.is_shape_inference_io(n))
        return cls(inputs, outputs, profiles, shape_inputs)


def profile_accepts(profile: Ranges, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether every shape lies within the profile's [min, max] range, dimension by dimension."""
    for name, shape in shapes.items():
        lo, _opt, hi = profile[name]
        if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            return False
    return True


def choose_profile(profiles: tuple[Ranges, ...], shapes: Mapping[str, tuple[int, ...]], current: int | None = None) -> int:
    """The profile for a step: the current one if it still fits, else the first that does.

    With the two profiles of a KV-cache build this is the context profile while the past is empty and the
    generation profile once it is not (their past ranges are 0..0 and 1..max).
    """
    if current is not None and profile_accepts(profiles[current], shapes):
        return current
    for index, profile in enumerate(profiles):
        if profile_accepts(profile, shapes):
            return index
    shown = {n: s for n, s in shapes.items() if n == "input_ids" or n.endswith(".0.key")} or dict(shapes)
    raise HarnessError(
        f"no optimization profile of the engine accepts this step's shapes ({', '.join(f'{n} {s}' for n, s in shown.items())}); "
        "it was built for other batch sizes or sequence lengths: rebuild it with flags that cover them"
    )


def _range_text(ranges) -> str:
    lo, _, hi = ranges
    return f"{'x'.join(map(str, lo))}..{'x'.join(map(str, hi))}"


def check_engine_io(io: EngineIO, input_names, output_names, required: list[Ranges], source: str,
                    role: str = "decoder", flag: str = "--decoder-engine") -> None:
    """An engine must have the tensor names of its graph (`role`: "decoder", "encoder", ...) and profiles covering
    every range the settings need; `flag` is the option that gave it, named in the hint.

    `required` comes from the ShapeSpec (`profiles(...)`, or `graph_profiles(...)` for an encoder-decoder model's
    graphs): each must fit inside one profile of the engine (min >= engine min, max <= engine max for every input).
    """
    if set(io.inputs) != set(input_names) or set(io.outputs) != set(output_names):
        raise UsageError(
            f"{source} does not have the {role}'s inputs and outputs: expected inputs {list(input_names)} and "
            f"outputs {list(output_names)}, found {list(io.inputs)} and {list(io.outputs)}"
        )
    if io.shape_inputs:
        raise UsageError(f"{source} takes shape tensors ({', '.join(io.shape_inputs)}), which the {role} never feeds")
    labels = ("context", "generation") if len(required) == 2 else ("whole-sequence",) * len(required)
    for label, need in zip(labels, required):
        if any(all(_covers(profile[n], r) for n, r in need.items()) for profile in io.profiles):
            continue
        lacking = [n for n, r in need.items() if not any(_covers(p[n], r) for p in io.profiles)]
        name = lacking[0] if lacking else "input_ids"
        have = ", ".join(_range_text(p[name]) for p in io.profiles) or "none"
        raise UsageError(
            f"{source} has no optimization profile for the {label} step of these settings: {name} needs "
            f"{_range_text(need[name])} and the engine's profiles allow {have}; match --batch-size, --num-beams, "
            f"--input-seq-len and --output-seq-len to the engine, or drop {flag} to build one"
        )


def _covers(engine_range, needed) -> bool:
    """Whether an engine profile's [min, max] for one input contains the needed [min, max]."""
    (lo, _, hi), (need_lo, _, need_hi) = engine_range, needed
    return len(lo) == len(need_lo) and all(a <= b for a, b in zip(lo, need_lo)) and \
        all(a >= b for a, b in zip(hi, need_hi))
