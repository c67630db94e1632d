"""A backend's session plus what the generation loop needs to drive it: cache creation and one step.

Every backend looks the same from here: `step` feeds `input_ids`, `attention_mask`, `position_ids` and the
cache's past tensors by name, and reads `logits` and the presents back. Inputs a session does not declare
(for example position ids of a model with ALiBi) are simply not fed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from nndf.backends import Session
from nndf.export.screened_head import CANDIDATES as SCREEN_CANDIDATES, INPUT as SCREEN_INPUT
from nndf.kvcache import KVCache
from nndf.spec import FamilyHooks, ShapeSpec


@dataclass
class TokenState:
    """The sequences being generated (one row per sequence in flight) and their attention mask."""

    tokens: torch.Tensor  # (rows, length) int64
    mask: torch.Tensor  # (rows, length) int64, 0 on left padding
    # Inputs that stay the same at every step (an encoder's mask and cross-attention keys and values), one row per
    # sequence in flight. All beams of a prompt share them, so beam reordering never touches them.
    fixed: dict = field(default_factory=dict)
    # Whether every mask entry is 1 (no row padded): the position ids are then the column indices, read from a
    # range made once instead of counted from the mask (four ops less per step). `append` and `replace_tokens` add
    # only ones, so it stays true; False (not known) takes the count.
    unpadded: bool = field(default=False, compare=False)
    # Rows whose prompt ends in padding (right-padded, which generate() warns about): generate() gives each new
    # column the position after the prompt's last column (a pad's 0), not the count of real tokens less one, so
    # their positions from the prompt's length on are the count's plus this (rows, 1) offset; None: no such row.
    position_offset: torch.Tensor | None = field(default=None, compare=False)
    prompt_length: int = field(default=0, compare=False)
    # The mask's new column at each step, made once (one op less per step): (rows, 1) ones.
    _ones_column: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # `reserve`'s buffers (tokens, mask), of which `tokens` and `mask` are the leading columns; None: none.
    _room: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def reserve(self, length: int) -> None:
        """Room for sequences of up to `length` columns: later appends write each token into buffers made here (a
        preallocated sequence, as gpt-fast's) instead of concatenating new tensors, one op per step instead of two
        (45 us of a GPT-2 ONNX Runtime decode step at batch 1, where each op right after the step meets caches the
        step's weights have flushed). One row only: its leading columns of a wider buffer are contiguous, where
        several rows' would not be (and a model may `.view()` its mask)."""
        rows, filled = self.tokens.shape
        if rows != 1 or length <= filled:
            return
        tokens = self.tokens.new_empty((rows, length))
        mask = self.mask.new_ones((rows, length))
        tokens[:, :filled] = self.tokens
        mask[:, :filled] = self.mask
        self._room = (tokens, mask)
        self.tokens, self.mask = tokens[:, :filled], mask[:, :filled]

    def append(self, next_tokens: torch.Tensor) -> None:
        room, filled = self._room, self.tokens.shape[1]
        if room is not None and filled < room[0].shape[1] and self.tokens.data_ptr() == room[0].data_ptr() \
                and self.mask.data_ptr() == room[1].data_ptr() and self.mask.shape[1] == filled:
            room[0][:, filled] = next_tokens  # the mask's columns past the prompt are ones already
            self.tokens, self.mask = room[0][:, :filled + 1], room[1][:, :filled + 1]
            return
        self.tokens = torch.cat([self.tokens, next_tokens.unsqueeze(1)], dim=1)
        ones = self._ones_column
        if ones is None or ones.shape[0] != self.mask.shape[0] or ones.device != self.mask.device:
            ones = self._ones_column = self.mask.new_ones((self.mask.shape[0], 1))
        self.mask = torch.cat([self.mask, ones], dim=1)

    def continue_positions(self, positions: torch.Tensor, seen: int) -> torch.Tensor:
        """`positions` (columns `seen` on, counted from the mask) as generate() gives them: a right-padded row's
        new columns count on from its last prompt column's position."""
        if self.position_offset is None or seen + positions.shape[1] <= self.prompt_length:
            return positions
        after_prompt = max(0, self.prompt_length - seen)
        return torch.cat([positions[:, :after_prompt], positions[:, after_prompt:] + self.position_offset], dim=1)

    def replace_tokens(self, tokens: torch.Tensor) -> None:
        """Beam search rewrites whole rows; the mask keeps its padding (all beams of a prompt share it)."""
        self.tokens = tokens
        extra = tokens.shape[1] - self.mask.shape[1]
        if extra > 0:
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], extra))], dim=1)


