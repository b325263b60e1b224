"""The ``jaxsparse`` command: ``inspect`` a PyTorch checkpoint, ``convert`` it to Flax variables, ``bench``
sparse layers of your shapes against dense ones, ``tune`` their products ahead of time (measured dispatch).

    jaxsparse inspect model.safetensors
    jaxsparse convert pruned.pt flax.safetensors --rules '.*intermediate\\.dense=nm:2:4' \\
        --name-map 'attention\\.self\\.=attention.' --ignore 'pooler.*'
    jaxsparse convert pruned.pt flax.safetensors --target init_variables.safetensors
    jaxsparse convert mingpt.pt flax.safetensors --embeddings '(^|\\.)(tok|pos)_emb$'
    jaxsparse bench 4096x4096 4096x16384 --patterns block:0.25:64x64 nm:2:4 --batch 2048 --dtype bfloat16
    jaxsparse tune 4096x4096 --patterns block:0.25:64x64 --rows 1 2048 --export tuned.json

Rules are ``REGEX=SPEC`` (REGEX matches the whole Flax module path; the first matching rule wins) with
SPEC one of ``block:DENSITY[:BKxBN]`` (Flax ``(in, out)`` block shape, default 32x32),
``nm:N:M``, ``unstructured:SPARSITY`` or ``dense``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from jaxsparse.torch_interop import _limits

__all__ = ["main", "parse_rule", "parse_spec"]

PROGRESS_MIN_BYTES = 64 * 2**20
# inspect: fewer exact zeros in a dense weight than this are no pruning worth a hint (a padding row, a zero bias row).
HINT_MIN_ZEROS = 0.1
# The largest size the sparse formats index (int32); a larger one failed inside MLIR, naming no argument.
MAX_SIZE = 2**31 - 1


def parse_spec(spec: str, *, dense: bool = True):
  """``"block:0.5:32x32"``, ``"nm:2:4"``, ``"unstructured:0.9"`` (or ``"dense"``: ``None``) -> a jaxsparse structure."""
  from jaxsparse import formats  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  kind, *args = spec.split(":")
  if kind == "dense" and not args and dense:
    return None
  if kind == "block" and len(args) in (1, 2):
    shape = _parse_block_shape(args[1]) if len(args) == 2 else (32, 32)
    return formats.BlockSparse(density=float(args[0]), block_shape=shape)
  if kind == "nm" and len(args) == 2:
    return formats.NM(int(args[0]), int(args[1]))
  if kind == "unstructured" and len(args) == 1:
    return formats.Unstructured(sparsity=float(args[0]))
  allowed = "block:DENSITY[:BKxBN], nm:N:M, unstructured:SPARSITY" + (" or dense" if dense else "")
  raise ValueError(f"SPEC must be {allowed}, got {spec!r}.")


def _parse_block_shape(text: str) -> tuple[int, int]:
  """``"32x64"`` -> ``(32, 64)``; anything else raises a ``ValueError`` naming the ``BKxBN`` format and ``text``."""
  parts = text.lower().split("x")
  try:
    bk, bn = (int(b) for b in parts)
  except ValueError:  # a part that is no int ('3x', 'ax4'), or not two parts
    raise ValueError(f"the block shape must be BKxBN (two positive ints, e.g. 32x32), got {text!r}.") from None
  return bk, bn


def parse_rule(text: str):
  """``"REGEX=SPEC"`` -> ``(regex, jaxsparse structure or None)``."""
  regex, sep, spec = text.rpartition("=")
  if not sep or not regex:
    raise argparse.ArgumentTypeError(f"rule {text!r} must look like REGEX=SPEC, e.g. '.*fc1=block:0.5:32x32'.")
  _check_regex(regex, what=f"rule {text!r}")
  try:
    return regex, parse_spec(spec)
  except (TypeError, ValueError) as e:
    raise argparse.ArgumentTypeError(f"rule {text!r}: {e}") from e


def _parse_pattern(text: str):
  try:
    return parse_spec(text, dense=False)
  except (TypeError, ValueError) as e:
    raise argparse.ArgumentTypeError(f"pattern {text!r}: {e}") from e


def _parse_positive(text: str, *, what: str = "int", capped: bool = True) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text!r}.")
  if capped and value > MAX_SIZE:
    raise argparse.ArgumentTypeError(f"must be at most 2**31 - 1, got {text!r}.")
  return value


def _parse_bytes(text: str) -> int:
  return _parse_positive(text, what="number of bytes", capped=False)


def _parse_dtype(text: str) -> str:
  import jax.numpy as jnp  # noqa: PLC0415 -- keeps `jaxsparse --help` fast (argparse converts only after --help)

  try:
    dtype = jnp.dtype(text)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise argparse.ArgumentTypeError(f"must be a floating dtype such as float32, bfloat16 or float16, got {text!r}.")
  return dtype.name


def _parse_shape(text: str) -> tuple[int, int]:
  try:
    k, n = (int(v) for v in text.lower().split("x"))
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"shape must look like INxOUT, e.g. 4096x1024, got {text!r}.") from e
  if k <= 0 or n <= 0:
    raise argparse.ArgumentTypeError(f"shape {text!r}: both sizes must be positive.")
  if max(k, n) > MAX_SIZE:
    raise argparse.ArgumentTypeError(f"shape {text!r}: both sizes must be at most 2**31 - 1.")
  memory = _limits.physical_memory()
  if memory is not None and k * n > memory:  # at least a byte per element (float8); XLA aborted past int64 bytes
    raise argparse.ArgumentTypeError(
        f"shape {text!r}: its weight has {k * n} elements, more bytes than this machine's memory ({memory} bytes) "
        "holds in any dtype.")
  return k, n


def _device_memory() -> tuple[int | None, str]:
  """The bytes the default device can hold (its allocator's limit on a GPU, else the physical memory) and a name."""
  import jax  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"the memory of {device.device_kind}"
  return _limits.physical_memory(), "this machine's memory"


def _check_fits(shapes: Sequence[tuple[int, int]], rows: int, dtype: str) -> None:
  """Raises a ``ValueError`` naming the shape when its weight, input and output (``rows`` rows of ``dtype``) alone
  take more bytes than the device holds: building them failed with XLA's RESOURCE_EXHAUSTED, or aborted."""
  import jax.numpy as jnp  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  limit, where = _device_memory()
  if limit is None:
    return
  item = jnp.dtype(dtype).itemsize
  for k, n in shapes:
    need = (k * n + rows * k + rows * n) * item
    if need > limit:
      raise ValueError(
          f"shape {k}x{n} with {rows} rows of {dtype}: the weight, input and output alone take {need} bytes, more "
          f"than {where} ({limit} bytes). Choose smaller shapes, fewer rows or a narrower --dtype.")


def _check_regex(regex: str, *, what: str) -> None:
  try:
    re.compile(regex)
  except re.error as e:
    raise argparse.ArgumentTypeError(f"{what}: {regex!r} is not a valid regular expression ({e}).") from e


def _parse_embeddings(text: str) -> str:
  _check_regex(text, what="--embeddings")
  return text


def _parse_conv1d(text: str) -> str:
  _check_regex(text, what="--conv1d")
  return text


def _parse_map(text: str) -> tuple[str, str | None]:
  regex, sep, repl = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"name map {text!r} must look like REGEX=REPLACEMENT (empty: drop).")
  _check_regex(regex, what=f"name map {text!r}")
  if repl:
    try:
      re.compile(regex).sub(repl, "")  # a bad group reference in REPLACEMENT fails here, not mid-conversion
    except (re.error, IndexError) as e:
      raise argparse.ArgumentTypeError(f"name map {text!r}: bad replacement {repl!r} ({e}).") from e
  return regex, (repl if repl != "" else None)


