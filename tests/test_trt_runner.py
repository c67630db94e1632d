"""The pure parts of the trt runner, without a GPU: engine tensor dtypes and I/O checks, profile choice, staging
buffers, the ping-pong KV cache, and the fp16 check's measures.
"""

from __future__ import annotations

import json

import pytest
import torch

from fake_tensorrt import DType, FakeEngine, fake_tensorrt
from nndf.backends import trt as trt_backend
from nndf.backends.trt import (
    FP16_LOGIT_BOUND, EngineIO, Fidelity, PingPongCache, Staging, check_engine_io, choose_profile, fp16_warning,
    fp32_cpu_copy, logit_fidelity, torch_dtype,
)
from nndf.errors import HarnessError, UsageError
from nndf.kvcache import KVCache, past_names, present_name
from nndf.spec import ShapeSpec
from test_trt_engines import NAMES, OUTPUTS, _shapes


def test_torch_dtypes_of_engine_tensors():
    assert torch_dtype(DType("INT32")) is torch.int32 and torch_dtype(DType("INT64")) is torch.int64
    assert torch_dtype(DType("HALF")) is torch.float16 and torch_dtype("DataType.FLOAT") is torch.float32
    with pytest.raises(HarnessError, match="tensor type \\(FP8\\)"):
        torch_dtype(DType("FP8"))


def _engine_spec(shapes: ShapeSpec, names=NAMES, outputs=OUTPUTS, int32=False, onnx=""):
    ints = "INT32" if int32 else "INT64"
    return {
        "onnx": str(onnx),
        "inputs": {n: ("FLOAT" if n.startswith("past_key_values.") else ints) for n in names},
        "outputs": {n: "FLOAT" for n in outputs},
        "profiles": json.loads(json.dumps(shapes.profiles(tuple(names)))),
    }


def test_engine_io_read_and_checked_against_the_settings():
    shapes = _shapes(batch_size=2, input_seq_len=8, output_seq_len=4)
    io = EngineIO.read(FakeEngine(_engine_spec(shapes, int32=True)), fake_tensorrt())
    assert io.inputs["input_ids"] is torch.int32 and io.inputs["past_key_values.1.key"] is torch.float32
    assert list(io.outputs) == list(OUTPUTS) and len(io.profiles) == 2
    assert io.profiles[1]["past_key_values.0.key"] == ((2, 2, 1, 16), (2, 2, 11, 16), (2, 2, 11, 16))
    required = shapes.profiles(NAMES)
    check_engine_io(io, NAMES, OUTPUTS, required, "e.engine")
    check_engine_io(io, NAMES, OUTPUTS, _shapes(batch_size=2, input_seq_len=4, output_seq_len=2).profiles(NAMES),
                    "e.engine")  # shorter sequences fit in the same engine
    with pytest.raises(UsageError, match=r"e.engine has no optimization profile for the context step of these "
                                         r"settings: input_ids needs 4x1..4x8 and the engine's profiles allow "
                                         r"2x1..2x8, 2x1..2x1"):
        check_engine_io(io, NAMES, OUTPUTS, _shapes(batch_size=4, input_seq_len=8, output_seq_len=4).profiles(NAMES),
                        "e.engine")
    with pytest.raises(UsageError, match="generation step of these settings: attention_mask needs 2x2..2x20 and "
                                         "the engine's profiles allow 2x1..2x8, 2x2..2x12"):
        check_engine_io(io, NAMES, OUTPUTS, _shapes(batch_size=2, input_seq_len=8, output_seq_len=12).profiles(NAMES),
                        "e.engine")
    with pytest.raises(UsageError, match="does not have the decoder's inputs and outputs"):
        check_engine_io(io, NAMES[:4], OUTPUTS[:1], required, "e.engine")


def test_choose_profile_context_then_generation():
    shapes = _shapes(batch_size=2, input_seq_len=8, output_seq_len=4)
    profiles = tuple({k: tuple(map(tuple, v)) for k, v in p.items()} for p in shapes.profiles(NAMES))
    kv = lambda n: {name: (2, 2, n, 16) for name in past_names(2)}
    context = {"input_ids": (2, 5), "attention_mask": (2, 5), "position_ids": (2, 5), "logits_to_keep": (1,), **kv(0)}
    step = {"input_ids": (2, 1), "attention_mask": (2, 6), "position_ids": (2, 1), "logits_to_keep": (1,), **kv(5)}
    assert choose_profile(profiles, context) == 0
    assert choose_profile(profiles, step, current=0) == 1
    assert choose_profile(profiles, step, current=1) == 1
    assert choose_profile(profiles, context, current=1) == 0
    with pytest.raises(HarnessError, match=r"no optimization profile of the engine accepts this step's shapes "
                                           r"\(input_ids \(3, 1\), past_key_values.0.key \(2, 2, 5, 16\)\)"):
        choose_profile(profiles, dict(step, input_ids=(3, 1)))


def test_staging_casts_and_keeps_addresses():
    staging = Staging(torch.device("cpu"))
    ids = torch.arange(6).view(2, 3)[:, 1:]  # int64, not contiguous
    staged = staging.stage("input_ids", ids, torch.int32)
    assert staged.dtype is torch.int32 and staged.is_contiguous() and torch.equal(staged.long(), ids)
    base = staged.data_ptr()
    for width in (1, 2, 3, 4):  # the mask grows by one per step: the buffer grows geometrically, rarely
        staging.stage("attention_mask", torch.ones(2, width, dtype=torch.long), torch.int64)
    ptrs = {staging.stage("attention_mask", torch.ones(2, w, dtype=torch.long), torch.int64).data_ptr()
            for w in (1, 2, 3, 4)}
    assert len(ptrs) == 1 and staging.stage("input_ids", ids[:1], torch.int32).data_ptr() == base
    empty = staging.view("past", (2, 2, 0, 16), torch.float32)
    fallback = torch.zeros(1)
    assert empty.shape == (2, 2, 0, 16) and trt_backend.tensor_address(empty, fallback) == fallback.data_ptr()
    assert trt_backend.tensor_address(staged, fallback) == staged.data_ptr()


