"""Whole-model LLM speed, dense vs sparse: prefill and KV-cache decode of random-weight Llama models (examples/llama).

Run on a CUDA GPU (the device tool's H100), from the repository root, one shape per command to stay within
10 minutes:

  PYTHONPATH=.:examples python3 benchmarks/llm_decode.py --shapes 8b
  PYTHONPATH=.:examples python3 benchmarks/llm_decode.py --shapes 1.1b
  PYTHONPATH=.:examples python3 benchmarks/llm_decode.py --shapes 1.1b --dense-if-slower  # slower layers -> dense
  PYTHONPATH=.:examples python3 benchmarks/llm_decode.py --tiny          # CPU, seconds: the CI check

Models (``examples/llama/model.py``: RMSNorm, RoPE, grouped-query attention, SwiGLU, static KV cache),
random weights, bfloat16 weights and compute:

* ``8b``: the Llama-3-8B shape, d = 4096, MLP 14336, 32 layers, 32 query / 8 KV heads of 128, vocab 128256;
* ``1.1b``: the TinyLlama-1.1B shape, d = 2048, MLP 5632, 22 layers, 32 / 4 heads of 64, vocab 32000;
* ``3.2-1b``: the Llama-3.2-1B shape, d = 2048, MLP 8192, 16 layers, 32 / 8 heads of 64, vocab 128256, the LM head
  tied to the embedding (its logits are the table's product: ``--embedding 2:4`` makes that product 2:4 too);
* ``tiny``: d = 128, MLP 256, 2 layers, 4 / 2 heads of 32, vocab 256 (``--tiny``); ``tiny-tied`` the same, tied.

Patterns of the seven projections of every layer (``jaxsparse.sparsify`` by magnitude; the embedding and LM head stay
dense unless ``--head sparse`` gives the LM head the pattern's structure too and ``--embedding 2:4`` keeps the
embedding as a 2:4 ``CompressedNMEmbed``, ``to_inference(head=..., embedding=...)``): ``dense``; ``2:4``
(``CompressedNMLinear`` as ``to_inference`` builds it: ``storage="auto"``, the weight kept once as cuSPARSELt's buffer
where the GPU's cuSPARSELt reads it, which the ``mma.sp`` decode kernel and cuSPARSELt's prefill product both read,
else values and positions; measured dispatch picks the routes); ``2:4 + copy`` (``nm-copy``: ``storage="values"``,
values and positions plus a copy in cuSPARSELt's layout); ``block 64x64 50%`` (``BlockSparseLinear``, Pallas kernels);
``unstructured 50%`` (routed to dense: ``nnx.Linear`` with the pruned weights zero,
``to_inference(dense_unstructured=True)``, since no GPU kernel beats the dense product at 50% unstructured and
``MaskedLinear`` ran at 0.36-0.42x).

Timings, each the median of ``--repeats`` samples after a compiling call, wall time, blocked on once a sample (so
the host's dispatch cost is amortised):

* prefill: ``--prefill`` tokens (2048) of one sequence into an empty cache, logits of the last position; the
  attention core is cuDNN's fused attention there (``--attention auto``, the model's default on a GPU) or the
  eager einsum-softmax-einsum (``--attention xla``). A sample is ``--prefill-calls`` (8) calls enqueued back to
  back, as a server's stream of prompts runs, over their count: one call blocked alone also holds the host's
  launch of it (a few hundred microseconds with a model's hundreds of arrays), which the next prompt's device work
  hides in a stream;
* decode: ``--steps`` greedy decode steps in one ``lax.fori_loop`` at batch ``--batches`` (1, 8, 32), each
  step attending to a cache holding ``--context`` (1024) tokens before it; tokens/s = batch * steps / time.

``--layers N`` builds the models with N decoder layers instead of the shape's full depth (the default for ``8b`` and
``1.1b`` is 8, to fit the 10 minutes). Then a model with 0 layers (embedding, final norm, LM head, the loop) is timed
too, and the full-depth time is extrapolated as ``t0 + (tN - t0) * depth / N``: the decoder layers are identical, so
their time is linear in their count. With ``--head sparse`` or ``--embedding 2:4`` each sparse pattern has its own
0-layer model (its LM head and embedding, not routed by ``--dense-if-slower``). Both the measured and the extrapolated
numbers are printed; the ratios to dense use the extrapolated ones. A time of N layers that is not above the 0-layer
model's (the layers below the noise: tiny models on a busy CPU) is not extrapolated: its cells read "-" and the log
says why.

Weight bytes: every array of the model's state (parameters, masks, index arrays, and, with ``2:4 + copy``, the
cuSPARSELt copy of the 2:4 values that ``CompressedNMLinear`` keeps next to ``kernel`` on a GPU, counted separately
too), at the measured depth and extrapolated the same way; and, as "decoder layers vs dense", the bytes of the
decoder layers alone (without the embedding and the LM head) over the dense model's.

Every model, dense included, runs with its projections fused (``fuse_projections``: ``qkv_proj`` and
``gate_up_proj``, one product each where the layers are ``nnx.Linear``, ``CompressedNMLinear`` or ``BlockSparseLinear``;
masked layers stay separate); ``--no-fuse`` keeps Hugging Face's seven projections.

``--dense-if-slower`` routes sparse layers slower than dense to dense: ``to_inference(dense_if_slower_at=--batches)``
times, on this device, each distinct sparse projection (class, shape, pattern, density, dtype) against the
``nnx.Linear`` of the same pruned weights, its jitted forward on a ``(batch, in_features)`` input at every decode
batch (measured dispatch tuning the sparse product first; CUPTI device time on a GPU), and every projection of a
signature slower by more than 3% at any batch becomes that ``nnx.Linear``. ``--dense-if-slower per-batch`` builds
one model per decode batch instead, routed at that batch alone (a server that decodes at batch 32 builds its model
with ``dense_if_slower_at=32``): each decode column is its own model's; prefill and the weight columns are the first
batch's model's, and the routed column gives each model's routing and weight bytes. ``--dense-if-slower step`` is
``per-batch`` with ``to_inference(step_timer=...)``: the signatures within 15% of dense alone are settled by timing
the model's decode step (``--steps`` steps, ``--repeats`` calls) with them sparse and dense. The log gets the
per-signature times; the table a column "layers routed to dense" with the count per projection kind among the layers
built (``all``: every projection, as ``unstructured 50%`` always is). Build times then include this timing. Without
the option, no layer is timed and the table has no such column.

``--kernels 1`` also logs the device time per kernel name of one decode call at batch 1 (CUPTI): where a
decode step's time goes (projections, attention, LM head, the cache update).

The Markdown table is printed last; with ``$OUT`` set, ``llm_decode.md`` (table) and ``llm_decode.log`` (the
run, with measured dispatch's lines: each tuned signature's candidate times and its cost in tracing, compiling and
timing) are written there as the run goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import jax
import jax.numpy as jnp
from flax import nnx
from llama import model as llama_model
from llama.model import LlamaConfig
from llama.model import LlamaForCausalLM
from llama.model import init_cache
from llama.prune import fuse_projections
from llama.prune import to_inference

import jaxsparse
from jaxsparse._tuning import _measure  # wait_for_background_compiles: no timing beside the tuner's leftovers
from jaxsparse.layers._nm_compressed import CusparseLtWeight  # the cuSPARSELt copy of 2:4 values, counted apart

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

SHAPES = {
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=8192),
    "1.1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=64),
    # Llama 3.2 1B: the LM head tied to the embedding (logits = the table's product; --embedding 2:4 makes it 2:4).
    "3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          max_position_embeddings=131072, tie_word_embeddings=True),
    "tiny": LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "tiny-tied": LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}
DEFAULT_LAYERS = {"8b": 8, "1.1b": 8, "3.2-1b": 8, "tiny": None, "tiny-tied": None}
PATTERNS = {
    "dense": None,
    "2:4": jaxsparse.NM(2, 4),  # to_inference's default: CompressedNMLinear without the cuSPARSELt copy
    "2:4 + copy": jaxsparse.NM(2, 4),  # CompressedNMLinear(cusparselt_copy=True): the copy for sparse tensor cores
    "block 64x64 50%": jaxsparse.BlockSparse(density=0.5, block_shape=(64, 64)),
    "unstructured 50%": jaxsparse.Unstructured(sparsity=0.5),
}
PATTERN_ALIASES = {"dense": "dense", "2:4": "2:4", "nm": "2:4", "nm-copy": "2:4 + copy",
                   "block64": "block 64x64 50%", "block": "block 64x64 50%", "unstructured": "unstructured 50%",
                   "u50": "unstructured 50%"}
LOG: list[str] = []
FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}


def log(*args) -> None:
  line = " ".join(str(a) for a in args)
  print(line, flush=True)
  LOG.append(line)
  out = os.environ.get("OUT")
  if out:
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "llm_decode.log").write_text("\n".join(LOG) + "\n")


class _TuningLog(logging.Handler):
  """Measured dispatch's lines into the log: each signature's candidate times and what its tuning cost (tracing,
  compiling, timing)."""

  def emit(self, record: logging.LogRecord) -> None:
    log(f"    {record.getMessage()}")


def state_bytes(model: nnx.Module) -> tuple[int, int, int]:
  """``(all bytes of the model's arrays, bytes of cuSPARSELt copies among them, bytes of its decoder layers)``."""
  total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  cusparselt = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, CusparseLtWeight)))
  layers = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model.layers)))
  return total, cusparselt, layers


