"""What `convert_model --task` exports: the PyTorch module behind each task, with flat tensor inputs and outputs.

As transformer-deploy does: `embedding` is a sentence-transformers model (its own modules: transformer, pooling,
normalisation, loaded by sentence-transformers itself, older folders of `0_Transformer/`, `1_Pooling/` included)
whose output is the sentence embedding, and whose own tokenizer is the one served; the other tasks are
transformers' Auto classes, whose output is the logits (`start_logits` and `end_logits` for question answering).
The inputs are the tokenizer's `model_input_names`, without `token_type_ids` for a model that has none
(`type_vocab_size` 0) or whose forward does not take them (DistilBERT).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import torch

from nndf.errors import HarnessError, UsageError


@dataclass(frozen=True)
class Task:
    name: str
    auto_class: str | None  # a transformers Auto class; None: a sentence-transformers model
    outputs: tuple[str, ...]
    per_token: bool  # the outputs keep the sequence axis (token classification, question answering, logits)
    text_inputs: tuple[str, ...] = ("TEXT",)  # what the Triton ensemble takes: one text, or a pair tokenized together


TASKS: dict[str, Task] = {
    "classification": Task("classification", "AutoModelForSequenceClassification", ("output",), False),
    "embedding": Task("embedding", None, ("output",), False),
    "token-classification": Task("token-classification", "AutoModelForTokenClassification", ("output",), True),
    "question-answering": Task("question-answering", "AutoModelForQuestionAnswering",  # transformer-deploy's names
                               ("start_logits", "end_logits"), True, ("QUESTION", "CONTEXT")),
    "text-generation": Task("text-generation", "AutoModelForCausalLM", ("output",), True),
}


class TaskModule(torch.nn.Module):
    """`forward(*inputs)` in `input_names` order -> the task's outputs as a tuple: what the exporter traces and
    the reference every backend is compared with."""

    def __init__(self, model: torch.nn.Module, task: Task, input_names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.task = task
        self.input_names = input_names
        self.graph_inputs = input_names  # the exported graph's (set by the export: it drops inputs left unused)
        self.eval()

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features = dict(zip(self.input_names, inputs))
        if self.task.auto_class is None:
            return (self.model(features)["sentence_embedding"],)
        out = self.model(**features)
        if self.task.name == "question-answering":
            return out.start_logits, out.end_logits
        return (out.logits,)


def transformer_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside (a sentence-transformers model keeps it in its first module)."""
    first = getattr(model, "_first_module", None)
    first = first() if callable(first) else model  # sentence-transformers: its Transformer module
    return getattr(first, "auto_model", first)