def _fake_step(past: dict, new: dict, targets: dict | None):
    """What the engine does with the cache: present = concat(past, new), written into `targets` when given."""
    outputs = {}
    for i, name in enumerate(past_names(len(past) // 2)):
        layer, kind = name.split(".")[1:]
        present = torch.cat([past[name], new[name]], dim=2)
        key = present_name(int(layer), kind)
        if targets is not None:
            targets[key].copy_(present)
            outputs[key] = targets[key]
        else:
            outputs[key] = present
    return outputs


def test_ping_pong_cache_matches_kvcache_without_copies_or_allocation():
    torch.manual_seed(0)
    layers, rows, heads, dim, max_len = 2, 3, 2, 4, 10
    ours = PingPongCache(layers, rows, heads, dim, max_len)
    reference = KVCache(layers, rows, heads, dim, max_len)
    storage = ours.storage
    bases = set()
    for step, new_tokens in enumerate([4, 1, 1, 1, 1, 1]):
        pasts = ours.past_feeds()
        assert all(t.shape == (rows, heads, ours.length, dim) and t.is_contiguous() for t in pasts.values())
        bases.add(pasts["past_key_values.0.key"].storage_offset())
        new = {n: torch.randn(rows, heads, new_tokens, dim) for n in past_names(layers)}
        targets = ours.present_targets(ours.length + new_tokens)
        outputs = _fake_step(pasts, new, targets)
        assert all(outputs[n].data_ptr() == targets[n].data_ptr() for n in outputs)
        ours.store(outputs, ours.length + new_tokens)
        reference.store(_fake_step(reference.past_feeds(), new, None), reference.length + new_tokens)
        if step == 3:
            order = torch.tensor([2, 0, 0])
            ours.reorder(order)
            reference.reorder(order)
        assert ours.length == reference.length
        for name, value in reference.past_feeds().items():
            assert torch.equal(ours.past_feeds()[name], value)
    assert ours.storage is storage and len(bases) == 2  # two buffers, used alternately
    assert ours.owns(ours.past_feeds()) and not ours.owns(reference.past_feeds())
    with pytest.raises(HarnessError, match="the KV cache holds 10 positions and a step needs 11"):
        ours.present_targets(11)


def test_ping_pong_cache_copies_presents_from_elsewhere_and_reuses_storage():
    cache = PingPongCache(1, 2, 1, 2, 5)
    present = {"present.0.key": torch.ones(2, 1, 3, 2), "present.0.value": torch.full((2, 1, 3, 2), 2.0)}
    cache.store(present, 3)
    assert cache.length == 3 and torch.equal(cache.past_feeds()["past_key_values.0.value"], present["present.0.value"])
    again = PingPongCache(1, 2, 1, 2, 4, storage=cache.storage)
    assert again.storage is cache.storage and again.length == 0
    bigger = PingPongCache(1, 2, 1, 2, 40, storage=cache.storage)
    assert bigger.storage is not cache.storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_cache_buffer_starts_256_byte_aligned(dtype):
    """TensorRT wants 256-byte aligned addresses: an odd rows x heads x length with head size 64 in fp16 put every
    other buffer at 128 bytes before the buffers were padded."""
    cache = PingPongCache(2, 3, 1, 64, 7, dtype=dtype)
    base = cache.storage.data_ptr()
    cache.store({name.replace("past_key_values", "present"): torch.zeros(3, 1, 5, 64, dtype=dtype)
                 for name in cache.names}, 5)
    views = [*cache.past_feeds().values(), *cache.present_targets(6).values()]
    assert len(views) == 8 and all((v.data_ptr() - base) % 256 == 0 for v in views)


def test_fidelity_and_fp16_warning():
    expected = torch.tensor([[[10.0, -2.0, 3.0], [0.0, 1.0, -20.0]]])
    close = logit_fidelity([(expected + 0.05, expected)])
    assert close.max_abs_diff == pytest.approx(0.05, abs=1e-6) and close.scale == 20.0 and close.top1_agreement == 1.0
    assert close.relative == pytest.approx(0.0025, abs=1e-7) and fp16_warning(close) is None
    far = logit_fidelity([(expected * torch.tensor([1.0, 1.0, 4.0]), expected)])
    assert far.top1_agreement == 0.5 and far.relative > FP16_LOGIT_BOUND
    assert fp16_warning(far) == (
        "warning: the fp16 engine's logits differ from fp32 PyTorch by up to 60 (300.00% of the logits' scale 20, "
        "bound 1%); top-1 agreement 50.0% over 2 positions: prefer the fp32 engine for accuracy")
    assert Fidelity(**{k: v for k, v in far.as_dict().items() if k in ("max_abs_diff", "scale", "top1_agreement",
                                                                        "positions")}) == far


def test_fp32_cpu_copy_keeps_tied_weights(tiny_gpt2_dir):
    from transformers import AutoModelForCausalLM

    half = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float16)
    copy32 = fp32_cpu_copy(half)
    assert next(copy32.parameters()).dtype is torch.float32 and next(half.parameters()).dtype is torch.float16
    assert copy32.lm_head.weight is copy32.transformer.wte.weight
    assert torch.equal(copy32.transformer.wte.weight, half.transformer.wte.weight.float())
