"""The work split of the ``mma.sp`` 2:4 decode kernel (:func:`jaxsparse._cuda._kernels.nm24_decode`): its config,
the measured default per product and the configs measured dispatch times (their names are the tuning cache's)."""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "NM24_LOADS", "NM24_SPANS", "NM24_X_LOADS", "Nm24DecodeConfig", "nm24_candidate_configs", "nm24_tma_shared_bytes",
]

NM24_SPANS = (128, 64)  # columns of W per thread block
NM24_X_LOADS = ("shuffle", "ldmatrix")  # Nm24DecodeConfig.x_load; NM_XLOAD is the index + 1
NM24_LOADS = ("step", "pair", "stages", "tma")  # Nm24DecodeConfig.loads; NM_LOADS is the index
NM24_MAX_TMA_SHARED_BYTES = 200 * 1024  # launch_checks.h's kMaxNm24TmaSharedBytes


def nm24_tma_shared_bytes(warps: int, span: int, stages: int) -> int:
  """Dynamic shared memory of a ``loads="tma"`` build: each warp's ring of ``stages`` stages (two steps of ``K``: the
  values' boxes of 64 columns x 32 rows, 8 rows of ``x``, the metadata), in whole KB, and 1 KB of alignment slack
  (launch_checks.h's ``Nm24TmaSharedBytes``).

  >>> nm24_tma_shared_bytes(8, 64, 2)
  91136
  """
  stage, meta = span // 64 * 4096 + 1024, span // 64 * 512
  return warps * -(-stages * (stage + meta) // 1024) * 1024 + 1024


@dataclasses.dataclass(frozen=True)
class Nm24DecodeConfig:
  """Work split of :func:`~jaxsparse._cuda._kernels.nm24_decode`.

  Attributes:
    split: thread blocks per column span of ``W`` (1, 2, 4 or 8), each a slice of ``K``; the blocks of a
      column span form a cluster and add their partial sums through distributed shared memory.
    warps: warps per thread block (they split the block's slice of ``K``).
    span: columns of ``W`` per thread block, 128 or 64 (each lane holds 16 or 8 columns of a row, and
      accumulators for that many columns: 64 halves the registers, for more warps or more rows of ``x``).
    blocks_per_sm: 1 to 4: the compiler keeps the registers per thread low enough for that many thread blocks on
      a multiprocessor (``__launch_bounds__``'s minimum; it may spill). An H100 profile of the 4096 x 28672 product at
      M = 1 (8 warps, 128-column spans) showed 152 registers, one block per multiprocessor and its 224 blocks in
      1.7 waves, at 76% of the memory bandwidth where cuBLAS's dense product reached 86%. At 32 rows, 3 blocks of 4
      warps took 0.79-0.95 of the best config without on the TinyLlama products (both layouts of the positions;
      ``benchmarks/results/llm_decode_nm24_blocks_2026-12-01_h200.md``).
    token_split: 1 or 2 warps per step of ``K``: with 2, two warps load the same weights (the second mostly from L1)
      and each multiplies half of the rows of ``x``, for half the accumulator registers (182 -> 128 at 32 rows and
      64-column spans) and twice the warps a multiprocessor holds. It pays only above 8 rows (one tile of 8 each).
    x_load: how a lane gets its slice of ``x`` (four bf16 pairs 16 bytes apart) after one 16-byte load per lane:
      ``"shuffle"`` (a 4 x 4 transpose across the lane's quad by warp shuffles) or ``"ldmatrix"`` (through 512 bytes
      of shared memory per warp and token tile). Both replace four 4-byte loads that each touched 8 rows of ``x``:
      on an H100, shuffles took 0.88-1.01 of the 4-byte loads' time at 1-8 rows and ``ldmatrix`` 0.54-1.02 at
      16-32 rows (``benchmarks/results/llm_decode_x_loads_2026-11-27_h100.md``).
    loads: when a warp issues the loads of its pairs of ``K`` steps: ``"step"``, each step's just before its products;
      ``"pair"``, both steps' before either's products (more bytes in flight, more registers); ``"stages"``, the next
      pair's before the current pair's products (two pairs in registers: the loads overlap the products). On an H200
      at 24 and 32 rows the best config with them took 0.76-1.03 of the best without on cuSPARSELt's buffer
      (``"pair"`` won) and 0.94-1.02 on ``NMSparseMatrix`` indices (``"stages"`` won from ``K`` or ``N`` of 4096 up);
      at 1-16 rows ``"step"`` was the fastest (``benchmarks/results/llm_decode_nm24_loads_2026-12-01_h200.md``).
      ``"tma"`` (cuSPARSELt's buffer at up to 8 rows, :func:`~jaxsparse._cuda._kernels.nm24_decode_buffer` only; ``x``
      through ``ldmatrix``, one warp per step): each warp streams pairs of consecutive steps (the values as boxes of
      64 columns x 32 rows, 8 rows of ``x``, the metadata) by bulk tensor copies (TMA) into a ring of ``stages``
      stages in shared memory, ``stages - 1`` pairs ahead of its products, so the bytes in flight cost no registers.
      On an H200 at 1 and 8 rows its best candidate took 0.86-0.94 of the other builds' best at the Llama-3-8B
      products but the 4096 x 28672 one (0.99-1.03) and 0.86-1.01 at the TinyLlama ones
      (``benchmarks/results/llm_decode_nm24_tma_2026-12-01_h200.md``).
    stages: the ring's stages with ``loads="tma"`` (2, 3 or 4; :func:`nm24_tma_shared_bytes` at most 200 KB); 2
      otherwise.
  """

  split: int = 1
  warps: int = 8
  span: int = 128
  blocks_per_sm: int = 1
  token_split: int = 1
  x_load: str = "shuffle"
  loads: str = "step"
  stages: int = 2

  def __post_init__(self):
    if self.split not in (1, 2, 4, 8):
      raise ValueError(f"split must be 1, 2, 4 or 8, got split={self.split}.")
    if self.warps not in (2, 4, 8):
      raise ValueError(f"warps must be 2, 4 or 8, got warps={self.warps}.")
    if self.span not in NM24_SPANS:
      raise ValueError(f"span must be one of {NM24_SPANS}, got span={self.span}.")
    if self.blocks_per_sm not in (1, 2, 3, 4):
      raise ValueError(f"blocks_per_sm must be 1, 2, 3 or 4, got blocks_per_sm={self.blocks_per_sm}.")
    if self.token_split not in (1, 2):
      raise ValueError(f"token_split must be 1 or 2, got token_split={self.token_split}.")
    if self.x_load not in NM24_X_LOADS:
      raise ValueError(f"x_load must be one of {NM24_X_LOADS}, got x_load={self.x_load!r}.")
    if self.loads not in NM24_LOADS:
      raise ValueError(f"loads must be one of {NM24_LOADS}, got loads={self.loads!r}.")
    if self.loads != "tma":
      if self.stages != 2:
        raise ValueError(f"stages applies to loads='tma' only (keep 2), got stages={self.stages} with "
                         f"loads={self.loads!r}.")
      return
    if self.stages not in (2, 3, 4):
      raise ValueError(f"stages must be 2, 3 or 4, got stages={self.stages}.")
    if self.x_load != "ldmatrix" or self.token_split != 1:
      raise ValueError(f"loads='tma' reads x through ldmatrix with one warp a step: needs x_load='ldmatrix' and "
                       f"token_split=1, got x_load={self.x_load!r}, token_split={self.token_split}.")
    if (need := nm24_tma_shared_bytes(self.warps, self.span, self.stages)) > NM24_MAX_TMA_SHARED_BYTES:
      raise ValueError(f"loads='tma' with warps={self.warps}, span={self.span}, stages={self.stages} needs {need} "
                       f"bytes of shared memory, at most {NM24_MAX_TMA_SHARED_BYTES}.")

  @property
  def name(self) -> str:
    """``"s{split}w{warps}c{span}b{blocks_per_sm}"``, ``"t2"`` with ``token_split=2``, ``"xs"`` (shuffle) or
    ``"xm"`` (ldmatrix), then ``"lp"`` / ``"ls"`` for ``loads`` ``"pair"`` / ``"stages"`` and ``"lt{stages}"`` for
    ``"tma"``: the tuning cache's names."""
    loads = {"step": "", "pair": "lp", "stages": "ls", "tma": f"lt{self.stages}"}[self.loads]
    return (f"s{self.split}w{self.warps}c{self.span}b{self.blocks_per_sm}" + ("t2" if self.token_split == 2 else "")
            + ("xs" if self.x_load == "shuffle" else "xm") + loads)

  @classmethod
  def get_default(cls, m: int, k: int, n: int, *, buffer: bool = False) -> Nm24DecodeConfig:
    """Measured on an H100 (``benchmarks/results/gpu_nm_decode_2026-11-23_h100.md``, ``..._2026-11-24_h100.md`` and,
    above 16 rows, ``llm_decode_nm32_configs_2026-11-28_h100.md``).

    ``M <= 8``: spans of 128 columns. From 64 spans (N >= 8192) blocks of 8 warps, about 1024 warps in
    all (N = 8192: 2 blocks per span; N = 11008, 14336, 16384: one), 0.63-0.70 of dense at M = 1 for
    K = 2048-4096; fewer spans (N = 4096): clusters of 8 blocks of 4 warps (0.78-0.80). ``x`` by shuffles, but
    reading cuSPARSELt's buffer with 768 warps or more in all through ``ldmatrix``: on an H200 those products (the
    Llama-3-8B ones) took 1.04-1.09 of dense's time with shuffles at 4096 x 4096 and 14336 x 4096 and 0.69-0.81
    with ``ldmatrix`` (``benchmarks/results/llm_decode_nm24_buffer_2026-12-01_h200.md``).
    ``8 < M <= 16``: spans of 64 columns (half the accumulators per lane), in blocks of 8 warps from 128
    spans (N >= 8192) and of 4 below; the split brings the warps nearest 1536, the best of the splits measured
    at N = 4096-16384: 0.59-0.85 of dense at M = 12-16 (N = 4096: 0.85, against 0.95 for the best split of
    128-column spans; N = 11008: 0.71 with 1376 warps, 0.88 with 2752).
    ``16 < M <= 32``: spans of 64 columns and the warps per span (a power of two) that bring the warps nearest
    768, each count in the (split, warps) that won most often (:data:`_NM24_WARPS_PER_SPAN`; 8 warps a span in one
    block from 25 rows), ``ldmatrix`` but shuffles from 25 rows at 64 warps per span. At 44 products of 17-32 rows
    (K = 1024-14336, N = 2048-28672), 0.60-0.95 of dense and 1.00-1.24 of the best of 72-96 configs (geometric mean
    1.05 at 17-24 rows, 1.02 at 25-32); the rules before them ran 5 of the 16 products they were not fitted on
    slower than dense (up to 1.36). At 32 warps per span (clusters of 8 blocks of 4 warps) from 25 rows, three
    blocks a multiprocessor and ``ldmatrix``: on an H200 at 32 rows, reading cuSPARSELt's buffer, 2048 x 2048 and
    5632 x 2048 took 5.9 and 10.0 µs (0.91-0.95 of dense) against 9.2 and 16.1 with one block and shuffles (H100
    fitted; ``benchmarks/results/llm_decode_nm24_buffer_2026-12-01_h200.md``). Reading cuSPARSELt's buffer
    (``buffer``) with ``loads="pair"``: on an H200 at 24 and 32 rows, 0.65-1.03 of the time with ``"step"`` (14
    products), where on the indices it took 0.89-1.09 (``benchmarks/results/llm_decode_nm24_loads_2026-12-01_h200.md``).

    Reading cuSPARSELt's buffer (``buffer``) at up to 8 rows the default is none of the above (those stay among the
    candidates, :func:`nm24_candidate_configs`) but ``loads="tma"`` on 64-column spans with two stages and the
    (split, warps) that bring the warps in all nearest 768 with at least two pairs of steps a warp: on an H200 it took
    0.67-0.97 of the time of the rules above at 32 products of 1-8 rows
    (``benchmarks/results/llm_decode_nm24_tma_2026-12-01_h200.md``; blocks of 4 warps at least from 1024 column
    spans, where 2 took 1.01-1.02 at a 4096 x 128256 LM head).

    Args:
      m, k, n: the product's rows, depth and columns.
      buffer: whether the kernel reads cuSPARSELt's buffer (:func:`~jaxsparse._cuda._kernels.nm24_decode_buffer`).
    """
    if buffer and m <= 8:
      return _tma_default(k, n)
    return _step_default(m, k, n, buffer)


def _step_default(m: int, k: int, n: int, buffer: bool) -> Nm24DecodeConfig:
  """:meth:`Nm24DecodeConfig.get_default` without ``loads="tma"``: the rules its docstring gives by rows."""
  if m > 16:
    spans, pairs = n // 64, k // 64
    per_span = min(_NM24_WARPS_PER_SPAN, key=lambda w: abs(math.log(spans * w / 768)))
    while per_span > 2 and pairs < per_span:
      per_span //= 2
    split, warps = (1, 8) if per_span == 8 and m > 24 else _NM24_WARPS_PER_SPAN[per_span]
    three = m > 24 and per_span == 32  # clusters of 8 blocks of 4 warps: three a multiprocessor
    return Nm24DecodeConfig(split, warps, 64, blocks_per_sm=3 if three else 1,
                            x_load="shuffle" if m > 24 and per_span == 64 else "ldmatrix",
                            loads="pair" if buffer else "step")
  span = 128 if m <= 8 and n % 128 == 0 else 64
  spans = n // span
  pairs = k // 64
  if span == 64:
    warps = 8 if spans >= 128 else 4
    # The split that brings the warps nearest 1536 (by ratio).
    split = min((1, 2, 4, 8), key=lambda s: abs(math.log(spans * s * warps / 1536)))
  elif spans >= 64:
    split, warps = 1, 8
    while split < 8 and spans * 8 * split * 2 <= 1024:
      split *= 2
  else:
    split = 8
    while split > 1 and spans * split > 256:
      split //= 2
    warps = 4
  # Every warp should get at least one pair of steps of K.
  while split > 1 and pairs < split * warps:
    split //= 2
  while warps > 2 and pairs < split * warps:
    warps //= 2
  # Up to 8 rows x by shuffles, but reading the buffer with 768 warps or more through ldmatrix.
  ldmatrix = m > 8 or (buffer and spans * split * warps >= _NM24_BUFFER_LDMATRIX_WARPS)
  return Nm24DecodeConfig(split=split, warps=warps, span=span, x_load="ldmatrix" if ldmatrix else "shuffle")


# Up to 8 rows, reading cuSPARSELt's buffer: from this many warps in all the default loads x through ldmatrix. On an
# H200 shuffles took 1.02-1.51 of ldmatrix's time on the default configs of 768-1792 warps (Llama-3-8B's products) and
# 0.95-1.02 on those of 512-704 (TinyLlama's; ``benchmarks/results/llm_decode_nm24_buffer_2026-12-01_h200.md``).
_NM24_BUFFER_LDMATRIX_WARPS = 768


def _tma_default(k: int, n: int) -> Nm24DecodeConfig:
  """The ``loads="tma"`` default (cuSPARSELt's buffer, up to 8 rows): 64-column spans, two stages, and the (split,
  warps) that bring the warps in all nearest 768 (by ratio; more warps a block on a tie) with at least two pairs of
  steps a warp, in blocks of 4 warps at least from 1024 column spans. On an H200 at 1 and 8 rows of 16 products (the
  Llama-3-8B and TinyLlama ones) it took 1.00-1.05 of the best of 96 ``"tma"`` configs at 14 and 1.15 at 5632 x 2048,
  where a neighbour (:func:`nm24_candidate_configs`) is the best, and 0.67-0.97 of the other builds' default at 32
  products (``benchmarks/results/llm_decode_nm24_tma_2026-12-01_h200.md``)."""
  spans, pairs = n // 64, k // 64
  # From 1024 spans (N >= 65536) blocks of 4 warps at least: at the 4096 x 128256 LM head 2 warps a block (4008 warps)
  # took 1.07x the time of 4 (8016); at 2048 x 32000 (500 spans) they tied, at 4096 x 28672 (448) 2 won.
  fewest = 4 if spans >= 1024 else 2
  shapes = [(s, w) for s in (1, 2, 4, 8) for w in (8, 4, 2) if w >= fewest and pairs >= 2 * s * w] or [(1, fewest)]
  split, warps = min(shapes, key=lambda sw: abs(math.log(spans * sw[0] * sw[1] / 768)))
  return Nm24DecodeConfig(split, warps, 64, x_load="ldmatrix", loads="tma")


# Above 16 rows: the (split, warps) of each count of warps per column span, the one that won most often at that count
# at 17-24 rows (``benchmarks/results/llm_decode_nm32_configs_2026-11-28_h100.md``).
_NM24_WARPS_PER_SPAN = {2: (1, 2), 4: (1, 4), 8: (2, 4), 16: (2, 8), 32: (8, 4), 64: (8, 8)}


def nm24_candidate_configs(m: int, k: int, n: int, *, buffer: bool = False) -> list[Nm24DecodeConfig]:
  """The configs measured dispatch times for an ``(m, k) @ (k, n)`` product: the default first, then its neighbours
  and the default with two blocks per multiprocessor; above 8 rows also the default with its rows split over two
  warps (``token_split``), with the other ``x_load`` and with the other two ``loads``, and above 16 rows the 4-warp
  ones of the default and its neighbours with three blocks per multiprocessor and ``ldmatrix`` loads of ``x`` (on
  an H200 at 32 rows the best candidate took 0.79-0.95 of the best before at 7 of 8 TinyLlama products and layouts;
  the Llama-3-8B ones keep an 8-warp config: ``benchmarks/results/llm_decode_nm24_blocks_2026-12-01_h200.md``); up to
  8 rows also the default with the other load of ``x`` and ``ldmatrix`` loads on 64-column spans with the
  default's warps per span and with its warps in all. On an H200, ``ldmatrix`` on 64-column spans was the best of 48
  configs at all 8 products of 1 and 8 rows it was fitted on (``NMSparseMatrix.indices``), and these candidates were
  the best at 6 and within 1.2% at 2, 4-14% under the default
  (``benchmarks/results/llm_decode_nm24_small_rows_2026-11-28_h200.md``); reading cuSPARSELt's buffer they took
  0.94-1.0 of the candidates' best without them at 16 products of 1 and 8 rows, and the candidates' best was within
  2.1% of the best of 88-96 configs at 14 (2048 x 11264: 6-8%;
  ``benchmarks/results/llm_decode_nm24_buffer_2026-12-01_h200.md``).

  Reading cuSPARSELt's buffer at up to 8 rows the default streams by bulk copies (``loads="tma"``); its candidates
  are that default, with three stages, with half and twice the split or the warps and with the other warp counts at
  the same warps per span, then every candidate above of the other builds' default (so tuning never offers less than
  before). On an H200 at 32 products of 1-8 rows the best bulk-copy candidate took 0.78-1.03 of the best of the
  others, and the default 0.67-0.97 of the other builds' default
  (``benchmarks/results/llm_decode_nm24_tma_2026-12-01_h200.md``).

  A default of three blocks per multiprocessor (from 25 rows at 32 warps per span) comes first and its one-block
  build second: the neighbours and variants below are those of the one-block build.

  Up to 16 rows the neighbours are half and twice the split, the other warp count at the same warps per span and the
  other span. Above 16 rows they are the other (split, warps) pairs of the default's warps per span, the usual pair
  and the 4-warp pair of half and twice as many, and twice as many on 128-column spans: at 44 products of 17-32 rows
  their best was the best of every config at 37 and within 1.13 of it at all
  (``benchmarks/results/llm_decode_nm32_configs_2026-11-28_h100.md``).

  The defaults were fitted at a few ``K`` and ``N``; a product elsewhere may run better one step away, which only a
  measurement can tell.

  >>> [c.name for c in nm24_candidate_configs(1, 4096, 4096)]  # doctest: +NORMALIZE_WHITESPACE
  ['s8w4c128b1xs', 's4w4c128b1xs', 's4w8c128b1xs', 's8w4c64b1xs', 's8w4c128b2xs', 's8w4c128b1xm', 's8w4c64b1xm',
   's8w2c64b1xm']
  >>> [c.name for c in nm24_candidate_configs(1, 4096, 4096, buffer=True)]  # doctest: +NORMALIZE_WHITESPACE
  ['s2w8c64b1xmlt2', 's2w8c64b1xmlt3', 's1w8c64b1xmlt2', 's4w8c64b1xmlt2', 's2w4c64b1xmlt2', 's8w2c64b1xmlt2',
   's4w4c64b1xmlt2', 's8w4c128b1xm', 's4w4c128b1xm', 's4w8c128b1xm', 's8w4c64b1xm', 's8w4c128b2xm', 's8w4c128b1xs',
   's8w2c64b1xm']

  Args:
    m, k, n: the product's rows, depth and columns.
    buffer: whether the kernel reads cuSPARSELt's buffer (:func:`~jaxsparse._cuda._kernels.nm24_decode_buffer`).

  Returns:
    The configs, the default first, each once.
  """
  d = Nm24DecodeConfig.get_default(m, k, n, buffer=buffer)
  if d.loads == "tma":
    return _tma_candidates(d, k) + _step_candidates(_step_default(m, k, n, buffer), m, k, n)
  return _step_candidates(d, m, k, n)


def _tma_candidates(d: Nm24DecodeConfig, k: int) -> list[Nm24DecodeConfig]:
  """``d`` (a ``loads="tma"`` default), a third stage, half and twice the split, half and twice the warps, and the
  other warp counts at the same warps per span."""
  out = [d, dataclasses.replace(d, stages=3)]
  per_span = d.split * d.warps
  for split, warps in ((d.split // 2, d.warps), (d.split * 2, d.warps), (d.split, d.warps // 2), (d.split, d.warps * 2),
                       *((per_span // w, w) for w in (2, 4, 8))):
    if split in (1, 2, 4, 8) and warps in (2, 4, 8) and k // 64 >= split * warps:
      cfg = dataclasses.replace(d, split=split, warps=warps)
      if cfg not in out:
        out.append(cfg)
  return out


def _step_candidates(d: Nm24DecodeConfig, m: int, k: int, n: int) -> list[Nm24DecodeConfig]:
  """The candidates of a default ``d`` of the ``"step"`` / ``"pair"`` builds (:func:`nm24_candidate_configs`)."""
  base = dataclasses.replace(d, blocks_per_sm=1)  # the neighbours and variants are of the one-block build
  out = [d] + ([base] if base != d else [])
  if m > 16:
    per_span = d.split * d.warps
    shapes = [(d.split * 2, d.warps // 2, 64), (d.split // 2, d.warps * 2, 64)]
    for w in (per_span // 2, per_span * 2):
      if w in _NM24_WARPS_PER_SPAN:
        shapes += [(*_NM24_WARPS_PER_SPAN[w], 64), (w // 4, 4, 64)]
    if per_span * 2 in _NM24_WARPS_PER_SPAN:  # the same warps in all on spans of 128 columns
      shapes.append((*_NM24_WARPS_PER_SPAN[per_span * 2], 128))
  else:
    other_warps = 8 if d.warps == 4 else 4
    shapes = [(d.split // 2, d.warps, d.span), (d.split * 2, d.warps, d.span),
              (d.split * d.warps // other_warps, other_warps, d.span), (d.split, d.warps, 64 if d.span == 128 else 128)]
  for split, warps, span in shapes:
    if split not in (1, 2, 4, 8) or warps not in (2, 4, 8) or n % span or k // 64 < split * warps:
      continue
    cfg = dataclasses.replace(base, split=split, warps=warps, span=span)
    if cfg not in out:
      out.append(cfg)
  shaped = list(out)  # the default and its neighbours
  out.append(dataclasses.replace(base, blocks_per_sm=2))
  other_x = dataclasses.replace(base, x_load="shuffle" if base.x_load == "ldmatrix" else "ldmatrix")
  if m <= 8:  # the default's other x load, and ldmatrix on 64-column spans with its warps per span and in all
    loads = [other_x]
    if base.span == 128:
      loads.append(dataclasses.replace(base, span=64, x_load="ldmatrix"))
      if base.warps > 2:
        loads.append(dataclasses.replace(base, span=64, warps=base.warps // 2, x_load="ldmatrix"))
    out += [c for c in loads if c not in out and (c.warps == base.warps or k // 64 >= c.split * c.warps)]
  else:
    out += [dataclasses.replace(base, token_split=2), other_x]
    out += [dataclasses.replace(base, loads=loads) for loads in NM24_LOADS if loads not in (base.loads, "tma")]
    if m > 16:  # three blocks of 4 warps a multiprocessor (registers capped at 168 a thread), x through ldmatrix
      thirds = [dataclasses.replace(c, blocks_per_sm=3, x_load="ldmatrix") for c in shaped if c.warps == 4]
      out += [c for c in dict.fromkeys(thirds) if c not in out]
  return out
