"""Measured dispatch: time a product's candidate routes once per signature and keep the fastest.

An op's router lists its candidates for one product (the shipped default first, the dense route always among
them) and calls :func:`choose` while the op is traced. In ``"tune"`` mode, the first trace of a signature that
no cache holds compiles every candidate on random operands of the product's shapes (a random pattern of the
same block count), times them on the device and records the winner (:mod:`._cache`); later traces, and other
processes sharing the cache file, read it back without measuring. A first-trace measurement has a time budget
(:func:`._cache.current_budget_s`): candidates other than the shipped default and the dense product that are not
compiled by then are left out (and named in the cache entry, for :func:`jaxsparse.autotune` to time). The
shipped default keeps its place unless a candidate beats it by more than :data:`MARGIN`, so noise does not flip
routes and tuning never picks a route measurably slower than the default.

Measuring runs eagerly inside the trace (``jax.ensure_compile_time_eval``) on concrete data, so it works
under ``jit``, ``grad``, ``vmap``, ``shard_map`` (each shard's shape), ``jax.export`` and the partition callback
of ``custom_partitioning``. GPU times are device times from CUPTI (Mosaic GPU's profiler); elsewhere, or when
CUPTI is busy (another profiler attached), the median wall time of back-to-back calls.

On a GPU, a product whose operands would stay in the L2 cache between calls is timed over several sets of operands in
turn (:func:`_copies`): in a model each layer's weights are evicted by the layers between its calls, so a decode
product reads its weight from memory, and a candidate fast only from the L2 must not win.

A product may name the dense product it stands in for (:class:`DenseProduct`: ``x @ W`` of a dense layer of the same
shapes). Its time is measured beside the candidates (as ``"dense_us"`` in the cache entry): no candidate can run it,
since the sparse operands do not hold ``W``, but where the fastest candidate of a forward (or of a train step tuned as
one) is slower than it by more than :data:`MARGIN` a :class:`SlowerThanDenseWarning` says so, once per signature and
process, from a measurement or from the cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse import _utils
from jaxsparse._tuning import _cache

__all__ = [
    "MARGIN",
    "Candidate",
    "DenseProduct",
    "SlowerThanDenseWarning",
    "choose",
    "default_platform",
    "random_operand",
    "signature_key",
    "time_call_ms",
    "wait_for_background_compiles",
    "will_measure",
]

logger = logging.getLogger("jaxsparse.autotune")

# A candidate replaces the shipped default only if it is faster by more than this fraction.
MARGIN = 0.03
# Of a signature's tuning budget, the seconds kept for timing the compiled candidates.
_TIMING_RESERVE_S = 0.4
# Each candidate is timed over about this much device time (at least 3 and at most 100 calls).
_TARGET_MS = 20.0
# On a GPU, operands of fewer bytes than _CACHED_BYTES are timed in copies that together hold at least _COLD_BYTES
# (at most _MAX_COPIES of them): twice the L2 of the largest GPU tuned on (B200: 126 MB; H100 / H200: 50 MB).
_CACHED_BYTES = 128 << 20
_COLD_BYTES = 256 << 20
_MAX_COPIES = 16
# Part of every cache key: how candidates are timed. Decisions timed another way are not reused (version 1, no field:
# before the copies above; 2: train-step candidates timed on a sum of their outputs; 3: on sum(y^2) / 2, `train_step`).
TIMING_VERSION = 3

# The key of the dense product's time in what _measure returns (no candidate's name: they have no spaces).
DENSE = "x @ W"
# Compiles of candidates that a measurement stopped waiting for (past the tuning budget) finish in the background and
# hold host cores meanwhile: a 2048-token prefill timed right after its products were tuned ran at 0.75x dense where
# it runs at 0.99x once they are done (H100, 2026-11-28). Benchmarks wait for them (wait_for_background_compiles).
# Each leaves the set when it finishes.
_BACKGROUND: set[concurrent.futures.Future] = set()


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to compute a product.

  Attributes:
    name: stable identifier stored in the cache (e.g. ``"mosaic/g2"``, ``"dense"``).
    run: ``(*operands) -> outputs``, traceable by ``jax.jit``.
    value: what the router uses when this candidate wins (e.g. a kernel config).
    measure: what is timed instead of ``run``, on the same operands, where ``run`` alone would mislead (e.g. a
      whole train step's products, when the candidates differ in their backward passes too); ``None``: ``run``.
    prepare: ``() -> Any``, thread-safe work that tracing ``run`` would otherwise do on its own (e.g. compiling a
      CUDA kernel with NVRTC): before a measurement traces the candidates one by one, the ``prepare`` of every
      candidate runs in a thread pool, side by side. Its result and errors are ignored (tracing then reports them).
    always_timed: timed however long it takes to compile (the dense product, which bounds every choice); the
      shipped default (the first candidate) always is. Others are left out of a first-trace measurement whose
      tuning budget (:func:`jaxsparse._tuning._cache.current_budget_s`) they would overrun.
  """

  name: str
  run: Callable[..., Any]
  value: Any = None
  measure: Callable[..., Any] | None = None
  prepare: Callable[[], Any] | None = None
  always_timed: bool = False


