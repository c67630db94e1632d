"""The backends `convert_model` checks and times, each as one callable: named inputs in, the outputs out (numpy).

PyTorch runs the task module itself (fp32, and fp16 on a GPU); ONNX Runtime runs each graph on the CPU or on CUDA
(its session is checked to really have the CUDA provider); TensorRT runs the plan through the trt backend's own
`TrtSession`, built by the engine builder the decoders use (`nndf.export.engine_build`, Polygraphy).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from nndf.backends.ort_runtime import CPU_DISABLED_OPTIMIZERS, session_options
from nndf.convert.tasks import TaskModule
from nndf.errors import HarnessError

Feeds = Mapping[str, torch.Tensor]

# Sentences for int8 calibration (static QDQ): varied lengths, punctuation, numbers and names, so that the
# activation ranges are those of text rather than of random token ids.
CALIBRATION_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, Apollo 11 landed on the Moon and Neil Armstrong walked on its surface.",
    "Could you send me the report by Friday afternoon, please?",
    "Prices rose 3.2% last year, the fastest increase in a decade.",
    "She opened the door, looked around the empty room, and sighed.",
    "Transformers process every token of a sentence in parallel with self-attention.",
    "The committee will meet again on 14 March to discuss the budget.",
    "Why do cats always land on their feet?",
    "Paris, London and Berlin are among the most visited cities in Europe.",
    "He said nothing at all for a long time, then laughed.",
    "Add two cups of flour, a pinch of salt and mix until smooth.",
    "The server returned error 503: service temporarily unavailable.",
    "Rain is expected across the north, with sunny spells in the south later.",
    "I can't believe it's already been ten years since we met!",
    "Quantum computers use qubits, which can hold superpositions of states.",
    "The museum's new wing displays sculptures from the eighteenth century.",
)


@dataclass
class Engine:
    """One backend to check and time. `infer` returns the outputs in the task's order, as numpy arrays."""

    name: str
    infer: Callable[[Feeds], list[np.ndarray]]
    artifact: Path | None = None
    notes: list[str] = field(default_factory=list)
    reruns_reference: bool = False  # PyTorch fp32 again: its difference is the machine's run-to-run noise


def random_feeds(input_names: tuple[str, ...], batch: int, seq: int, vocab: int, seed: int,
                 device: str) -> dict[str, torch.Tensor]:
    """Seeded random token ids of one shape, a full attention mask, segment ids 0: benchmarks' inputs."""
    generator = torch.Generator().manual_seed(seed)
    feeds = {}
    for name in input_names:
        if name == "input_ids":
            feeds[name] = torch.randint(0, vocab, (batch, seq), generator=generator)
        elif name == "attention_mask":
            feeds[name] = torch.ones((batch, seq), dtype=torch.long)
        else:
            feeds[name] = torch.zeros((batch, seq), dtype=torch.long)
    return {name: value.to(device) for name, value in feeds.items()}


def text_feeds(tokenizer, input_names: tuple[str, ...], texts, batch: int, max_len: int) -> list[dict[str, np.ndarray]]:
    """The texts tokenized in batches (padded, truncated to `max_len`), as numpy feeds of the graph's inputs."""
    out = []
    for start in range(0, len(texts), batch):
        encoded = tokenizer(list(texts[start:start + batch]), padding=True, truncation=True, max_length=max_len,
                            return_tensors="np")
        out.append({name: encoded[name].astype(np.int64) for name in input_names})
    return out


def pytorch_engine(module: TaskModule, name: str = "Pytorch (FP32)", fp16: bool = False) -> Engine:
    model = module
    if fp16:
        model = copy.deepcopy(module).half()

    @torch.inference_mode()
    def infer(feeds: Feeds) -> list[np.ndarray]:
        outputs = model(*(feeds[n] for n in module.input_names))
        return [o.float().cpu().numpy() for o in outputs]

    return Engine(name, infer, reruns_reference=not fp16)


def ort_engine(name: str, path: Path, device: str, threads: int) -> Engine:
    """An ONNX Runtime session over `path`, on CUDA when asked (and then checked to really be there)."""
    import onnxruntime as ort

    options = session_options(threads)
    providers = (["CUDAExecutionProvider"] if device == "cuda" else []) + ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=providers,
                                   disabled_optimizers=None if device == "cuda" else CPU_DISABLED_OPTIMIZERS)
    if device == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise HarnessError(f"{name}: ONNX Runtime has no CUDA provider here (install the onnxruntime-gpu extra, "
                           "not onnxruntime), so it cannot run on the GPU")
    inputs = [i.name for i in session.get_inputs()]

    def infer(feeds: Feeds) -> list[np.ndarray]:
        return session.run(None, {n: feeds[n].cpu().numpy() for n in inputs})

    return Engine(name, infer, artifact=path)


def tensorrt_engine(name: str, plan: Path, input_names, output_names, profile: dict, gpu) -> Engine:
    """The plan run by the trt backend's session (one profile: the -b / -s ranges)."""
    from nndf.backends.trt.runner import TrtSession

    session = TrtSession(plan, input_names, output_names, [profile], trt=gpu.trt, device=gpu.device,
                         role="model", flag="--backend tensorrt")

    def infer(feeds: Feeds) -> list[np.ndarray]:
        outputs = session.run({n: feeds[n].to(gpu.device) for n in input_names})
        return [outputs[n].float().cpu().numpy() for n in output_names]

    return Engine(name, infer, artifact=plan)
