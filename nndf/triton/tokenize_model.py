"""Triton Python-backend model that tokenizes text for an encoder; copied verbatim as `<name>_tokenize/1/model.py`.

It runs inside Triton's Python backend stub, not inside nndf: it imports nothing from this package, and needs only
numpy and transformers in the server's Python (in NVIDIA's container: a derived image with `pip install
transformers`). Which tensors it returns, and their dtypes, come from the model's own config.pbtxt outputs, so the
config written by nndf.triton.repository is the single place that names the engine's inputs.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer, PreTrainedTokenizerFast

TOKENIZER_FOLDER = "tokenizer"
MIN_LENGTH = "min_length"


def load_as_saved(folder: Path):
    """The tokenizer saved in `folder`, tokenizing as it did when saved. AutoTokenizer rebuilds some classes
    (BERT's) from their vocabulary and config, which drops what was changed in the tokenizer's pipeline before it
    was saved: sentence-transformers lowercases the texts of a model whose `do_lower_case` asks it by putting a
    Lowercase step in front of a cased tokenizer's normalizer, and a reload by class would serve that model cased.
    tokenizer.json holds the pipeline itself, so where it is present the tokenizer is built from it, with the
    input names the class gives."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if not (folder / "tokenizer.json").is_file():
        return tokenizer
    return PreTrainedTokenizerFast.from_pretrained(str(folder), model_input_names=tokenizer.model_input_names)


class TritonPythonModel:
    """One tokenizer per model instance; each request's rows are padded to that request's longest row. The config's
    string inputs are one text per row (TEXT), or two tokenized as a pair (QUESTION and CONTEXT, in that order)."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.texts = [tensor["name"] for tensor in config["input"]]
        # the fewest tokens the model takes (a TensorRT plan's profile minimum): shorter rows are padded up to it
        self.min_length = int(config.get("parameters", {}).get(MIN_LENGTH, {}).get("string_value", 1))
        self.outputs = {out["name"]: pb_utils.triton_string_to_numpy(out["data_type"]) for out in config["output"]}
        folder = Path(args["model_repository"]) / args["model_version"] / TOKENIZER_FOLDER
        self.tokenizer = load_as_saved(folder)
        missing = [name for name in self.outputs if name not in self.tokenizer.model_input_names]
        if missing:
            raise ValueError(f"the tokenizer in {folder} produces {self.tokenizer.model_input_names}, not {missing}")

    def tokenize(self, texts, pairs=None):
        """{output name: array[batch, seq]} for a list of strings (and the second strings of pairs), as the engine's
        config wants them."""
        encoded = self.tokenizer(texts, pairs, padding=True, truncation=True, return_tensors="np")
        if encoded["input_ids"].shape[1] < self.min_length:  # every row is shorter, so max_length cuts none
            encoded = self.tokenizer(texts, pairs, padding="max_length", max_length=self.min_length, truncation=True,
                                     return_tensors="np")
        return {name: np.ascontiguousarray(encoded[name], dtype=dtype) for name, dtype in self.outputs.items()}

    def execute(self, requests):
        """One response per request; a request that cannot be tokenized gets an error, the others still run."""
        responses = []
        for request in requests:
            try:
                columns = [[row.decode("utf-8") if isinstance(row, bytes) else str(row) for row in
                            pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)]
                           for name in self.texts]
                tensors = [pb_utils.Tensor(name, array) for name, array in self.tokenize(*columns).items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # noqa: BLE001 - the client must get the reason, the server must keep serving
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tokenization failed: {exc}")))
        return responses