class SlowerThanDenseWarning(UserWarning):
  """No route of a sparse product beats the dense product it stands in for, as measured on this device.

  Tuning (``"tune"`` mode, the default on GPUs, and :func:`jaxsparse.autotune`) times the dense product of a layer of
  the same shapes and dtypes beside a sparse product's routes. Where the fastest route of a forward (or of a whole
  train step, for the ops tuned as one and a block-sparse forward chosen in its step) is slower than it by more than
  3%, this warning names the product, both times and their ratio, once per signature and process, also when the
  decision comes from the tuning cache. Gradients tuned one by one (block-sparse ``dX``, ``dW``) are not compared:
  time the train step itself. At such densities
  (typically 40-60% of the weights kept, or small products on large blocks) the sparse layer saves memory but not
  time: :func:`jaxsparse.route_slower_to_dense` turns such layers of a model into dense ones with the same weights.

  >>> import warnings, jaxsparse
  >>> warnings.simplefilter("ignore", jaxsparse.SlowerThanDenseWarning)  # the memory is what you are after
  >>> warnings.resetwarnings()
  """


@dataclasses.dataclass(frozen=True)
class DenseProduct:
  """The dense product a sparse product stands in for, timed beside its candidates (:class:`SlowerThanDenseWarning`).

  Attributes:
    lhs: the left operand's shape, ``(..., K)`` (``x`` of a forward; ``dY`` of ``dX = dY @ W.T``; ``x.T`` of ``dW``).
    rhs: the right operand's shape, ``(K, N)``.
    dtypes: the two operands' dtypes.
    step: time :func:`train_step` of the product (its value and both gradients), for products whose candidates are
      timed that way (``Candidate.measure``), instead of the product alone.
  """

  lhs: tuple[int, ...]
  rhs: tuple[int, int]
  dtypes: tuple[Any, Any]
  step: bool = False

  def describe(self) -> str:
    """E.g. ``"(384, 4096) @ (4096, 2048) float16"``, with `` train step`` for ``step``."""
    names = dict.fromkeys(str(jnp.dtype(d)) for d in self.dtypes)
    return f"{tuple(self.lhs)} @ {tuple(self.rhs)} {' x '.join(names)}{' train step' if self.step else ''}"


