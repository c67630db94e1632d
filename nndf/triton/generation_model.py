"""Triton Python-backend model that generates text with nndf's loop; copied verbatim as `<name>/1/model.py`.

It runs nndf itself inside the server's Python: `nndf.triton.served.load_served` on the files beside it (the model's
config, generation config and tokenizer in `hf/`, the exported graphs in `decoder/`, and an encoder-decoder's in
`encoder/` and `cross/`, what to load in `nndf.json`), so each request gets what `run.py` would generate. The server's Python needs nndf installed with its `onnxruntime` extra
(in NVIDIA's container: a derived image with `pip install nndf[onnxruntime]`).

Two schedulers (`nndf.json`'s "scheduler", `run.py triton --scheduler`):
- continuous (default): every prompt row joins one running batch (`nndf.continuous`) at the next step boundary and
  leaves when it is done; `execute` hands the requests over and returns at once, and each request's response is
  sent from the batch's thread when its last row ends (Triton's response sender). Rows with different settings
  share steps; each gets the answer it would get alone.
- sequential: each request runs as its own batch, one after another (the model before continuous batching, kept
  for comparison: `bench/serving_cpu.py`).

Decoupled (`model_transaction_policy { decoupled: true }`, the `<name>_stream` model): each new piece of text is a
response as soon as it is generated (GENERATED holds every row's new piece, empty for rows with none), then an
empty response flagged final. gRPC streaming clients only, as for any decoupled model.

Inputs: TEXT (one prompt per batch row); optional, one value per row, the same in every row of a request (its
settings are the request's): MAX_NEW_TOKENS, MIN_NEW_TOKENS, NUM_BEAMS, DO_SAMPLE, TEMPERATURE, TOP_K, TOP_P, SEED,
REPETITION_PENALTY; and STOP, any number of stop strings per row (the same in every row): a row ends with the token
that reaches one of them (it may run past it), as `generate(stop_strings=...)` ends it. TEMPERATURE, TOP_K and TOP_P are refused where the request
does not sample (as `run.py` refuses their flags): generate() would ignore them.
Output: GENERATED, the new text of each row (special tokens dropped; a stop string that ended it is kept).

A request's own fault (a bad value, a prompt too long, text that is not UTF-8) is answered with INVALID_ARG, which
clients see as HTTP 400 or gRPC INVALID_ARGUMENT, naming the input; anything else is INTERNAL (HTTP 500).
"""

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from nndf.errors import UsageError

# optional input -> (keyword of Model.generation_options, type); checked by nndf's own options (one sentence each)
DECODING_INPUTS = {"DO_SAMPLE": ("do_sample", bool), "TEMPERATURE": ("temperature", float), "TOP_K": ("top_k", int),
                   "TOP_P": ("top_p", float), "SEED": ("seed", int), "REPETITION_PENALTY": ("repetition_penalty", float)}
INPUT_KEYWORDS = {"MAX_NEW_TOKENS": "max_new_tokens", "MIN_NEW_TOKENS": "min_new_tokens", "NUM_BEAMS": "num_beams",
                  **{name: keyword for name, (keyword, _) in DECODING_INPUTS.items()}}