def timed(f, *args, repeats: int, reset=None, calls: int = 1) -> float:
  """Median seconds of ``f(*args)`` (after one compiling call); ``reset(out) -> args`` feeds donated buffers back.

  With ``calls`` > 1 (no ``reset``), each sample enqueues that many calls and blocks on the last: the seconds of
  one call in a stream of them, the host's dispatch of the next overlapping the device's work on this one.

  The timing starts once the compiles that measured dispatch left running in the background (candidates past its
  tuning budget) are done: while they run they share the host with the timed calls (a 1.1B-shape prefill timed
  0.75x dense that way and 0.99x without them)."""
  out = jax.block_until_ready(f(*args))
  _measure.wait_for_background_compiles()
  times = []
  for _ in range(repeats):
    if reset is not None:
      args = reset(out)
    t0 = time.perf_counter()
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def prefill_seconds(model, tokens: int, *, repeats: int, calls: int) -> float:
  cfg = model.config
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, ids):
    m = nnx.merge(graphdef, state)
    cache = init_cache(cfg, 1, tokens, dtype=m.dtype)
    return m.step(ids, cache, last_only=True)[0]

  ids = jax.random.randint(jax.random.key(1), (1, tokens), 0, cfg.vocab_size, jnp.int32)
  return timed(prefill, state, ids, repeats=repeats, calls=calls)