@functools.partial(jax.jit, static_argnums=(1, 2))
def _hashed(seed: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  i = lax.iota(jnp.uint32, math.prod(shape)) + seed * jnp.uint32(0x9E3779B9)
  h = i * jnp.uint32(2654435761)
  h = (h ^ (h >> 15)) * jnp.uint32(2246822519)
  h = h ^ (h >> 13)
  u = (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) - 0.5  # 24 bits: uniform on [-0.5, 0.5)
  return (u * 3.4).reshape(shape).astype(dtype)


def random_operand(shape: Sequence[int], dtype: jax.typing.DTypeLike, seed: int = 0) -> jax.Array:
  """Random-looking numbers of ``shape`` and ``dtype``, made on the default device, to time a product on.

  Uniform on ``[-1.7, 1.7)`` (mean 0, standard deviation about 1), from a hash of each element's index and ``seed``
  (up to ``2**32`` elements). One small program per shape and dtype: it compiles in about 0.05 s on a CPU where
  ``jax.random.normal`` took 0.3-0.45 s, a cost every product signature's first measurement pays; host-made numbers
  cost seconds at an LLM's weight sizes. The values only need to be finite, varied and free of structure a kernel
  could exploit (a 2:4 weight's kept positions, say, follow their magnitudes).

  Args:
    shape: the operand's shape.
    dtype: its floating dtype.
    seed: a non-negative int; operands of one product take different seeds.

  Returns:
    A ``shape`` array of ``dtype``.

  >>> a = random_operand((256, 512), "bfloat16", seed=1)
  >>> a.shape, a.dtype, bool(jnp.all(jnp.abs(a.astype(jnp.float32)) < 1.75))
  ((256, 512), dtype(bfloat16), True)
  >>> b, c = random_operand((256, 512), "bfloat16", seed=1), random_operand((256, 512), "bfloat16", seed=2)
  >>> bool(jnp.all(a == b)), bool(jnp.any(a != c))
  (True, True)
  """
  return _hashed(jnp.uint32(seed), tuple(int(d) for d in shape), jnp.dtype(dtype))


def train_step(run: Callable[..., Any]) -> Callable[..., Any]:
  """What a candidate that differs in its backward passes is timed on: ``run(x, w)``'s value and its gradients to
  both operands, for the loss ``sum(y ** 2) / 2`` (so ``dY = y``).

  The loss must make the cotangent depend on the forward's result, as a train step's does. Under ``sum(y)`` the
  cotangent is a constant: XLA then computes ``dW`` before the forward product and fuses the forward's cast of a
  float32 weight into the optimizer update, which no real step allows (the SR-STE step on an H200: the dense step
  looked 15 us faster, and the pruning kernel's route 1.08x of it where it runs at 1.00-1.02x).

  Args:
    run: ``(x, w) -> y``, traceable by ``jax.jit``.

  Returns:
    ``(x, w) -> (loss, (dx, dw))``; integer operands get ``float0`` gradients.

  >>> f = train_step(lambda x, w: x @ w)
  >>> loss, (dx, dw) = f(jnp.ones((2, 3)), jnp.ones((3, 4)))
  >>> float(loss), dx.shape, dw.shape
  (36.0, (2, 3), (3, 4))
  """

  def loss(x, w):
    y = run(x, w).astype(jnp.float32)
    return 0.5 * jnp.sum(y * y)

  return jax.value_and_grad(loss, argnums=(0, 1), allow_int=True)


def signature_key(op: str, direction: str, platform: str, **fields: Any) -> str:
  """The cache key of one product: its fields plus the device kind, the jaxsparse and jax versions and
  :data:`TIMING_VERSION`."""
  from jaxsparse import __version__  # noqa: PLC0415 (the package imports this module)

  try:
    device_kind = jax.devices(platform)[0].device_kind
  except RuntimeError:
    device_kind = platform
  doc = {"op": op, "dir": direction, "device": device_kind, "jaxsparse": __version__, "jax": jax.__version__,
         "timing": TIMING_VERSION}
  return json.dumps({**doc, **{k: _plain(v) for k, v in fields.items()}}, sort_keys=True)


def _plain(v: Any) -> Any:
  if isinstance(v, (tuple, list)):
    return [_plain(x) for x in v]
  if v is None or isinstance(v, (bool, int, float, str)):
    return v
  return str(v)


def _has_device(platform: str) -> bool:
  """Whether products traced now run on ``platform``: its devices exist and it is the default backend. Under
  ``jit`` both branches of ``lax.platform_dependent`` are traced (a GPU machine traces the CPU routes too); only
  the branch of the backend that runs is measured."""
  backend = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  try:
    return bool(jax.devices(platform)) and jax.default_backend() == backend
  except RuntimeError:
    return False


def _cupti_ms(exe, args, iterations: int) -> float | None:
  try:
    from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU-only module, absent on some jaxlibs)

    _, times = profiler.measure(exe, iterations=iterations)(*args)
  except Exception as e:  # CUPTI missing or held by another profiler: host timing instead
    logger.debug("CUPTI timing unavailable (%s: %s); timing from the host", type(e).__name__, e)
    return None
  if times is None:
    return 0.0
  return float(statistics.median(times if isinstance(times, list) else [times]))


def _host_ms(exe, args, iterations: int) -> float:
  reps = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(iterations):
      out = exe(*args)
    jax.block_until_ready(out)
    reps.append((time.perf_counter() - t0) * 1e3 / iterations)
  return float(statistics.median(reps))


