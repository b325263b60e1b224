"""2:4 against dense on the GPU, with measured dispatch off and on: products, a decode loop, the SR-STE step.

    PYTHONPATH=. python3 benchmarks/gpu_nm.py --tuned [--cases 12 --seed 35] [--parts products,decode,sr_ste] \
        [--out gpu_nm_tuned.md]

Three questions of issue 35, bf16 throughout, ratios to dense measured in the same run (< 1 is faster):

* **Products** ``x @ W`` for a 2:4 ``W`` (``K x N``, groups along ``K``) stored compressed: ``nm_matmul`` with the
  cuSPARSELt copy a :class:`jaxsparse.layers.CompressedNMLinear` keeps (``cusparselt_weight``) and without it, on the
  TinyLlama-1.1B and Llama-3-8B projections and ``--cases`` random shapes, at decode to training row counts.
* **A decode loop** of TinyLlama-sized projections (q / k / v / o, gate / up / down of ``--layers`` layers, ``--steps``
  tokens in one jitted ``fori_loop``) at batch 1 / 8 / 32: tokens/s over dense.
* **The SR-STE train step** (``value_and_grad`` of ``sr_ste_matmul``, prune + product + both gradients) against the
  dense layer's step; with ``--parts sr_ste_optax`` the whole step of the layer, gradients and an ``optax.adamw``
  update jitted together, against the dense layer's.

Each is timed with ``jaxsparse.autotune_mode("off")`` (the shipped rules) and ``"tune"`` (each product's candidate
routes timed on its first trace, into a fresh cache under ``$OUT``; the table gives the route picked). Device-side
times (CUPTI, ``_gpu_timing.time_ms``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms

import jaxsparse
from jaxsparse import ops
from jaxsparse._tuning import _cache as _tuning_cache
from jaxsparse._tuning import train_step

TINY = ((2048, 2048), (2048, 256), (2048, 5632), (5632, 2048))
LLAMA8B = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
ROWS = (1, 8, 32, 128, 2048)
DIMS = (512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 11008, 14336)
MODES = ("off", "tune")


def _weight(key, k, n):
  dense = jax.random.normal(key, (k, n), jnp.bfloat16)
  w = jaxsparse.NMSparseMatrix.from_dense(dense, 2, 4)
  return w, w.to_dense()


def _choices() -> str:
  """The routes the tuner recorded since the last call (from the cache file)."""
  path = _tuning_cache.cache_path()
  if not path.exists():
    return ""
  entries = json.loads(path.read_text())["entries"]
  seen = _choices.seen
  new = {k: v for k, v in entries.items() if k not in seen}
  seen.update(new)
  return ",".join(f"{v['choice']}" for v in new.values())


_choices.seen = {}


def products(shapes, iterations: int) -> list[dict]:
  rows = []
  blob_ok = ops.cusparselt_available()
  for i, (k, n) in enumerate(shapes):
    w, wd = _weight(jax.random.key(i), k, n)
    blob = ops.cusparselt_compress(w) if blob_ok else None
    for m in ROWS:
      x = jax.random.normal(jax.random.key(100 + m), (m, k), jnp.bfloat16)
      dense = time_ms(lambda x, wd: x @ wd, x, wd, iterations=iterations)
      row = {"shape": f"{k}x{n}", "rows": m, "dense_us": dense * 1e3}
      ref = x @ wd
      for mode in MODES:
        with jaxsparse.autotune_mode(mode):
          for tag, b in (("blob", blob), ("values", None)):
            if tag == "blob" and b is None:
              continue
            t0 = time.perf_counter()
            y = jax.jit(lambda x, w, b: ops.nm_matmul(x, w, cusparselt_weight=b))(x, w, b)
            first = time.perf_counter() - t0
            err = rel_err(y, ref)
            assert err < 2e-2, (k, n, m, tag, mode, err)
            t = time_ms(lambda x, w, b: ops.nm_matmul(x, w, cusparselt_weight=b), x, w, b, iterations=iterations)
            row[f"{tag}/{mode}"] = t / dense
            row[f"{tag}/{mode}/route"] = _choices() if mode == "tune" else ""
            row[f"{tag}/{mode}/first_s"] = first
      log(json.dumps(row))
      rows.append(row)
  return rows


def decode_loop(layers: int, steps: int, iterations: int) -> list[dict]:
  d, hidden, kv = 2048, 5632, 256
  shapes = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "g": (d, hidden), "u": (d, hidden), "dn": (hidden, d)}
  keys = iter(jax.random.split(jax.random.key(7), layers * len(shapes)))
  sparse = [{name: _weight(next(keys), *s)[0] for name, s in shapes.items()} for _ in range(layers)]
  dense = [{name: w.to_dense() for name, w in layer.items()} for layer in sparse]
  blobs = None
  if ops.cusparselt_available():
    blobs = [{name: ops.cusparselt_compress(w) for name, w in layer.items()} for layer in sparse]

  def run(mm, params):
    def step(_, h):
      for p in params:
        q, k, v = mm(h, p, "q"), mm(h, p, "k"), mm(h, p, "v")
        h = h + mm(q, p, "o") + (k.mean(-1, keepdims=True) + v.mean(-1, keepdims=True))
        h = h + mm(jax.nn.silu(mm(h, p, "g")) * mm(h, p, "u"), p, "dn")
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(h.dtype)
      return h

    return lambda h: jax.lax.fori_loop(0, steps, step, h)

  out = []
  for batch in (1, 8, 32):
    h = jax.random.normal(jax.random.key(batch), (batch, d), jnp.bfloat16)
    t_dense = time_ms(run(lambda h, p, n: h @ p[n], dense), h, iterations=iterations)
    row = {"batch": batch, "dense_tok_s": batch * steps / t_dense * 1e3}
    for mode in MODES:
      with jaxsparse.autotune_mode(mode):
        params = [{n: (sparse[i][n], None if blobs is None else blobs[i][n]) for n in shapes} for i in range(layers)]
        mm = lambda h, p, n: ops.nm_matmul(h, p[n][0], cusparselt_weight=p[n][1])
        t = time_ms(run(mm, params), h, iterations=iterations)
        row[mode] = t_dense / t  # tokens/s over dense
        row[f"{mode}/route"] = _choices() if mode == "tune" else ""
    log(json.dumps(row))
    out.append(row)
  return out


# The layer's value and gradients for the loss sum(y^2) / 2 (dY = y): a cotangent that depends on the forward, as in
# a real step. Under sum(y) XLA ran dW before the forward and fused the dense step's weight cast into the optimizer
# update (the dense step 15 us faster than any real one at 2048 x 5632, 256 rows).
_loss = train_step
# Routes timed forced beside the modes (each where it runs).
ROUTES = ("xla", "prune_kernel", "cusparselt")


TRANSPOSABLE = {"on": False}  # --transposable: the SR-STE parts prune with transposable masks


def _sr_ste(impl):
  t = TRANSPOSABLE["on"]
  return lambda a, b: ops.sr_ste_matmul(a, b, 2, 4, dtype=jnp.bfloat16, implementation=impl, transposable=t)


def _forced(row: dict, wrap, args, iterations: int, t_dense: float) -> None:
  """``row[route]``: the time of ``wrap(sr_ste_matmul forced to route)`` on ``args`` over ``t_dense``, for each of
  ``ROUTES`` (``"-"`` where it cannot run)."""
  for route in ROUTES:
    try:
      with jaxsparse.autotune_mode("off"):
        row[route] = time_ms(wrap(_sr_ste(route)), *args, iterations=iterations) / t_dense
    except RuntimeError as e:  # the route cannot run these operands here
      log(f"{route}: {e}")
      row[route] = "-"


def sr_ste_steps(iterations: int) -> list[dict]:
  out = []
  for (k, n) in ((2048, 5632), (4096, 4096), (5632, 2048)):
    w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.float32)
    for m in (256, 1024, 4096, 8192):
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      t_dense = time_ms(_loss(lambda a, b: a @ b.astype(jnp.bfloat16)), x, w, iterations=iterations)
      row = {"shape": f"{k}x{n}", "rows": m}
      for mode in MODES:
        with jaxsparse.autotune_mode(mode):
          row[mode] = time_ms(_loss(_sr_ste(None)), x, w, iterations=iterations) / t_dense
          row[f"{mode}/route"] = _choices() if mode == "tune" else ""
      _forced(row, _loss, (x, w), iterations, t_dense)
      log(json.dumps(row))
      out.append(row)
  return out


def sr_ste_optimizer_steps(iterations: int) -> list[dict]:
  """The whole train step of one SR-STE layer: its gradients and an ``optax.adamw`` update, jitted together.

  Where the step ends in an optimizer, XLA can fuse the decay term of ``dW`` and the gradient's cast into the update
  that reads the gradient anyway; ``sr_ste_steps`` (gradients as outputs) cannot.
  """
  import optax  # noqa: PLC0415 (only this part)

  tx = optax.adamw(1e-3)
  out = []
  for (k, n) in ((2048, 5632), (4096, 4096), (5632, 2048)):
    w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.float32)
    state = tx.init(w)
    for m in (256, 1024, 2048, 4096):
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)

      def step_of(f):
        def step(a, b, st):
          loss, (da, db) = _loss(f)(a, b)
          updates, st = tx.update(db, st, b)
          return loss, da, optax.apply_updates(b, updates), st

        return step

      t_dense = time_ms(step_of(lambda a, b: a @ b.astype(jnp.bfloat16)), x, w, state, iterations=iterations)
      row = {"shape": f"{k}x{n}", "rows": m, "dense_ms": t_dense}
      for mode in MODES:
        with jaxsparse.autotune_mode(mode):
          row[mode] = time_ms(step_of(_sr_ste(None)), x, w, state, iterations=iterations) / t_dense
          row[f"{mode}/route"] = _choices() if mode == "tune" else ""
      _forced(row, step_of, (x, w, state), iterations, t_dense)
      log(json.dumps(row))
      out.append(row)
  return out


def _table(rows, cols) -> str:
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    cells = []
    for c in cols:
      v = r.get(c, "")
      cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="gpu_nm.py --tuned", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cases", type=int, default=8, help="random product shapes besides the Llama ones")
  parser.add_argument("--seed", type=int, default=35)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--parts", default="products,decode,sr_ste")
  parser.add_argument("--out", default=None, help="write the markdown tables here")
  parser.add_argument("--transposable", action="store_true", help="SR-STE parts: transposable 2:4 masks")
  args = parser.parse_args(argv)
  TRANSPOSABLE["on"] = args.transposable
  out_dir = os.environ.get("OUT", ".")
  os.environ[_tuning_cache.ENV_PATH] = os.path.join(out_dir, "autotune_nm.json")
  logging.getLogger("jaxsparse.autotune").setLevel(logging.WARNING)
  rng = np.random.default_rng(args.seed)
  drawn = [(int(rng.choice(DIMS)), int(rng.choice(DIMS))) for _ in range(args.cases)]
  parts = args.parts.split(",")
  text = [f"# 2:4 against dense, measured dispatch off / tune ({jax.devices()[0].device_kind})", ""]
  if "products" in parts:
    rows = products(TINY + LLAMA8B + tuple(drawn), args.iterations)
    cols = ["shape", "rows", "dense_us"] + [f"{t}/{m}" for t in ("blob", "values") for m in MODES]
    cols += ["blob/tune/route", "values/tune/route"]
    text += ["## Products (time / dense)", "", _table(rows, cols), ""]
  if "decode" in parts:
    rows = decode_loop(args.layers, args.steps, args.iterations)
    text += ["## TinyLlama-projection decode loop (tokens/s over dense)", "",
             _table(rows, ["batch", "dense_tok_s", *MODES, "tune/route"]), ""]
  if "sr_ste" in parts:
    rows = sr_ste_steps(args.iterations)
    text += ["## SR-STE step (time / dense step)", "",
             _table(rows, ["shape", "rows", *MODES, "tune/route", *ROUTES]), ""]
  if "sr_ste_optax" in parts:
    rows = sr_ste_optimizer_steps(args.iterations)
    text += [f"## SR-STE step with an optax.adamw update{' (transposable masks)' if args.transposable else ''} "
             "(time / dense step with the same update)", "",
             _table(rows, ["shape", "rows", "dense_ms", *MODES, "tune/route", *ROUTES]), ""]
  report = "\n".join(text)
  print(report)
  if args.out:
    with open(args.out, "w") as f:
      f.write(report)


if __name__ == "__main__":
  main()
