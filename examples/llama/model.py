"""A Llama-architecture decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU, a static KV cache.

An example, not jaxsparse API. Module and parameter paths follow Hugging Face's ``LlamaForCausalLM``
(``model.layers.3.self_attn.q_proj``, ``model.layers.3.mlp.down_proj``, ``model.norm``, ``lm_head``), so
checkpoints map one to one (``checkpoint.py``), :func:`jaxsparse.torch_interop.export_masks` writes torch
names without a name map (after ``prune.fuse_projections``, ``checkpoint.export_masks`` splits the fused ones), and
sparsity rules select the seven projections of every decoder layer by path
(:data:`PROJECTIONS`). Inference only: no dropout, no training.

RoPE uses Hugging Face's ``rotate_half`` convention (the two halves of each head are the pairs), the layout
HF checkpoints store ``q_proj`` / ``k_proj`` in, so no permutation of the weights is needed. Rope types:
``"default"``, ``"linear"`` (position interpolation: the frequencies divided by ``factor``), ``"dynamic"``
(dynamic NTK: the base rescaled from the current length, see :func:`rope_frequencies_at`) and ``"llama3"``
(Llama 3.1 / 3.2 frequency scaling); others (``"yarn"``, ``"longrope"``, ...) are refused.

KV cache (:class:`KVCache`): one ``(B, S, kv_heads, head_dim)`` key and value array per layer, ``S``
fixed when the cache is made, so prefill and every decode step have static shapes under ``jit``; a
``(B, S)`` mask of filled slots (left padding stays masked) and per-row positions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama import decode_attention

# The seven projections of every decoder layer, as paths for jaxsparse rules (re.fullmatch).
PROJECTIONS = r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
ATTENTION_PROJECTIONS = r"model\.layers\.\d+\.self_attn\.[qkvo]_proj"
MLP_PROJECTIONS = r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj"


# The rope_scaling types implemented, with the fields each needs.
# The config fields that are sizes.
POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "max_position_embeddings")
# Hugging Face model types whose checkpoints are this architecture: "mistral" is Llama's with a sliding window,
# accepted without one ("sliding_window": null, Mistral 7B v0.2 and later).
MODEL_TYPES = ("llama", "mistral")

ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The fields of a Hugging Face Llama ``config.json`` this model uses, checked when made (sizes ints >= 1, layers
  >= 0, ``rms_norm_eps`` and ``rope_theta`` positive, flags booleans, ``head_dim`` even).

  ``rope_scaling`` is ``None`` or a dict with ``rope_type`` ``"default"``, ``"linear"`` or ``"dynamic"`` (then also
  ``factor``) or
  ``"llama3"`` (then also ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # a dict is accepted and stored as sorted items
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | list[int] | None = None

  def __post_init__(self):
    # Hashable fields: the config is static data of the NNX module (part of its graphdef under jit).
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    # config.json is untrusted: a string, 0 or a float here failed deep in the model (or built a wrong one).
    for name in POSITIVE_INTS:
      value = getattr(self, name)
      if not _is_size(value):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    if not _is_size(self.num_hidden_layers, minimum=0):  # 0: embedding and head alone (benchmarks/llm_decode.py)
      raise ValueError(f"num_hidden_layers must be an int >= 0, got {self.num_hidden_layers!r}.")
    for name in ("rms_norm_eps", "rope_theta"):
      value = getattr(self, name)
      if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates the two halves of each head.")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                       f"num_key_value_heads={self.num_key_value_heads}.")
    rope_type = self.rope.get("rope_type", "default")
    if rope_type not in ROPE_FIELDS:
      raise ValueError(f"rope_scaling type {rope_type!r} is not implemented; only {sorted(ROPE_FIELDS)}.")
    absent = [k for k in ROPE_FIELDS[rope_type] if not isinstance(self.rope.get(k), int | float)]
    if absent:
      raise ValueError(f"rope_scaling of type {rope_type!r} needs the numbers {list(ROPE_FIELDS[rope_type])}; "
                       f"{absent} missing or not numbers in {self.rope}.")

  @property
  def rope(self) -> dict[str, Any]:
    """``rope_scaling`` as a dict (empty for plain RoPE)."""
    return dict(self.rope_scaling or ())

  @classmethod
  def from_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
    """From a ``config.json`` dict: transformers 4 (``rope_theta`` + ``rope_scaling``) or 5 (``rope_parameters``).

    Raises:
      ValueError: a field missing or of the wrong type, or a config of a model this one is not: another
        ``model_type`` (Qwen2, Gemma, ...; Mistral only without a sliding window), another activation, a
        ``quantization_config``.
    """
    if not isinstance(cfg, dict):
      raise ValueError(f"a config must be a JSON object {{field: value}}, got {type(cfg).__name__} {cfg!r:.100}.")
    model_type = cfg.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
      raise ValueError(f"model_type={model_type!r} is not implemented: only {list(MODEL_TYPES)} (Llama's "
                       "architecture); other decoders differ in their attention, norms or biases.")
    if model_type == "mistral" and cfg.get("sliding_window") is not None:  # transformers' Llama ignores the field
      raise ValueError(f"sliding_window={cfg['sliding_window']!r}: Mistral's sliding-window attention is not "
                       "implemented (each token attends to all the tokens before it here); only sliding_window null.")
    if cfg.get("quantization_config") is not None:
      method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) else None
      raise ValueError(f"quantization_config (quant_method={method!r}): quantized checkpoints are not implemented; "
                       "use a floating-point (float32 / bfloat16 / float16) checkpoint.")
    absent = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
              if cfg.get(k) is None]
    if absent:
      raise ValueError(f"the config has no {absent}: a Llama config.json needs them.")
    if cfg.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act={cfg['hidden_act']!r}: only 'silu' (Llama's SwiGLU) is implemented.")
    if cfg.get("pretraining_tp", 1) not in (1, None):
      raise ValueError(f"pretraining_tp={cfg['pretraining_tp']} is not implemented; only 1.")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
      raise ValueError(f"rope_parameters / rope_scaling must be a JSON object or null, got {rope!r:.100}.")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
      rope["rope_type"] = rope.pop("type")
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim")
    if head_dim is None and _is_size(heads) and _is_size(hidden):  # else __post_init__ names the bad field
      head_dim = hidden // heads
    return cls(
        vocab_size=cfg["vocab_size"], hidden_size=hidden, intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=_or(cfg.get("num_key_value_heads"), heads),
        head_dim=head_dim, rms_norm_eps=_or(cfg.get("rms_norm_eps"), 1e-6),
        rope_theta=float(theta) if isinstance(theta, int) and not isinstance(theta, bool) else theta,
        rope_scaling=scaling, max_position_embeddings=_or(cfg.get("max_position_embeddings"), 2048),
        tie_word_embeddings=_or(cfg.get("tie_word_embeddings"), False),
        attention_bias=_or(cfg.get("attention_bias"), False), mlp_bias=_or(cfg.get("mlp_bias"), False),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
    )

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> LlamaConfig:
    """From a ``config.json`` file; an error names the file."""
    try:
      with open(path) as f:
        cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is not a valid JSON file: {e}") from e
    try:
      return cls.from_dict(cfg)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from e

  def to_dict(self) -> dict[str, Any]:
    """A ``config.json`` dict that transformers 4 and 5 read as ``LlamaForCausalLM``."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           **dataclasses.asdict(self)}
    out["rope_scaling"] = None if self.rope_scaling is None else self.rope
    if isinstance(self.eos_token_id, tuple):
      out["eos_token_id"] = list(self.eos_token_id)
    return out