def decode_call(model, batch: int, context: int, steps: int):
  """``(decode, state, start, cache, token)``: ``decode(state, cache, token)`` runs ``steps`` greedy decode steps
  of ``batch`` rows after ``context`` cached tokens (the cache is donated); ``start(cache)`` resets a cache."""
  cfg = model.config
  graphdef, state = nnx.split(model)

  def start(cache):  # new arrays each time: the previous ones were donated
    filled = jnp.zeros(cache.filled.shape, bool).at[:, :context].set(True)
    return cache._replace(filled=filled, positions=jnp.full((batch,), context, jnp.int32),
                          index=jnp.asarray(context, jnp.int32))

  def decode(state, cache, token):
    m = nnx.merge(graphdef, state)

    def body(_, carry):
      token, cache = carry
      logits, cache = m.step(token[:, None], cache)
      return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, body, (token, cache))

  cache = start(init_cache(cfg, batch, context + steps, dtype=model.dtype))
  return decode, state, start, cache, jnp.zeros((batch,), jnp.int32)


def decode_seconds(model, batch: int, context: int, steps: int, *, repeats: int) -> float:
  """Seconds for ``steps`` greedy decode steps of ``batch`` rows after ``context`` cached tokens."""
  decode, state, start, cache, token = decode_call(model, batch, context, steps)
  decode = jax.jit(decode, donate_argnums=1)
  return timed(decode, state, cache, token, repeats=repeats, reset=lambda out: (state, start(out[1]), out[0]))


