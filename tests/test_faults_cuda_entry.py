"""The GPU entry points treat their operands as untrusted, checked on the host before anything is launched (issue 36).

Runs on a CPU: the checks of the CUDA custom calls (``jaxsparse/_cuda/launch_checks.h``, what the FFI handlers of
``kernel_launch.cc`` and ``cusparselt_matmul.cc`` call) are compiled into a small driver with the local compiler;
the Python wrappers of ``jaxsparse._cuda`` raise before they compile or call a kernel; the Pallas entry points
(in interpret mode) reject index arrays that would address outside the weight's grid, naming the field.
"""

from __future__ import annotations

import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse._cpu._build import compiler
from jaxsparse._cuda import _cusparselt as cslt
from jaxsparse._cuda import _kernels as cuda_kernels
from jaxsparse.pallas import _block_sparse_matmul as bs_kernels
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
from jaxsparse.pallas import _block_sparse_sdd_mgpu as mosaic_sdd
from jaxsparse.pallas import _nm_matmul as nm_kernels
from jaxsparse.pallas._common import check_pattern

CHECKS = pathlib.Path(cuda_kernels.__file__).parent / "launch_checks.h"
G = 1 << 30

# (C++ call, fragment of the error; "" = accepted)
NATIVE_CASES = {
    "decode_ok": ("CheckNm24Decode(16, 4096, 4096, 2048, 4096, 512, 4096, 16, 4096, 4, 8, 128)", ""),
    "decode_rows": ("CheckNm24Decode(33, 4096, 4096, 2048, 4096, 512, 4096, 33, 4096, 1, 8, 128)", "M=33"),
    "decode_k_huge": ("CheckNm24Decode(1, 4 * G, 128, 2 * G, 128, G / 2, 128, 1, 128, 1, 8, 128)", "2**30"),
    "decode_split": ("CheckNm24Decode(1, 4096, 4096, 2048, 4096, 512, 4096, 1, 4096, 16, 8, 128)", "split=16"),
    "decode_warps": ("CheckNm24Decode(1, 4096, 4096, 2048, 4096, 512, 4096, 1, 4096, 1, 32, 128)", "warps=32"),
    "decode_span": ("CheckNm24Decode(1, 4096, 4096, 2048, 4096, 512, 4096, 1, 4096, 1, 8, 96)", "span=96"),
    "decode_values": ("CheckNm24Decode(1, 4096, 4096, 4096, 4096, 512, 4096, 1, 4096, 1, 8, 128)", "values (4096"),
    "decode_idx": ("CheckNm24Decode(1, 4096, 4096, 2048, 4096, 511, 4096, 1, 4096, 1, 8, 128)", "idx (511"),
    "decode_y": ("CheckNm24Decode(2, 4096, 4096, 2048, 4096, 512, 4096, 1, 4096, 1, 8, 128)", "y (1, 4096)"),
    "decode_buffer_ok": ("CheckNm24DecodeBuffer(16, 4096, 4096, 18874368, 16, 4096, 4, 8, 128)", ""),
    "decode_buffer_bytes": ("CheckNm24DecodeBuffer(16, 4096, 4096, 18874367, 16, 4096, 4, 8, 128)", "18874367 bytes"),
    "decode_buffer_values_only": ("CheckNm24DecodeBuffer(1, 4096, 4096, 16777216, 1, 4096, 1, 8, 128)", "K N 9 / 8"),
    "decode_buffer_k_huge": ("CheckNm24DecodeBuffer(1, 4 * G, 128, 576 * G, 1, 128, 1, 8, 128)", "2**30"),
    "decode_buffer_rows": ("CheckNm24DecodeBuffer(33, 4096, 4096, 18874368, 33, 4096, 1, 8, 128)", "M=33"),
    "decode_buffer_y": ("CheckNm24DecodeBuffer(2, 4096, 4096, 18874368, 2, 2048, 1, 8, 128)", "y (2, 2048)"),
    "decode_tma_ok": ("CheckNm24DecodeBufferTma(8, 4096, 4096, 18874368, 8, 4096, 2, 8, 64, 2, 256, 512)", ""),
    "decode_tma_rows": ("CheckNm24DecodeBufferTma(9, 4096, 4096, 18874368, 9, 4096, 2, 8, 64, 2, 256, 512)", "M=9"),
    "decode_tma_stages": ("CheckNm24DecodeBufferTma(1, 4096, 4096, 18874368, 1, 4096, 2, 8, 64, 5, 0, 0)", "stages=5"),
    "decode_tma_smem": ("CheckNm24DecodeBufferTma(1, 4096, 4096, 18874368, 1, 4096, 1, 8, 128, 3, 0, 0)",
                        "246784 bytes of shared memory, at most 204800"),
    "decode_tma_align": ("CheckNm24DecodeBufferTma(1, 4096, 4096, 18874368, 1, 4096, 1, 8, 64, 2, 8, 0)", "16-byte"),
    "decode_tma_bytes": ("CheckNm24DecodeBufferTma(1, 4096, 4096, 18874367, 1, 4096, 1, 8, 64, 2, 0, 0)",
                         "nm24_decode_buffer_tma: buffer of 18874367 bytes"),
    "tma_shared_bytes": ("Nm24TmaSharedBytes(8, 64, 2)", "91136"),
    "bs_decode_ok": ("CheckBlockSparseDecode(8, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 8, 4096, 64, 64, 4, 2, 2, "
                     "true, 256, 512)", ""),
    "bs_decode_rows": ("CheckBlockSparseDecode(9, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 9, 4096, 64, 64, 4, 2, 2, "
                       "true, 0, 0)", "M=9"),
    "bs_decode_block": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 32, 64, 65, 2048, 2048, 1, 4096, 32, 64, 4, 2, "
                        "2, true, 0, 0)", "block (32, 64)"),
    "bs_decode_warps": ("CheckBlockSparseDecode(1, 4096, 4096, 512, 128, 128, 33, 512, 512, 1, 4096, 128, 128, 3, 1, "
                        "2, true, 0, 0)", "warps=3, needs 1-8 and a multiple of bn / 64 = 2"),
    "bs_decode_split": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 1, 4096, 64, 64, 4, 3, "
                        "2, true, 0, 0)", "split=3"),
    "bs_decode_smem": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 1, 4096, 64, 64, 8, 1, 3, "
                       "true, 0, 0)", "222208 bytes of shared memory, at most 204800"),
    "bs_decode_k": ("CheckBlockSparseDecode(1, 4000, 4096, 2048, 64, 64, 65, 2048, 2048, 1, 4096, 64, 64, 4, 1, 2, "
                    "true, 0, 0)", "multiples of the block (64, 64)"),
    "bs_decode_k_huge": ("CheckBlockSparseDecode(1, 4 * G, 4096, 1, 64, 64, 65, 1, 1, 1, 4096, 64, 64, 4, 1, 2, "
                         "true, 0, 0)", "2**30"),
    "bs_decode_empty": ("CheckBlockSparseDecode(1, 4096, 4096, 0, 64, 64, 65, 0, 0, 1, 4096, 64, 64, 4, 1, 2, true, "
                        "0, 0)", "0 kept blocks"),
    "bs_decode_nnz_huge": ("CheckBlockSparseDecode(1, 4096, 4096, 1LL << 26, 64, 64, 65, 1LL << 26, 1LL << 26, 1, "
                           "4096, 64, 64, 4, 1, 2, true, 0, 0)", "2**31 / bk"),
    "bs_decode_data": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 32, 65, 2048, 2048, 1, 4096, 64, 64, 4, 1, 2, "
                       "true, 0, 0)", "data (2048, 64, 32)"),
    "bs_decode_offsets": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 64, 64, 2048, 2048, 1, 4096, 64, 64, 4, 1, "
                          "2, true, 0, 0)", "col_offsets of 64, needs N / bn + 1 = 65"),
    "bs_decode_order": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 64, 65, 2047, 2048, 1, 4096, 64, 64, 4, 1, "
                        "2, true, 0, 0)", "transpose_order of 2047"),
    "bs_decode_y": ("CheckBlockSparseDecode(2, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 1, 4096, 64, 64, 4, 1, 2, "
                    "true, 0, 0)", "y (1, 4096)"),
    "bs_decode_types": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 1, 4096, 64, 64, 4, 1, "
                        "2, false, 0, 0)", "dtypes"),
    "bs_decode_align": ("CheckBlockSparseDecode(1, 4096, 4096, 2048, 64, 64, 65, 2048, 2048, 1, 4096, 64, 64, 4, 1, "
                        "2, true, 0, 8)", "16-byte"),
    "bs_decode_shared_bytes": ("BlockSparseDecodeSharedBytes(4, 2)", "74752"),
    "transposable_ok": ("CheckNm24Transposable(64, 128, true, 64, 128, 16, 32)", ""),
    "transposable_types": ("CheckNm24Transposable(64, 128, false, 64, 128, 16, 32)", "dtype"),
    "transposable_pattern": ("CheckNm24Transposable(64, 128, true, 64, 128, 16, 31)", "pattern (16, 31)"),
    "transposable_odd": ("CheckNm24Transposable(62, 128, true, 62, 128, 15, 32)", "multiples of 4"),
    "transposable_grid": ("CheckNm24Transposable(G, G, true, G, G, G / 4, G / 4)", "one launch"),
    "transposable_negative": ("CheckNm24Transposable(-4, 8, true, -4, 8, -1, 2)", "2**30"),
    "compress_ok": ("CheckNm24TransposableCompress(128, 64, true, 32, 16, 9216, 9216)", ""),
    "compress_buffer": ("CheckNm24TransposableCompress(128, 64, true, 32, 16, 9216, 9215)", "9215"),
    "compress_k_grid": ("CheckNm24TransposableCompress(64 * 65536, 64, true, 16 * 65536, 16, 0, 0)", "65535"),
    "compress_overflow": ("CheckNm24TransposableCompress(1LL << 40, 1LL << 40, true, 0, 0, 0, 0)", "2**30"),
    "prune_ok": ("CheckNm24Prune(128, 64, true, 128, 64, 32, 64, 9216, true)", ""),
    "prune_no_buffer": ("CheckNm24Prune(8, 4, true, 8, 4, 2, 4, 0, false)", ""),
    "prune_bits": ("CheckNm24Prune(128, 64, true, 128, 64, 32, 16, 0, true)", "bits (32, 16)"),
    "prune_buffer_f32": ("CheckNm24Prune(128, 64, true, 128, 64, 32, 64, 9216, false)", "bfloat16"),
    "prune_buffer_size": ("CheckNm24Prune(128, 64, true, 128, 64, 32, 64, 100, true)", "100 bytes"),
    "register_ok": ('CheckRegister("nm24_decode", "ELF", 4)', ""),
    "register_no_name": ("CheckRegister(nullptr, \"x\", 1)", "name is empty"),
    "register_no_cubin": ('CheckRegister("k", nullptr, 0)', "cubin is empty"),
    "register_negative_size": ('CheckRegister("k", "x", -5)', "size -5"),
    "cslt_ok": ('CheckCslt("op", 4096, 4096, 0, 0)', ""),
    "cslt_layout": ('CheckCslt("op", 4096, 4096, 2, 0)', "layout=2"),
    "cslt_dtype": ('CheckCslt("op", 4096, 4096, 1, 7)', "dtype code 7"),
    "cslt_align": ('CheckCslt("op", 4100, 4096, 0, 0)', "multiples of 16"),
    "cslt_empty": ('CheckCslt("op", 0, 4096, 0, 0)', "multiples of 16"),
    "cslt_matmul_ok": ("CheckCsltMatmul(32, 4096, 4096, 32, 1)", ""),
    "cslt_matmul_rows": ("CheckCsltMatmul(17, 4096, 4096, 17, 0)", "M=17"),
    "cslt_matmul_y": ("CheckCsltMatmul(32, 4096, 4096, 16, 0)", "y has 16 rows"),
    "cslt_matmul_layout": ("CheckCsltMatmul(32, 4096, 4096, 32, -1)", "layout=-1"),
}


