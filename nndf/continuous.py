"""Continuous (in-flight) batching: requests join a running batch at step boundaries and leave when they are done.

`nndf.generation.generate` runs one batch from start to end: rows that arrive later wait for the whole batch, and
finished rows keep their place until the last one ends. A server wants what TensorRT-LLM's in-flight batching and
vLLM do: one decode step for every request in flight, each at its own position. Here:

- a new request is prefilled alone (a step of batch 1 over its prompt, in its own cache), its first token chosen,
  and its keys and values copied into a free row of the batch's cache (`nndf.rowcache.RowCache`, rows aligned on
  the right, masks for the rest);
- every decode step feeds each row's last token; each row's token is chosen with its own options, as
  `generate()` would choose it for that request alone: its own processors over its own tokens, its own seeded
  draw, its own EOS and `max_new_tokens`;
- a row that ends (EOS, length, or its client gone: `is_cancelled`) leaves at once and its row is reused.

So a request's answer does not depend on what it was batched with (greedy: token for token the answer of
`Model.generate` on that prompt alone; `tests/test_continuous.py`). Beam search keeps whole-batch semantics
(its beams share a prompt's fate): such a request runs on its own between steps.

`ContinuousBatcher` is single-threaded (`step`); `BatchWorker` runs one on a thread for servers (the Triton model).
"""

from __future__ import annotations

import collections
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from nndf.decoder import TokenState
from nndf.errors import UsageError
from nndf.generation import BEAMS_WITH_STOPPING, GenerationOptions, generate
from nndf.kvcache import StaticKVCache
from nndf.rowcache import RowCache
from nndf.sampling import last_dim_argmax

CANCEL_CHECK_EVERY = 4  # decode steps between asking each request whether its client is still there
FIRST_CAPACITY = 128  # columns the batch's cache starts with (it grows to the model's positions as needed)


@dataclass(eq=False)
class Request:
    """One prompt (1, L) to continue with `options`. `streamer` (put/end, as `generate(streamer=...)`) gets the
    prompt, then each new token, then `end()`; `is_cancelled` is asked every few steps (a client that left);
    `on_done(request)` is called once, from the batcher's thread, when the request ends for any reason. `stopping`
    (what `generate(stopping_criteria=...)` takes, e.g. `Model.stop_criteria(["\\n"])`) ends the request once it
    says so of the prompt and the new tokens (called with scores None), as stop strings end a `Model.generate` row."""

    prompt: torch.Tensor
    options: GenerationOptions
    streamer: object | None = None
    stopping: Callable[[torch.Tensor, None], object] | None = None
    is_cancelled: Callable[[], bool] | None = None
    on_done: Callable[["Request"], None] | None = None
    new_tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._processors = None
        self._chooser = None
        self._sequence = self.prompt

    @property
    def plain(self) -> bool:
        """Greedy with no processor: its token is the argmax, taken for all such rows at once."""
        return not self._processors and not self.options.sampling.samples

    def _start(self, device: torch.device) -> None:
        prompt = self.prompt
        self.prompt = self._sequence = prompt.to(device)  # where the decoder's logits are (a GPU's)
        self._processors = self.options.processors(prompt.shape[1], torch.ones_like(self.prompt))
        self._chooser = self.options.sampling.chooser()
        if self.streamer is not None:
            self.streamer.put(prompt.cpu())  # as generate() puts it

    def _choose(self, logits: torch.Tensor) -> int:
        """The next token from this request's (1, vocab) logits, as greedy search or sampling picks it."""
        scores = self._processors(self._sequence, logits.float())
        return int(self._chooser(scores)[0])

    def _take(self, token: int) -> bool:
        """Record a token; whether the request is finished."""
        self.new_tokens.append(token)
        if self._processors or self.stopping is not None:
            self._sequence = torch.cat([self._sequence, self._sequence.new_tensor([[token]])], dim=1)
        if self.streamer is not None:
            self.streamer.put(torch.tensor([token]))
        return (token in self.options.eos_ids or len(self.new_tokens) >= self.options.max_new_tokens
                or (self.stopping is not None and bool(self.stopping(self._sequence, None)[0])))

    def _finish(self, error: BaseException | None = None, cancelled: bool = False) -> None:
        self.error, self.cancelled = error, cancelled
        if self.streamer is not None and error is None and not cancelled:
            self.streamer.end()
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception as exc:  # noqa: BLE001 - a reply that cannot be sent (its client gone) ends only it
                print(f"nndf: the answer to a request could not be delivered: {exc}", file=sys.stderr)


