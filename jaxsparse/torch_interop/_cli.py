"""The ``jaxsparse`` command: ``inspect`` a PyTorch checkpoint, ``convert`` it to Flax variables.

    jaxsparse inspect model.safetensors
    jaxsparse convert pruned.pt flax.safetensors --rules '.*intermediate\\.dense=nm:2:4' \\
        --name-map 'attention\\.self\\.=attention.' --ignore 'pooler.*'

Rules are ``REGEX=SPEC`` (REGEX matches the whole Flax module path; the first matching rule wins) with
SPEC one of ``block:DENSITY[:BKxBN]`` (Flax ``(in, out)`` block shape, default 32x32),
``nm:N:M``, ``unstructured:SPARSITY`` or ``dense``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main", "parse_rule"]

PROGRESS_MIN_BYTES = 64 * 2**20


def parse_rule(text: str):
  """``"REGEX=SPEC"`` -> ``(regex, jaxsparse structure or None)``."""
  from jaxsparse import formats  # noqa: PLC0415 -- keeps `jaxsparse --help` fast

  regex, sep, spec = text.rpartition("=")
  if not sep or not regex:
    raise argparse.ArgumentTypeError(f"rule {text!r} must look like REGEX=SPEC, e.g. '.*fc1=block:0.5:32x32'.")
  kind, *args = spec.split(":")
  try:
    if kind == "dense" and not args:
      return regex, None
    if kind == "block" and len(args) in (1, 2):
      shape = tuple(int(b) for b in args[1].lower().split("x")) if len(args) == 2 else (32, 32)
      return regex, formats.BlockSparse(density=float(args[0]), block_shape=shape)
    if kind == "nm" and len(args) == 2:
      return regex, formats.NM(int(args[0]), int(args[1]))
    if kind == "unstructured" and len(args) == 1:
      return regex, formats.Unstructured(sparsity=float(args[0]))
  except (TypeError, ValueError) as e:
    raise argparse.ArgumentTypeError(f"rule {text!r}: {e}") from e
  raise argparse.ArgumentTypeError(
      f"rule {text!r}: SPEC must be block:DENSITY[:BKxBN], nm:N:M, unstructured:SPARSITY or dense, got {spec!r}."
  )


def _parse_map(text: str) -> tuple[str, str | None]:
  regex, sep, repl = text.partition("=")
  if not sep:
    raise argparse.ArgumentTypeError(f"name map {text!r} must look like REGEX=REPLACEMENT (empty: drop).")
  return regex, (repl if repl != "" else None)


def _parse_nm(text: str) -> tuple[int, int]:
  try:
    n, m = (int(x) for x in text.split(":"))
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--nm must look like N:M, e.g. 2:4, got {text!r}.") from e
  return n, m


class _Progress:
  """A one-line progress bar on stderr for large checkpoints."""

  def __init__(self, enabled: bool, label: str):
    self.enabled, self.label, self.shown = enabled, label, -1

  def __call__(self, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    if not self.enabled or (filled == self.shown and done != total):
      return
    self.shown = filled
    sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
      sys.stderr.write("\n")
    sys.stderr.flush()


def _progress(src, flag: bool | None, label: str) -> _Progress:
  if flag is None:  # by default only for large files, and only on a terminal
    flag = src.nbytes >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
  return _Progress(flag, label)


def _inspect(args) -> int:
  from jaxsparse._utils import text_table  # noqa: PLC0415 -- keeps `jaxsparse --help` fast
  from jaxsparse.torch_interop._decode import decode_checkpoint  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._load import open_checkpoint  # noqa: PLC0415 -- lazy: imports torch

  src = open_checkpoint(args.file, key=args.key)
  params = decode_checkpoint(src, nm=args.nm, on_error="collect", progress=_progress(src, args.progress, "reading"))
  rows = [("name", "shape", "dtype", "format", "pattern", "density")]
  problems = []
  total = kept = 0
  for p in params.values():
    if p.problem is not None:
      rows.append((p.name, "?", "?", "unreadable", "?", "?"))
      problems.append(f"{p.name}: {p.problem}")
      continue
    pattern = p.pattern
    rows.append((p.name, "x".join(map(str, p.shape)) or "scalar", str(p.value.dtype), p.format, str(pattern),
                 f"{pattern.density:.3f}"))
    if p.value.ndim >= 2:
      total += p.value.size
      kept += p.value.size if p.mask is None else int(p.mask.sum())
  print(f"{args.file}: {len(params)} parameters")
  print(text_table(rows))
  if total:
    print(f"weights (ndim >= 2): {kept}/{total} kept, density {kept / total:.3f}")
  if problems:
    print(f"\n{len(problems)} parameter(s) could not be decoded:", file=sys.stderr)
    for line in problems:
      print(f"  {line}", file=sys.stderr)
    return 1
  return 0


def _convert(args) -> int:
  from jaxsparse.torch_interop._files import save_flax_variables  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._flax import to_linen_variables  # noqa: PLC0415 -- lazy: imports torch
  from jaxsparse.torch_interop._load import open_checkpoint  # noqa: PLC0415 -- lazy: imports torch

  if os.path.exists(args.output) and not args.force:
    print(f"jaxsparse: error: {args.output} exists; pass --force to overwrite it.", file=sys.stderr)
    return 1
  fmt = args.format or ("safetensors" if args.output.endswith(".safetensors") else "orbax")
  if fmt == "orbax" and os.path.exists(args.output):
    print(f"jaxsparse: error: orbax output {args.output} must not exist yet.", file=sys.stderr)
    return 1
  src = open_checkpoint(args.input, key=args.key)
  variables = to_linen_variables(
      src,
      name_map=args.name_map or None,
      ignore=args.ignore,
      nm=args.nm,
      rules=dict(args.rules) if args.rules else None,
      progress=_progress(src, args.progress, "converting"),
  )
  save_flax_variables(variables, args.output, format=fmt)
  n = sum(1 for _ in _leaves(variables))
  print(f"wrote {n} arrays to {args.output} ({fmt}); collections: {sorted(variables)}")
  return 0


def _leaves(tree):
  for v in tree.values():
    if isinstance(v, dict):
      yield from _leaves(v)
    else:
      yield v


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxsparse", description="Bring (sparse) PyTorch checkpoints to jaxsparse.")
  sub = parser.add_subparsers(dest="command", required=True)

  def common(p):
    p.add_argument("--key", help="dotted path of the state dict inside a nested checkpoint")
    p.add_argument("--nm", type=_parse_nm, help="recompute N:M masks of dense weights (NM-sparsity), e.g. 2:4")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"progress bar (default: on a terminal, for files over {PROGRESS_MIN_BYTES // 2**20} MiB)")

  ins = sub.add_parser("inspect", help="per-layer table: name, shape, format found, pattern, density")
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
  conv.add_argument("--format", choices=("safetensors", "orbax"), help="default: from the output name")
  conv.add_argument("--force", action="store_true", help="overwrite an existing output file")
  common(conv)
  conv.set_defaults(run=_convert)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``jaxsparse`` console script."""
  args = _parser().parse_args(argv)
  from jaxsparse.torch_interop._load import CheckpointError  # noqa: PLC0415 -- keeps `--help` fast

  try:
    return args.run(args)
  except (CheckpointError, ImportError, ValueError, TypeError) as e:
    print(f"jaxsparse: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