def _parse_nm(text: str) -> tuple[int, int]:
  try:
    n, m = (int(x) for x in text.split(":"))
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--nm must look like N:M, e.g. 2:4, got {text!r}.") from e
  if not 0 < n < m:
    raise argparse.ArgumentTypeError(f"--nm N:M needs 0 < N < M, got {text!r}.")
  return n, m


class _Progress:
  """A ``progress(done, total)`` callback drawing a tqdm bar on stderr."""

  def __init__(self, enabled: bool, label: str, unit: str):
    self.enabled, self.label, self.unit, self.bar = enabled, label, unit, None

  def __call__(self, done: int, total: int) -> None:
    if not self.enabled:
      return
    if self.bar is None:
      from tqdm import tqdm  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

      self.bar = tqdm(total=total, desc=self.label, unit=self.unit, file=sys.stderr)
    self.bar.update(done - self.bar.n)
    if done == total:
      self.bar.close()


def _progress(src, flag: bool | None, label: str) -> _Progress:
  if flag is None:  # by default only for large files, and only on a terminal
    flag = src.nbytes >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
  return _Progress(flag, label, "param")


def _inspect(args) -> int:
  import numpy as np  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  from jaxsparse._utils import text_table  # noqa: PLC0415 -- keeps `jaxsparse --help` fast
  from jaxsparse.torch_interop._decode import decode_checkpoint  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._load import open_checkpoint  # noqa: PLC0415 -- lazy: imports torch

  src = open_checkpoint(args.file, key=args.key, max_bytes=args.max_bytes)
  params = decode_checkpoint(src, nm=args.nm, on_error="collect", progress=_progress(src, args.progress, "reading"),
                             conv1d=args.conv1d, max_bytes=args.max_bytes)
  rows = [("name", "shape", "dtype", "format", "pattern", "density", "zeros")]
  problems, hints = [], []
  total = kept = 0
  for p in params.values():
    if p.problem is not None:
      rows.append((p.name, "?", "?", "unreadable", "?", "?", "?"))
      problems.append(f"{p.name}: {p.problem}")
      continue
    pattern = p.pattern
    size = p.value.size
    zeros = (size - int(np.count_nonzero(p.masked_value))) / size if size else 0.0
    rows.append((p.name, "x".join(map(str, p.shape)) or "scalar", str(p.value.dtype), p.format, str(pattern),
                 f"{pattern.density:.3f}", f"{zeros:.3f}"))
    if p.value.ndim >= 2:
      total += size
      kept += size if p.mask is None else int(p.mask.sum())
    hint = _zeros_hint(p, zeros)
    if hint is not None:
      hints.append(hint)
  print(f"{args.file}: {len(params)} parameters")
  print(text_table(rows))
  if total:
    print(f"weights (ndim >= 2): {kept}/{total} kept, density {kept / total:.3f}")
  if hints:
    print(f"{len(hints)} dense weight(s) hold a pruning's exact zeros (convert's --rules below name torch module "
          "paths; with --name-map, name the mapped ones):")
    for line in hints:
      print(f"  {line}")
  if problems:
    print(f"\n{len(problems)} parameter(s) could not be decoded:", file=sys.stderr)
    for line in problems:
      print(f"  {line}", file=sys.stderr)
    return 1
  return 0