def kernel_breakdown(model, batch: int, context: int, steps: int, *, top: int = 12) -> list[str]:
  """Device time per kernel name of one decode call (CUPTI, GPU only), largest first, per decode step."""
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from _gpu_timing import kernel_times_ms  # noqa: PLC0415 -- GPU-only helper next to this script

  decode, state, _, cache, token = decode_call(model, batch, context, steps)
  by_name: dict[str, float] = {}
  for name, ms in kernel_times_ms(decode, state, cache, token, iterations=3):
    by_name[name] = by_name.get(name, 0.0) + ms
  total = sum(by_name.values())
  lines = [f"    {total / steps:.3f} ms/step on the device in {len(by_name)} kernel names"]
  for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
    lines.append(f"    {ms / steps:8.4f} ms/step {100 * ms / total:5.1f}%  {name[:110]}")
  return lines


@dataclasses.dataclass
class Row:
  shape: str
  pattern: str
  layers: int
  depth: int
  weight_bytes: float
  cusparselt_bytes: float
  layer_bytes: float  # of the decoder layers alone (the sparsified projections, norms; no embedding or LM head)
  prefill_s: float | None
  decode_s: dict[int, float]
  routed: str = "-"  # projections routed to dense, with --dense-if-slower


def build_dense(cfg: LlamaConfig, dtype) -> LlamaForCausalLM:
  return nnx.jit(lambda: LlamaForCausalLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))()


def sparse_options(args, pattern: str) -> dict:
  """``to_inference``'s storage, LM head and embedding options for ``pattern``."""
  copy = pattern == "2:4 + copy"
  return dict(cusparselt_copy=copy, storage="values" if copy else "auto", head=args.head == "sparse",
              embedding=jaxsparse.NM(2, 4) if args.embedding == "2:4" else None)


def routed_to_dense(model, report) -> str:
  """The sparsified projections that are dense ``nnx.Linear`` in ``model``, counted per kind: ``"gate_proj 8, up_proj
  8"``, ``"all 56"`` or ``"none"``."""
  modules = {".".join(map(str, p)): node for p, node in nnx.iter_graph(model)}
  counts: dict[str, int] = {}
  for change in report.replaced:
    kind = change.path.rsplit(".", 1)[-1]
    path = change.path
    if path not in modules:  # fuse_projections joined it
      path = f"{path.rsplit('.', 1)[0]}.{FUSED_INTO[kind]}"
    node = modules[path]
    if type(node) is nnx.Linear:
      counts[kind] = counts.get(kind, 0) + 1
  total = sum(counts.values())
  if not total:
    return "none"
  if total == len(report.replaced):
    return f"all {total}"
  return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def measure(model, args, label: str, batches: list[int] | None = None,
            with_prefill: bool = True) -> tuple[float | None, dict[int, float]]:
  """``(prefill seconds or None, {batch: decode seconds})`` at ``batches`` (default ``--batches``)."""
  t0 = time.perf_counter()
  prefill = (prefill_seconds(model, args.prefill, repeats=args.repeats, calls=args.prefill_calls)
             if args.prefill and with_prefill else None)
  if prefill is not None:
    log(f"  {label}: prefill {args.prefill} tokens {prefill * 1e3:.2f} ms a call in a stream of {args.prefill_calls}")
    if args.prefill_calls > 1:  # the latency of one prompt alone, the host's launch included: logged, not tabled
      one = prefill_seconds(model, args.prefill, repeats=args.repeats, calls=1)
      log(f"  {label}: prefill {args.prefill} tokens {one * 1e3:.2f} ms one call blocked alone")
  decode = {}
  for b in batches or args.batches:
    decode[b] = decode_seconds(model, b, args.context, args.steps, repeats=args.repeats)
    log(f"  {label}: decode batch {b}: {decode[b] / args.steps * 1e3:.3f} ms/step, "
        f"{b * args.steps / decode[b]:.1f} tokens/s")
    if args.kernels and b in args.kernels:
      try:
        for line in kernel_breakdown(model, b, args.context, args.steps, top=args.kernels_top):
          log(line)
      except Exception as e:  # CUPTI missing (CPU) or busy: the timings above stand
        log(f"    kernel breakdown failed: {type(e).__name__}: {str(e)[:200]}")
  log(f"  {label}: done in {time.perf_counter() - t0:.1f} s (compiles included)")
  return prefill, decode


