"""The Mosaic GPU sampled ``xᵀ dY`` kernel (:mod:`jaxsparse.pallas._block_sparse_sdd_mgpu`).

Its work-item logic runs on a CPU (replayed in NumPy against the dense product); the kernel itself
needs a Hopper GPU (jax 0.10's Mosaic GPU interpreter has no transposed wgmma operands), so the
kernel tests are marked ``gpu`` (``benchmarks/run_gpu.sh tests``).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import KernelConfig
from jaxsparse.pallas import _block_sparse_config as kernel_config
from jaxsparse.pallas import _block_sparse_matmul as kernels
from jaxsparse.pallas import _block_sparse_sdd_mgpu as sdd
from jaxsparse.pallas import _common
from jaxsparse.pallas import _dense_route as dense_route
from jaxsparse.pallas import _transpose
from tests.test_pallas_block_sparse import RTOL
from tests.test_pallas_block_sparse import RTOL_TF32
from tests.test_pallas_block_sparse import _assert_close
from tests.test_pallas_block_sparse import _dense_reference
from tests.test_pallas_block_sparse import _problem

needs_hopper = pytest.mark.skipif(not kernels.mosaic_available(), reason=kernels.mosaic_unavailable_reason())


@pytest.fixture(autouse=True)
def _quiet_triton_deprecation():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    yield


@pytest.mark.parametrize("order", ["rows", "cols"])
# long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it (group 4)
@pytest.mark.parametrize("group", [2, pytest.param(4, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("pattern", ["random", "single", "dense"])
def test_items_rebuild_the_sampled_product(pattern, group, order):
  # The kernel's work items, replayed in NumPy: each item's blocks get x[:, row]ᵀ dY[:, col].
  x, dy, w = _problem(24, 5 * 32, 7 * 32, (32, 32), pattern, jnp.float32, seed=group)
  (bk, bn) = w.block_shape
  num_items, rows, blocks, cols = (np.asarray(a) for a in _common.items_of(w, group, order))
  n = int(num_items[0])
  assert rows.shape[0] >= n and blocks.shape == cols.shape == (rows.shape[0] * group,)
  xs, dys = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  out = np.full(w.data.shape, np.nan)
  row_of, col_of = np.asarray(w.row_indices), np.asarray(w.col_indices)
  for it in range(n):
    i = rows[it]
    for q in range(group):
      t, j = blocks[it * group + q], cols[it * group + q]
      assert row_of[t] == i and col_of[t] == j  # a padded slot repeats a block of the same row
      out[t] = xs[:, i * bk : (i + 1) * bk].T @ dys[:, j * bn : (j + 1) * bn]
  _, _, ddata_ref = _dense_reference(x, dy, w)
  np.testing.assert_allclose(out, np.asarray(ddata_ref, np.float64), rtol=1e-4, atol=1e-4)
  # Items are as few as runs of `group` allow: sum over block rows of ceil(kept / group).
  per_row = np.diff(np.asarray(w.row_offsets))
  assert n == int(np.sum(-(-per_row // group)))
  # The order the thread blocks take them in: by (row, first column) or by (first column, row).
  firsts = cols[: n * group : group]
  pairs = np.stack([rows[:n], firsts], 1) if order == "rows" else np.stack([firsts, rows[:n]], 1)
  keys = [tuple(p) for p in pairs.tolist()]
  assert keys == sorted(keys)
  with pytest.raises(ValueError, match="order='diagonal'"):
    _common.items_of(w, group, "diagonal")


def test_config_defaults_fit_and_errors():
  for bs, dtype in [(bs, dt) for bs in [(64, 64), (128, 128), (64, 128), (128, 64)] for dt in (jnp.bfloat16,
                    jnp.float32)] + [((64, 32), jnp.float32), ((128, 32), jnp.float32)]:
    cfg = sdd.MosaicSddConfig.get_default(bs, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    assert cfg.smem_bytes(bs, itemsize) <= 227 * 1024 and cfg.num_stages >= 3 and cfg.group == 2
    # The deepest ring that fits, up to MAX_STAGES (6: 8 measured slower).
    deeper = dataclasses.replace(cfg, num_stages=cfg.num_stages + 1)
    assert cfg.num_stages == sdd.MAX_STAGES or deeper.smem_bytes(bs, itemsize) > 227 * 1024, (bs, dtype, cfg)
    assert cfg.group // 2 * bs[0] * bs[1] <= 128 * 128  # accumulator registers per thread
    assert cfg.tile_m * itemsize == 128  # one 128-byte swizzle row of x / dY per step
  with pytest.raises(ValueError, match="group=3"):
    sdd.MosaicSddConfig(group=3)
  with pytest.raises(ValueError, match="tile_m=16"):
    sdd.MosaicSddConfig(tile_m=16)
  with pytest.raises(ValueError, match="order='diagonal'"):
    sdd.MosaicSddConfig(order="diagonal")
  x, dy, w = _problem(64, 128, 128, (64, 64), "random", jnp.bfloat16)
  assert sdd.supports(x, dy, w)
  assert "one dtype" in sdd.unsupported_reason(x.astype(jnp.float32), dy, w)
  x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
  w32 = w.with_data(w.data.astype(jnp.float32))
  assert sdd.supports(x32, dy32, w32)
  assert "tile_m=32" in sdd.unsupported_reason(x32, dy32, w32, sdd.MosaicSddConfig(tile_m=64))
  assert "tile_m=32" in sdd.unsupported_reason(x, dy, w, sdd.MosaicSddConfig(tile_m=32))
  for bs in [(32, 64), (64, 32)]:
    _, _, w_small = _problem(64, 128, 128, bs, "random", jnp.bfloat16)
    assert "bk" in sdd.unsupported_reason(x, dy, w_small)
  assert "shared memory" in sdd.unsupported_reason(x, dy, w, sdd.MosaicSddConfig(group=8, num_stages=8))
  x128, dy128, w128 = _problem(64, 256, 256, (128, 128), "random", jnp.bfloat16)
  assert "registers" in sdd.unsupported_reason(x128, dy128, w128, sdd.MosaicSddConfig(group=4, num_stages=1))


def test_dw_defaults_where_they_measured_faster(monkeypatch):
  monkeypatch.setattr(kernel_config, "_mosaic_probe", lambda: None)  # as on a Hopper GPU
  get = BlockSparseMatmulConfig.get_default
  # 16-bit: the Mosaic dW for 64 x 64 blocks only (Triton was faster at 128 x 128).
  assert get(8192, (4096, 4096), (64, 64), 1024, jnp.bfloat16).mosaic_dw == sdd.MosaicSddConfig(group=2, num_stages=6)
  assert get(8192, (4096, 4096), (64, 64), 1024, jnp.float32).mosaic_dw.group == 2
  assert get(8192, (4096, 4096), (128, 128), 256, jnp.bfloat16).mosaic_dw is None
  assert get(64, (4096, 4096), (64, 64), 1024, jnp.bfloat16).mosaic_dw is None
  # Float32 (TF32): every block with bk >= 64, from M = 128.
  for bs in [(128, 128), (64, 64), (64, 32)]:
    assert get(8192, (4096, 4096), bs, 256, jnp.float32).mosaic_dw.tile_m == 32
  assert get(128, (4096, 4096), (128, 128), 256, jnp.float32).mosaic_dw.tile_m == 32
  assert get(127, (4096, 4096), (128, 128), 256, jnp.float32).mosaic_dw is None
  # Small blocks elsewhere: one dense xᵀdY plus a gather, unless very sparse.
  for bs, dtype in [((32, 32), jnp.bfloat16), ((32, 32), jnp.float32), ((64, 32), jnp.bfloat16)]:
    nnz = (4096 // bs[0]) * (4096 // bs[1]) // 4
    cfg = get(8192, (4096, 4096), bs, nnz, dtype)
    assert cfg.dw_dense and cfg.mosaic_dw is None
    assert not get(8192, (4096, 4096), bs, nnz // 4, dtype).dw_dense  # density 1/16
  assert not get(8192, (4096, 4096), (64, 64), 1024, jnp.bfloat16).dw_dense


def test_dense_then_gather_dw_matches_dense():
  # The XLA dW path of small blocks (also what the GPU runs for them): rectangular blocks, an
  # empty block row and column.
  x, dy, w = _problem(40, 5 * 32, 6 * 16, (32, 16), "random", jnp.float32, seed=9)
  ddata = dense_route.dw_dense_then_gather(x, dy, w, precision=jax.lax.Precision.HIGHEST)
  _, _, ddata_ref = _dense_reference(x, dy, w)
  _assert_close(ddata, ddata_ref, jnp.float32, "dW", 1e-5)


@pytest.mark.parametrize(("x_dtype", "w_dtype", "product"), [("bfloat16",) * 3, ("float32", "bfloat16", "float32")])
def test_dense_then_gather_dw_product_in_the_weight_dtype(x_dtype, w_dtype, product):
  # 16-bit operands: the dense xᵀdY is written in 16 bits (no K x N float32 array: half the bytes), and
  # rounds as the float32 product cast afterwards; wider operands keep a float32 product.
  x, dy, w = _problem(48, 4 * 32, 3 * 32, (32, 32), "random", jnp.dtype(x_dtype), seed=3)
  w = w.with_data(w.data.astype(w_dtype))
  route = jax.jit(lambda x, dy: dense_route.dw_dense_then_gather(x, dy, w, precision=None))
  hlo = route.lower(x, dy).as_text()
  dots = [line for line in hlo.splitlines() if "dot_general" in line]
  assert len(dots) == 1 and f"tensor<128x96x{jnp.dtype(product).name.replace('float', 'f')}>" in dots[0], dots
  ddata = route(x, dy)
  assert ddata.dtype == jnp.dtype(w_dtype)
  _, _, ddata_ref = _dense_reference(x, dy, w)
  _assert_close(ddata, ddata_ref, getattr(jnp, w_dtype), "dW")
  # The same values as the float32 product gathered and cast.
  full = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  blocks = full.reshape(4, 32, 3, 32)[w.row_indices, :, w.col_indices, :].astype(w_dtype)
  np.testing.assert_array_equal(np.asarray(ddata), np.asarray(blocks))


GPU_CASES = [
    (m, b, pattern, dtype, group)
    for m in (1024, 300)
    for b in [(64, 64), (128, 128)]
    for pattern, dtype in [("random", jnp.bfloat16), ("random", jnp.float16), ("single", jnp.bfloat16)]
    for group in (None,)
] + [
    (m, b, pattern, jnp.float32, None)
    for m in (1024, 300)
    for b in [(64, 64), (128, 128), (64, 32)]
    for pattern in ("random", "single")
] + [
    (512, (64, 64), "random", jnp.bfloat16, 2),
    (512, (64, 64), "dense", jnp.bfloat16, 8),
    (512, (64, 128), "random", jnp.bfloat16, None),
    (512, (128, 64), "random", jnp.float16, None),
    (448, (64, 64), "random", jnp.bfloat16, None),
    (512, (64, 64), "random", jnp.float16, 4),
    (512, (128, 64), "dense", jnp.float32, 2),
    # 456 rows: a multiple of 8, not of tile_m; the 16-bit kernel reads the last step past row M (zero fill).
    (456, (64, 64), "random", jnp.bfloat16, None),
    (456, (128, 128), "random", jnp.float16, None),
    (456, (64, 64), "random", jnp.float32, None),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("m", "block_shape", "pattern", "dtype", "group"), GPU_CASES)
def test_gpu_sampled_dw_matches_dense(m, block_shape, pattern, dtype, group):
  # "random" has an empty block row and column; m = 300 / 448 / 456 are not multiples of tile_m = 64 / 128 (300:
  # nor of 8, padded; 448 / 456: read without padding where 16-bit).
  # N > K: the items run in column order ("auto").
  _check_sampled_dw(m, 512, 768, block_shape, pattern, dtype, group)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("order", ["auto", "rows", "cols"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_sampled_dw_item_orders(order, dtype):
  # K > N: "auto" is the row order.
  _check_sampled_dw(320, 768, 512, (64, 64), "random", dtype, None, order=order)


def _check_sampled_dw(m, k, n, block_shape, pattern, dtype, group, order="auto"):
  x, dy, w = _problem(m, k, n, block_shape, pattern, dtype, seed=m + block_shape[1])
  cfg = dataclasses.replace(sdd.MosaicSddConfig.get_default(block_shape, dtype), order=order)
  if group is not None:
    cfg = dataclasses.replace(cfg, group=group, num_stages=2)
    if dtype != jnp.float32:
      cfg = dataclasses.replace(cfg, tile_m=128 if group == 4 else 64)
  poisoned = jnp.full(w.data.shape, jnp.nan, dtype)
  w = w.with_data(poisoned)  # the kernel reads only the pattern; every block must be written
  ddata = jax.jit(lambda x, dy, w: sdd.sampled_dw(x, dy, w, config=cfg))(x, dy, w)
  _, _, ddata_ref = _dense_reference(x, dy, w.with_data(jnp.zeros_like(poisoned)))
  assert ddata.dtype == dtype
  _assert_close(ddata, ddata_ref, dtype, "dW", RTOL_TF32 if dtype == jnp.float32 else RTOL[dtype])


@pytest.mark.gpu
@needs_hopper
def test_gpu_backward_dispatches_dw_to_mosaic(monkeypatch):
  # A long weight (N = 4 K): 64-blocks take the Mosaic dW from 1024 rows, items by block row below 2048. (A grid of
  # more blocks than SMs: one that fits a wave runs dense, DenseRules.dw_max_grid_per_sm.)
  x, dy, w = _problem(1024, 512, 2048, (64, 64), "random", jnp.bfloat16, seed=3)
  cfg = BlockSparseMatmulConfig.get_default(1024, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
  assert cfg.mosaic_dw is not None and cfg.mosaic_dw.order == "rows"
  calls, real = [], sdd.sampled_dw
  monkeypatch.setattr(sdd, "sampled_dw", lambda *a, **k: calls.append(k) or real(*a, **k))
  _, ddata = kernels.backward(x, dy, w, config=cfg)
  assert len(calls) == 1
  _, _, ddata_ref = _dense_reference(x, dy, w)
  _assert_close(ddata, ddata_ref, jnp.bfloat16, "dW")
  # The Triton fallback (no Mosaic config) gives the same blocks.
  tri = dataclasses.replace(cfg, mosaic_dw=None, dw=KernelConfig(64))
  _, ddata_tri = kernels.backward(x, dy, w, config=tri)
  _assert_close(ddata, ddata_tri, jnp.bfloat16, "dW vs Triton")


def test_small_dense_patterns_run_densely():
  get = BlockSparseMatmulConfig.get_default
  blocks = (4096 // 32) ** 2
  assert get(8192, (4096, 4096), (32, 32), blocks // 2, jnp.bfloat16).dense  # d = 0.5: 1.5x dense measured
  assert not get(8192, (4096, 4096), (32, 32), blocks // 4, jnp.bfloat16).dense  # d = 0.25: 0.95
  assert not get(8192, (4096, 4096), (64, 64), (4096 // 64) ** 2 // 2, jnp.float32).dense


@pytest.mark.parametrize(("m", "k", "dtype"), [(128, 192, jnp.float32), (64, 64, jnp.bfloat16), (96, 128, jnp.float32)])
def test_transpose_kernel_is_exact(m, k, dtype):
  # The float32 dW operands' transpose, in Pallas interpret mode; (96, 128) is not tiled: XLA's x.T.
  x = jax.random.normal(jax.random.key(m + k), (m, k), dtype)
  out = _transpose.transpose(x, interpret=True)
  assert out.shape == (k, m) and out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x, np.float32).T)
  with pytest.raises(ValueError, match="x must be 2-D"):
    _transpose.transpose(x[None])


@pytest.mark.gpu
@pytest.mark.skipif(not _common.available(), reason=_common.unavailable_reason())
@pytest.mark.parametrize("shape", [(8192, 2048), (320, 4096), (2048, 8192 + 64)])
def test_gpu_transpose_kernel_is_exact(shape):
  x = jax.random.normal(jax.random.key(shape[1]), shape, jnp.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(_transpose.transpose)(x)), np.asarray(x).T)