# what run.py's refusals say of its command line, as a client of this model says it (before the flags' names)
CLIENT_WORDS = {"this run does not sample": "this request does not sample", "add --do-sample": "send DO_SAMPLE true",
                "--no-do-sample was given": "DO_SAMPLE is false"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _optional(request, name, kind, default=None):
    """The request's value of an optional input: one value for all its rows (a row that differs would silently get
    the first row's setting, so it is refused)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = [kind(v.item()) for v in tensor.as_numpy().reshape(-1)]
    if any(v != values[0] and not (v != v and values[0] != values[0]) for v in values):  # NaN equals NaN here
        raise UsageError(f"{name} differs between the rows of one request ({', '.join(map(str, values))}): a "
                         "request's settings apply to all its rows; send rows with other settings as their own request")
    return values[0]


def _texts(request) -> list:
    text = pb_utils.get_input_tensor_by_name(request, "TEXT")
    if text is None:
        raise UsageError("the TEXT input is missing: give one prompt per row")
    return [_text(value, "TEXT", row) for row, value in enumerate(text.as_numpy().reshape(-1))]


def _text(value, name: str, row: int) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name} row {row} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _stop_strings(request) -> list:
    """The request's STOP strings (a row's list, the same in every row), [] when absent."""
    stop = pb_utils.get_input_tensor_by_name(request, "STOP")
    if stop is None:
        return []
    rows = stop.as_numpy()
    lists = [[_text(value, "STOP", row) for value in values] for row, values in enumerate(rows.reshape(len(rows), -1))]
    if any(strings != lists[0] for strings in lists):
        raise UsageError("STOP differs between the rows of one request: a request's settings apply to all its rows; "
                         "send rows with other stop strings as their own request")
    if any(not text for text in lists[0]):
        raise UsageError("STOP holds an empty string, which would end every row at its first token; give each stop "
                         "string at least one character")
    return lists[0]


def _error(exc: BaseException) -> "pb_utils.TritonError":
    """The error a client gets: INVALID_ARG for its own fault (a UsageError: a bad value, a prompt too long), with
    nndf's keyword names (`temperature (--temperature)`) said as the inputs the client sent; INTERNAL otherwise."""
    message = str(exc).replace(" or a torch.Generator", "")  # the Python API's; a client sends a number
    for words, said in CLIENT_WORDS.items():
        message = message.replace(words, said)
    for name, keyword in INPUT_KEYWORDS.items():
        flag = "--" + keyword.replace("_", "-")
        message = message.replace(f"{keyword} ({flag})", name)
        # `num_beams=1 (--num-beams 1)`, `do_sample=False (--no-do-sample)`: the input and its value
        message = re.sub(rf"\b{keyword}=(\S+) \(--[^)]*\)", lambda m, name=name: f"{name} {m.group(1).lower()}",
                         message)
        message = re.sub(rf"{flag}\b", name, message)  # `--temperature and --top-k shape sampled draws`
    code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, UsageError) else pb_utils.TritonError.INTERNAL
    return pb_utils.TritonError(f"generation failed: {message}", code)


def _strings(texts) -> "pb_utils.Tensor":
    return pb_utils.Tensor("GENERATED", np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(-1, 1))


class Reply:
    """The rows of one Triton request in the batch: sends the whole answer (or each streamed piece, then the final
    flag) through the request's response sender once its last row ends; an error or a cancelled row ends the
    request with an error."""

    def __init__(self, sender, rows: int, tokenizer, stream: bool):
        self.sender, self.tokenizer, self.stream = sender, tokenizer, stream
        self.left = rows
        self.failed = None
        self.requests = []

    def piece(self, row: int, rows: int, text: str) -> None:
        if self.failed is None:
            pieces = [""] * rows
            pieces[row] = text
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[_strings(pieces)]))

    def row_done(self, request) -> None:
        if request.cancelled:
            pb_utils.Logger.log_info(f"nndf: a request was cancelled after {len(request.new_tokens)} new tokens; "
                                     f"its row is free")
        if request.error is not None and self.failed is None:
            self.failed = _error(request.error)
        elif request.cancelled and self.failed is None:
            self.failed = pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED)
        self.left -= 1
        if self.left:
            return
        if self.failed is not None:
            self.sender.send(pb_utils.InferenceResponse(error=self.failed), flags=FINAL)
        elif self.stream:
            self.sender.send(flags=FINAL)
        else:
            replies = self.tokenizer.batch_decode([r.new_tokens for r in self.requests], skip_special_tokens=True)
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[_strings(replies)]), flags=FINAL)