def run_shape(name: str, args) -> list[Row]:
  full = SHAPES[name]
  layers = args.layers if args.layers is not None else DEFAULT_LAYERS[name]
  layers = full.num_hidden_layers if layers is None else min(layers, full.num_hidden_layers)
  cfg = dataclasses.replace(full, num_hidden_layers=layers)
  dtype = jnp.dtype(args.dtype)
  rows = []
  bases = {}

  def base_for(pattern):  # the 0-layer model (embedding, norm, LM head) of a pattern, for the extrapolation
    if layers == full.num_hidden_layers:
      return None
    own = PATTERNS[pattern] is not None and (args.head == "sparse" or args.embedding != "dense")
    key = pattern if own else "dense"
    if key not in bases:
      log(f"{name}: 0-layer model (embedding, norm, LM head){f' of {pattern}' if own else ''}")
      head = build_dense(dataclasses.replace(full, num_hidden_layers=0), dtype)
      if own:
        with warnings.catch_warnings():  # the projections' rule matches no layer of a 0-layer model: expected
          warnings.filterwarnings("ignore", message=r"rule\(s\) .* matched no ")
          head = to_inference(head, PATTERNS[pattern], **sparse_options(args, pattern))[0]
      bases[key] = (state_bytes(head), *measure(head, args, f"{name} 0 layers {key}"))
      del head
      gc.collect()
    return bases[key]
  log(f"{name}: {layers} of {full.num_hidden_layers} layers, {args.dtype}")
  dense = build_dense(cfg, dtype)
  scale = full.num_hidden_layers / layers

  def extrapolate(t, t0):  # to full depth: t0 + (tN - t0) * depth / N, t0 the 0-layer model's
    return t if base is None else t0 + (t - t0) * scale

  def extrapolate_time(t, t0, what):  # NaN where the layers' time is not above the 0-layer model's (noise)
    if base is not None and t <= t0:
      log(f"  {what}: {layers} layers timed {t * 1e3:.3f} ms, the 0-layer model {t0 * 1e3:.3f} ms: below the noise, "
          "not extrapolated")
      return math.nan
    return extrapolate(t, t0)

  for pattern in args.patterns:
    base = base_for(pattern)
    t0 = time.perf_counter()
    routed = "-"
    # One model per routing: every batch of --batches (--dense-if-slower all), each batch (per-batch), none (off).
    per_batch = args.dense_if_slower in ("per-batch", "step") and PATTERNS[pattern] is not None
    regimes = [[b] for b in args.batches] if per_batch else [args.batches]
    decode, parts = {}, []
    for i, at in enumerate(regimes):
      if PATTERNS[pattern] is None:
        model = fuse_projections(nnx.clone(dense)) if args.fuse else dense
      else:
        step_timer = None
        if args.dense_if_slower == "step":  # the decode step of the model being routed, at its batch
          step_timer = lambda m, b=at[0]: 1e3 * decode_seconds(m, b, args.context, args.steps, repeats=args.repeats)
        model, report = to_inference(dense, PATTERNS[pattern], **sparse_options(args, pattern),
                                     dense_if_slower_at=at if args.dense_if_slower else None, fuse=args.fuse,
                                     step_timer=step_timer)
        if args.dense_if_slower:
          routed = routed_to_dense(model, report)
          log(f"{name} {pattern}: layers routed to dense at batch {at}: {routed}")
          if report.timings:
            log(report.timing_table())
      log(f"{name} {pattern}: built in {time.perf_counter() - t0:.1f} s")
      model_bytes = state_bytes(model)
      if i == 0:
        total, cusparselt, layer_bytes = model_bytes
      prefill_i, decode_i = measure(model, args, f"{name} {pattern}", batches=at, with_prefill=i == 0)
      if i == 0:
        prefill = prefill_i
      decode.update(decode_i)
      if len(regimes) > 1:
        nbytes = extrapolate(model_bytes[0], base and base[0][0])
        size = f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.3f} MB"
        parts.append(f"b={at[0]}: {routed} ({size})")
      if model is not dense and i + 1 < len(regimes):
        del model
        gc.collect()
    if parts:
      routed = "; ".join(parts)
    if base is not None:
      (b_total, b_cus, _), b_prefill, b_decode = base
      total, cusparselt = extrapolate(total, b_total), extrapolate(cusparselt, b_cus)
      layer_bytes *= scale
      prefill = None if prefill is None else extrapolate_time(prefill, b_prefill, f"{pattern} prefill")
      decode = {b: extrapolate_time(decode[b], b_decode[b], f"{pattern} decode batch {b}") for b in decode}
    rows.append(Row(name, pattern, layers, full.num_hidden_layers, total, cusparselt, layer_bytes, prefill, decode,
                    routed))
    write_table(args, ROWS + rows)
    if model is not dense:
      del model
      gc.collect()
  return rows


