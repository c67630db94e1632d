"""The onnxrt shared-buffer KV layout (nndf.export.fused_attention): GroupQueryAttention writing one whole-length
buffer per layer in place. Every decoder family's tiny model against Hugging Face `generate()` (batch 1, a batch
of equal lengths, a left-padded batch; greedy and beam search), the buffers really written in place, quantized
graphs on the layout, and the families that cannot have it falling back to the growing layout with the reason."""

from __future__ import annotations

import pytest
import torch

import nndf
from conftest import decoder_only_families, dump_optimized_graph
from nndf.actions.common import describe
from nndf.backends import BackendOptions
from nndf.errors import UsageError
from nndf.export.attention_inputs import kernel_reads_query_seqlens
from nndf.export.fused_attention import layout_refusal
from nndf.export.screened_head import PREFIX
from nndf.kvcache import past_name
from test_family_parity import _prompts
from test_generation_parity import _batch


def _shared(family, family_dirs, work, **kwargs):
    return nndf.load(family, backend="onnxrt", torch_dir=str(family_dirs[family]), working_dir=str(work),
                     device="cpu", kv_layout="shared", **kwargs)


def _batches():
    padded = _prompts()
    single = (padded[0][1:2, 6:], torch.ones(1, 4, dtype=torch.long))
    equal = (padded[0][:2], torch.ones(2, 10, dtype=torch.long))
    return {"batch 1": single, "equal lengths": equal, "left-padded": padded}


@pytest.mark.parametrize("family", decoder_only_families())
def test_shared_layout_tokens_equal_hf_generate(family, family_dirs, onnx_work_dir):
    m = _shared(family, family_dirs, onnx_work_dir)
    refusal = layout_refusal(m.loaded.model_class)
    session = m.decoder.session
    if refusal is not None:  # ALiBi (BLOOM), GPT-Neo's own attention: the growing graph, and --info says why
        assert session.layout == "growing"
        assert session.info_notes[0].startswith("KV layout: growing") and "attention interface" in session.info_notes[0]
    else:
        assert session.layout == "shared"
        assert session.info_notes[0].startswith("KV layout: shared")
    # a result's context (--info, --json) names the layout the graph has, not the one asked for
    assert describe(m)["backend_options"]["kv_layout"] == session.layout
    # ... each row's own where a table has several backends (the first one's told nothing of the others)
    backends = describe(nndf.load(family, backend="frameworks", loaded=m.loaded), m)["backends"]
    assert "kv_layout" not in backends["frameworks"] and backends["onnxrt"]["kv_layout"] == session.layout
    for name, (ids, mask) in _batches().items():
        for num_beams in (1, 3):
            ours = m.generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
            reference = m.hf_generate(ids, mask, max_new_tokens=12, num_beams=num_beams)
            assert torch.equal(ours, reference), f"{family} {name} beams={num_beams}"
    ids, _ = _batch([17], vocab=1000, seed=5)
    with torch.no_grad():
        expected = m.loaded.model(ids).logits
    assert float((m.logits(ids) - expected).abs().max()) < 1e-4


def test_buffers_are_written_in_place(family_dirs, onnx_work_dir):
    """After a step, the cache's own buffers hold the keys and values the growing graph returns as presents: the
    graph wrote them there (the presents are bound to the pasts), and a decode step appends to them. Positions of
    left padding are left out: no query attends to them, and what a layer computes there differs between the two
    attentions (a padding query that sees no key)."""
    shared = _shared("Llama", family_dirs, onnx_work_dir)
    growing = nndf.load("Llama", backend="onnxrt", loaded=shared.loaded, working_dir=str(onnx_work_dir),
                        kv_layout="growing")
    ids, mask = _prompts()
    state = shared.decoder.start(ids, mask, 1)
    caches = {m: m.decoder.new_cache(3, 16) for m in (shared, growing)}
    for model, cache in caches.items():
        model.decoder.step(state, cache)
    state.append(torch.tensor([5, 6, 7]))
    for model, cache in caches.items():
        model.decoder.step(state, cache)
    buffers = caches[shared].arrays
    real = state.mask.bool()  # (rows, 11)
    for name, present in caches[growing].values.items():
        filled = torch.from_numpy(buffers[name][:, :, :11]).transpose(1, 2)[real]
        assert torch.allclose(filled, torch.from_numpy(present.numpy()).transpose(1, 2)[real], atol=1e-5), name
    assert caches[shared].past_feeds()[past_name(0, "key")].data_ptr() == buffers[past_name(0, "key")].ctypes.data