class ContinuousBatcher:
    """Drives a decoder-only `Model`'s decoder over requests that come and go; at most `max_rows` in flight."""

    def __init__(self, model, max_rows: int, first_capacity: int = FIRST_CAPACITY) -> None:
        self.check_model(model)
        if max_rows < 1:
            raise UsageError(f"a batch needs at least 1 row, got {max_rows}")
        decoder = model.decoder
        self.model, self.decoder, self.shapes = model, decoder, decoder.shapes
        self.max_positions = model.max_positions
        self.cache = RowCache(self.shapes.num_layers, self.shapes.kv_heads, self.shapes.head_dim, max_rows,
                              min(first_capacity, self.max_positions), self.max_positions,
                              in_place=getattr(decoder.session, "layout", None) == "shared",
                              dtype=decoder.session.dtype, device=decoder.device)
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []  # index = row of the cache
        self.pending: list[int] = []  # each row's last token, not yet in the cache
        self.steps = 0

    @staticmethod
    def check_architecture(family: str, architecture, use_cache: bool) -> None:
        """Refuse a family whose rows are not one decoder's, or a build without the cache that keeps each row's
        place (both known before the load)."""
        if architecture.name != "decoder-only":
            raise UsageError(f"continuous batching serves decoder-only models; {family} is {architecture.name}: "
                             "serve it with --scheduler sequential")
        if not use_cache:
            raise UsageError("continuous batching needs the KV cache (drop --no-use-cache)")

    @staticmethod
    def check_model(model) -> None:
        """Refuse, with a sentence, a model whose batch rows cannot be at different positions."""
        decoder = model.decoder
        ContinuousBatcher.check_architecture(model.spec.family, model.architecture, decoder.use_cache)
        if isinstance(decoder.new_cache(1, 1), StaticKVCache):
            raise UsageError("continuous batching needs a cache whose rows can move (a static cache for CUDA graphs "
                             "cannot): serve it without CUDA graphs")
        if decoder.cache_restart is not None:
            raise UsageError("this model restarts its cache past a length (Phi-3's long rope), which a batch of rows "
                             "at different lengths cannot do: serve it with --scheduler sequential")

    def check(self, request: Request) -> None:
        """Refuse a request the batch cannot serve, with a sentence (before it is queued)."""
        if request.prompt.dim() != 2 or request.prompt.shape[0] != 1 or request.prompt.shape[1] < 1:
            raise UsageError(f"a request is one non-empty prompt of shape (1, length), got {tuple(request.prompt.shape)}")
        self.model.architecture.check_length(request.prompt.shape[1], request.options.max_new_tokens, self.shapes)
        self.model.architecture.check_token_ids(request.prompt, self.shapes)
        if request.options.num_beams > 1 and request.streamer is not None:
            raise UsageError("beam search (num_beams > 1) cannot stream: ask for one beam, or for the whole answer")
        if request.options.num_beams > 1 and request.stopping is not None:
            raise UsageError(BEAMS_WITH_STOPPING)

    def submit(self, request: Request) -> Request:
        """Queue a request (safe from any thread); it joins the batch at the next step."""
        self.check(request)
        self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def step(self) -> None:
        """Admit what waits (while rows are free), run one decode step for the rows in flight, retire the ended."""
        with torch.inference_mode(), self.decoder.host_threads():
            if self.steps % CANCEL_CHECK_EVERY == 0:
                self._drop_cancelled()
            while self.waiting and len(self.active) < self.cache.max_rows:
                self._admit(self.waiting.popleft())
            if self.active:
                try:
                    self._decode()
                except Exception as exc:  # noqa: BLE001 - the step failed for every row: each request gets it
                    self._fail_all(exc)
            self.steps += 1

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    def _admit(self, request: Request) -> None:
        if _cancelled(request):
            request._finish(cancelled=True)
            return
        try:
            request._start(self.decoder.device)
            if request.options.num_beams > 1:
                ones = torch.ones_like(request.prompt)
                out = generate(self.decoder, request.prompt, ones, request.options)
                request.new_tokens = out[0, request.prompt.shape[1]:].tolist()
                request._finish()
                return
            length = request.prompt.shape[1]
            cache = self.decoder.new_cache(1, length)
            logits = self.decoder.step(TokenState(request.prompt, torch.ones_like(request.prompt)), cache)
            if request._take(request._choose(logits[:, -1, :])):
                request._finish()
                return
            self.cache.admit(cache.past_feeds(), length)
        except Exception as exc:  # noqa: BLE001 - this request's failure is its own; the batch goes on
            request._finish(error=exc)
            return
        self.active.append(request)
        self.pending.append(request.new_tokens[-1])

    def _decode(self) -> None:
        cache, rows = self.cache, len(self.active)
        cache.make_room(1)
        cache.mask[:rows, cache.length] = 1
        mask = cache.mask[:rows, : cache.length + 1]
        # Decoder.step feeds the columns the cache has not seen: only the last, each row's pending token.
        tokens = torch.tensor(self.pending, device=mask.device).view(rows, 1).expand(rows, cache.length + 1)
        logits = self.decoder.step(TokenState(tokens, mask), cache)[:, -1, :]
        plain = [row for row, request in enumerate(self.active) if request.plain]
        chosen = dict(zip(plain, last_dim_argmax(logits[plain].float()).tolist())) if plain else {}
        ended = []
        for row, request in enumerate(self.active):
            try:
                token = chosen[row] if row in chosen else request._choose(logits[row : row + 1])
                if request._take(token):
                    ended.append((row, None))
                self.pending[row] = token
            except Exception as exc:  # noqa: BLE001 - one request's processors failed: it alone ends
                ended.append((row, exc))
        for row, error in reversed(ended):
            self._retire(row)._finish(error=error)

    def _retire(self, row: int) -> Request:
        request = self.active[row]
        moved = self.cache.retire(row)
        if moved is not None:
            self.active[row], self.pending[row] = self.active[moved], self.pending[moved]
        self.active.pop()
        self.pending.pop()
        return request

    def _drop_cancelled(self) -> None:
        for row in reversed(range(len(self.active))):
            if _cancelled(self.active[row]):
                self._retire(row)._finish(cancelled=True)

    def _fail_all(self, exc: BaseException) -> None:
        while self.active:
            self._retire(len(self.active) - 1)._finish(error=exc)


def _cancelled(request: Request) -> bool:
    """Whether the request's client has left; a question that cannot be answered (the server's side of the request
    gone) counts as yes."""
    if request.is_cancelled is None:
        return False
    try:
        return bool(request.is_cancelled())
    except Exception:  # noqa: BLE001
        return True


class BatchWorker:
    """A `ContinuousBatcher` on its own thread: `submit` from any thread; `close` lets every queued and running
    request finish (a model unloading must not lose answers), then stops the thread."""

    def __init__(self, batcher: ContinuousBatcher, name: str = "nndf-batcher") -> None:
        self.batcher = batcher
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Request:
        if self._closing:
            raise UsageError("the model is unloading and takes no new requests")
        self.batcher.submit(request)
        self._wake.set()
        return request

    def _loop(self) -> None:
        while True:
            if not self.batcher.busy:
                if self._closing:
                    return
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.batcher.step()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one step: those in flight fail
                print(f"nndf: a batch step failed, its requests get the error: {exc!r}", file=sys.stderr)
                self.batcher._fail_all(exc)

    def close(self, timeout: float | None = None) -> bool:
        """Finish what was submitted and stop; whether the thread ended within `timeout` seconds."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()