ROWS: list[Row] = []


def table(args, rows: list[Row]) -> str:
  batches = args.batches
  unit, scale = ("GB", 1e9) if max(r.weight_bytes for r in rows) >= 1e9 else ("MB", 1e6)
  head = ["shape", "pattern", "layers timed", f"weight {unit} (cuSPARSELt copy)", "vs dense",
          "decoder layers vs dense", f"prefill {args.prefill} ms", "vs dense"]
  for b in batches:
    head += [f"decode b={b} tok/s", "vs dense"]
  if args.dense_if_slower:
    head.append("layers routed to dense")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  dense = {r.shape: r for r in rows if r.pattern == "dense"}
  for r in rows:
    d = dense.get(r.shape)
    layers = f"{r.layers} of {r.depth}" + (" (extrapolated)" if r.layers != r.depth else "")
    cells = [r.shape, r.pattern, layers, f"{r.weight_bytes / scale:.3f} ({r.cusparselt_bytes / scale:.3f})",
             f"{r.weight_bytes / d.weight_bytes:.3f}x" if d else "-",
             f"{r.layer_bytes / d.layer_bytes:.3f}x" if d and d.layer_bytes else "-"]
    if r.prefill_s is None or math.isnan(r.prefill_s):
      cells += ["-", "-"]
    else:
      ok = d and d.prefill_s and not math.isnan(d.prefill_s)
      cells += [f"{r.prefill_s * 1e3:.2f}", f"{d.prefill_s / r.prefill_s:.2f}x" if ok else "-"]
    for b in batches:
      if math.isnan(r.decode_s[b]):
        cells += ["-", "-"]
        continue
      tps = b * args.steps / r.decode_s[b]
      cells += [f"{tps:.1f}", f"{d.decode_s[b] / r.decode_s[b]:.2f}x" if d and not math.isnan(d.decode_s[b]) else "-"]
    if args.dense_if_slower:
      cells.append(r.routed)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_table(args, rows: list[Row]) -> None:
  out = os.environ.get("OUT")
  if out:
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "llm_decode.md").write_text(header(args) + "\n\n" + table(args, rows) + "\n")