def _is_size(value: Any, *, minimum: int = 1) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _or(value: Any, default: Any) -> Any:
  """``value``, or ``default`` for a field that is absent or null."""
  return default if value is None else value


# -------------------------------------------------------------------------------------------------
# Rotary position embeddings.
# -------------------------------------------------------------------------------------------------


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
  """Inverse frequencies ``(head_dim // 2,)`` float32, with the linear or Llama 3 scaling ``rope_scaling`` asks for."""
  dim = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  inv_freq = inv_freq.astype(np.float32)
  scaling = cfg.rope
  rope_type = scaling.get("rope_type", "default")
  if rope_type == "linear":  # HF: positions / factor, i.e. the frequencies / factor
    return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
  if rope_type != "llama3":
    return inv_freq
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_context = scaling["original_max_position_embeddings"]
  low_wavelen, high_wavelen = old_context / low, old_context / high
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_frequencies_at(cfg: LlamaConfig, positions: jax.Array) -> jax.Array:
  """The inverse frequencies of a forward over ``positions`` ``(B, T)``: :func:`rope_frequencies`, except for
  ``"dynamic"`` (dynamic NTK) RoPE, whose base transformers rescales in every forward from the current length
  ``L = max(positions) + 1`` once it exceeds ``max_position_embeddings`` ``M``:
  ``base * (factor * L / M - (factor - 1)) ** (dim / (dim - 2))`` (``_compute_dynamic_ntk_parameters``).

  Computed under ``jit`` from the traced positions. With a KV cache this is what transformers does with its own
  cache: each step's queries and new keys take the frequencies of the length so far, and the cached keys keep the
  rotation of the step that wrote them. transformers also keeps the largest length it has seen between calls
  (``max_seq_len_cached``: a shorter forward after a longer one, still above ``M``, reuses the longer one's
  frequencies); this model is stateless and uses the current call's length, which is the same for one sequence
  decoded step by step and for a fresh model.
  """
  inv_freq = rope_frequencies(cfg)
  if cfg.rope.get("rope_type") != "dynamic":
    return jnp.asarray(inv_freq)
  dim, m, factor = cfg.head_dim, cfg.max_position_embeddings, cfg.rope["factor"]
  length = jnp.max(positions).astype(jnp.float32) + 1
  base = cfg.rope_theta * (factor * length / m - (factor - 1)) ** (dim / (dim - 2))
  scaled = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  return jnp.where(length > m, scaled, jnp.asarray(inv_freq))


