"""Test examples, one per registered family (as vLLM keeps a registry of examples beside its model registry).

Each is a tiny config of the family's architecture with the quirks that matter switched on (OPT's embedding
projection, GPT-Neo's local attention with a window shorter than the test sequences, partial rotary for
GPT-NeoX and GPT-J), small enough to build with random weights in a fraction of a second.
"""

from __future__ import annotations

FAMILY_EXAMPLES: dict[str, dict] = {
    "GPT2": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=1000,
                 bos_token_id=999, eos_token_id=999),
    "GPTNeo": dict(model_type="gpt_neo", num_layers=2, num_heads=2, hidden_size=32, max_position_embeddings=128,
                   attention_types=[[["global", "local"], 1]], window_size=8, vocab_size=1000, bos_token_id=999,
                   eos_token_id=999),
    "GPTNeoX": dict(model_type="gpt_neox", num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                    intermediate_size=64, rotary_pct=0.25, max_position_embeddings=128, vocab_size=1000,
                    bos_token_id=0, eos_token_id=0),
    "GPTJ": dict(model_type="gptj", n_layer=2, n_head=2, n_embd=32, rotary_dim=8, n_positions=128, vocab_size=1000,
                 tie_word_embeddings=False, bos_token_id=999, eos_token_id=999),
    "CerebrasGPT": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_inner=128, n_positions=128,
                        vocab_size=1000, bos_token_id=999, eos_token_id=999),
    "OPT": dict(model_type="opt", num_hidden_layers=2, num_attention_heads=2, hidden_size=32, ffn_dim=64,
                word_embed_proj_dim=16, do_layer_norm_before=False, max_position_embeddings=128, vocab_size=1000,
                bos_token_id=2, eos_token_id=2, pad_token_id=1),
    "BLOOM": dict(model_type="bloom", n_layer=2, n_head=2, hidden_size=32, vocab_size=1000, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3),
}
