"""ONNX Runtime's fused normalizations in the shared-layout decoder graph, by onnxscript's own rewrite rules.

Why: the exporter writes each RMSNorm as seven nodes (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul), a
pattern ONNX Runtime's load-time fusions do not recognise, so a SmolLM2-135M decode step ran 1530 nodes where GPT-2
small runs 388. At batch 1 every node costs its dispatch whatever its size, so a small or quantized model pays most.
onnxscript's `ort_fusions` rules (those `onnxscript.rewriter.ort_fusions.optimize_for_ort` applies, from the
exporter's own toolchain) turn each norm, with the residual Add before it, into ONNX Runtime's
SkipSimplifiedLayerNormalization (RMSNorm) or SkipLayerNormalization: 426 nodes fewer on SmolLM2.

Not applied: the attention rules (the attention already is GroupQueryAttention, nndf.export.fused_attention) and
the rotary embedding rules, which do not reach ONNX Runtime's RotaryEmbedding on our exports (the full rule matches,
but the cos/sin cache rule that makes the real kernel of its result does not, with or without onnxscript's shape
pre-optimization, and its intermediate function is then inlined back into the same small ops).
Only the shared layout gets them: its graph is ONNX Runtime's alone (contrib ops), where the growing graph is also
what TensorRT builds engines from. A rule that does not match leaves the graph as it is.
"""

from __future__ import annotations


def fuse_for_onnxruntime(model) -> dict[str, int]:
    """Apply the rules to an onnx_ir model in place, in `fuse_xformers`' order; how many times each applied."""
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import (fuse_skip_layer_normalization,
                                                                    fuse_skip_rms_normalization)

    rules = (("rms_normalization", fuse_rms_normalization), ("skip_layer_normalization", fuse_skip_layer_normalization),
             ("skip_rms_normalization", fuse_skip_rms_normalization))  # named as `fuse_xformers` reports them
    counts = {name: rule(model) for name, rule in rules}
    optimize(model)  # inlines what a rule left as an intermediate function, drops unused nodes
    return counts