def rope_cos_sin(inv_freq: jax.typing.ArrayLike, positions: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """``cos, sin`` of shape ``(B, T, head_dim)`` for int ``positions`` ``(B, T)``, computed in float32."""
  freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """``x * cos + rotate_half(x) * sin`` for ``x`` ``(B, T, heads, head_dim)``, ``cos, sin`` ``(B, T, head_dim)``."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


# -------------------------------------------------------------------------------------------------
# KV cache.
# -------------------------------------------------------------------------------------------------


class KVCache(NamedTuple):
  """A static-size KV cache: a pytree, carried through ``jit`` and ``lax.scan``.

  Attributes:
    keys: one ``(B, S, kv_heads, head_dim)`` array per decoder layer (RoPE already applied).
    values: the same for values.
    filled: bool ``(B, S)``, slots holding a real token (left padding and unused slots are False).
    positions: int32 ``(B,)``, the RoPE position the next token of each row gets (its real tokens so far).
    index: int32 scalar, the next slot to write (the same for every row).
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  filled: jax.Array
  positions: jax.Array
  index: jax.Array

  @property
  def size(self) -> int:
    """``S``, the number of slots."""
    return self.filled.shape[1]


def init_cache(cfg: LlamaConfig, batch: int, size: int, *, dtype: Any = jnp.float32) -> KVCache:
  """An empty cache for ``batch`` rows of at most ``size`` tokens (prompt and generated)."""
  shape = (batch, size, cfg.num_key_value_heads, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
  return KVCache(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)),
                 jnp.zeros((batch, size), bool), jnp.zeros((batch,), jnp.int32), jnp.zeros((), jnp.int32))


def check_token_ids(ids: jax.typing.ArrayLike, vocab_size: int, *, name: str = "input_ids") -> jax.Array:
  """``ids`` as an int32 ``(B, T)`` array after checking it: integer dtype, 2-D, and (when concrete, not traced
  under ``jit``) every id in ``[0, vocab_size)``. An id outside would read no embedding row: ``jnp.take`` gives NaN
  (or wraps a negative id around) instead of an error."""
  dtype = getattr(ids, "dtype", None)
  dtype = np.asarray(ids).dtype if dtype is None else dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must hold integer token ids, got dtype {dtype}.")
  ids = jnp.asarray(ids)
  if ids.ndim != 2:
    raise ValueError(f"{name} must be (batch, length), got shape {ids.shape}.")
  if not isinstance(ids, jax.core.Tracer) and ids.size:
    host = np.asarray(ids)  # NumPy: jnp reductions would be staged out inside another function's trace
    low, high = int(host.min()), int(host.max())
    if low < 0 or high >= vocab_size:
      raise ValueError(f"{name} must be token ids in [0, vocab_size={vocab_size}), got ids from {low} to {high}.")
  return ids.astype(jnp.int32)