@pytest.fixture(scope="module")
def native_checks(tmp_path_factory):
  cxx = compiler()
  if cxx is None:
    pytest.skip("no C++ compiler")
  tmp = tmp_path_factory.mktemp("launch_checks")
  body = "\n".join(f'  std::cout << "{name}\\t" << jaxsparse_cuda::{call} << "\\n";'
                   for name, (call, _) in NATIVE_CASES.items())
  (tmp / "driver.cc").write_text(
      f'#include <iostream>\n#include "{CHECKS}"\nconstexpr long long G = 1LL << 30;\nint main() {{\n{body}\n}}\n'
  )
  subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-fsanitize=undefined", "-fno-sanitize-recover",
                  "-o", str(tmp / "driver"), str(tmp / "driver.cc")], check=True, capture_output=True, timeout=120)
  out = subprocess.run([str(tmp / "driver")], check=True, capture_output=True, text=True, timeout=60).stdout
  return dict(line.split("\t", 1) for line in out.splitlines())


@pytest.mark.parametrize("case", sorted(NATIVE_CASES))
def test_native_launch_checks(native_checks, case):
  fragment = NATIVE_CASES[case][1]
  got = native_checks[case]
  if fragment:
    assert fragment in got, got
  else:
    assert got == "", got


def test_handlers_call_the_checks():
  # Every FFI handler and exported entry reads its sizes through launch_checks.h before it launches.
  here = CHECKS.parent
  launch, cslt_src = (here / "kernel_launch.cc").read_text(), (here / "cusparselt_matmul.cc").read_text()
  for fn in ("CheckNm24Decode", "CheckNm24DecodeBuffer", "CheckNm24DecodeBufferTma", "CheckBlockSparseDecode",
             "CheckNm24Transposable",
             "CheckNm24TransposableCompress", "CheckNm24Prune", "CheckRegister"):
    assert f"jaxsparse_cuda::{fn}(" in launch, fn
  assert cslt_src.count("jaxsparse_cuda::CheckCslt(") == 2 and "jaxsparse_cuda::CheckCsltMatmul(" in cslt_src


