"""The exported decoder's last layer past its attention on the kept rows alone (nndf.export.kept_rows): the same
logits as the whole layer, and the layer's MLP, norms and residual see the kept rows only. The exported graphs'
parity with generate() on every family is tests/test_family_parity.py's and tests/test_kv_layout.py's."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny
from family_examples import FAMILY_EXAMPLES
from nndf.export.kept_rows import decoder_layers, last_layer_on_kept_rows, self_attention
from nndf.export.wrapper import DecoderWrapper
from nndf.registry import get_spec

# GPT-2 (Conv1D, a view to the input's shape after the layers), Llama (GQA, rotary, RMS norms), GPT-NeoX (parallel
# residual: both norms read the layer's input), OPT before and after its norms (opt-350m's attention reads the
# layer's input itself)
CASES = {
    "GPT2": ("GPT2", FAMILY_EXAMPLES["GPT2"]),
    "Llama": ("Llama", FAMILY_EXAMPLES["Llama"]),
    "GPTNeoX": ("GPTNeoX", dict(FAMILY_EXAMPLES["GPTNeoX"], num_hidden_layers=2)),
    "OPT-post-norm": ("OPT", FAMILY_EXAMPLES["OPT"]),
    "OPT-pre-norm": ("OPT", dict(FAMILY_EXAMPLES["OPT"], do_layer_norm_before=True, word_embed_proj_dim=32)),
}


def _model(tmp_path, family: str, config: dict):
    from transformers import AutoModelForCausalLM

    folder = build_tiny(tmp_path, family, config)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _step(wrapper: DecoderWrapper, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    positions = (torch.arange(ids.shape[1]).expand_as(ids),) if wrapper.with_position_ids else ()
    with torch.no_grad():
        return wrapper(ids, mask, *positions, keep)[0]


def _rows_past_attention(layer, attention, pre_attention) -> list[int]:
    """Records the rows each weighted module of `layer` outside its attention (and its first norm) computes."""
    seen = []
    skip = set(attention.modules()) | {layer, pre_attention}
    for module in layer.modules():
        if module not in skip and not list(module.children()) and list(module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[:-1].numel()))
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_last_layer_runs_past_its_attention_on_the_kept_rows(case, tmp_path):
    family, config = CASES[case]
    model = _model(tmp_path, family, config)
    hooks = get_spec(family).hooks
    layers = hooks.num_layers(model.config)
    wrapper = DecoderWrapper(model, layers, use_cache=False)
    ids = torch.randint(5, 900, (2, 9))
    last, every = torch.tensor([8]), torch.arange(9)
    whole_last, whole_every = _step(wrapper, ids, last), _step(wrapper, ids, every)
    layer = decoder_layers(model)[-1]
    before = hooks.pre_attention(layer)
    seen = _rows_past_attention(layer, self_attention(layer), before)
    with last_layer_on_kept_rows(model, layers, hooks.pre_attention) as trimmed:
        assert trimmed
        wrapper.keeps_rows = trimmed  # as the export sets it
        kept_last = _step(wrapper, ids, last)
        assert seen and set(seen) == {2 * 1}  # two rows, one position each
        seen.clear()
        kept_every = _step(wrapper, ids, every)
        assert set(seen) == {2 * 9}
    torch.testing.assert_close(kept_last, whole_last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept_every, whole_every, rtol=1e-5, atol=1e-5)
    seen.clear()
    _step(wrapper, ids, last)  # the hooks are gone after the export: the layer is whole again
    assert set(seen) == {2 * 9}


@pytest.mark.parametrize("family", ["BLOOM", "GPTNeo"])
def test_models_with_attention_of_their_own_are_exported_whole(family, tmp_path):
    """BLOOM's attention adds the residual itself, GPT-Neo's is a module of its own: the layer runs on every row."""
    model = _model(tmp_path, family, FAMILY_EXAMPLES[family])
    hooks = get_spec(family).hooks
    with last_layer_on_kept_rows(model, hooks.num_layers(model.config), hooks.pre_attention) as trimmed:
        assert not trimmed