# -------------------------------------------------------------------------------------------------
# Layers.
# -------------------------------------------------------------------------------------------------

# The attention core: "auto" runs cuDNN's fused (flash) attention for bfloat16 / float16 queries of at least
# FLASH_MIN_QUERIES tokens (prefill) on a CUDA GPU, where it is supported, the fused decode kernel of
# decode_attention.py for one 16-bit query token (a decode step) on a GPU, and the einsum-softmax-einsum of
# Hugging Face's eager attention otherwise; "xla" always the latter.
ATTENTION = "auto"
FLASH_MIN_QUERIES = 16


def _eager_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  b, t, heads, hd = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, heads // kv_heads, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)  # as HF: fully masked rows uniform
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, heads * hd)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """``softmax(q kᵀ / sqrt(head_dim), masked) v``: ``q`` ``(B, T, heads, head_dim)``, ``k`` / ``v`` ``(B, S,
  kv_heads, head_dim)``, ``mask`` bool ``(B, T, S)``; returns ``(B, T, heads * head_dim)``.

  With :data:`ATTENTION` ``"auto"``, a 16-bit decode step (``T = 1``) on a GPU runs the fused kernel of
  :func:`llama.decode_attention.decode_attention` (eager attention's result, one kernel and one small fusion), and
  16-bit prefill on a CUDA GPU runs cuDNN's fused attention
  (``jax.nn.dot_product_attention(implementation="cudnn")``, which never writes the ``(T, S)`` scores); a query
  row with no visible key (left padding) gets zeros there instead of eager attention's uniform average.
  """
  b, t, heads, hd = q.shape
  if ATTENTION == "auto" and t == 1 and jax.default_backend() == "gpu" and decode_attention.supports(q[:, 0], k):
    return decode_attention.decode_attention(q[:, 0], k, v, mask[:, 0]).reshape(b, 1, heads * hd)
  flash = (ATTENTION == "auto" and t >= FLASH_MIN_QUERIES and q.dtype in (jnp.bfloat16, jnp.float16)
           and jax.default_backend() == "gpu")
  if flash:
    try:
      out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError):  # a shape or dtype cuDNN does not take here
      flash = False
  if not flash:
    return _eager_attention(q, k, v, mask)
  return jnp.where(mask.any(-1)[:, :, None, None], out, jnp.zeros((), out.dtype)).reshape(b, t, heads * hd)


