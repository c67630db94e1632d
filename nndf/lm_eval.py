"""Our backends as an lm-evaluation-harness model: `NndfLM(model)` runs lm-eval 0.4.13's tasks on any text family
and backend (PyTorch, ONNX Runtime fp32/int8/int4, TensorRT) through this project's own machinery.

    import lm_eval, nndf
    from nndf.lm_eval import NndfLM
    lm = NndfLM(nndf.load("GPT2", backend="onnxrt-int8", torch_dir="./my-gpt2"))
    results = lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])

lm-eval asks a model three things; each is answered as its own `hf` model (`HFLM`) answers it, on the same inputs
(tests/test_lm_eval.py compares both on the same models, requests and data):

- `loglikelihood`: lm-eval's base class encodes each (context, continuation) pair (`TemplateLM._encode_pair`, over
  `tok_encode` below: the tokenizer's own special tokens, as `HFLM.tok_encode`); the continuation is teacher-forced
  through `Model.logits` in batches of equal lengths (`nndf.batching`), so the scores are those of one request per
  pass, and scored as `nndf.loglikelihood.score` (float32 log-softmax, as lm-eval). Decoder-only models read
  context + continuation cut from the left to the model's positions; encoder-decoder models read the context on the
  encoder and the continuation on the decoder (lm-eval's `seq2seq` backend).
- `loglikelihood_rolling`: lm-eval's own rolling windows (`get_rolling_token_windows`, `make_disjoint_window`, the
  prefix token first, windows of the model's positions), each scored as a loglikelihood request, summed per text.
- `generate_until`: greedy search through our generation loop (`Model.generate`) under the model's generation
  config, as `HFLM` calls `generate()`: the context encoded with the tokenizer's special tokens and cut from the
  left (decoder-only: to the positions minus `max_gen_toks`), at most `context + max_gen_toks` tokens in the
  loop's sequences (`generate(max_length=...)` counts an encoder-decoder's decoder tokens, start token included),
  stopping when every row has produced a stop sequence or EOS (lm-eval's own stopping criterion, given the
  context's length as lm-eval gives it); the new tokens are decoded without special tokens and cut at the first
  stop sequence. Requests with equal context lengths and
  generation settings run as one batch. Sampling is refused (the loop is greedy here), as are generation keys it
  does not know; a generation config with beams (bart-large-cnn) searches with them and the text is cut at the
  first stop sequence afterwards.

Image-to-text families (BLIP) have no text tasks here and are refused.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from nndf.errors import HarnessError, UsageError
from nndf.loglikelihood import encode, prefix_token_id

# lm-eval's HFLM default for `max_gen_toks` (a task's generation_kwargs may set its own).
DEFAULT_MAX_GEN_TOKS = 256


def check_text_family(spec) -> None:
    """lm-eval's tasks here are text: a family whose architecture has no lm-eval backend (BLIP) is refused."""
    from nndf.architectures import architecture

    if architecture(spec).lm_eval_backend is None:
        raise UsageError(f"{spec.family} reads images and lm-evaluation-harness's tasks here are text, so evaluate "
                         "does not apply to it; use run or compare, which caption its checkpoint photos")


def greedy_settings(gen_kwargs: dict, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, task: str = "a task") -> dict:
    """A request's or a task's generation_kwargs as lm-eval normalises them (`until`, `max_gen_toks`), or one
    sentence for anything that would make the generation other than greedy. `evaluate` asks it of every generation
    task before a model loads (`nndf.lm_eval_tasks`), so that a sampled task is not refused after the load and
    the exports; `NndfLM` asks it of each request."""
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, max_gen_toks))
    if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) != 0.0:
        raise HarnessError(f"{task} asks for sampled generation (do_sample / temperature > 0); this model "
                           "generates greedily, as lm-eval's generate_until defines it")
    unknown = sorted(set(kwargs) - {"until", "max_gen_toks"})
    if unknown:
        raise HarnessError(f"{task}'s generation_kwargs {unknown} are not supported: this model takes until, "
                           "max_gen_toks (or max_new_tokens), do_sample=False and temperature=0")
    return kwargs