def _time_ms(exe, args, platform: str) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(exe(*args))  # warm-up, and a first estimate of one call
  estimate = max((time.perf_counter() - t0) * 1e3, 1e-3)
  iterations = int(min(100, max(3, _TARGET_MS / estimate)))
  if platform == "cuda":
    ms = _cupti_ms(exe, args, iterations)
    if ms is not None:
      return ms
  return _host_ms(exe, args, iterations)


def default_platform() -> str:
  """The tuner's platform name of the default backend: ``"cuda"`` on a CUDA GPU (CUPTI device times), else the
  backend's name."""
  backend = jax.default_backend()
  return "cuda" if backend == "gpu" else backend


def _copies(args: tuple, platform: str) -> int:
  """How many sets of operands like ``args`` a candidate is timed over, one call each in turn: 1 off a GPU (a CPU's
  caches are small against the weights; the CPU also stands in for a GPU in tests) and for operands too large to
  stay in an L2 cache; else enough for ``_COLD_BYTES``."""
  if platform != "cuda" or jax.default_backend() != "gpu":
    return 1
  nbytes = sum(getattr(a, "nbytes", 0) for a in jax.tree.leaves(args))
  if nbytes >= _CACHED_BYTES:
    return 1
  return max(1, min(_MAX_COPIES, -(-_COLD_BYTES // max(nbytes, 1))))


def _in_turn(f: Callable[..., Any]) -> Callable[[list], list]:
  """``f`` called once on each set of operands (traced once: the calls share one jitted ``f``)."""
  g = jax.jit(f)
  return lambda sets: [g(*args) for args in sets]


def _sets(args: tuple, platform: str) -> list[tuple]:
  """``args`` and the copies of it that :func:`_copies` asks for (new buffers of the same values)."""
  copy = lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a
  return [args, *(jax.tree.map(copy, args) for _ in range(_copies(args, platform) - 1))]


def time_call_ms(f: Callable[..., Any], args: tuple, platform: str) -> float:
  """Milliseconds of one jitted call ``f(*args)``, timed as the tuner times its candidates: CUPTI device time on a
  CUDA GPU (else wall time), over copies of ``args`` in turn where they would stay in the L2 cache (:func:`_copies`).
  Traced and compiled here, in the caller's tuning mode."""
  sets = _sets(args, platform)
  exe = jax.jit(_in_turn(f)).lower(sets).compile()
  return _time_ms(exe, (sets,), platform) / len(sets)


def _made_outside_the_trace(make_args: Callable[[], tuple]) -> tuple:
  """``make_args()`` in a thread of its own, where no trace is active (JAX's trace state is per thread): its jitted
  parts compile and run as whole programs. Inside the caller's trace, under ``jax.ensure_compile_time_eval``, they
  ran op by op with their constants folded: a random 2:4 weight of 4096 x 28672 took 20 s to make on a CPU (2.4 s
  jitted), most of a Llama-3-8B gate / up product's tuning on an H100 machine (15.5 s). The caller's thread-local
  settings that decide what the operands are (64-bit types, the default device) go with it."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(_with_callers_config(make_args)).result()


def _with_callers_config(f: Callable[[], Any]) -> Callable[[], Any]:
  """``f`` to run in another thread with this thread's settings that decide what operands are (64-bit types, the
  default device)."""
  x64, device = jax.config.jax_enable_x64, jax.config.jax_default_device

  def run():
    with jax.enable_x64(x64), jax.default_device(device):
      return f()

  return run


def _prepare(candidates: Sequence[Candidate]) -> None:
  """Runs the candidates' ``prepare`` side by side (kernel builds release the GIL); errors are left to tracing."""
  jobs = [c.prepare for c in candidates if c.prepare is not None]
  if len(jobs) < 2:
    return  # one build gains nothing from a thread; tracing does it
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(jobs))) as pool:
    for fut in [pool.submit(job) for job in jobs]:
      if fut.exception() is not None:
        logger.info("autotune: preparing a candidate failed: %s", fut.exception())


def _timed_compile(lowered) -> tuple[Any, float]:
  """``(lowered.compile(), seconds it took)``."""
  t0 = time.perf_counter()
  exe = lowered.compile()
  return exe, time.perf_counter() - t0