def _zeros_hint(p, zeros: float) -> str | None:
  """For a dense floating weight (no mask) of ndim >= 2 with at least ``HINT_MIN_ZEROS`` exact zeros, a line saying
  what structure they form (``zero_pattern``) and how to sparsify it keeping every nonzero; else ``None``."""
  from jaxsparse.torch_interop._names import DEFAULT_EMBEDDINGS  # noqa: PLC0415 -- keeps `jaxsparse --help` fast
  from jaxsparse.torch_interop._patterns import zero_pattern  # noqa: PLC0415

  w = p.value
  floating = w.dtype.kind == "f" or w.dtype.name == "bfloat16"
  if p.mask is not None or w.ndim < 2 or zeros < HINT_MIN_ZEROS or not floating:
    return None
  line = f"{p.name}: dense storage, {100 * zeros:.1f}% zeros"
  found = zero_pattern(w)
  if found.density == 0:
    return f"{line}: every entry is zero"
  table = w.ndim == 2 and re.search(DEFAULT_EMBEDDINGS, p.module) is not None
  layer = None  # the structure as a jaxsparse spec, for a convolution or table (sparsify takes no block one of those)
  if found.kind == "block":
    b0, b1 = found.block_shape
    what = f"in whole {b0}x{b1} blocks (out x in), {found.density:.1%} of them kept"
    rule = f"block:{_fraction(found.density, w.size // (b0 * b1))}:{b1}x{b0}"  # the rule's blocks are Flax (in, out)
  elif found.kind == "nm":
    along = "the input channels" if w.ndim > 2 else "the features" if table else "the inputs"
    what = f"{found.n}:{found.m} along dim 1 ({along})"
    rule, layer = f"nm:{found.n}:{found.m}", f"jaxsparse.NM({found.n}, {found.m})"
  else:
    sparsity = _fraction(zeros, w.size)
    what, rule = "unstructured", f"unstructured:{sparsity}"
    layer = None if table else f"jaxsparse.Unstructured(sparsity={sparsity})"  # tables take N:M only
  if w.ndim == 2 and not table and p.param == "weight" and p.module:  # a Linear weight: convert's rules take it
    return f"{line}, {what}: sparsify with convert --rules '{re.escape(p.module)}={rule}'"
  if layer is not None:
    return f"{line}, {what}: after loading, sparsify its layer with {layer} (convert's rules take Linear weights only)"
  return f"{line}, {what}"


