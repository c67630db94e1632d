"""Triton Python-backend model that generates text with nndf's loop; copied verbatim as `<name>/1/model.py`.

Unlike the encoders' tokenizer model, this one runs nndf itself inside the server's Python: `nndf.load` on the
files beside it (the model's config, generation config and tokenizer in `hf/`, the exported decoder graph in
`decoder/`, what to load in `nndf.json`), so each request runs the same generation loop with the KV cache as
`run.py` does: greedy or beam search, batches with masks, EOS. The server's Python needs nndf installed with its
`onnxruntime` extra (in NVIDIA's container: a derived image with `pip install nndf[onnxruntime]`).

Inputs: TEXT (one prompt per batch row), optional MAX_NEW_TOKENS and NUM_BEAMS (one int32 per row; a request's
first row decides for the request). Output: GENERATED, the new text of each row (special tokens dropped).
"""

import json
import tempfile
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

SETTINGS_FILE = "nndf.json"


def _optional_int(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = int(tensor.as_numpy().reshape(-1)[0])
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


class TritonPythonModel:
    """One loaded model per instance; requests run one after another, each as one batch."""

    def initialize(self, args):
        import nndf

        version = Path(args["model_repository"]) / args["model_version"]
        settings = json.loads((version / SETTINGS_FILE).read_text())
        self.defaults = settings["defaults"]
        self._work = tempfile.TemporaryDirectory(prefix="nndf-triton-")
        self.model = nndf.load(settings["family"], settings["variant"], backend=settings["backend"],
                               torch_dir=str(version / "hf"), decoder_onnx=str(version / settings["graph"]),
                               working_dir=self._work.name, use_cache=settings["use_cache"],
                               threads=settings.get("threads"), device="cpu")

    def generate(self, texts, max_new_tokens, num_beams):
        """The new text of each prompt, as `run.py` generates it."""
        from nndf.actions.common import encode_prompts

        model = self.model
        ids, mask = encode_prompts(model.tokenizer, texts, use_mask=True, pad_side=model.architecture.pad_side)
        output = model.generate(ids, mask, max_new_tokens=max_new_tokens, num_beams=num_beams)
        return model.tokenizer.batch_decode(model.new_tokens(output, ids), skip_special_tokens=True)

    def execute(self, requests):
        """One response per request; a request that fails gets its error, the others still run."""
        responses = []
        for request in requests:
            try:
                text = pb_utils.get_input_tensor_by_name(request, "TEXT")
                if text is None:
                    raise ValueError("the TEXT input is missing: give one prompt per row")
                rows = text.as_numpy().reshape(-1)
                texts = [row.decode("utf-8") if isinstance(row, bytes) else str(row) for row in rows]
                max_new = _optional_int(request, "MAX_NEW_TOKENS", self.defaults["max_new_tokens"])
                replies = self.generate(texts, max_new, _optional_int(request, "NUM_BEAMS", self.defaults["num_beams"]))
                out = np.array([reply.encode("utf-8") for reply in replies], dtype=np.object_).reshape(-1, 1)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("GENERATED", out)]))
            except Exception as exc:  # noqa: BLE001 - the client gets the reason, the server keeps serving
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"generation failed: {exc}")))
        return responses

    def finalize(self):
        self._work.cleanup()