def _measure(candidates: Sequence[Candidate], make_args: Callable[[], tuple],
             platform: str, dense: DenseProduct | None = None) -> dict[str, float | None]:
  """``{name: ms}`` of the candidates that compile and run (the others are logged and left out): the time of one
  call, on operands that are not in the L2 cache (:func:`_copies`). ``None``: not compiled within the tuning
  budget (:func:`_cache.current_budget_s`), so not timed; the shipped default and ``always_timed`` candidates never
  are. With ``dense``, its time too, under :data:`DENSE` (absent where it fails), compiled beside the candidates."""
  # The operands are made where no trace is active and copied eagerly (concrete, on the device) even inside the
  # caller's trace; the candidates are traced on their own, outside that eager scope (a kernel body must be staged,
  # not evaluated).
  t0 = time.perf_counter()
  budget = _cache.current_budget_s()
  # Time left for timing the compiled candidates: ~0.03 s each on the H100 (2026-11-27, 0.07-0.32 s a signature).
  deadline = math.inf if budget is None else t0 + budget - _TIMING_RESERVE_S
  kept = {c.name for c in candidates[:1]} | {c.name for c in candidates if c.always_timed}
  _prepare(candidates)
  args = _made_outside_the_trace(make_args)
  with jax.ensure_compile_time_eval():
    sets = _sets(args, platform)
  t1 = time.perf_counter()
  # Each candidate compiles in a thread as soon as it is lowered (compiling releases the GIL): the compiles run side
  # by side and beside the lowering of the next candidates, which holds the GIL. Past the deadline the measurement
  # waits only for the candidates it keeps; a compile it stops waiting for finishes in the background, unused.
  futures, unfinished = {}, []
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, max(1, len(candidates) + (dense is not None))))
  # The dense product's operands and program are made in a pool thread (no trace active there), from the start.
  dense_job = pool.submit(_with_callers_config(lambda: _dense_compiled(dense, platform))) if dense else None
  try:
    for c in candidates:
      if c.name not in kept and time.perf_counter() > deadline:
        unfinished.append(c.name)
        continue
      try:
        lowered = jax.jit(_in_turn(c.measure or c.run)).lower(sets)
      except Exception as e:  # a candidate that cannot trace is not a candidate
        logger.info("autotune: candidate %s does not trace: %s: %s", c.name, type(e).__name__, e)
        continue
      futures[c.name] = pool.submit(_timed_compile, lowered)
    t2 = time.perf_counter()
    concurrent.futures.wait([f for n, f in futures.items() if n in kept] + ([dense_job] if dense_job else []))
    concurrent.futures.wait(futures.values(),
                            timeout=None if budget is None else max(0.0, deadline - time.perf_counter()))
    unfinished += [n for n, f in futures.items() if not f.done()]
    for f in futures.values():
      if not f.done():
        _BACKGROUND.add(f)
        f.add_done_callback(_BACKGROUND.discard)  # no compiled program kept once it is done
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
  t3 = time.perf_counter()
  times, compile_s = dict.fromkeys(unfinished), {}
  with jax.ensure_compile_time_eval():
    for name, fut in futures.items():
      if name in times:
        continue
      try:
        exe, compile_s[name] = fut.result()
        times[name] = _time_ms(exe, (sets,), platform) / len(sets)
      except Exception as e:  # a candidate that fails to compile or run loses
        logger.info("autotune: candidate %s failed: %s: %s", name, type(e).__name__, e)
    if dense_job is not None:
      try:
        exe, sets = dense_job.result()
        times[DENSE] = _time_ms(exe, (sets,), platform) / len(sets)
      except Exception as e:  # e.g. a dtype XLA's dot does not take here: no comparison
        logger.info("autotune: the dense product %s failed: %s: %s", dense.describe(), type(e).__name__, e)
  logger.info("autotune: operands %.2f s, traced %.2f s, compiled %.2f s after, timed %.2f s (%d operand sets); "
              "compile s by candidate: %s%s", t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, len(sets),
              {k: round(v, 2) for k, v in compile_s.items()},
              f"; not compiled within the {budget:g} s budget: {unfinished}" if unfinished else "")
  return times


