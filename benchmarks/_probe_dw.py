import jax, jax.numpy as jnp, numpy as np, sys
sys.path.insert(0, "benchmarks")
from gpu_block_sparse import problem
from jax.experimental.mosaic.gpu import profiler
from jaxsparse.pallas._block_sparse_config import dense_weight
for (m, k, n, b, d) in [(3000, 4096, 2560, (32, 32), 0.32), (4096, 768, 2560, (64, 32), 0.36), (8192, 4096, 4096, (32, 32), 0.5)]:
  x, dy, w, _ = problem(m, k, n, b, d, dtype=jnp.bfloat16)
  wd = w.to_dense()
  f = jax.jit(lambda w: dense_weight(w, jnp.bfloat16))
  g = jax.jit(lambda x, w: x @ dense_weight(w, jnp.bfloat16))
  h = jax.jit(lambda x, wd: x @ wd)
  c = jax.jit(lambda wd: wd * 2)
  for name, fn, args in [("dense_weight", f, (w,)), ("route fwd", g, (x, w)), ("dense fwd", h, (x, wd)), ("copy KxN", c, (wd,))]:
    fn(*args)
    _, runs = profiler.measure(fn, aggregate=False, iterations=10)(*args)
    ks = {}
    for run in runs:
      for kname, t in run:
        ks.setdefault(kname[:40], []).append(t)
    print(m, k, n, b, d, name, "; ".join(f"{kn} {np.median(v)*1e3:.1f}us" for kn, v in ks.items()), flush=True)
  print(jax.jit(lambda w: dense_weight(w, jnp.bfloat16)).lower(w).compile().as_text()[:3000] if m == 3000 else "", flush=True)