def usable_positions(config, model: torch.nn.Module | None = None) -> int | None:
    """The most tokens the model takes, None where nothing caps them; from the config and the model's structure
    (`model`, else one built from the config on the meta device: no weights read, no memory taken).

    - A model without absolute positions (`position_biased_input` false: DeBERTa's relative attention alone,
      which transformers runs at any length, its relative positions bucketed or clamped) has no cap.
    - Else `max_position_embeddings`, less the rows that its position table keeps before the first position: a
      table with a padding row (RoBERTa's family: XLM-R, CamemBERT, Longformer...) numbers positions from
      padding_idx + 1, so RoBERTa's 514 take 512 tokens. The config does not say which tables do; the table does.
    Why up front: past the table PyTorch raises an IndexError on the CPU, and on CUDA a device-side assert that
    leaves the process unusable."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions or positions < 1 or getattr(config, "position_biased_input", True) is False:
        return None
    model = model if model is not None else _skeleton(config)
    if model is None:
        return int(positions)
    words = model.get_input_embeddings()  # the vocabulary's table has a padding row too, and may be as long
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module is not words and module.num_embeddings == positions \
                and module.padding_idx is not None:
            return positions - (module.padding_idx + 1)
    return int(positions)


def _skeleton(config) -> torch.nn.Module | None:
    """The base model of `config` on the meta device (its modules, no weights), or None where transformers cannot
    build one from the config alone (then the model's own load says what is wrong)."""
    import transformers

    try:
        with torch.device("meta"):
            return transformers.AutoModel.from_config(config)
    except Exception:  # any architecture transformers does not know from a config: nothing is read off it
        return None


def check_generates(config, model_path: str) -> None:
    """Refuse --task text-generation for an encoder (BERT, MiniLM, RoBERTa...): transformers would give it a causal
    LM head of random weights (after a warning to add is_decoder=True), and every figure would be of that."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_encoder_decoder
    if encoder and not config.is_decoder:
        raise UsageError(f"-m/--model {model_path} is a {config.model_type} encoder; --task text-generation converts "
                         "decoder-only language models (its causal LM head would be random weights): use "
                         "--task embedding, classification, token-classification or question-answering")


def load_task_model(task: Task, model_path: str, device: str, token: str | bool | None = None) -> torch.nn.Module:
    """The task's PyTorch model from a hub id or a local folder, in fp32 on `device`, in eval mode (`token`: the
    hub's, for private models)."""
    try:
        if task.auto_class is None:
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(model_path, device=device, token=token)
        else:
            import transformers

            if task.name == "text-generation":
                check_generates(transformers.AutoConfig.from_pretrained(model_path, token=token), model_path)
            model = _load_trained(getattr(transformers, task.auto_class), model_path, token, task).to(device)
    except UsageError:  # check_generates' own sentence (a UsageError is a ValueError)
        raise
    except ImportError as exc:
        raise HarnessError(f"--task {task.name} needs {exc.name}, which is not installed: pip install "
                           f"{exc.name.replace('_', '-')}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"-m/--model {model_path}: cannot load it for --task {task.name} "
                         f"({str(exc).splitlines()[0]}); give a hub id or a local Hugging Face folder") from None
    return model.eval()


def _load_trained(auto_class, model_path: str, token, task: Task) -> torch.nn.Module:
    """The checkpoint with the task's head, refused when the head is not in it: transformers would start it at
    random (after a notice in its log), and every figure and the served model would be of that. transformers'
    load report is kept out of the log: what matters of it is this refusal."""
    import logging

    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model, info = auto_class.from_pretrained(model_path, token=token, output_loading_info=True)
    finally:
        log.setLevel(level)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        are, they = ("is", "it") if len(missing) == 1 else ("are", "they")
        raise UsageError(f"-m/--model {model_path} has no trained weights for --task {task.name} ({shown} {are} not "
                         f"in the checkpoint, so {they} would be random): give a model fine-tuned for that task, or "
                         "the task it was trained for (a sentence-transformers model is --task embedding, a causal "
                         "language model --task text-generation)")
    return model


def sentence_tokenizer(model, model_path: str, given=None, given_path: str = ""):
    """The tokenizer a sentence-transformers model tokenizes with, as its encode() does (its max_seq_length, its
    lowercasing): the one tokenizer that is checked and served, so that the served model embeds a text as the model
    does. `given` (-t) must tokenize as that one does; one that does not would be served in its place while the
    model's own defined the embeddings (transformer-deploy served it)."""
    own = getattr(model, "tokenizer", None)
    if own is None:
        raise UsageError(f"-m/--model {model_path}: the sentence-transformers model has no tokenizer (its first "
                         "module takes no text); --task embedding converts text models")
    if given is not None and _pipeline(given) != _pipeline(own):
        raise UsageError(f"-t/--tokenizer {given_path} tokenizes texts otherwise than the sentence-transformers "
                         f"model {model_path} does with its own tokenizer, which defines its embeddings: drop -t "
                         "(--task embedding serves the model's own)")
    return own


def _pipeline(tokenizer) -> object:
    """What decides how a tokenizer splits a text into ids (its `tokenizers` pipeline: vocabulary, normalizer,
    pre-tokenizer, post-processor, special tokens), leaving out the truncation and padding that each call sets."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a tokenizer without a `tokenizers` backend: its class, vocabulary and special tokens
        return type(tokenizer).__name__, tokenizer.get_vocab(), tokenizer.all_special_tokens
    spec = json.loads(backend.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return spec


def model_inputs(model: torch.nn.Module, tokenizer) -> tuple[str, ...]:
    """The graph's inputs: the tokenizer's, less `token_type_ids` where the model has none."""
    names = list(tokenizer.model_input_names)
    inner = transformer_of(model)
    config = getattr(inner, "config", None)
    takes = inspect.signature(inner.forward).parameters
    if "token_type_ids" in names and (getattr(config, "type_vocab_size", 1) == 0 or "token_type_ids" not in takes):
        names.remove("token_type_ids")
    return tuple(names)


def eager_attention(model: torch.nn.Module):
    """Put the transformer on eager attention for the export: ONNX Runtime's transformer optimizer fuses the
    attention pattern of eager attention (its SDPA export stays unfused), and the maths is the same."""
    inner = transformer_of(model)
    if hasattr(inner, "set_attn_implementation"):
        inner.set_attn_implementation("eager")
    return inner