class TritonPythonModel:
    """One loaded model per instance, and with the continuous scheduler one batch (on its own thread) per instance."""

    def initialize(self, args):
        from nndf.triton.served import load_served

        config = json.loads(args["model_config"])
        self.stream = pb_utils.using_decoupled_model_transaction_policy(config)
        self._work = tempfile.TemporaryDirectory(prefix="nndf-triton-")
        settings, self.model = load_served(Path(args["model_repository"]) / args["model_version"], self._work.name)
        self.defaults = settings["defaults"]
        self.max_rows = settings["max_rows"]  # rows generated at once: what this server's memory was sized for
        self.worker = None
        if settings.get("scheduler", "continuous") == "continuous":
            from nndf.continuous import BatchWorker, ContinuousBatcher

            self.worker = BatchWorker(ContinuousBatcher(self.model, max_rows=settings["max_rows"]))

    def settings(self, request) -> tuple[dict, object]:
        """`Model.generate`'s keywords from the request's optional inputs (the defaults where absent), and the
        `GenerationOptions` they make (built once: the draw inputs' check needs them, and so does the batch)."""
        decoding = {}
        for name, (keyword, kind) in DECODING_INPUTS.items():
            value = _optional(request, name, kind)
            if value is not None:
                decoding[keyword] = value
        max_new = _optional(request, "MAX_NEW_TOKENS", int, self.defaults["max_new_tokens"])
        beams = _optional(request, "NUM_BEAMS", int, self.defaults["num_beams"])
        min_new = _optional(request, "MIN_NEW_TOKENS", int)  # None: the model's generation config (min_length)
        for name, value in (("MAX_NEW_TOKENS", max_new), ("NUM_BEAMS", beams)):
            if value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if min_new is not None and not 0 <= min_new <= max_new:
            raise UsageError(f"MIN_NEW_TOKENS must lie in 0..MAX_NEW_TOKENS ({max_new}), got {min_new}")
        if beams > self.max_rows:  # a row per beam: far more would take the memory of every client's rows
            raise UsageError(f"NUM_BEAMS {beams} is more than the {self.max_rows} rows this model generates at once; "
                             f"ask for at most {self.max_rows}")
        settings = dict(decoding, max_new_tokens=max_new, min_new_tokens=min_new, num_beams=beams,
                        sampling_stream=self.defaults.get("sampling_stream", "generate"))
        from nndf.actions.common import check_draw_flags_apply  # TEMPERATURE, TOP_K, TOP_P where nothing is sampled

        options = self.model.generation_options(**settings)
        check_draw_flags_apply(decoding, options.sampling.do_sample)
        return settings, options

    def prompts(self, texts):
        from nndf.actions.common import encode_prompts

        tokenizer = self.model.tokenizer
        return [encode_prompts(tokenizer, [text], use_mask=True, pad_side=self.model.architecture.pad_side)[0]
                for text in texts]

    def execute(self, requests):
        if self.worker is None:
            return [self._sequential(request) for request in requests]
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request):
        """Queue every row of the request in the batch; a request that cannot be served gets its error at once."""
        from nndf.continuous import Request
        from nndf.streaming import ReplyStreamer

        sender = request.get_response_sender()
        try:
            texts = _texts(request)
            _, options = self.settings(request)
            stopping = self.model.stop_criteria(_stop_strings(request))
            prompts = self.prompts(texts)
            reply = Reply(sender, len(prompts), self.model.tokenizer, self.stream)
            rows = []
            for row, ids in enumerate(prompts):
                streamer = None
                if self.stream:
                    streamer = ReplyStreamer(self.model.tokenizer,
                                             write=lambda text, row=row: reply.piece(row, len(prompts), text))
                rows.append(Request(ids, options, streamer=streamer, stopping=stopping,
                                    is_cancelled=request.is_cancelled, on_done=reply.row_done))
                self.worker.batcher.check(rows[-1])
            reply.requests = rows
        except Exception as exc:  # noqa: BLE001 - the client gets the reason, the server keeps serving
            sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=FINAL)
            return
        for row in rows:
            self.worker.submit(row)

    def _sequential(self, request):
        """One request as its own batch, answered when done (the model before continuous batching)."""
        from nndf.actions.common import encode_prompts

        try:
            texts = _texts(request)
            settings, _ = self.settings(request)
            if len(texts) * settings["num_beams"] > self.max_rows:  # the request is one batch: a row per beam
                raise UsageError(f"{len(texts)} prompts with NUM_BEAMS {settings['num_beams']} are "
                                 f"{len(texts) * settings['num_beams']} rows, more than the {self.max_rows} this "
                                 "model generates at once; send fewer prompts per request, or fewer beams")
            model = self.model
            ids, mask = encode_prompts(model.tokenizer, texts, use_mask=True, pad_side=model.architecture.pad_side)
            output = model.generate(ids, mask, stop_strings=_stop_strings(request) or None, **settings)
            replies = model.tokenizer.batch_decode(model.new_tokens(output, ids), skip_special_tokens=True)
            return pb_utils.InferenceResponse(output_tensors=[_strings(replies)])
        except Exception as exc:  # noqa: BLE001 - the client gets the reason, the server keeps serving
            return pb_utils.InferenceResponse(error=_error(exc))

    def finalize(self):
        if self.worker is not None:
            self.worker.close()  # queued and running requests finish (a reload must not lose their answers)
        self._work.cleanup()