def header(args) -> str:
  dev = jax.devices()[0]
  routing = ("" if not args.dense_if_slower else
             f"; --dense-if-slower: projections slower than dense (> 3%, jitted layer forward) at a decode batch of "
             f"{args.batches} run dense" if args.dense_if_slower == "all" else
             "; --dense-if-slower per-batch: one model per decode batch, its projections slower than dense (> 3%, "
             "jitted layer forward) at that batch run dense; prefill and weight bytes are the first batch's model's"
             + ("; those within 15% of dense settled by the decode step's time" if args.dense_if_slower == "step"
                else ""))
  return (f"{getattr(dev, 'device_kind', dev.platform)}, {args.dtype}, jax {jax.__version__}; prefill {args.prefill} "
          f"tokens at batch 1 ({args.prefill_calls} calls enqueued per sample, blocked once); decode {args.steps} "
          f"steps after {args.context} cached tokens; median of {args.repeats} samples; speed ratios are tokens/s "
          f"(or 1/time) over dense's, > 1 is faster{routing}; "
          + ("q / k / v and gate / up fused (fuse_projections) in every model, dense included" if args.fuse
             else "projections not fused (--no-fuse)")
          + ("; LM head: the pattern's structure in the sparse models (--head sparse)" if args.head == "sparse"
             else "; LM head dense in every model")
          + ("; embedding: 2:4 CompressedNMEmbed in the sparse models (--embedding 2:4)" if args.embedding == "2:4"
             else "; embedding dense in every model")
          + ("; attention: cuDNN fused for 16-bit prefill on a GPU, eager otherwise (--attention auto)"
             if args.attention == "auto" else "; attention: eager einsum-softmax-einsum (--attention xla)"))


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", type=lambda v: v.split(","),
                 help="8b,1.1b (the default), 3.2-1b; with --tiny: tiny (the default) or tiny-tied")
  p.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], help="default 1,8,32 (--tiny: 1,2)")
  p.add_argument("--patterns", type=lambda v: [PATTERN_ALIASES.get(x, x) for x in v.split(",")],
                 default=list(PATTERNS), help="dense,2:4,nm-copy,block64,unstructured")
  p.add_argument("--layers", type=int, default=None,
                 help="decoder layers to build (default: 8 for 8b and 1.1b, extrapolated to full depth)")
  p.add_argument("--context", type=int, help="cached tokens before the decode steps (default 1024; --tiny: 16)")
  p.add_argument("--steps", type=int, help="decode steps per timed call (default 64; --tiny: 4)")
  p.add_argument("--prefill", type=int, help="prefill tokens, 0 skips (default 2048; --tiny: 32)")
  p.add_argument("--repeats", type=int, help="timed samples per case (default 3; --tiny: 1)")
  p.add_argument("--prefill-calls", type=int, help="prefill calls enqueued per sample, blocked once (default 8; "
                 "--tiny: 1; 1 times a prefill blocked alone, the host's launch of it included)")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--kernels", type=lambda v: [int(b) for b in v.split(",")], default=[],
                 help="batches whose decode call gets a per-kernel device-time breakdown (CUPTI, GPU), e.g. 1")
  p.add_argument("--kernels-top", type=int, default=12, help="kernel names listed per --kernels breakdown")
  p.add_argument("--dense-if-slower", nargs="?", const="all", default=None, choices=("all", "per-batch", "step"),
                 help="time each sparse projection against dense and run the slower ones dense: 'all' (the default "
                      "value) builds one model routed at every batch of --batches, 'per-batch' one model per batch, "
                      "'step' as per-batch, the projections within 15%% of dense settled by timing the decode step")
  p.add_argument("--head", choices=("dense", "sparse"), default="dense",
                 help="sparse: the LM head takes each pattern's structure too (to_inference(head=True))")
  p.add_argument("--embedding", choices=("dense", "2:4"), default="dense",
                 help="2:4: the sparse patterns keep the token embedding as a CompressedNMEmbed (memory only)")
  p.add_argument("--no-fuse", dest="fuse", action="store_false",
                 help="keep q / k / v and gate / up as separate layers (default: fuse_projections, every pattern)")
  p.add_argument("--attention", choices=("auto", "xla"), default="auto",
                 help="examples/llama's attention core (llama.model.ATTENTION): auto = cuDNN's fused attention for "
                      "16-bit prefill on a GPU, xla = Hugging Face's eager einsum-softmax-einsum everywhere")
  p.add_argument("--tiny", action="store_true", help="the tiny shape, small sizes: a CPU check in seconds")
  args = p.parse_args(argv)
  defaults = {"batches": [1, 2], "context": 16, "steps": 4, "prefill": 32, "repeats": 1,
              "prefill_calls": 1} if args.tiny else {
      "batches": [1, 8, 32], "context": 1024, "steps": 64, "prefill": 2048, "repeats": 3, "prefill_calls": 8}
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if args.shapes is None:
    args.shapes = ["tiny"] if args.tiny else ["8b", "1.1b"]
  elif args.tiny and not all(s.startswith("tiny") for s in args.shapes):
    p.error(f"--tiny runs the tiny shapes (tiny, tiny-tied), got --shapes {','.join(args.shapes)}")
  llama_model.ATTENTION = args.attention
  unknown = [x for x in args.patterns if x not in PATTERNS] + [s for s in args.shapes if s not in SHAPES]
  if unknown:
    p.error(f"unknown pattern or shape {unknown}; patterns {list(PATTERN_ALIASES)}, shapes {list(SHAPES)}")
  if "dense" in args.patterns:  # ratios need dense first
    args.patterns = ["dense"] + [x for x in args.patterns if x != "dense"]
  tuning = logging.getLogger("jaxsparse.autotune")
  tuning.setLevel(logging.INFO)
  if not any(isinstance(h, _TuningLog) for h in tuning.handlers):
    tuning.addHandler(_TuningLog())
  log(header(args))
  t0 = time.perf_counter()
  for name in args.shapes:
    ROWS.extend(run_shape(name, args))
  log(f"total {time.perf_counter() - t0:.1f} s\n")
  write_table(args, ROWS)
  print(table(args, ROWS))


if __name__ == "__main__":
  main()
