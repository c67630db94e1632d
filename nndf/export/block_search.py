"""int4 blocks whose range is searched for the least squared error, in MatMulNBits' own layout.

ONNX Runtime's quantizer rounds each block to the nearest of 16 levels spread over the block's whole range (its
minimum to its maximum, zero included). One outlier then stretches the levels for every other weight of the block;
a slightly narrower range, the outlier clipped, is often closer overall. llama.cpp's k-quants search for it; so does
this (`search_blocks`), in the simplest form that pays: for each block, the range [lo, hi] shrunk by each factor of
`SHRINK` (both ends alike, so the zero point, rounded from the whole range, is the same for every factor), the
weights rounded to that grid, then the scale refitted by least squares for those levels (<x, c> / <c, c>, c = level
- zero point); the candidate with the smallest squared error wins, plain rounding (factor 1) on ties. The zero point stays an integer and zero stays exact (the padding of K to whole
blocks dequantizes to 0).

On Gaussian blocks this cuts the squared error by 8% (blocks of 64) to 11% (128) against rounding over the whole
range; on the trained GPT-2 of ../shared/data it is what lets blocks of 128 keep every LAMBADA passage
(nndf.export.quantize's docstring has the figures). The search reads each weight 7 times: a few seconds for GPT-2
small, once per artifact.

`SearchedBlocks` is ONNX Runtime's `DefaultWeightOnlyQuantizer` with its block quantization replaced by
`search_blocks`, so that the nodes, their attributes and the packing conventions stay ORT's: levels two to a byte,
the low nibble first; scales [N, blocks]; zero points two to a byte, the even block in the low nibble. Only 4-bit
asymmetric blocks are searched (`nndf.export.quantize` refuses a search for anything else).
"""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

LEVELS = 15  # the largest 4-bit level
SHRINK = np.linspace(0.7, 1.0, 7)  # the range's candidate widths; 7 factors: finer grids gain <0.5% more
CHUNK = 1 << 16  # blocks searched at once (GPT-2 small's head has 50257 x 6 of 128: bounded temporaries)


def search_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row of `blocks` ([n, block] float32) as 4-bit levels: (levels uint8 [n, block] in 0..15, scales float32
    [n], zero points uint8 [n]), the weights being scale * (level - zero point)."""
    levels = np.empty(blocks.shape, np.uint8)
    scales = np.empty(len(blocks), np.float32)
    zeros = np.empty(len(blocks), np.uint8)
    for start in range(0, len(blocks), CHUNK):
        part = slice(start, start + CHUNK)
        levels[part], scales[part], zeros[part] = _search(np.asarray(blocks[part], np.float32))
    return levels, scales, zeros


def _search(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    low, high = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
    whole = (high - low) / LEVELS  # the step over the whole range
    whole = np.where(whole > 0, whole, np.float32(1))  # an all-zero block: level = zero point, weight 0
    zero = np.clip(np.rint(-low / whole), 0, LEVELS)
    best_error = np.full(len(x), np.inf, np.float32)
    levels = np.zeros(x.shape, np.uint8)
    scales = np.zeros(len(x), np.float32)
    zeros = np.zeros(len(x), np.uint8)
    for factor in SHRINK[::-1]:  # plain rounding first: it keeps ties
        step = whole * np.float32(factor)
        level = np.clip(np.rint(x / step[:, None]) + zero[:, None], 0, LEVELS)
        centred = level - zero[:, None]
        norm = np.einsum("ij,ij->i", centred, centred)
        fitted = np.where(norm > 0, np.einsum("ij,ij->i", x, centred) / np.where(norm > 0, norm, 1), step)
        residual = x - fitted[:, None] * centred
        error = np.einsum("ij,ij->i", residual, residual)
        better = error < best_error
        best_error[better] = error[better]
        levels[better], scales[better], zeros[better] = level[better], fitted[better], zero[better]
    return levels, scales, zeros


def pack_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A [K, N] weight as MatMulNBits' 4-bit inputs (searched blocks along K, K padded with zeros to whole
    blocks): (packed levels uint8 [N, blocks, block_size / 2], scales [N, blocks] of the weight's dtype, zero
    points uint8 [N, ceil(blocks / 2)])."""
    k, n = weight.shape
    count = -(-k // block_size)
    padded = np.pad(np.asarray(weight, np.float32), ((0, count * block_size - k), (0, 0)))
    levels, scales, zeros = search_blocks(np.ascontiguousarray(padded.T).reshape(n * count, block_size))
    levels = levels.reshape(n, count, block_size)
    packed = levels[..., 0::2] | (levels[..., 1::2] << 4)
    zeros = np.pad(zeros.reshape(n, count), ((0, 0), (0, count % 2)))
    return packed, scales.reshape(n, count).astype(weight.dtype), zeros[:, 0::2] | (zeros[:, 1::2] << 4)


def unpack_blocks(packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, k: int) -> np.ndarray:
    """The [K, N] weight that `pack_blocks`' outputs (MatMulNBits' 4-bit inputs) stand for."""
    n, count, half = packed.shape
    levels = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, count, 2 * half).astype(np.float32)
    zero = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(n, -1)[:, :count].astype(np.float32)
    return (scales.astype(np.float32)[..., None] * (levels - zero[..., None])).reshape(n, -1)[:, :k].T


class SearchedBlocks(DefaultWeightOnlyQuantizer):
    """ORT's MatMulNBits quantizer with `search_blocks` for its 4-bit asymmetric blocks."""

    def qbits_block_quant(self, fp32weight):
        if self.config.bits != 4 or self.config.is_symmetric or fp32weight.ndim != 2:
            raise ValueError(f"searched blocks are 4-bit asymmetric 2-D weights, not {self.config.bits}-bit "
                             f"{'symmetric' if self.config.is_symmetric else 'asymmetric'} {fp32weight.ndim}-D ones")
        return pack_blocks(fp32weight, self.config.block_size)