def _fraction(fraction: float, total: int) -> str:
  """``fraction`` to 3 significant digits, or as many more as ``round(fraction * total)`` entries (or blocks) need to
  come out of it again (rounded either way: no half-way product)."""
  count = round(fraction * total)
  for digits in range(3, 18):
    text = f"{fraction:.{digits}g}"
    if abs(float(text) * total - count) < 0.45:
      return text
  return repr(fraction)


def _convert(args) -> int:
  from jaxsparse.torch_interop._files import load_flax_variables  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._files import save_flax_variables  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._linen import to_linen_variables  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._load import open_checkpoint  # noqa: PLC0415 -- lazy: imports torch

  fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "orbax")
  if fmt == "orbax" and os.path.exists(args.output):  # --force does not remove a directory
    print(f"jaxsparse: error: orbax output {args.output} exists; orbax writes a new directory: remove it or choose "
          "another name.", file=sys.stderr)
    return 1
  if os.path.exists(args.output) and not args.force:
    print(f"jaxsparse: error: {args.output} exists; pass --force to overwrite it.", file=sys.stderr)
    return 1
  target = None if args.target is None else load_flax_variables(args.target, max_bytes=args.max_bytes)
  src = open_checkpoint(args.input, key=args.key, max_bytes=args.max_bytes)
  variables = to_linen_variables(
      src,
      name_map=args.name_map or None,
      ignore=args.ignore,
      nm=args.nm,
      rules=dict(args.rules) if args.rules else None,
      embeddings=args.embeddings,
      progress=_progress(src, args.progress, "converting"),
      target=target,
      conv1d=args.conv1d,
      max_bytes=args.max_bytes,
  )
  save_flax_variables(variables, args.output, format=fmt)
  n = sum(1 for _ in _leaves(variables))
  print(f"wrote {n} arrays to {args.output} ({fmt}); collections: {sorted(variables)}")
  return 0


def _bench(args) -> int:
  import jax  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  from jaxsparse._bench import bench  # noqa: PLC0415
  from jaxsparse._bench import bench_table  # noqa: PLC0415

  _check_fits(args.shapes, args.batch, args.dtype)  # before any layer is built
  modes = args.modes
  flag = sys.stderr.isatty() if args.progress is None else args.progress
  device = jax.devices()[0]
  print(f"backend: {jax.default_backend()} ({device.device_kind}); batch {args.batch}, {args.dtype}; "
        "median ms per call after warm-up")
  rows = bench(args.shapes, args.patterns, batch=args.batch, dtype=args.dtype, modes=modes,
               progress=_Progress(flag, "timing", "layer"))
  print(bench_table(rows, modes))
  return 0


