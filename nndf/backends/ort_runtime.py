"""ONNX Runtime itself: importing it with an error that says which extra to install, and the `SessionOptions` every
session of ours starts from (the onnxrt backend's, convert_model's checks).

Why the thread pool stops spinning at the end of each run (`session.force_spinning_stop`): by default ONNX Runtime's
intra-op worker threads keep spinning on their cores for about 100 ms after `run` returns, waiting for more work.
Whatever runs next on those cores pays for it: another session (an encoder-decoder's encoder and decoder, BLIP's
vision encoder, `chat --compare`, `benchmark` with several backends), PyTorch, or another process. Measured on the
2-core Xeon (GPT-2 small, 64-token prompt, `bench/README.md`, 2026-11-29): a prefill right after another session's
run took 105-121 ms against 65-82 ms after its own, and 73-83 ms either way with spinning stopped. The next run
wakes the threads again, which costs a decode step nothing measurable; the threads still spin between the
operators of one run, where it pays.

Why CPU sessions may leave residual Adds and LayerNorms apart (`CPU_DISABLED_OPTIMIZERS`): ONNX Runtime's CPU
kernel for `SkipLayerNormalization` is 3-5x slower than the `Add` and `LayerNormalization` it fuses (64 rows of
768, 2 threads: 170 against 51 us; one thread 330 against 64), and its `SkipLayerNormFusion` makes one at load
wherever it finds the pair in a BERT-like graph: all-MiniLM-L6-v2's 12 cost 4.4 ms of a 30 ms call at one thread,
against 1.2 ms for the pairs left apart (measured 2026-11-29). Every CPU session of ours is made without it:
the onnxrt backend's (BART's post-norm layers, BLIP's text decoder and the last norm of a decoder-only graph are
what it would fuse there; bart-base batch 4: first token 0.968x, decode step 0.986x with it off) and
convert_model's. It also leaves T5's RMS norms apart from their Adds, where fused and apart are as fast
(t5-small batch 4: within the noise); our Llama-class graphs come fused from the exporter. On a GPU the
fused kernels stay.
"""

from __future__ import annotations

from nndf.errors import HarnessError

STOP_SPINNING = "session.force_spinning_stop"
CPU_DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]  # for `InferenceSession(disabled_optimizers=...)` on the CPU


def ort_module():
    try:
        import onnxruntime
    except ImportError:
        raise HarnessError(
            "the onnxrt backend needs ONNX Runtime: pip install -e '.[onnxruntime]' (CPU) or "
            "'.[onnxruntime-gpu]' (CUDA), never both"
        ) from None
    return onnxruntime


def ort_version() -> tuple[int, int]:
    """The installed ONNX Runtime's (major, minor), for what differs between its versions and cannot be asked of it
    (a kernel that kills the process on some input)."""
    import re

    major, minor = (int(part) for part in re.findall(r"\d+", ort_module().__version__)[:2])
    return major, minor


def session_options(threads: int | None = None):
    """Fresh `SessionOptions`: every graph optimization, `threads` intra-op threads where given (else ONNX Runtime's
    one per physical core), and the thread pool's spinning stopped when a run returns (above)."""
    ort = ort_module()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry(STOP_SPINNING, "1")
    return options
