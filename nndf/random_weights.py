"""Random weights drawn as transformers draws them, without its slow way of drawing them (`--random-weights`).

`from_config` initialises most weights twice: each layer's constructor draws its own (nn.Linear's kaiming
uniform), then the model's `_init_weights` draws them again with the model's distributions, and some of those
are drawn a third time (GPT-2's scaled `c_proj`, T5's shared embedding, an LM head drawn and then tied to the
embedding). On the CPU, where one `normal_` pass over gpt2-large's 0.77 G parameters takes about 3 s, that made
`--random-weights` take about twice as long as drawing once (bench/random_weights.py, bench/README.md).

`build_random_model` keeps transformers as the authority on *what* to draw and does the drawing once:

1. the model is built under transformers' own `no_init_weights` on the target device in the final dtype: memory
   is allocated, nothing is drawn, and buffers computed in the constructors (rotary frequencies, causal masks,
   position ids) are real;
2. the model's own `initialize_weights` runs (so every family's `_init_weights` decides, sub-models such as
   BLIP's vision and text towers with their own configs) with transformers' init functions replaced by a
   recorder: each call becomes an `InitOp` (which function, which tensor, which arguments) instead of a draw;
3. of the ops on one tensor only those a later op does not overwrite survive (the second `c_proj` draw replaces
   the first; a padding row zeroed after its embedding's draw stays), and they run in `named_parameters`
   order, then buffers, every random one from ONE `torch.Generator` seeded with the seed, on the model's device;
4. tied weights are tied as `from_config` ties them (the LM head that will become the embedding is not drawn).

The result has the distributions of `from_config` (normal(0, initializer_range) for weight matrices and
embeddings, GPT-2's and T5's scaled ones, ones and zeros for norms and biases, Gemma's zero RMSNorm weights,
BLIP's per-tower ranges), the same buffers, and is bit-identical for a seed on a device; the numbers differ from
`from_config`'s (other order, one generator), which `DRAW_REVISION` in the weights' identity records.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

import torch

# Part of every random-weight model's identity (`LoadedModel.weights_id`, hence of every export's name). Bump when
# a change here draws other numbers for the same seed, so that an export of the old weights is never reused.
DRAW_REVISION = 2


@dataclass
class InitOp:
    """One call of a transformers init function, deferred: `function(tensor, *args, **kwargs)`."""

    name: str
    tensor: torch.Tensor
    args: tuple
    kwargs: dict

    @property
    def span(self) -> tuple[int, int]:
        """The elements of its storage the tensor reaches, as [start, end)."""
        start = self.tensor.storage_offset()
        extent = sum((size - 1) * stride for size, stride in zip(self.tensor.shape, self.tensor.stride()))
        return start, start + extent + 1 if self.tensor.numel() else start

    def covers(self, other: "InitOp") -> bool:
        """Whether this op writes every element `other` writes (so `other`, if earlier, is overwritten)."""
        start, end = self.span
        dense = self.tensor.numel() == end - start
        other_start, other_end = other.span
        return dense and start <= other_start and other_end <= end

    def run(self, generator: torch.Generator) -> None:
        """The call itself, a random one drawing from `generator`."""
        function = _function(self.name)
        function(self.tensor, *self.args, **self.kwargs, **({"generator": generator} if _draws(self.name) else {}))


def weight_bytes(auto_class, config, dtype: torch.dtype) -> int:
    """The bytes of the model's parameters (tied ones once) in `dtype`, from a build on the meta device: exact, and
    nothing is allocated (gpt-neox-20b's 20 G parameters take a second)."""
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():
        model = auto_class.from_config(config, dtype=dtype)
    model.tie_weights()  # as `build_random_model` does: a tied LM head is the embedding, not a second table
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in unique)


def check_memory(needed: int, device: str | torch.device, name: str) -> None:
    """One sentence before drawing weights that cannot fit where they go: otherwise the kernel's OOM killer ends the
    process with no message (gpt-neox-20b in fp32 is 82 GB)."""
    from nndf.errors import HarnessError
    from nndf.measure import available_host_memory

    device = torch.device(device)
    if device.type == "cuda":
        available, where = torch.cuda.mem_get_info(device)[0], "free on the GPU"
    else:
        available, where = available_host_memory(), "available on this machine"
    if available is not None and needed > available:
        raise HarnessError(f"the random weights of {name} take {needed / 1024**3:.1f} GiB and {available / 1024**3:.1f}"
                           f" GiB is {where}; choose a smaller --variant (python run.py list shows their sizes)")


def build_random_model(auto_class, config, *, dtype: torch.dtype, device: str | torch.device, seed: int):
    """`auto_class.from_config(config)` on `device` in `dtype`, its weights drawn once from one seeded generator."""
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        model = auto_class.from_config(config, dtype=dtype)
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if model.get_parameter(target) is not model.get_parameter(source):  # replaced by the source when tied
            model.get_parameter(target)._is_hf_initialized = True  # so not drawn (as from_pretrained does)
    ops = record_initialization(model)
    generator = torch.Generator(device=_device_of(model)).manual_seed(seed)
    with torch.no_grad():
        for op in surviving_in_order(ops, model):
            op.run(generator)
    model.tie_weights()
    return model


def record_initialization(model: torch.nn.Module) -> list[InitOp]:
    """The init functions the model's own `initialize_weights` calls, in its order, none of them run."""
    from transformers import initialization

    names = [*initialization.TORCH_INIT_FUNCTIONS, "copy_"]
    originals = {name: _function(name) for name in names}
    ops: list[InitOp] = []

    def recorder(name):
        def record(tensor, *args, **kwargs):
            if not getattr(tensor, "_is_hf_initialized", False):  # the guard transformers' own functions apply
                ops.append(InitOp(name, tensor, args, kwargs))
            return tensor
        return record

    try:
        for name in names:  # `initialize_weights` also routes torch.nn.init's functions through these
            setattr(initialization, name, recorder(name))
        model.initialize_weights()
    finally:
        for name, function in originals.items():
            setattr(initialization, name, function)
    return ops


def surviving_in_order(ops: list[InitOp], model: torch.nn.Module) -> list[InitOp]:
    """The ops no later op overwrites, grouped by tensor in `named_parameters` order then buffers (each tensor's
    ops in the order transformers called them). Ops on tensors outside the model come first, as recorded."""
    tensors = [*model.parameters(), *model.buffers()]
    rank = {}
    for index, tensor in enumerate(tensors):
        rank.setdefault(_storage(tensor), index)
    by_storage: dict[int, list[InitOp]] = {}
    for op in ops:
        kept = by_storage.setdefault(_storage(op.tensor), [])
        kept[:] = [earlier for earlier in kept if not op.covers(earlier)]
        kept.append(op)
    ordered = sorted(by_storage.items(), key=lambda item: rank.get(item[0], -1))
    return [op for _, kept in ordered for op in kept]


@cache
def _function(name: str):
    """transformers' init function `name` (read once, before any recorder could stand in for it)."""
    from transformers import initialization

    return getattr(initialization, name)


@cache
def _draws(name: str) -> bool:
    """Whether init function `name` is a random one (it takes a generator: normal_, trunc_normal_, xavier_...)."""
    return "generator" in inspect.signature(_function(name)).parameters


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