def _tune(args) -> int:
  import jax  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  import jaxsparse  # noqa: PLC0415
  from jaxsparse._bench import tune  # noqa: PLC0415
  from jaxsparse._tuning import cache_path  # noqa: PLC0415
  from jaxsparse._tuning._cache import ENV_PATH  # noqa: PLC0415
  from jaxsparse._tuning._cache import check_export_path  # noqa: PLC0415
  from jaxsparse._tuning._cache import unsaved_decisions  # noqa: PLC0415

  _check_fits(args.shapes, max(args.rows), args.dtype)  # before any layer is built
  if args.export:
    check_export_path(args.export)  # before the tuning, which may take long
  if args.import_cache:
    print(f"imported {jaxsparse.import_tuning_cache(args.import_cache)} decisions from {args.import_cache}")
  device = jax.devices()[0]
  print(f"backend: {jax.default_backend()} ({device.device_kind}); {args.dtype}; cache: "
        f"{cache_path()}")
  added = 0
  for shape, pattern, rows, n, cached in tune(args.shapes, args.patterns, rows=args.rows, dtype=args.dtype):
    what = (f"{n} new decisions, {cached} already cached" if n or cached else
            f"nothing to tune (no product of this pattern has measured dispatch on {jax.default_backend()})")
    print(f"{shape[0]}x{shape[1]} {pattern}, {rows} rows: {what}")
    added += n
  print(f"{added} new decisions in all (products already in the cache are not measured again)")
  if args.export:
    print(f"exported {jaxsparse.export_tuning_cache(args.export)} decisions to {args.export}")
  unsaved = unsaved_decisions()  # the cache file could not be written (each failure warned)
  if unsaved and args.export:
    print(f"the tuning cache {cache_path()} could not be written: {len(unsaved)} decisions are in {args.export} only")
  elif unsaved:  # filling the cache is this command's purpose: saving nothing is a failure, not a warning
    raise OSError(
        f"{next(iter(unsaved.values()))}: {len(unsaved)} decisions were not saved and are lost when this command "
        f"exits. Make {cache_path()} writable, point ${ENV_PATH} at a writable file, or pass --export FILE."
    )
  return 0


