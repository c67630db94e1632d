"""The encoder-decoder side of the one generation loop: how its first state is prepared, and scoring.

`Seq2SeqDecoder` is a `Decoder` whose `step` is the decoder-only one (the decoder graph's pasts come from the same
KV caches); what differs is `start`: the encoder and the cross-attention cache generator run once per batch of
prompts, their results are repeated for the beams (beams of a prompt share them, so beam reordering leaves them
alone) and ride along every step as fixed inputs, and the decoder starts from its start token.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from nndf.decoder import Decoder, TokenState


def as_tensor(value) -> torch.Tensor:
    """A session output as a torch tensor (ONNX Runtime hands back numpy arrays or OrtValues)."""
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, np.ndarray):
        value = value.numpy()
    return torch.from_numpy(value)


class Seq2SeqDecoder(Decoder):
    """Drives three sessions: encoder and cross-attention cache generator once, the decoder step by step."""

    def __init__(self, encoder, cross, decoder, shapes, hooks, start_token_id: int | None = None) -> None:
        super().__init__(decoder, shapes, hooks)
        self.encoder = encoder
        self.cross = cross
        self.start_token_id = None if start_token_id is None else int(start_token_id)

    @property
    def graphs(self) -> dict:
        return {"encoder": self.encoder, "cross": self.cross, "decoder": self.session}

    def cross_feeds(self, encoder_feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every decoder layer's cross-attention keys and values: the encoder, then the cache generator, once."""
        hidden = as_tensor(self.encoder.run(encoder_feeds)["encoder_hidden_states"])
        cross = self.cross.run({"encoder_hidden_states": hidden.to(self.cross.device)})
        return {name: as_tensor(value) for name, value in cross.items()}

    def encode(self, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoder's fixed inputs for these prompts: the encoder's mask and every layer's cross keys/values."""
        return {"encoder_attention_mask": mask, **self.cross_feeds({"input_ids": input_ids, "attention_mask": mask})}

    def _fixed_feeds(self, fixed: Mapping[str, torch.Tensor], beams: int) -> dict:
        """Repeat each row for its beams and hand the tensors to the decoder session in its own form, once."""
        convert = getattr(self.session, "as_feed", None)
        out = {}
        for name, value in fixed.items():
            value = value.to(self.session.device)
            if beams > 1:
                value = value.repeat_interleave(beams, dim=0)
            out[name] = convert(value) if convert is not None else value
        return out

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, beams: int) -> TokenState:
        fixed = self._fixed_feeds(self.encode(input_ids, mask), beams)
        rows = input_ids.shape[0] * beams
        tokens = torch.full((rows, 1), self.start_token_id, dtype=torch.long, device=self.device)
        return TokenState(tokens, torch.ones_like(tokens), fixed)

    def logits(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None, *,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every decoder position of `decoder_input_ids` (teacher-forced, padded on the right if at all)
        given `input_ids` on the encoder under `attention_mask` (none: unpadded); without decoder ids, the start
        token's logits (the first token's distribution)."""
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        if decoder_input_ids is None:
            decoder_input_ids = torch.full((input_ids.shape[0], 1), self.start_token_id, dtype=torch.long)
        decoder_input_ids = decoder_input_ids.to(self.device)
        with torch.inference_mode(), self.host_threads():
            return self.teacher_forced(self.encode(input_ids, mask), decoder_input_ids)

    def teacher_forced(self, fixed: Mapping[str, torch.Tensor], decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """Float logits of every position of `decoder_input_ids` (unpadded) with these fixed inputs, in one pass."""
        state = TokenState(decoder_input_ids, torch.ones_like(decoder_input_ids), self._fixed_feeds(fixed, 1))
        cache = self.new_cache(decoder_input_ids.shape[0], decoder_input_ids.shape[1])
        return self.step(state, cache, all_logits=True).float()
