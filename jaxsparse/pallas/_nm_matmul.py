"""Pallas GPU kernel for ``x @ W`` with an N:M-sparse ``W`` read in compressed form.

``W`` is a ``(K, N)`` :class:`jaxsparse.NMSparseMatrix` with its groups along ``K`` (axis 0): the
kernel reads only the kept values (``K * n / m`` rows) and the packed positions, and expands them
on chip into a dense ``(block_groups * m, block_n)`` tile for a tensor-core dot. Work on the tensor
cores is that of the dense product (Hopper has no sparse tensor-core instruction reachable from
Pallas); what shrinks is the weight traffic (a 2:4 bfloat16 weight is 56% of the dense bytes), which
matters when ``M`` is small (decode). The expansion itself, a select per weight and a trip through
shared memory into the tensor cores' operand layout, then limits the speed: 0.79-1.0x the dense time
at M = 16 on an H100 with the weights read from HBM, and no faster with them in L2 (1.5x dense there;
``benchmarks/results/gpu_nm_2026-11-21.md``, ``gpu_decode_2026-11-23_h100.md``).

One program computes one ``(block_m, block_n)`` output tile. Each loop step loads one
``(block_groups, block_n)`` tile of packed position words; word ``r`` packs ``per_word`` groups
``r + s * rows`` (see :func:`jaxsparse.formats._nm.index_layout`), so each slot ``s`` of the tile covers a
contiguous run of ``block_groups`` groups, i.e. ``block_groups * m`` contiguous columns of ``x``.
With ``split_k > 1`` the loop is split over programs whose float32 partial sums are added after
the kernel (decode with few column tiles).

The kernel is a plain ``pl.pallas_call`` lowered through Triton on CUDA GPUs (compute capability
8.0 and later) and runs in Pallas interpret mode on a CPU, which is how CI tests it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxsparse import _utils
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm import index_layout
from jaxsparse.formats._nm import position_bits
from jaxsparse.pallas._common import PallasFallbackWarning
from jaxsparse.pallas._common import available
from jaxsparse.pallas._common import check_pattern
from jaxsparse.pallas._common import dot
from jaxsparse.pallas._common import grouped_tile
from jaxsparse.pallas._common import pad_rows
from jaxsparse.pallas._common import unavailable_reason

__all__ = [
    "NMMatmulConfig",
    "PallasFallbackWarning",
    "available",
    "forward",
    "preferred",
    "supports",
    "unavailable_reason",
    "unsupported_reason",
]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Triton tensors need power-of-two dims; the expanded tile has an axis of size m.
SUPPORTED_M = (2, 4, 8, 16)
# Rows up to which `jaxsparse.ops.nm_matmul` picks this kernel over expanding W and a dense product
# (measured, see benchmarks/results/gpu_nm_2026-11-21.md).
MAX_FUSED_ROWS = 64
# Decode splits the K loop until about this many programs run (4 per SM of an H100 / H200).
_SPLIT_TARGET = 512


def _pow2(v: int) -> bool:
  return v >= 1 and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class NMMatmulConfig:
  """Tiling of the N:M product kernel.

  Attributes:
    block_m: rows of ``x`` per program; a power of two >= 16.
    block_n: output columns per program; a power of two >= 16.
    block_groups: rows of the packed-position tile per loop step (each covers ``per_word`` runs of
      that many groups, i.e. ``block_groups * m`` columns of ``x`` per run); a power of two.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth of the loop over ``K``.
    split_k: split the loop over ``K`` into this many programs per output tile (float32 partial
      sums, added afterwards); for decode shapes with too few output tiles to fill the GPU.
    group_m: output tiles are visited ``group_m`` row tiles per column at a time, so that programs
      running together share their weight tile in L2.

  :meth:`get_default` chooses one per shape (computed on any machine; the kernel needs a CUDA GPU):

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pallas
  >>> cfg = pallas.NMMatmulConfig.get_default(16, (4096, 4096), 2, 4, jnp.bfloat16)  # decode: 16 rows
  >>> cfg.block_m, cfg.block_n, cfg.split_k
  (16, 128, 8)
  >>> pallas.NMMatmulConfig(block_m=32, block_n=64).num_warps
  4
  """

  block_m: int = 16
  block_n: int = 64
  block_groups: int = 32
  num_warps: int = 4
  num_stages: int = 3
  split_k: int = 1
  group_m: int = 8

  def __post_init__(self):
    for name in ("block_m", "block_n"):
      v = getattr(self, name)
      if v < 16 or not _pow2(v):
        raise ValueError(f"{name} must be a power of two >= 16, got {name}={v}.")
    if not _pow2(self.block_groups):
      raise ValueError(f"block_groups must be a power of two, got block_groups={self.block_groups}.")
    for name in ("num_warps", "num_stages", "split_k", "group_m"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}.")

  @classmethod
  def get_default(cls, rows: int, shape: tuple[int, int], n: int, m: int, dtype) -> NMMatmulConfig:
    """The default tiling for ``x`` of ``rows`` rows times an N:M ``W`` of ``shape`` ``(K, N)``.

    Decode (``rows <= 64``): 128 output columns per program and a tile of 4K expanded weights per
    step; the ``K`` loop is split until about 256 to 512 programs run, since one program per SM
    cannot expand weights as fast as memory delivers them (``benchmarks/gpu_nm.py --sweep`` on an
    H100 and an H200, 2026-11-21: 128 columns, 8 groups of 4 per step and splits 8 and 4 were the
    fastest tried at N = 4096 and 16384). Larger ``rows``: 128 x 128 output tiles.

    Args:
      rows: rows of ``x`` (all its leading axes together).
      shape: ``(K, N)`` of the weight.
      n, m: the N:M pattern (``m`` sets how many groups a step covers; ``n`` is not used).
      dtype: the operands' dtype (4-byte dtypes get half the tile, to fit shared memory).

    Returns:
      An ``NMMatmulConfig``; the kernel shrinks ``block_n`` / ``block_groups`` / ``split_k`` further where they
      do not divide ``w``'s shape.

    >>> import jax.numpy as jnp
    >>> from jaxsparse import pallas
    >>> cfg = pallas.NMMatmulConfig.get_default(4096, (4096, 4096), 2, 4, jnp.bfloat16)  # prefill: 4096 rows
    >>> cfg.block_m, cfg.block_n, cfg.num_warps, cfg.split_k
    (128, 128, 8, 1)
    """
    del n
    _, cols = shape
    wide = max(1, jnp.dtype(dtype).itemsize // 2)  # 4-byte dtypes: half the tile, to fit shared memory
    if rows <= MAX_FUSED_ROWS:
      bm = max(16, pl.next_power_of_2(rows))
      bn = max(16, min(128, _pow2_floor(cols)))
      cfg = cls(block_m=bm, block_n=bn, block_groups=max(1, 4096 // (m * bn * wide)), num_warps=4, num_stages=3)
    else:
      cfg = cls(block_m=128, block_n=128, block_groups=max(1, 64 // (m * wide)), num_warps=8, num_stages=3)
    tiles = pl.cdiv(rows, cfg.block_m) * pl.cdiv(cols, cfg.block_n)
    return dataclasses.replace(cfg, split_k=max(1, min(8, _SPLIT_TARGET // tiles)))


def _pow2_floor(v: int) -> int:
  return 1 << (max(1, v).bit_length() - 1)


# -------------------------------------------------------------------------------------------------
# Support.
# -------------------------------------------------------------------------------------------------


def _fit(cfg: NMMatmulConfig, w: NMSparseMatrix) -> NMMatmulConfig | str:
  """``cfg`` with tiles shrunk to divide ``w``'s shape, or why that is impossible."""
  k, cols = w.shape
  _, per_word = index_layout(w.n, w.m, w.groups)
  rows = w.groups // per_word
  bn = cfg.block_n
  while bn > 16 and cols % bn:
    bn //= 2
  if cols % bn:
    return f"N={cols} must be a multiple of 16"
  min_bg = max(1, 16 // w.m)  # the dot's contraction, block_groups * m, must be at least 16
  bg = cfg.block_groups
  while bg > min_bg and rows % bg:
    bg //= 2
  if bg < min_bg or rows % bg:
    return (
        f"K={k} with {w.n}:{w.m} packs {rows} rows of position words; the kernel needs a multiple of "
        f"{min_bg} (K a multiple of {min_bg * per_word * w.m})"
    )
  steps = rows // bg
  split = min(cfg.split_k, steps)
  while steps % split:
    split -= 1
  return dataclasses.replace(cfg, block_n=bn, block_groups=bg, split_k=split)


def unsupported_reason(x2: jax.Array, w: NMSparseMatrix, config: NMMatmulConfig | None = None) -> str | None:
  """Why :func:`supports` is False for these operands, or ``None`` when they are supported."""
  if not isinstance(w, NMSparseMatrix):
    return f"w must be an NMSparseMatrix, got {type(w).__name__}"
  if w.ndim != 2 or w.axis != 0:
    return f"w must be a 2-D (K, N) matrix with its groups along K (axis 0), got shape {w.shape}, axis={w.axis}"
  if w.m not in SUPPORTED_M:
    return f"m={w.m} is not one of {SUPPORTED_M}"
  for a in (x2, w.values):
    if jnp.dtype(a.dtype) not in SUPPORTED_DTYPES:
      return f"dtype {a.dtype} is not one of {[str(d) for d in SUPPORTED_DTYPES]}"
  if x2.ndim != 2 or x2.shape[1] != w.shape[0]:
    return f"x must be 2-D (M, K) with K = {w.shape[0]}, got shape {x2.shape}"
  fitted = _fit(config or NMMatmulConfig.get_default(x2.shape[0], w.shape, w.n, w.m, w.dtype), w)
  return fitted if isinstance(fitted, str) else None


def supports(x2: jax.Array, w: NMSparseMatrix) -> bool:
  """Whether the kernel handles ``x2 @ w``: 2-D operands, bf16 / f16 / f32, ``m`` in :data:`SUPPORTED_M`,
  ``N`` a multiple of 16 and ``K`` a multiple of a small tile (64 for 2:4)."""
  return unsupported_reason(x2, w) is None


def preferred(x2: jax.Array, w: NMSparseMatrix) -> bool:
  """Whether the kernel is expected to beat expanding ``W`` and a dense product (few rows)."""
  return x2.shape[0] <= MAX_FUSED_ROWS


# -------------------------------------------------------------------------------------------------
# Kernel.
# -------------------------------------------------------------------------------------------------


def _nm_kernel(x_ref, v_ref, idx_ref, y_ref, *, n, m, per_word, rows, steps, cfg: NMMatmulConfig, dot):
  """``y[i, j] = sum over steps: x[i, run] @ expand(values[run, :, j], positions[run, j])``.

  ``x_ref`` is ``(block_m, K)``, ``v_ref`` ``(groups, n, block_n)`` (the kept values of group
  ``g`` in row ``g``), ``idx_ref`` ``(rows, block_n)`` packed position words.
  """
  bg, bn = cfg.block_groups, cfg.block_n
  bits = position_bits(m)
  field = jnp.uint32((1 << bits) - 1)
  lanes = lax.broadcasted_iota(jnp.int32, (1, m, 1), 1)
  first = pl.program_id(1) * (steps * bg) if cfg.split_k > 1 else 0

  def step(t, acc):
    r0 = pl.multiple_of(first + t * bg, bg)
    words = idx_ref[pl.ds(r0, bg), :].astype(jnp.uint32)
    for s in range(per_word):
      # Slot s of these words holds groups g0 .. g0 + bg - 1: x columns g0 * m .. (g0 + bg) * m - 1.
      g0 = r0 + s * rows
      tile = jnp.zeros((bg, m, bn), v_ref.dtype)
      for j in range(n):
        pos = ((words >> jnp.uint32((s * n + j) * bits)) & field).astype(jnp.int32)
        tile = jnp.where(pos[:, None, :] == lanes, v_ref[pl.ds(g0, bg), j, :][:, None, :], tile)
      k0 = pl.multiple_of(g0 * m, bg * m)
      acc = acc + dot(x_ref[:, pl.ds(k0, bg * m)], tile.reshape(bg * m, bn))
    return acc

  acc = lax.fori_loop(0, steps, step, jnp.zeros(y_ref.shape, jnp.float32))
  y_ref[...] = acc.astype(y_ref.dtype)


def forward(
    x2: jax.Array,
    w: NMSparseMatrix,
    *,
    precision: lax.PrecisionLike = None,
    out_dtype: jax.typing.DTypeLike | None = None,
    config: NMMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
  """``x2 (M, K) @ W (K, N) -> (M, N)`` reading ``W`` compressed, accumulated in float32.

  Args:
    x2: ``(M, K)`` activations.
    w: N:M-sparse ``(K, N)`` weight with its groups along ``K``.
    precision: passed to the in-kernel dots (float32 inputs: ``None`` means TF32 on the GPU).
    out_dtype: output dtype; defaults to ``result_type(x2, w.values)``.
    config: tiling; defaults to :meth:`NMMatmulConfig.get_default` (shrunk to fit the shape).
    interpret: run in Pallas interpret mode (any backend, slow; for tests).

  Returns:
    ``(M, N)`` array of ``out_dtype``.
  """
  reason = unsupported_reason(x2, w, config)
  if reason is not None:
    raise ValueError(f"The Pallas N:M kernel does not support these operands: {reason}.")
  check_pattern(w, op="Pallas N:M forward")
  (mrows, k), (_, cols) = x2.shape, w.shape
  n, m, groups = w.n, w.m, w.groups
  _, per_word = index_layout(n, m, groups)
  rows = groups // per_word
  cfg = _fit(config or NMMatmulConfig.get_default(mrows, w.shape, n, m, w.dtype), w)
  compute_dtype = jnp.result_type(x2.dtype, w.dtype)
  out_dtype = jnp.dtype(out_dtype or compute_dtype)
  bm, bn, split = cfg.block_m, cfg.block_n, cfg.split_k
  xp = pad_rows(x2, bm)
  num_m, num_n = xp.shape[0] // bm, cols // bn
  steps = rows // cfg.block_groups // split
  tile = functools.partial(grouped_tile, num_m=num_m, num_n=num_n, group_m=cfg.group_m)
  values = w.values.reshape(groups, n, cols)  # free: rows g*n + j -> (g, j)
  if split == 1:
    out_shape = _utils.result_struct((xp.shape[0], cols), out_dtype, x2, w)
    out_spec = pl.BlockSpec((bm, bn), lambda p, s: tile(p))
  else:
    out_shape = _utils.result_struct((split, xp.shape[0], cols), jnp.float32, x2, w)
    out_spec = pl.BlockSpec((None, bm, bn), lambda p, s: (s, *tile(p)))
  kernel = functools.partial(
      _nm_kernel,
      n=n,
      m=m,
      per_word=per_word,
      rows=rows,
      steps=steps,
      cfg=cfg,
      dot=functools.partial(dot, contract=((1,), (0,)), compute_dtype=compute_dtype, precision=precision),
  )
  y = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(num_m * num_n, split),
      in_specs=[
          pl.BlockSpec((bm, k), lambda p, s: (tile(p)[0], 0)),
          pl.BlockSpec((groups, n, bn), lambda p, s: (0, 0, tile(p)[1])),
          pl.BlockSpec((rows, bn), lambda p, s: (0, tile(p)[1])),
      ],
      out_specs=out_spec,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=f"nm_matmul_{n}x{m}",
  )(xp, values, w.indices)
  if split > 1:
    y = y.sum(axis=0).astype(out_dtype)
  return y[:mrows]