def _dense_compiled(dense: DenseProduct, platform: str) -> tuple[Any, list[tuple]]:
  """``dense``'s compiled program and its sets of random operands (:func:`_sets`), made where no trace is active."""
  run = jnp.matmul if not dense.step else train_step(jnp.matmul)
  args = (random_operand(dense.lhs, dense.dtypes[0], 1), random_operand(dense.rhs, dense.dtypes[1], 2))
  sets = _sets(args, platform)
  return jax.jit(_in_turn(run)).lower(sets).compile(), sets


_WARNED: set[str] = set()  # the signatures a SlowerThanDenseWarning was given for, in this process


def _warn_if_slower(key: str, op: str, direction: str, entry: dict, choice: str, dense: DenseProduct | None) -> None:
  """A :class:`SlowerThanDenseWarning` (once per ``key``) where a forward's (or a whole train step's, ``"step"``) chosen
  route is slower than the dense product. Gradients (``"dx"``, ``"dw"``) are not compared: their candidates' times
  each include per-call work on the weight (a re-tiled or transposed copy of the blocks) that a train step does once
  for all its products, so they overstate what the step loses (on an H200, two layers whose three products summed to
  1.05x and 1.15x the dense layer's trained at 0.93x and 0.99x of its step)."""
  dense_us, chosen_us = _us(entry.get("dense_us")), _recorded_us(entry).get(choice)
  if dense is None or direction in ("dx", "dw") or key in _WARNED or chosen_us is None:
    return
  if not (dense_us is not None and dense_us > 0 and chosen_us > dense_us * (1 + MARGIN)):
    return
  _WARNED.add(key)
  what, advice = f"{op} {direction}", "train such layers dense, or less dense, where time matters more"
  if direction == "fwd":
    what, advice = f"{op} forward", "jaxsparse.route_slower_to_dense makes such layers dense with the same weights"
  _utils.warn_at_caller(
      f"{what}: the fastest route measured on this device ({choice}, {chosen_us:g} us) takes "
      f"{chosen_us / dense_us:.2f}x the time of the dense product it stands in for ({dense.describe()}: "
      f"{dense_us:g} us). Sparsity saves memory here but not time; {advice}.", SlowerThanDenseWarning)


def wait_for_background_compiles(timeout: float | None = None) -> bool:
  """Waits (at most ``timeout`` seconds; ``None``: as long as it takes) for the compiles that measurements stopped
  waiting for; ``True`` when none is left running. A timing taken while they run shares the host with them."""
  _, running = concurrent.futures.wait(list(_BACKGROUND), timeout=timeout)
  return not running


def _us(value: Any) -> float | None:
  """A time read from a cache entry (a file other processes and machines write) as a finite float; ``None`` for
  anything else: a string, a bool, NaN, infinity, or an integer too large for a float (JSON's integers are not
  bounded)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  try:
    value = float(value)
  except OverflowError:
    return None
  return value if math.isfinite(value) else None


def _recorded_us(entry: dict | None) -> dict[str, float]:
  """A cached decision's recorded times (µs) by candidate name; malformed ones left out."""
  times = entry.get("times_us") if entry is not None else None
  if not isinstance(times, dict):
    return {}
  return {k: us for k, v in times.items() if isinstance(k, str) and (us := _us(v)) is not None}


def recorded_decision(op: str, direction: str, platform: str,
                      fields: dict[str, Any]) -> tuple[str | None, dict[str, float]]:
  """``(choice, times in µs by candidate name)`` of the cached decision of one product's signature; ``(None, {})``
  where none is cached."""
  entry = _cache.lookup(signature_key(op, direction, platform, **fields))
  choice = entry.get("choice") if entry is not None else None
  return (choice if isinstance(choice, str) else None), _recorded_us(entry)


def _timed(entry: dict) -> set[str]:
  """The candidate names a cached decision chose among (entries written before ``"candidates"``: those it timed)."""
  names = entry.get("candidates")
  return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set(_recorded_us(entry))


def _unfinished(entry: dict) -> set[str]:
  """The candidate names a cached decision left untimed for its tuning budget."""
  names = entry.get("unfinished")
  return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _pick(times: dict[str, float], prior: str) -> str:
  """The fastest name of ``times``, or ``prior`` (the shipped default) where it is within :data:`MARGIN` of it."""
  best = min(times, key=times.get)
  return prior if prior in times and times[prior] <= times[best] * (1 + MARGIN) else best


