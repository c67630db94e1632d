"""Test examples, one per registered family (as vLLM keeps a registry of examples beside its model registry).

Each is a tiny config of the family's architecture with the quirks that matter switched on (OPT's embedding
projection, GPT-Neo's local attention with a window shorter than the test sequences, partial rotary for
GPT-NeoX and GPT-J), small enough to build with random weights in a fraction of a second.

Layers: two where a family's layers differ from one another (GPT-Neo's and Gemma 2's global and local layers
alternate) and in the examples that prove the per-layer plumbing of every graph layout (GPT-2, BLOOM, Llama: each
layer's past and present tensors, or its shared buffer, bound to the right inputs); one elsewhere, since what is
a family's own is in every layer alike. Why: an export's time grows with its layers (a tiny Qwen2's 13-16 s with
two, 8.6-8.8 s with one, measured here), and the family tests export each family three ways; the suite must stay
under 15 minutes on 2 cores.

Encoder-decoder families have more than one architecture behind one family name (T5 and Flan-T5, BART and
mBART); `SEQ2SEQ_EXAMPLES` holds one example of each, with the family it runs under.
"""

from __future__ import annotations

FAMILY_EXAMPLES: dict[str, dict] = {
    # GPT-2's is conftest's tiny GPT-2 (the vocabulary of GPT-2's tokenizer): the same folder, so the same exports
    "GPT2": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=50257,
                 bos_token_id=50256, eos_token_id=50256),
    "GPTNeo": dict(model_type="gpt_neo", num_layers=2, num_heads=2, hidden_size=32, max_position_embeddings=128,
                   attention_types=[[["global", "local"], 1]], window_size=8, vocab_size=1000, bos_token_id=999,
                   eos_token_id=999),
    "GPTNeoX": dict(model_type="gpt_neox", num_hidden_layers=1, num_attention_heads=2, hidden_size=32,
                    intermediate_size=64, rotary_pct=0.25, max_position_embeddings=128, vocab_size=1000,
                    bos_token_id=0, eos_token_id=0),
    "GPTJ": dict(model_type="gptj", n_layer=1, n_head=2, n_embd=32, rotary_dim=8, n_positions=128, vocab_size=1000,
                 tie_word_embeddings=False, bos_token_id=999, eos_token_id=999),
    "CerebrasGPT": dict(model_type="gpt2", n_layer=1, n_head=2, n_embd=32, n_inner=128, n_positions=128,
                        vocab_size=50257, bos_token_id=50256, eos_token_id=50256),
    "OPT": dict(model_type="opt", num_hidden_layers=1, num_attention_heads=2, hidden_size=32, ffn_dim=64,
                word_embed_proj_dim=16, do_layer_norm_before=False, max_position_embeddings=128, vocab_size=1000,
                bos_token_id=2, eos_token_id=2, pad_token_id=1),
    "BLOOM": dict(model_type="bloom", n_layer=2, n_head=2, hidden_size=32, vocab_size=1000, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3),
    # Llama-class decoders: grouped-query attention (KV heads < heads) everywhere. Llama: llama3 rope scaling whose
    # original length (16) the test sequences cross, a tied head (SmolLM2, Llama 3.2); weights drawn wide (0.2)
    # enough that positions steer attention (at 0.02 the scaling moves no argmax: tests/test_family_quirks.py).
    "Llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=128, vocab_size=1000, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=16),
                  tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2),
    # multi-query attention (one KV head), a sliding window (6) shorter than the test prompts (10), an untied head
    "Mistral": dict(model_type="mistral", num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128, sliding_window=6,
                    vocab_size=1000, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # q/k/v biases (drawn non-zero: CONSTANTS_DRAWN), tied head
    "Qwen2": dict(model_type="qwen2", num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=128, vocab_size=1000, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2),
    # q/k norms, head_dim (16) other than width / heads (8), untied head
    "Qwen3": dict(model_type="qwen3", num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=64, max_position_embeddings=128, vocab_size=1000,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # fused qkv and gate_up projections, partial rotary (0.75: 6 of 8 frequency pairs), longrope whose original
    # length (16) the test sequences cross: short and long factors, and generate()'s cache restart between them;
    # weights drawn wide, as Llama's. Phi-3's and Gemma's vocabularies hold GPT-2's tokenizer's ids, so that LAMBADA
    # scores on their family exports (tests/test_families.py) with no export of their own
    "Phi3": dict(model_type="phi3", num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, max_position_embeddings=128, original_max_position_embeddings=16,
                 partial_rotary_factor=0.75, vocab_size=50272, tie_word_embeddings=False, initializer_range=0.2,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                   long_factor=[1.5, 3.0, 6.0, 12.0, 24.0, 48.0])),
    # Gemma 2: scaled embeddings, head_dim (16) other than width / heads (8), local (window 6 < prompt) and global
    # layers alternating, soft-capped attention scores and logits with caps small enough to bite at these weights
    "Gemma": dict(model_type="gemma2", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=128,
                  sliding_window=6, query_pre_attn_scalar=16, attn_logit_softcapping=1.0,
                  final_logit_softcapping=1.0, initializer_range=0.2, vocab_size=50272, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0),
}