def _leaves(tree):
  for v in tree.values():
    if isinstance(v, dict):
      yield from _leaves(v)
    else:
      yield v


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jaxsparse",
      description="Bring (sparse) PyTorch checkpoints to jaxsparse; time sparse layers; tune their kernels.",
  )
  sub = parser.add_subparsers(dest="command", required=True)

  def common(p):
    p.add_argument("--key", help="dotted path of the state dict inside a nested checkpoint")
    p.add_argument("--nm", type=_parse_nm, help="recompute N:M masks of dense weights (NM-sparsity), e.g. 2:4")
    p.add_argument("--conv1d", type=_parse_conv1d, metavar="REGEX",
                   help="torch module paths (re.search) whose 2-D weight is stored (in, out) like transformers' Conv1D "
                        "(GPT-2), e.g. '\\.(c_attn|c_proj|c_fc)$' (default: told by a bias of the second dimension's "
                        "size; square weights beside such ones are an error)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"progress bar (default: on a terminal, for files over {PROGRESS_MIN_BYTES // 2**20} MiB)")
    p.add_argument("--max-bytes", type=_parse_bytes, metavar="BYTES",
                   help="refuse a checkpoint whose tensors (each, or all together, in dense form) declare more bytes "
                        "than this, before reading any (default: $JAXSPARSE_CHECKPOINT_MAX_BYTES, 'none' for no "
                        "limit, else the machine's physical memory)")

  ins = sub.add_parser("inspect", help="per-layer table: name, shape, format found, pattern, density, exact zeros; "
                                       "hints for dense weights that hold a pruning's zeros")
  ins.add_argument("file")
  common(ins)
  ins.set_defaults(run=_inspect)

  conv = sub.add_parser("convert", help="write Flax (Linen) variables with jaxsparse layouts")
  conv.add_argument("input")
  conv.add_argument("output", help="a .safetensors file, or a new directory for orbax")
  conv.add_argument("--rules", type=parse_rule, nargs="+", default=[], metavar="REGEX=SPEC",
                    help="sparsify while converting: block:DENSITY[:BKxBN], nm:N:M, unstructured:SPARSITY, dense")
  conv.add_argument("--name-map", type=_parse_map, nargs="+", default=[], metavar="REGEX=REPL",
                    help="rename torch module paths (re.sub, in order); an empty REPL drops matching modules")
  conv.add_argument("--ignore", nargs="+", default=[], metavar="GLOB", help="torch parameter names to skip")
  conv.add_argument("--embeddings", type=_parse_embeddings, metavar="REGEX",
                    help="torch module paths (re.search) whose 2-D weight is an embedding table; every other one is a "
                         "Linear's (default: names like *embed*, wte, wpe, shared, with a warning listing the "
                         "bias-free weights read as Linear ones; --target decides by the target's variables)")
  conv.add_argument("--target", metavar="VARIABLES",
                    help="Flax variables of the Linen model (a file save_flax_variables wrote): the output takes their "
                         "shapes ((in, heads, head_dim) attention kernels), with masks under 'masks' for "
                         "sparsify_linen(masks=...)")
  conv.add_argument("--format", choices=("safetensors", "orbax"), help="default: from the output name")
  conv.add_argument("--force", action="store_true",
                    help="overwrite an existing .safetensors output file (an orbax output directory must be new)")
  common(conv)
  conv.set_defaults(run=_convert)

  ben = sub.add_parser("bench", help="time sparse layers of your shapes against dense (forward, forward+backward)")
  ben.add_argument("shapes", type=_parse_shape, nargs="+", metavar="INxOUT", help="layer shapes, e.g. 4096x1024")
  ben.add_argument("--patterns", type=_parse_pattern, nargs="+", metavar="SPEC",
                   default=[_parse_pattern("block:0.25:32x32"), _parse_pattern("nm:2:4"),
                            _parse_pattern("unstructured:0.9")],
                   help="block:DENSITY[:BKxBN], nm:N:M, unstructured:SPARSITY (default: block:0.25:32x32 nm:2:4 "
                        "unstructured:0.9)")
  ben.add_argument("--batch", type=_parse_positive, default=128, help="input rows (tokens), default 128")
  ben.add_argument("--dtype", type=_parse_dtype, default="float32",
                   help="parameter and input dtype, e.g. float32, bfloat16")
  ben.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
  ben.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on a terminal)")
  ben.set_defaults(run=_bench)

  tun = sub.add_parser("tune", help="measured dispatch ahead of time: time the candidate kernels of sparse layers of "
                                    "your shapes on this machine's backend (GPU, or the CPU routes) and cache the "
                                    "fastest (every candidate timed: no first-trace budget, "
                                    "$JAXSPARSE_AUTOTUNE_BUDGET); the cache is $JAXSPARSE_AUTOTUNE_CACHE (a cache "
                                    "that cannot be written fails the command, unless --export wrote the decisions)")
  tun.add_argument("shapes", type=_parse_shape, nargs="+", metavar="INxOUT", help="layer shapes, e.g. 4096x1024")
  tun.add_argument("--patterns", type=_parse_pattern, nargs="+", metavar="SPEC",
                   default=[_parse_pattern("block:0.25:64x64")],
                   help="block:DENSITY[:BKxBN], nm:N:M, unstructured:SPARSITY (default: block:0.25:64x64)")
  tun.add_argument("--rows", type=_parse_positive, nargs="+", default=[128],
                   help="input rows (tokens) to tune for, default 128")
  tun.add_argument("--dtype", type=_parse_dtype, default="float32",
                   help="parameter and input dtype, e.g. float32, bfloat16")
  tun.add_argument("--export", metavar="FILE", help="then write every known decision to FILE (for other machines)")
  tun.add_argument("--import", dest="import_cache", metavar="FILE", help="first merge the decisions of FILE")
  tun.set_defaults(run=_tune)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``jaxsparse`` console script."""
  args = _parser().parse_args(argv)
  from jax.errors import JaxRuntimeError  # noqa: PLC0415 -- keeps `--help` fast

  from jaxsparse.torch_interop._load import CheckpointError  # noqa: PLC0415 -- keeps `--help` fast

  try:
    return args.run(args)
  except (CheckpointError, ImportError, OSError, ValueError, TypeError) as e:
    print(f"jaxsparse: error: {e}", file=sys.stderr)
    return 1
  except JaxRuntimeError as e:  # e.g. RESOURCE_EXHAUSTED: a shape this device cannot hold; was a traceback
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = (" (out of memory: choose smaller shapes, fewer rows or a narrower --dtype)"
            if "RESOURCE_EXHAUSTED" in first else "")
    print(f"jaxsparse: error: {first}{hint}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
