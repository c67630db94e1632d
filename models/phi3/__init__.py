"""Phi-3 (Microsoft): Phi-3-mini and -medium, Phi-3.5-mini, Phi-4-mini. The Llama architecture with fused
projections (one `qkv_proj`, one `gate_up_proj`), a sliding window on the 4k checkpoints, and on the long-context
ones `longrope` scaling: the rotary frequencies come from `short_factor` while the sequence is within
`original_max_position_embeddings` and from `long_factor` beyond it. transformers picks the set per forward pass
from the largest position id with a `torch.where`, which the ONNX export traces as it is (both sets in the graph,
the choice made per step), so every backend rotates each step's new positions as the PyTorch model does.

One quirk is generation, not the graph: Phi-3's own `generate()` drops its KV cache once, at the step where the
sequence first grows past `original_max_position_embeddings`, and recomputes the whole sequence (whose keys were
rotated with the short factors) with the long ones. `cache_restart_length` tells our loop to do the same.
"""

from __future__ import annotations

from pathlib import Path

from nndf.spec import FamilyHooks, ModelSpec, Variant


class Phi3Hooks(FamilyHooks):
    def cache_restart_length(self, config) -> int | None:
        """transformers' `Phi3ForCausalLM.prepare_inputs_for_generation`: the cache is dropped when the sequence
        reaches `original_max_position_embeddings` + 1 tokens with at most that many cached."""
        original = getattr(config, "original_max_position_embeddings", None)
        return int(original) if original is not None else None


_BASE = {"model_type": "phi3", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "vocab_size": 32064, "original_max_position_embeddings": 4096, "tie_word_embeddings": False,
         "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000, "attention_bias": False}
_MINI = dict(_BASE, num_hidden_layers=32, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
             intermediate_size=8192)

# microsoft/Phi-3.5-mini-instruct's config.json (one factor per pair of rotary dimensions: 3072 / 32 / 2 = 48).
_PHI35_LONGROPE = {
    "type": "longrope",
    "long_factor": [
        1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
        1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
        4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
        17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
        32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
        50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
        62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
        63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
        64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
        64.51000213623047, 64.52999877929688, 64.83999633789062],
    "short_factor": [
        1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
        1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
        1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
        1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
        1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
        2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
        2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
        2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
        2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
        2.749999523162842, 2.8399994373321533],
}

SPEC = ModelSpec(
    family="Phi3",
    description="Microsoft Phi-3 and Phi-3.5 (fused projections, longrope)",
    variants=(
        Variant.of("microsoft/Phi-3-mini-4k-instruct", "3.8B", _MINI, max_position_embeddings=4096,
                   sliding_window=2047, generation={"bos_token_id": 1, "eos_token_id": [32000, 32001, 32007],
                                                    "pad_token_id": 32000}),
        Variant.of("microsoft/Phi-3.5-mini-instruct", "3.8B", _MINI, max_position_embeddings=131072,
                   sliding_window=262144, rope_scaling=_PHI35_LONGROPE,
                   generation={"bos_token_id": 1, "eos_token_id": [32007, 32001, 32000], "pad_token_id": 32000}),
        Variant.of("microsoft/Phi-3-medium-4k-instruct", "14B", _BASE, num_hidden_layers=40, hidden_size=5120,
                   num_attention_heads=40, num_key_value_heads=10, intermediate_size=17920,
                   max_position_embeddings=4096, sliding_window=2047),
    ),
    backends=("frameworks", "onnxrt", "trt"),
    hooks=Phi3Hooks(),
    checkpoint_file=str(Path(__file__).with_name("checkpoint.toml")),
    default_tokenizer="microsoft/Phi-3-mini-4k-instruct",
)