def test_beam_reorder_is_in_place(family_dirs, onnx_work_dir):
    cache = _shared("GPT2", family_dirs, onnx_work_dir).decoder.new_cache(3, 8)
    name = past_name(1, "value")
    before = cache.arrays[name]
    before[...] = torch.arange(3.0)[:, None, None, None].numpy()
    cache.length = 5
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.arrays[name] is before
    assert before[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert before[:, 0, 5:, 0].tolist() == [[0.0] * 3, [1.0] * 3, [2.0] * 3]  # past the filled part: untouched


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_graphs_keep_the_shared_layout(quantize, family_dirs, onnx_work_dir):
    """Quantization rewrites the MatMuls and leaves the attention node as it is: the same tokens as the growing
    layout's quantized graph, on prompts without padding. (With left padding they may differ, and neither is the
    more right: int8's dynamic quantization scales activations per tensor, padding positions included, and what a
    padding query computes differs between the two attentions, as it sees no key.)"""
    shared = _shared("GPT2", family_dirs, onnx_work_dir, quantize=quantize)
    growing = nndf.load("GPT2", backend="onnxrt", loaded=shared.loaded, working_dir=str(onnx_work_dir),
                        quantize=quantize, kv_layout="growing")
    assert shared.decoder.session.layout == "shared" and growing.decoder.session.layout == "growing"
    ids, mask = _batches()["equal lengths"]
    for num_beams in (1, 2):
        assert torch.equal(shared.generate(ids, mask, max_new_tokens=10, num_beams=num_beams),
                           growing.generate(ids, mask, max_new_tokens=10, num_beams=num_beams))


def test_given_graph_layout_read_from_the_graph(family_dirs, onnx_work_dir):
    """--decoder-onnx runs a shared-layout graph as such: the session reads the layout from the graph's nodes."""
    exported = _shared("GPT2", family_dirs, onnx_work_dir)
    given = nndf.load("GPT2", backend="onnxrt", loaded=exported.loaded, working_dir=str(onnx_work_dir),
                      decoder_onnx=str(exported.decoder.session.artifacts[0]))
    assert given.decoder.session.layout == "shared"
    ids, mask = _prompts()
    assert torch.equal(given.generate(ids, mask, max_new_tokens=6), exported.hf_generate(ids, mask, max_new_tokens=6))


def test_unknown_layout_is_refused():
    with pytest.raises(UsageError, match="--kv-layout"):
        BackendOptions(kv_layout="paged")


def test_default_layout_is_shared_and_info_says_so(family_dirs, onnx_work_dir):
    from nndf.actions.common import info_result

    m = nndf.load("GPT2", backend="onnxrt", torch_dir=str(family_dirs["GPT2"]), working_dir=str(onnx_work_dir),
                  device="cpu")
    assert m.decoder.session.layout == "shared"
    assert any(note.startswith("KV layout: shared") for note in info_result(m).notes)
    assert any(note.startswith("decoder huge pages: ") for note in info_result(m).notes)  # nndf.hugepages
    # its last layer runs past the attention on the kept rows (nndf.export.kept_rows), recorded with the export and
    # read back where a later load finds it built (`built_export`)
    again = nndf.load("GPT2", backend="onnxrt", torch_dir=str(family_dirs["GPT2"]), working_dir=str(onnx_work_dir))
    for model in (m, again):
        assert any(note.startswith("last layer: past its attention, only the rows whose logits are kept")
                   for note in info_result(model).notes)
    growing = nndf.load("GPT2", backend="onnxrt", loaded=m.loaded, working_dir=str(onnx_work_dir), kv_layout="growing")
    assert any(note.startswith("KV layout: growing") for note in info_result(growing).notes)
    assert growing.decoder.session.artifacts[0].parent != m.decoder.session.artifacts[0].parent  # two artifacts


def test_growing_layout_plain_run_still_agrees(family_dirs, onnx_work_dir):
    """The growing layout with plain `session.run` (numpy in and out, no binding): the same tokens as the default
    layout, so that both of the growing graph's paths stay covered now that the default binds shared buffers."""
    shared = _shared("GPT2", family_dirs, onnx_work_dir)
    growing = nndf.load("GPT2", backend="onnxrt", loaded=shared.loaded, working_dir=str(onnx_work_dir),
                        kv_layout="growing")
    growing.decoder.session.io_binding = False
    ids, mask = _prompts()
    for num_beams in (1, 2):
        assert torch.equal(growing.generate(ids, mask, max_new_tokens=6, num_beams=num_beams),
                           shared.generate(ids, mask, max_new_tokens=6, num_beams=num_beams))


def test_a_generation_binds_once_and_reuses_its_logits_buffer(family_dirs, onnx_work_dir):
    """A shared-layout generation keeps one IO binding (`SharedStep`, its cache's) for all its steps, and the session
    forgets the cache when it goes; from the second step the last position's logits are written into the binding's own buffer, and they
    equal what a fresh binding per step (the generic path) computes."""
    import gc

    m = _shared("GPT2", family_dirs, onnx_work_dir)
    session = m.decoder.session
    ids, _ = _batches()["equal lengths"]
    state, cache = m.decoder.start(ids, torch.ones_like(ids), 1), m.decoder.new_cache(2, 16)
    first = m.decoder.step(state, cache)
    step = cache.step
    state.append(first[:, -1].argmax(-1))
    second = m.decoder.step(state, cache)
    assert step.logits is not None and second.data_ptr() == step.logits[1].data_ptr()
    kept = second.clone()
    state.append(second[:, -1].argmax(-1))
    third = m.decoder.step(state, cache)
    assert third.data_ptr() == second.data_ptr() and cache.step is step

    generic = m.decoder.new_cache(2, 16)  # the same steps with the shared buffers given as tensors: no SharedStep
    tensors = {name: torch.from_numpy(array) for name, array in generic.arrays.items()}
    generic.past_feeds = lambda: dict(tensors)
    replay = m.decoder.start(state.tokens[:, :-2], torch.ones_like(state.tokens[:, :-2]), 1)
    m.decoder.step(replay, generic)
    replay.append(state.tokens[:, -2])
    assert torch.equal(m.decoder.step(replay, generic), kept)
    replay.append(state.tokens[:, -1])
    assert torch.allclose(m.decoder.step(replay, generic), third, atol=1e-5)
    assert generic.step is None  # fed as tensors: the generic path
    del cache, step
    gc.collect()
    assert list(session.shared_caches.values()) == [generic]


def test_a_decode_step_binds_only_what_changed(family_dirs, onnx_work_dir, monkeypatch):
    """A decode step rebinds the inputs that change (tokens, mask, position ids) and keeps `logits_to_keep` bound
    (the same tensor every step); the position ids of rows without padding are read from the decoder's range and
    equal the family's count over the mask, which padded rows still take."""
    m = _shared("GPT2", family_dirs, onnx_work_dir)
    ids, _ = _batches()["equal lengths"]
    state, cache = m.decoder.start(ids, torch.ones_like(ids), 1), m.decoder.new_cache(2, 16)
    assert state.unpadded
    for _ in range(2):  # the prompt, then the first decode step (its logits_to_keep differs from the prompt's)
        state.append(m.decoder.step(state, cache)[:, -1].argmax(-1))
    bound = []
    monkeypatch.setattr(cache.step.binding, "bind_cpu_input", lambda name, value: bound.append((name, value.copy())))
    m.decoder.step(state, cache)
    names = [name for name, _ in bound]
    assert sorted(names) == ["attention_mask", "input_ids", "position_ids"]
    positions = dict(bound)["position_ids"]
    assert positions.tolist() == m.spec.hooks.position_ids(state.mask, ids.shape[1] + 1).tolist() == [[11], [11]]

    padded_ids, padded_mask = _batches()["left-padded"]
    padded = m.decoder.start(padded_ids, padded_mask, 1)
    assert not padded.unpadded and m.decoder.start(padded_ids[:, -2:], padded_mask[:, -2:], 1).unpadded


def test_a_built_export_loads_without_the_models_code(family_dirs, onnx_work_dir):
    """Once a graph is exported, loading it again finds it from its settings and metadata alone: transformers'
    modeling code (1.5 s and 110 MB to import) and the exporter stay unimported, and the graph's layout and names
    are the built ones. A fresh process shows it."""
    import subprocess
    import sys

    built = _shared("GPT2", family_dirs, onnx_work_dir)
    session = built.decoder.session
    script = (
        "import sys, torch, nndf\n"
        f"m = nndf.load('GPT2', backend='onnxrt', torch_dir={str(family_dirs['GPT2'])!r}, "
        f"working_dir={str(onnx_work_dir)!r}, device='cpu')\n"
        "tokens = m.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5)\n"
        "s = m.decoder.session\n"
        "print(s.layout, str(s.artifacts[0]), list(s.input_names), tokens.tolist())\n"
        "print(sorted(n for n in ('transformers.modeling_utils', 'torch._dynamo', 'torch.onnx') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}).stdout.splitlines()
    expected = built.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5).tolist()
    assert out[0] == f"shared {session.artifacts[0]} {list(session.input_names)} {expected}"
    assert out[1] == "[]"


@pytest.mark.parametrize("family, fused", [("Llama", {"SkipSimplifiedLayerNormalization"}),
                                           ("Qwen3", {"SkipSimplifiedLayerNormalization"}),
                                           ("Qwen2", {"SkipSimplifiedLayerNormalization", "RotaryEmbedding"}),
                                           ("GPT2", set())])
def test_the_shared_graph_has_onnxruntimes_fused_kernels(family, fused, family_dirs, onnx_work_dir):
    """The shared layout's graph (ONNX Runtime's alone) carries its fused normalizations and rotary embeddings
    (nndf.export.ort_fusions; its tokens are checked against generate() above): no rotate-half (Neg) is left,
    sibling projections are one MatMul, and Llama's and Qwen3's attention rotates its queries and keys itself,
    Llama's taking its projection whole (nndf.export.attention_inputs); Qwen2's tiny heads of 8, which the kernel's
    rotary refuses, keep their RotaryEmbeddings. The growing graph, which TensorRT builds from, keeps the
    plain ops."""
    import onnx

    shared = _shared(family, family_dirs, onnx_work_dir)
    growing = nndf.load(family, backend="onnxrt", loaded=shared.loaded, working_dir=str(onnx_work_dir),
                        kv_layout="growing")

    def graph(model):
        return onnx.load(str(model.decoder.session.artifacts[0]), load_external_data=False).graph

    def ops(model) -> list[str]:  # the model's own (not the screened LM head's: tests/test_screened_head.py)
        return [node.op_type for node in graph(model).node if not node.name.startswith(PREFIX)]

    assert fused <= set(ops(shared))
    assert not set(ops(growing)) & (fused | {"SimplifiedLayerNormalization", "RotaryEmbedding"})
    if family != "GPT2":
        assert "Neg" not in ops(shared) and "Neg" in ops(growing)
    if family in ("Llama", "Qwen3"):
        layers = 2 if family == "Llama" else 1
        attention = [({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}, list(node.input[1:3]))
                     for node in graph(shared).node if node.op_type == "GroupQueryAttention"]
        if not kernel_reads_query_seqlens():  # ONNX Runtime before 1.32: rotated before the attention, as exported
            assert not any(attributes.get("do_rotary") for attributes, _ in attention)
            assert ops(shared).count("RotaryEmbedding") == 2 * layers
        else:  # the kernel rotates its own queries and keys (nndf.export.attention_inputs)
            assert [attributes["do_rotary"] for attributes, _ in attention] == [1] * layers
            assert "RotaryEmbedding" not in ops(shared)
            # Llama's projection goes in whole (no Split but the gate-up ones); Qwen3's queries and keys are its
            # normalized heads, merged, and its value the projection's third part
            assert all((parts == ["", ""]) == (family == "Llama") for _, parts in attention)
            assert ops(shared).count("Split") == layers * (1 if family == "Llama" else 2)
    if family == "Llama":  # 2 layers: only the mask's and the head's Transposes are left, none per layer; each
        # layer's query, key and value projections are one MatMul, and its gate and up projections another
        assert ops(shared).count("Transpose") < ops(growing).count("Transpose") - 8
        assert ops(shared).count("MatMul") == 2 * 4  # (qkv, o, gate-up, down) per layer (the LM head is screened)


def test_layer_norms_stay_apart_from_their_residual_add(family_dirs, onnx_work_dir, tmp_path, monkeypatch):
    """GPT-2's LayerNorms: the shared graph keeps each residual `Add` and `LayerNormalization` apart, and ONNX
    Runtime's optimizers do not fuse them into SkipLayerNormalization at load either, whose CPU kernel is the slower
    (nndf.export.ort_fusions); the graph ONNX Runtime optimized shows what it runs."""
    import onnx

    import nndf.backends.onnxrt as backend

    shared = _shared("GPT2", family_dirs, onnx_work_dir)
    graph = shared.decoder.session.artifacts[0]
    exported = {node.op_type for node in onnx.load(str(graph), load_external_data=False).graph.node}
    assert "LayerNormalization" in exported and "SkipLayerNormalization" not in exported
    optimized = tmp_path / "optimized.onnx"
    dump_optimized_graph(monkeypatch, backend, optimized)
    session = backend.OrtSession(graph, shared.decoder.session.input_names, shared.decoder.session.output_names)
    assert session.provider == "CPUExecutionProvider"
    ran = [node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node]
    assert "LayerNormalization" in ran and "SkipLayerNormalization" not in ran


def test_gpt2s_attention_takes_its_projection_whole_as_packed_qkv(family_dirs, onnx_work_dir):
    """GPT-2's one qkv projection: its GroupQueryAttention reads the projection's output as packed QKV (key and value
    inputs empty), with no Split copying it into three first (nndf.export.attention_inputs.pack_attention_inputs); its
    tokens against generate() are the parity tests'. Qwen2's tiny heads of 8 are rotated after their split (the
    kernel's rotary refuses them), so its nodes keep three inputs."""
    import onnx

    def attention(family):
        graph = onnx.load(str(_shared(family, family_dirs, onnx_work_dir).decoder.session.artifacts[0]),
                          load_external_data=False).graph
        made_by = {output: node.op_type for node in graph.node for output in node.output}
        return [(made_by.get(node.input[0]), list(node.input[1:3]))
                for node in graph.node if node.op_type == "GroupQueryAttention"]

    gpt2 = attention("GPT2")
    assert len(gpt2) == 2 and all(producer != "Split" and rest == ["", ""] for producer, rest in gpt2)
    assert all(rest[0] and rest[1] for _, rest in attention("Qwen2"))


def test_a_shared_graph_is_keyed_by_the_onnx_runtime_kernels_it_was_fused_for(family_dirs, monkeypatch):
    """The shared graph's fusions follow the installed ONNX Runtime (a GroupQueryAttention that rotates padded
    rows, a TopK over no rows): a working dir used under another version gets its own graph, rather than one that
    version refuses at load or dies in (ONNX Runtime 1.30's TopK over no rows)."""
    from nndf.export import onnx as export_onnx

    loaded = nndf.load("GPT2", torch_dir=str(family_dirs["GPT2"]), device="cpu").loaded
    shared, growing = (export_onnx.export_settings(loaded, True, layout) for layout in ("shared", "growing"))
    kernels = shared["onnxruntime_kernels"]
    for name, feature in (("topk_no_rows", "topk_takes_no_rows"), ("gqa_query_seqlens", "kernel_reads_query_seqlens")):
        monkeypatch.setattr(export_onnx, feature, lambda value=kernels[name]: not value)
        assert export_onnx.export_settings(loaded, True, "shared")["onnxruntime_kernels"][name] != kernels[name]
        assert export_onnx.export_settings(loaded, True, "growing") == growing  # TensorRT's graph: no contrib ops
        monkeypatch.undo()