# Families whose example is another family's architecture and config (Cerebras-GPT is GPT-2's architecture, model
# type gpt2, at other sizes): the same graph, exported the same way. Tests of a graph's other exports (without cache,
# the growing layout TensorRT builds from) run on the other family's example alone; frameworks and the default onnxrt
# export still run under the family's own name.
SAME_GRAPH_AS = {"CerebrasGPT": "GPT2"}

# Families whose graph without cache is tested on another family's example alone: they build the attention mask and
# positions of a cache-less pass as Llama does (a causal mask, rotary angles from the position ids), which Llama's
# cache-less graph proves; what is their own (GPT-NeoX's partial and GPT-J's interleaved rotary, Qwen2's q/k/v
# biases, Qwen3's q/k norms) is in every layer of their cached graphs, which the onnxrt and trt tests run, prompt
# pass included. Why: each such export is about 16 s of the suite, which must stay under 15 minutes on 2 cores.
CACHELESS_GRAPH_AS = {"GPTNeoX": "Llama", "GPTJ": "Llama", "Qwen2": "Llama", "Qwen3": "Llama"}

# Families whose tiny models get random biases and norm weights (conftest.draw_constants): Qwen2's q/k/v biases,
# Qwen3's q/k norms and Gemma's (1 + weight) norms would otherwise be identities at initialisation.
CONSTANTS_DRAWN = {"Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Gemma"}

_T5 = dict(model_type="t5", d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2,
           vocab_size=1000, relative_attention_num_buckets=8, relative_attention_max_distance=16, n_positions=128,
           decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
_BART = dict(model_type="bart", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=1000,
             max_position_embeddings=128, bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
             forced_eos_token_id=2)

SEQ2SEQ_EXAMPLES: dict[str, tuple[str, dict]] = {
    # relative attention buckets (8 buckets, distance 16: the test sequences cross both), ReLU, tied scaled head
    "t5": ("T5", _T5),
    # T5 v1.1: gated GELU feed-forward; transformers 5 reads tie_word_embeddings=False as no scaling of the
    # decoder's output before the (tied) head
    "flan-t5": ("T5", dict(_T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    # learned positions with BART's offset of 2, post-norm layers; no repeated 2-grams from the generation rules
    "bart": ("BART", dict(_BART, no_repeat_ngram_size=2)),
    # pre-norm layers, final layer norms, scaled embeddings; the target language forced as the first token
    "mbart": ("BART", dict(_BART, model_type="mbart", normalize_before=True, add_final_layer_norm=True,
                           scale_embedding=True, forced_bos_token_id=250 % 1000)),
}

FAMILY_EXAMPLES.update({"T5": _T5, "BART": SEQ2SEQ_EXAMPLES["bart"][1]})

# BLIP: a ViT over 32 x 32 images in 8 x 8 patches (17 encoder positions) and a 2-layer BERT text decoder with BERT's
# real uncased vocabulary size and BLIP's special ids ([DEC] 30522 starts, [SEP] 102 ends, [PAD] 0), so that the
# offline BERT tokenizer and the processor's text prefixes fit. Weights drawn wide enough for the images to steer
# the captions (vision 0.02: the hub config's 1e-10 makes every image alike; text 0.2: at 0.02 the cross-attention
# moves the logits by under 1%, and both photos get one caption), so that the parity tests see the images.
BLIP_EXAMPLE = dict(
    model_type="blip",
    text_config=dict(vocab_size=30524, hidden_size=32, encoder_hidden_size=48, intermediate_size=64,
                     num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=30522,
                     eos_token_id=2, sep_token_id=102, pad_token_id=0, initializer_range=0.2),
    vision_config=dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2,
                       image_size=32, patch_size=8, initializer_range=0.02),
)
FAMILY_EXAMPLES["BLIP"] = BLIP_EXAMPLE