class Decoder:
    """Drives a decoder `Session`: `step` runs the tokens the cache has not seen yet (or all, without cache)."""

    def __init__(self, session: Session, shapes: ShapeSpec, hooks: FamilyHooks,
                 cache_restart: int | None = None) -> None:
        self.session = session
        self.shapes = shapes
        self.hooks = hooks
        self.use_cache = shapes.use_cache
        self.cache_restart = cache_restart  # FamilyHooks.cache_restart_length of the model's config
        self._screen_feeds: dict[int, torch.Tensor] = {}  # the screened head's input, one tensor per value
        self._candidates = None  # the last step's screened candidates, or a function that reads them: `candidates`

    @property
    def device(self) -> torch.device:
        return self.session.device

    @property
    def graphs(self) -> dict:
        """Every session this decoder runs, by graph ("decoder" here; an encoder-decoder adds "encoder" and
        "cross", the export's names)."""
        return {"decoder": self.session}

    @property
    def sessions(self) -> list:
        return list(self.graphs.values())

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, beams: int) -> TokenState:
        """The loop's first state: each prompt (and its mask) repeated once per beam, as `generate()` expands it."""
        mask = mask.repeat_interleave(beams, dim=0)
        state = TokenState(input_ids.repeat_interleave(beams, dim=0), mask, unpadded=bool(mask.all()))
        ends_padded = mask[:, -1:] == 0
        if not state.unpadded and bool(ends_padded.any()):  # generate() counts on from the pad's position 0
            state.position_offset = (1 - mask.sum(-1, keepdim=True)) * ends_padded
            state.prompt_length = mask.shape[1]
        return state

    @contextlib.contextmanager
    def host_threads(self):
        """Run the loop's own tensor ops with the session's `host_threads` PyTorch threads, if it names a number.

        Between steps the loop does small PyTorch ops (argmax over the vocabulary, a mask, a cumsum). When another
        runtime computes the steps, its threads keep spinning on the cores meanwhile, and PyTorch's thread pool
        starting beside them costs milliseconds per step (measured: 3.4 ms of 5.3 on a 2-core CPU); one PyTorch
        thread avoids it and loses nothing on such small tensors.
        """
        threads = getattr(self.session, "host_threads", None)
        if threads is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def new_cache(self, rows: int, max_len: int, reads_candidates: bool = False) -> KVCache | None:
        """A cache for `rows` sequences of up to `max_len` positions. `reads_candidates`: whether the loop reads a
        screened head's candidates (`candidates`) after this cache's steps; a backend that must fetch them as an
        output of every step (ONNX Runtime's IO binding: 55 us of a GPT-2 step) fetches them only then."""
        if not self.use_cache:
            return None
        custom = getattr(self.session, "new_cache", None)
        if custom is not None:  # a backend that keeps its cache in its own form (ONNX Runtime values)
            return custom(self.shapes, rows, max_len, reads_candidates=reads_candidates)
        return KVCache(
            self.shapes.num_layers,
            rows,
            self.shapes.kv_heads,
            self.shapes.head_dim,
            max_len,
            dtype=self.session.dtype,
            device=self.session.device,
        )

    def step(self, state: TokenState, cache: KVCache | None, all_logits: bool = False,
             screen: int = 0) -> torch.Tensor:
        """Logits for the tokens after `cache.length` (all tokens without a cache): (rows, 1, vocab) for the last
        of them, or (rows, new tokens, vocab) with `all_logits`.

        `screen` k >= 1 lets a graph with a screened head (`nndf.export.screened_head`) compute the logits for
        greedy search and top-k sampling: the k - b highest after up to b tokens are banned or lowered are exact,
        every other value an approximation below them (`nndf.processors.head_screen` picks k). 0 (and any session
        without one) computes them all."""
        if cache is not None and self.cache_restart is not None and \
                0 < cache.length <= self.cache_restart < state.tokens.shape[1]:
            cache.restart()  # as the model's generate() does (FamilyHooks.cache_restart_length)
        rows, total = state.tokens.shape
        seen = cache.length if cache is not None else 0
        new = total - seen
        positions = self._positions(total, state.tokens.device)
        feeds = {
            "input_ids": state.tokens[:, seen:],
            "attention_mask": state.mask,
            # a decode step's is the same tensor every step, so a binding can keep it (SharedStep)
            "logits_to_keep": positions[:new] if all_logits else self._last_of_one if new == 1 else
            positions[new - 1 : new],
        }
        if "position_ids" in self.session.input_names:  # ALiBi models and encoder-decoders take none
            feeds["position_ids"] = self._unpadded_positions(rows, seen, total) if state.unpadded else \
                state.continue_positions(self.hooks.position_ids(state.mask, seen), seen)
        if SCREEN_INPUT in self.session.input_names:
            feeds[SCREEN_INPUT] = self._screen_feed(screen)
        feeds.update(state.fixed)
        if cache is not None:
            feeds.update(cache.past_feeds())
        outputs = self.session.run({name: feeds[name] for name in self.session.input_names})
        if cache is not None:
            cache.store(outputs, state.tokens.shape[1])
        self._candidates = outputs.get(SCREEN_CANDIDATES) if screen >= 1 else None
        return outputs["logits"]

    @property
    def candidates(self):
        """The last step's screened candidates (`nndf.export.screened_head.CANDIDATES`, a numpy array of (row,
        column) pairs) where it screened and its cache was made to read them (`new_cache`), else None: every score
        that can be among the k highest of a row is among them (`step`'s screen k). Read from the session on first
        use (greedy search never asks)."""
        if callable(self._candidates):
            self._candidates = self._candidates()
        return self._candidates

    def _screen_feed(self, screen: int) -> torch.Tensor:
        """The screened head's input for `screen`, one tensor per value (a binding that is fed the same tensor
        again keeps it, `SharedStep`)."""
        feed = self._screen_feeds.get(screen)
        if feed is None:
            with torch.inference_mode(False):
                feed = self._screen_feeds[screen] = torch.tensor([screen], dtype=torch.int64)
        return feed

    def _positions(self, count: int, device: torch.device) -> torch.Tensor:
        """0, 1, ... on the loop's device, made once: `logits_to_keep` is a slice of it, so a step copies nothing
        from the host (a host-to-device copy of a fresh tensor waits for the GPU: one synchronisation per step)."""
        cached = getattr(self, "_arange", None)
        if cached is None or cached.device != device or cached.numel() < count:
            with torch.inference_mode(False):
                cached = torch.arange(max(count, self.shapes.total.max), device=device)
            self._arange = cached
            self._last_of_one = cached[:1]  # logits_to_keep of a step over one new token
            self._arange_row = cached.unsqueeze(0)
        return cached

    def _unpadded_positions(self, rows: int, seen: int, total: int) -> torch.Tensor:
        """The position ids of columns seen .. total - 1 of rows without padding: those columns' indices."""
        columns = self._arange_row[:, seen:total]
        return columns if rows == 1 else columns.expand(rows, total - seen)

    def logits(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every position of sequences padded on the right (none: unpadded) in one pass (used to score
        data sets)."""
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        state = TokenState(input_ids, mask)
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1])
        with self.host_threads():
            return self.step(state, cache, all_logits=True).float()
