"""The tensor shapes of an encoder-decoder build: one ShapeSpec, from which flag validation, `--info` and the
TensorRT optimization profiles of all three graphs derive.

`--input-seq-len` is the encoder's length and `--output-seq-len` the number of tokens the decoder generates after
its start token; each is checked against the model's positions on its own (the encoder and the decoder each have
theirs), unlike a decoder-only model whose prompt and output share one window. Encoder rows are the batch (the
encoder runs once per prompt); decoder rows are batch x beams (its inputs are expanded for the beams), down to the
smallest batch with one beam: teacher-forced scoring (`Seq2SeqDecoder.logits`: accuracy, the fp16 check) runs
encoder and decoder on the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from nndf.errors import UsageError
from nndf.spec import BuildSettings, Dim, ModelSpec, ShapeSpec, cache_dims


def profile_ranges(*dims: tuple[int | Dim, ...]) -> tuple[tuple[int, ...], ...]:
    """(min shape, opt shape, max shape) from a shape whose entries are fixed ints or Dims."""
    return tuple(tuple(d if isinstance(d, int) else getattr(d, which) for d in dims)
                 for which in ("min", "opt", "max"))


@dataclass(frozen=True)
class Seq2SeqShapeSpec(ShapeSpec):
    """ShapeSpec for three graphs. `prompt` is the decoder's first step (its start token), `total` the decoder's
    length with the new tokens, `encoder` the encoder's length and `batch` the encoder's rows."""

    encoder: Dim = Dim(1, 1, 1)
    batch: Dim = Dim(1, 1, 1)
    hidden_size: int = 0

    @classmethod
    def derive(cls, settings: BuildSettings, spec: ModelSpec, config) -> "Seq2SeqShapeSpec":
        hooks = spec.hooks
        positions = hooks.max_positions(config)
        enc_len, new_len = settings.input_seq_len, settings.output_seq_len
        if enc_len is not None and enc_len > positions:
            raise UsageError(f"--input-seq-len {enc_len} exceeds the {positions} positions of this model's encoder")
        if new_len is not None and new_len + 1 > positions:
            raise UsageError(f"--output-seq-len {new_len} plus the decoder's start token exceeds the {positions} "
                             "positions of this model's decoder")
        lo, hi = settings.batch_range
        beams = settings.num_beams
        total_max = new_len + 1 if new_len else positions
        return cls(
            rows=Dim(lo, settings.batch_size * beams, hi * beams),
            prompt=Dim(1, 1, 1),
            total=Dim(1, min(total_max, (new_len or 64) + 1), total_max),
            max_positions=positions,
            use_cache=settings.use_cache,
            encoder=Dim(1, enc_len or max(1, positions // 2), enc_len or positions),
            batch=Dim(lo, settings.batch_size, hi),
            hidden_size=int(config.hidden_size),  # T5's and BART's configs map it to d_model
            **cache_dims(hooks, config),
        )

    def graph_profiles(self, graph: str, input_names: tuple[str, ...]) -> list[dict]:
        """TensorRT profiles of one graph ("encoder", "cross" or "decoder"), each {input: (min, opt, max) shape}."""
        b, e = self.batch, self.encoder
        if graph == "encoder":
            return [{name: profile_ranges(b, e) for name in input_names}]
        if graph == "cross":
            return [{name: profile_ranges(b, e, self.hidden_size) for name in input_names}]
        return self.profiles(input_names)

    def profiles(self, input_names: tuple[str, ...]) -> list[dict]:
        """The decoder's profiles: with cache, a first step (empty past: the start token when generating, or a
        whole teacher-forced decoder sequence when scoring) and a generation profile (one token, past
        1..total-1); without, one profile over the whole decoder sequence."""
        r, e, (heads, dim) = self.rows, self.encoder, (self.kv_heads, self.head_dim)

        def shapes(seq: Dim, past: Dim | None) -> dict:
            profile = {"input_ids": profile_ranges(r, seq), "encoder_attention_mask": profile_ranges(r, e),
                       "logits_to_keep": profile_ranges(seq)}
            for name in input_names:
                if name.startswith("cross."):
                    profile[name] = profile_ranges(r, heads, e, dim)
                elif name.startswith("past_key_values.") and past is not None:
                    profile[name] = profile_ranges(r, heads, past, dim)
            return {name: profile[name] for name in input_names}

        if not self.use_cache:
            return [shapes(self.total, None)]
        first = shapes(Dim(1, 1, self.total.max), Dim(0, 0, 0))
        generation = shapes(Dim(1, 1, 1), Dim(1, max(1, self.total.opt - 1), max(1, self.total.max - 1)))
        return [first, generation]

    def describe(self) -> list[tuple[str, str]]:
        """(name, shape) lines for `--info`: every graph's inputs and outputs with their ranges."""
        def span(d: Dim) -> str:
            return str(d.max) if d.min == d.max else f"{d.min}..{d.max}"

        b, r, e, t = span(self.batch), span(self.rows), span(self.encoder), f"1..{self.total.max}"
        last = self.num_layers - 1
        kv = f"[{r}, {self.kv_heads}, {{}}, {self.head_dim}]"
        lines = [
            ("encoder: input_ids, attention_mask", f"[{b}, {e}] int64"),
            ("encoder: encoder_hidden_states", f"[{b}, {e}, {self.hidden_size}] float"),
            (f"cross: cross.{{0..{last}}}.key|value", kv.format(e).replace(f"[{r},", f"[{b},", 1)),
            ("decoder: input_ids", f"[{r}, {'1' if self.use_cache else t}] int64"),
            ("decoder: encoder_attention_mask", f"[{r}, {e}] int64"),
            (f"decoder: cross.{{0..{last}}}.key|value", kv.format(e)),
            ("decoder: logits", f"[{r}, {'1' if self.use_cache else t}, {self.vocab_size}] float"),
        ]
        if self.use_cache:
            lines.append((f"decoder: past_key_values.{{0..{last}}}.key|value", kv.format(f"0..{self.total.max - 1}")))
            lines.append((f"decoder: present.{{0..{last}}}.key|value", kv.format(t)))
        return lines