class NndfLM(TemplateLM):
    """An lm-eval model over a `nndf.model.Model` (one family's variant on one backend)."""

    def __init__(self, model, batch_size: int = 16, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 progress: bool = True) -> None:
        super().__init__()
        check_text_family(model.spec)
        if batch_size < 1 or max_gen_toks < 1:
            raise UsageError(f"batch_size and max_gen_toks must be at least 1, got {batch_size} and {max_gen_toks}")
        self.model = model
        self.backend = model.architecture.lm_eval_backend  # "causal" or "seq2seq": how _encode_pair encodes
        self.tokenizer = model.tokenizer
        self.batch_size = batch_size
        self._max_gen_toks = max_gen_toks
        self.progress = progress

    # ---------------------------------------------------------------------------------------------- what lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        """The model's positions (lm-eval's `hf` model reads the same config field)."""
        return self.model.max_positions

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        ids = encode(self.tokenizer, string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def get_model_info(self) -> dict:
        """What ran, for lm-eval's results["config"]."""
        m = self.model
        return {"family": m.spec.family, "variant": m.variant.name, "backend": m.backend,
                "quantize": m.options.quantize, "weights": m.loaded.source}

    # ------------------------------------------------------------------------------------------------------ requests
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each ((context, continuation) | None, context ids, continuation ids)."""
        pairs = [(list(context), list(continuation)) for _, context, continuation in requests]
        scores = self.model.architecture.loglikelihoods(self.model, pairs, self.batch_size,
                                                        progress=self.progress and not disable_tqdm)
        for (key, _, _), answer in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            rolling = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (loglik, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[index] += loglik  # window by window, in order, as lm-eval sums them
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        groups: dict[tuple, list[int]] = defaultdict(list)
        settings, contexts = [], []
        for index, (context, gen_kwargs) in enumerate(request.args for request in requests):
            until, max_gen_toks = self._generation_settings(gen_kwargs, eos_text)
            ids = self._context_ids(context, max_gen_toks)
            settings.append((until, max_gen_toks))
            contexts.append(ids)
            groups[(len(ids), max_gen_toks, tuple(until))].append(index)
        answers: list = [None] * len(requests)
        with tqdm(total=len(requests), desc="generate_until", unit="request", file=sys.stderr,
                  disable=disable_tqdm or not self.progress) as bar:
            for group in groups.values():
                until, max_gen_toks = settings[group[0]]
                texts = self._generate([contexts[i] for i in group], until, max_gen_toks)
                for index, text in zip(group, texts):
                    answers[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                bar.update(len(group))
        return answers

    # ------------------------------------------------------------------------------------------------- generation
    def _generation_settings(self, gen_kwargs: dict, eos_text: str) -> tuple[list[str], int]:
        """(stop sequences with EOS's text, max new tokens) of a request, as lm-eval normalises them; anything that
        would make the generation other than greedy is refused."""
        kwargs = greedy_settings(gen_kwargs, self.max_gen_toks)
        return handle_stop_sequences(kwargs.get("until"), eos=eos_text), int(kwargs["max_gen_toks"])

    def _context_ids(self, context: str, max_gen_toks: int) -> list[int]:
        """A generation context's ids as lm-eval's `HFLM.tok_batch_encode` makes them, cut from the left."""
        if self.backend == "causal":
            longest = self.max_length - max_gen_toks
            if longest < 1:
                raise HarnessError(f"max_gen_toks {max_gen_toks} leaves no room for a context in this model's "
                                   f"{self.max_length} positions")
        else:
            longest = self.max_length  # the encoder's
        bos = getattr(self.tokenizer, "bos_token", None)
        special = {"add_special_tokens": False} if self.backend == "causal" and bos and context.startswith(bos) else {}
        return list(self.tokenizer(context, **special)["input_ids"])[-longest:]

    def _generate(self, contexts: list[list[int]], until: list[str], max_gen_toks: int) -> list[str]:
        """Greedy continuations of contexts of one length, decoded and cut at the first stop sequence."""
        model = self.model
        input_ids = torch.tensor(contexts, dtype=torch.long)
        prompt = model.architecture.prompt_length(input_ids, model.loaded)
        # generate(max_length=context + max_gen_toks) as lm-eval calls it, within the decoder's positions
        new = min(input_ids.shape[1] + max_gen_toks - prompt, model.max_positions - prompt)
        greedy = model.generation_options(new, None, None, do_sample=False).num_beams == 1
        # lm-eval's criterion, told the context's length as lm-eval tells it: for an encoder-decoder model it then
        # skips the decoder's first context-length tokens (it decodes special tokens too, so a stop sequence inside
        # a special token's text would otherwise end a generation that lm-eval's hf model goes on with)
        stopping = None
        if greedy:
            stopping = stop_sequences_criteria(self.tokenizer, until, input_ids.shape[1], len(contexts))
        out = model.generate(input_ids, attention_mask=None, max_new_tokens=new, min_new_tokens=None,
                             num_beams=None, stopping=stopping, do_sample=False)  # as HFLM: greedy
        return [postprocess_generated_text(self.tok_decode(row.tolist()), until, None)
                for row in model.new_tokens(out, input_ids)]
