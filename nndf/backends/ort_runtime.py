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
"""

from __future__ import annotations

from nndf.errors import HarnessError

STOP_SPINNING = "session.force_spinning_stop"


def ort_module():
    try:
        import onnxruntime
    except ImportError:
        raise HarnessError(
            "the onnxrt backend needs ONNX Runtime: pip install -e '.[onnxruntime]' (CPU) or "
            "'.[onnxruntime-gpu]' (CUDA), never both"
        ) from None
    return onnxruntime


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