def will_measure(platform: str) -> bool:
  """Whether a product traced now for ``platform`` may be measured (``"tune"`` mode, on that platform's device)."""
  return _cache.current_mode(platform) == "tune" and _has_device(platform)


def choose(
    op: str,
    direction: str,
    candidates: Sequence[Candidate],
    make_args: Callable[[], tuple],
    *,
    platform: str,
    fields: dict[str, Any],
    dense: DenseProduct | None = None,
) -> Candidate:
  """The candidate to run for one product: cached, measured now, or the shipped default (``candidates[0]``).

  A cached decision stands unless this call may measure (``"tune"`` mode, on the platform's device) and offers a
  candidate the decision did not time (a route or config added since, e.g. by a newer jaxsparse): then the product
  is measured again, once, over every candidate offered now. Products of one signature may offer different
  candidates (two row counts of one bucket): where the cached choice is not offered, the fastest offered candidate
  of the entry's recorded times runs, without measuring; the entry keeps the times of every measurement of its key.

  Args:
    op: the op's name, e.g. ``"block_sparse_matmul"``.
    direction: ``"fwd"``, ``"dx"`` or ``"dw"``; ``"step"`` for a forward whose candidates are timed in a train step
      (their ``measure``).
    candidates: the routes to choose from, the shipped default first; names unique.
    make_args: builds concrete random operands of the product's shapes on the device (called only to measure).
    platform: ``"cuda"`` or ``"cpu"``: where the product runs.
    fields: the rest of the signature (row bucket, shapes, block shape, density bucket, dtypes, precision).
    dense: the dense product this one stands in for, timed with the candidates (``"dense_us"`` in the entry); a
      :class:`SlowerThanDenseWarning` where the choice is slower than it. ``None``: no comparison.

  Returns:
    One of ``candidates``.
  """
  prior = candidates[0]
  mode = _cache.current_mode(platform)
  if mode == "off" or len(candidates) == 1:
    return prior
  by_name = {c.name: c for c in candidates}
  key = signature_key(op, direction, platform, **fields)
  hit = _cache.lookup(key)
  can_measure = mode == "tune" and _has_device(platform)
  recorded = _recorded_us(hit)
  # Remeasured where tuning may: candidates new to the decision, or (without a budget: jaxsparse.autotune) ones it
  # left out for the budget of a first-trace measurement.
  untimed = set(by_name) - _timed(hit) if hit is not None else set()
  if hit is not None and _cache.current_budget_s() is None:
    untimed |= set(by_name) & _unfinished(hit)
  if hit is not None and not (can_measure and untimed):
    offered = {k: v for k, v in recorded.items() if k in by_name}
    if hit["choice"] in by_name:
      choice = hit["choice"]
    elif offered:  # the key's other products chose among other candidates: the fastest of these, as recorded
      choice = _pick(offered, prior.name)
    else:
      choice = None
    if choice is not None:
      _warn_if_slower(key, op, direction, hit, choice, dense)
      return by_name[choice]
  if not can_measure:
    return prior
  t0 = time.perf_counter()
  measured = _measure(candidates, make_args, platform, dense)
  dense_ms = measured.pop(DENSE, None)
  times = {k: v for k, v in measured.items() if v is not None}
  if not times:
    return prior
  best = _pick(times, prior.name)
  all_us = {**recorded, **{k: round(v * 1e3, 2) for k, v in times.items()}}
  entry = {
      "choice": best,
      "default": prior.name,
      # Every name offered, also those that failed to run, and those an earlier decision for this key chose among.
      "candidates": sorted(set(by_name) | (_timed(hit) if hit is not None else set())),
      "times_us": dict(sorted(all_us.items())),
  }
  unfinished = sorted(k for k, v in measured.items() if v is None and k not in all_us)
  if unfinished:  # offered but not compiled within the budget: jaxsparse.autotune measures them
    entry["unfinished"] = unfinished
  if dense_ms is not None:
    entry["dense_us"] = round(dense_ms * 1e3, 2)
  elif hit is not None and (hit_dense_us := _us(hit.get("dense_us"))) is not None:
    entry["dense_us"] = hit_dense_us
  entry["tuning_s"] = round(time.perf_counter() - t0, 3)
  _cache.record(key, entry)
  logger.info("autotune %s %s %s: %s", op, direction, fields, entry)
  _warn_if_slower(key, op, direction, entry, best, dense)
  return by_name[best]