class RMSNorm(nnx.Module):
  """Llama's RMSNorm: normalised in float32, cast back to the input dtype, then scaled by ``weight`` ``(d,)``."""

  def __init__(self, features: int, *, eps: float, param_dtype: Any = jnp.float32):
    self.weight = nnx.Param(jnp.ones((features,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * y.astype(x.dtype)


def _linear(init: dict, in_features: int, out_features: int, *, use_bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(in_features, out_features, use_bias=use_bias, rngs=rngs, **init)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE: ``q_proj`` ``(d, heads * head_dim)``, ``k_proj`` / ``v_proj``
  ``(d, kv_heads * head_dim)``, ``o_proj`` ``(heads * head_dim, d)``; or, after :func:`llama.prune.fuse_projections`,
  ``qkv_proj`` ``(d, (heads + 2 kv_heads) * head_dim)`` in place of the first three."""

  def __init__(self, cfg: LlamaConfig, init: dict, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.head_dim
    self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
    bias = cfg.attention_bias
    self.q_proj = _linear(init, d, self.heads * hd, use_bias=bias, rngs=rngs)
    self.k_proj = _linear(init, d, self.kv_heads * hd, use_bias=bias, rngs=rngs)
    self.v_proj = _linear(init, d, self.kv_heads * hd, use_bias=bias, rngs=rngs)
    self.o_proj = _linear(init, self.heads * hd, d, use_bias=bias, rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array,
               kv: tuple[jax.Array, jax.Array, jax.Array] | None = None):
    """Args: ``x`` ``(B, T, d)``; ``cos, sin`` ``(B, T, head_dim)``; ``mask`` bool ``(B, T, S)`` (query may see
    key); ``kv``: ``(keys, values, index)`` of the cache, ``(B, S, kv_heads, head_dim)`` each, the new keys
    written at slots ``index .. index + T - 1``; ``None``: attend to the ``T`` new keys (``S = T``).

    Returns ``(y (B, T, d), (keys, values) or None)``.
    """
    b, t, _ = x.shape
    fused = getattr(self, "qkv_proj", None)  # prune.fuse_projections: q, k, v in one product
    if fused is not None:
      q_end = self.heads * self.head_dim
      q, k, v = jnp.split(fused(x), [q_end, q_end + self.kv_heads * self.head_dim], axis=-1)
    else:
      q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q = apply_rope(q.reshape(b, t, self.heads, self.head_dim), cos, sin)
    k = apply_rope(k.reshape(b, t, self.kv_heads, self.head_dim), cos, sin)
    v = v.reshape(b, t, self.kv_heads, self.head_dim)
    new_kv = None
    if kv is not None:
      keys, values, index = kv
      keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, index, 0, 0))
      values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (0, index, 0, 0))
      k, v, new_kv = keys.astype(q.dtype), values.astype(q.dtype), (keys, values)
    return self.o_proj(attention_core(q, k, v, mask)), new_kv


class MLP(nnx.Module):
  """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; ``gate_proj``, ``up_proj`` ``(d, hidden)``, or
  ``gate_up_proj`` ``(d, 2 hidden)`` in their place after :func:`llama.prune.fuse_projections`."""

  def __init__(self, cfg: LlamaConfig, init: dict, rngs: nnx.Rngs):
    d, h, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
    self.gate_proj = _linear(init, d, h, use_bias=bias, rngs=rngs)
    self.up_proj = _linear(init, d, h, use_bias=bias, rngs=rngs)
    self.down_proj = _linear(init, h, d, use_bias=bias, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    fused = getattr(self, "gate_up_proj", None)  # prune.fuse_projections: gate and up in one product
    gate, up = jnp.split(fused(x), 2, axis=-1) if fused is not None else (self.gate_proj(x), self.up_proj(x))
    return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: LlamaConfig, init: dict, rngs: nnx.Rngs):
    pdt = init["param_dtype"]
    self.self_attn = Attention(cfg, init, rngs)
    self.mlp = MLP(cfg, init, rngs)
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)

  def __call__(self, x, cos, sin, mask, kv=None):
    h, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), new_kv


class LlamaModel(nnx.Module):
  """Embedding, decoder layers, final norm (Hugging Face's ``LlamaModel``)."""

  def __init__(self, cfg: LlamaConfig, init: dict, rngs: nnx.Rngs):
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=init["dtype"],
                                  param_dtype=init["param_dtype"], embedding_init=init["kernel_init"], rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, init, rngs) for _ in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=init["param_dtype"])


class LlamaForCausalLM(nnx.Module):
  """A Llama decoder with its LM head; paths as Hugging Face's ``LlamaForCausalLM``.

  >>> cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
  ...                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 128)
  >>> cache = init_cache(cfg, 2, 8)
  >>> logits, cache = model.step(jnp.zeros((2, 5), jnp.int32), cache)   # prefill
  >>> logits, cache = model.step(jnp.zeros((2, 1), jnp.int32), cache)   # one decode step
  >>> logits.shape, int(cache.index)
  ((2, 1, 128), 6)

  Args:
    cfg: the architecture.
    dtype: compute dtype (``None``: the parameters').
    param_dtype: storage dtype of every parameter.
    init_std: standard deviation of the normal initialisation (HF's ``initializer_range``); norms are ones.
    rngs: ``nnx.Rngs``.
  """

  def __init__(self, cfg: LlamaConfig, *, dtype: Any = None, param_dtype: Any = jnp.float32, init_std: float = 0.02,
               rngs: nnx.Rngs):
    self.config = cfg
    init = {"dtype": dtype, "param_dtype": param_dtype, "kernel_init": nnx.initializers.normal(init_std)}
    self.model = LlamaModel(cfg, init, rngs)
    self.lm_head = None if cfg.tie_word_embeddings else _linear(init, cfg.hidden_size, cfg.vocab_size,
                                                                use_bias=False, rngs=rngs)

  @property
  def dtype(self) -> Any:
    """The compute dtype: the embedding's ``dtype``, else its parameters'."""
    emb = self.model.embed_tokens
    return emb.dtype or emb.embedding.dtype

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.model.norm(x)
    if self.lm_head is None:
      return self.model.embed_tokens.attend(x)
    return self.lm_head(x)

  def _layers(self, x, positions, mask, cache: KVCache | None):
    cos, sin = rope_cos_sin(rope_frequencies_at(self.config, positions), positions, x.dtype)
    keys, values = [], []
    for i, layer in enumerate(self.model.layers):
      kv = None if cache is None else (cache.keys[i], cache.values[i], cache.index)
      x, new_kv = layer(x, cos, sin, mask, kv)
      if new_kv is not None:
        keys.append(new_kv[0])
        values.append(new_kv[1])
    return x, tuple(keys), tuple(values)

  def __call__(self, input_ids: jax.Array, *, attention_mask: jax.Array | None = None) -> jax.Array:
    """Logits ``(B, T, vocab)`` of a whole sequence, no cache.

    Args:
      input_ids: int ``(B, T)``.
      attention_mask: 0/1 ``(B, T)``, 0 for padding (positions count only real tokens, as in HF).
    """
    input_ids = check_token_ids(input_ids, self.config.vocab_size)
    x = self.model.embed_tokens(input_ids)
    b, t = input_ids.shape
    real = jnp.ones((b, t), bool) if attention_mask is None else jnp.asarray(attention_mask) != 0
    if real.shape != (b, t):
      raise ValueError(f"attention_mask must have input_ids' shape {(b, t)}, got {real.shape}.")
    positions = jnp.maximum(jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)
    causal = jnp.tril(jnp.ones((t, t), bool))
    x, _, _ = self._layers(x, positions, causal[None] & real[:, None, :], None)
    return self._logits(x)

  def step(self, input_ids: jax.Array, cache: KVCache, *, attention_mask: jax.Array | None = None,
           last_only: bool = False) -> tuple[jax.Array, KVCache]:
    """Runs ``T`` new tokens against the cache (prefill: the prompt; decode: ``T = 1``).

    Args:
      input_ids: int ``(B, T)``, written at cache slots ``cache.index .. cache.index + T - 1``.
      cache: a :class:`KVCache` with room for ``T`` more slots: checked when ``cache.index`` is concrete; under
        ``jit``, where it is traced, the logits of a step that would overflow the cache are NaN (its tokens would
        have overwritten the last slots).
      attention_mask: 0/1 ``(B, T)``, 0 for padding tokens (left padding of a prompt); default all real.
      last_only: compute the logits of the last position only (prefill before generation).

    Returns:
      ``(logits, cache)``: logits ``(B, T, vocab)`` (``(B, 1, vocab)`` with ``last_only``) and the updated cache.
    """
    input_ids = check_token_ids(input_ids, self.config.vocab_size)
    b, t = input_ids.shape
    if b != cache.filled.shape[0] or t > cache.size:
      raise ValueError(f"input_ids {input_ids.shape} do not fit the cache of batch {cache.filled.shape[0]} and "
                       f"{cache.size} slots.")
    if not isinstance(cache.index, jax.core.Tracer) and int(cache.index) + t > cache.size:
      raise ValueError(f"the cache is full: {int(cache.index)} of its {cache.size} slots used, {t} more tokens do "
                       f"not fit; make it with init_cache(cfg, batch, size) for the prompt and all new tokens.")
    real = jnp.ones((b, t), bool) if attention_mask is None else jnp.asarray(attention_mask) != 0
    if real.shape != (b, t):
      raise ValueError(f"attention_mask must have input_ids' shape {(b, t)}, got {real.shape}.")
    positions = cache.positions[:, None] + jnp.maximum(jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)
    filled = jax.lax.dynamic_update_slice(cache.filled, real, (0, cache.index))
    slots = jnp.arange(cache.size)
    causal = slots[None, :] <= cache.index + jnp.arange(t)[:, None]  # (T, S)
    mask = causal[None] & filled[:, None, :]
    x = self.model.embed_tokens(input_ids)
    x, keys, values = self._layers(x, positions, mask, cache)
    if last_only:
      x = x[:, -1:]
    new = KVCache(keys, values, filled, cache.positions + jnp.sum(real, axis=1, dtype=jnp.int32),
                  cache.index + t)
    logits = self._logits(x)
    if isinstance(cache.index, jax.core.Tracer):  # traced: an overflow poisons the logits instead of raising
      logits = jnp.where(cache.index + t > cache.size, jnp.nan, logits)
    return logits, new