# -- the Python wrappers of jaxsparse._cuda: checked before a kernel is compiled or called --------------------------

def _decode_operands(m=4, k=128, n=128):
  return (jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k // 2, n), jnp.bfloat16), jnp.zeros((k // 8, n), jnp.uint8))


@pytest.mark.parametrize(("edit", "error", "match"), [
    (lambda x, v, i: (x[0], v, i), ValueError, r"x must be a 2-D array, got shape \(128,\)"),
    (lambda x, v, i: (x, v[None], i), ValueError, "values must be a 2-D array"),
    (lambda x, v, i: (x, v, i.astype(jnp.int32)), ValueError, "indices .* uint8, got .* int32"),
    (lambda x, v, i: (x, v, i[:-1]), ValueError, r"indices \(16, 128\) uint8, got .* \(15, 128\)"),
    (lambda x, v, i: (x.astype(jnp.float32), v, i), ValueError, "dtype must be bfloat16"),
    (lambda x, v, i: (jnp.zeros((33, 128), jnp.bfloat16), v, i), ValueError, "M=33"),
])
def test_nm24_decode_rejects(edit, error, match):
  with pytest.raises(error, match=match):
    cuda_kernels.nm24_decode(*edit(*_decode_operands()))


def test_nm24_decode_buffer_rejects():
  x = jnp.zeros((4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"needs a \(18432,\) uint8 buffer for W \(128, 128\), got \(18431,\) uint8"):
    cuda_kernels.nm24_decode_buffer(x, jnp.zeros((18431,), jnp.uint8), 128)
  with pytest.raises(ValueError, match=r"got \(18432,\) int8"):
    cuda_kernels.nm24_decode_buffer(x, jnp.zeros((18432,), jnp.int8), 128)
  with pytest.raises(ValueError, match="M=33"):
    cuda_kernels.nm24_decode_buffer(jnp.zeros((33, 128), jnp.bfloat16), jnp.zeros((18432,), jnp.uint8), 128)
  with pytest.raises(ValueError, match="x must be a 2-D array"):
    cuda_kernels.nm24_decode_buffer(x[0], jnp.zeros((18432,), jnp.uint8), 128)
  with pytest.raises(TypeError, match="config must be an Nm24DecodeConfig or None, got dict"):
    cuda_kernels.nm24_decode_buffer(x, jnp.zeros((18432,), jnp.uint8), 128, config={"split": 2})


def test_nm24_decode_config_type():
  with pytest.raises(TypeError, match="config must be an Nm24DecodeConfig or None, got dict"):
    cuda_kernels.nm24_decode(*_decode_operands(), config={"split": 2})
  with pytest.raises(ValueError, match="split must be 1, 2, 4 or 8"):
    cuda_kernels.Nm24DecodeConfig(split=3)


def test_nm24_sizes_within_int():
  assert "2**30" in cuda_kernels.nm24_unsupported_reason(1, 2 * G, 128, jnp.bfloat16)
  assert "one launch" in cuda_kernels.nm24_prune_unsupported_reason((G, G), jnp.float32, jnp.float32)
  assert cuda_kernels.nm24_prune_unsupported_reason((4096, 4096), jnp.float32, jnp.bfloat16) == ""
  for fn in (cuda_kernels.nm24_prune, cuda_kernels.nm24_transposable, cuda_kernels.nm24_transposable_compress):
    with pytest.raises(ValueError, match=r"must be 2-D \(K, N\)"):
      fn(jnp.zeros((4, 4, 4)))
    with pytest.raises(ValueError, match="must be float32 or bfloat16, got int8"):
      fn(jnp.zeros((64, 64), jnp.int8))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: cslt.compress(jnp.zeros((64, 64), jnp.bfloat16), layout=2), "layout must be LAYOUT_KN"),
    (lambda: cslt.compress(jnp.zeros((64, 64), jnp.bfloat16), layout=True), "layout=True"),
    (lambda: cslt.compress(jnp.zeros((4, 64, 64), jnp.bfloat16)), "w must be a 2-D weight"),
    (lambda: cslt.compress(jnp.zeros((60, 64), jnp.bfloat16)), "K must be a positive multiple of 16"),
    (lambda: cslt.compress(jnp.zeros((64, 64), jnp.float32)), "dtype must be bfloat16 or float16, got float32"),
    (lambda: cslt.compressed_bytes(64, 0, jnp.bfloat16), r"K must be a positive multiple of 16 up to 2\*\*30, got K=0"),
    (lambda: cslt.compressed_bytes(64, 64, jnp.bfloat16, 5), "layout=5"),
    (lambda: cslt.matmul(jnp.zeros((64,), jnp.bfloat16), jnp.zeros((10,), jnp.uint8), 64), "x must be 2-D"),
    (lambda: cslt.matmul(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((10,), jnp.float32), 64),
     "compressed must be the 1-D uint8 buffer"),
    (lambda: cslt.matmul(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((10,), jnp.uint8), 40), "N=40"),
    (lambda: cslt.matmul(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((10,), jnp.uint8), 64, layout=-1), "layout"),
])
def test_cusparselt_wrappers_reject(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# -- the Pallas entry points: index arrays outside the grid are refused before launching ----------------------------

def _block_weight(dtype=jnp.float32, block=(32, 32), shape=(128, 128)):
  mask = np.zeros((shape[0] // block[0], shape[1] // block[1]), bool)
  mask[0, 1] = mask[1, 0] = mask[2, 2] = True
  w = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
  return jaxsparse.BlockSparseMatrix.from_dense(w, block, block_mask=mask)


def _spoil(w, field, i, value):
  """``w`` with one index entry replaced, as a tree map or ``validate=False`` would leave it (no constructor check)."""
  leaves, tree = jax.tree.flatten(w)
  fields = ("data", *type(w).INDEX_FIELDS)
  pos = fields.index(field)
  leaves[pos] = leaves[pos].at[i].set(value) if value is not None else leaves[pos].astype(jnp.float32)
  return jax.tree.unflatten(tree, leaves)


@pytest.mark.parametrize(("field", "i", "value", "match"), [
    ("row_indices", 0, 10**6, r"row_indices is invalid at position 0 \(value 1000000"),
    ("col_indices", 2, -1, r"col_indices is invalid at position 2 \(value -1"),
    ("col_indices", 1, 4, r"col_indices is invalid at position 1 \(value 4; 1 bad\): expected values in \[0, 4\)"),
    ("row_offsets", 1, 99, "row_offsets is invalid"),
    ("transpose_order", 0, 7, "transpose_order is invalid"),
    ("row_indices", 0, None, "row_indices must be an int32 array"),
])
@pytest.mark.parametrize("entry", ["forward", "backward", "mosaic_forward", "mosaic_dx", "mosaic_dw"])
def test_pallas_entries_reject_bad_index_arrays(entry, field, i, value, match):
  # A 4 x 4 grid of blocks the kernel takes (the Mosaic float32 dw kernel: bk of 64 or 128).
  block, size = ((64, 64), 256) if entry == "mosaic_dw" else ((32, 32), 128)
  w = _spoil(_block_weight(block=block, shape=(size, size)), field, i, value)
  x, dy = jnp.ones((16, size), jnp.float32), jnp.ones((16, size), jnp.float32)
  call = {
      "forward": lambda: bs_kernels.forward(x, w, interpret=True),
      "backward": lambda: bs_kernels.backward(x, dy, w, interpret=True),
      "mosaic_forward": lambda: mosaic.forward(x, w, interpret=True),
      "mosaic_dx": lambda: mosaic.dx(dy, w, interpret=True),
      "mosaic_dw": lambda: mosaic_sdd.sampled_dw(x, dy, w, interpret=True),
  }[entry]
  with pytest.raises(ValueError, match=match):
    call()


def test_pallas_entries_check_static_under_jit():
  # Traced index arrays: values are checked by the constructors that built them, shapes and dtypes here.
  w = _spoil(_block_weight(), "row_indices", 0, None)
  x = jnp.ones((16, 128), jnp.float32)
  with pytest.raises(ValueError, match=r"block_sparse_matmul forward: .*row_indices must be an int32 array"):
    jax.jit(lambda x, w: bs_kernels.forward(x, w, interpret=True))(x, w)
  good = _block_weight()
  check_pattern(good, op="test")  # a valid matrix passes, concrete or traced
  jax.jit(lambda w: check_pattern(w, op="test"))(good)


def test_pallas_nm_forward_rejects_bad_positions():
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((128, 64), jnp.float32), 2, 4)
  leaves, tree = jax.tree.flatten(w)
  idx = next(j for j, leaf in enumerate(leaves) if leaf.dtype == w.indices.dtype and leaf.shape == w.indices.shape)
  bad = list(leaves)
  bad[idx] = bad[idx].at[0, 0].set(np.iinfo(np.dtype(w.indices.dtype)).max)  # positions past the group, spare bits
  spoiled = jax.tree.unflatten(tree, bad)
  x = jnp.ones((8, 128), jnp.float32)
  with pytest.raises(ValueError, match="Pallas N:M forward: the weight's pattern is invalid: NMSparseMatrix"):
    nm_kernels.forward(x, spoiled, interpret=True)
  wrong = list(leaves)
  wrong[idx] = wrong[idx].astype(jnp.int32)
  with pytest.raises(ValueError, match=r"NMSparseMatrix\.indices must be"):
    nm_kernels.forward(x, jax.tree.unflatten(tree, wrong), interpret=True)
