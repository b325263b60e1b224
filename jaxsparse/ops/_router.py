"""One backend interface and one routing function for every op's products.

Each kernel family (the Pallas GPU route, cuSPARSELt, the CUDA ``mma.sp`` decode kernel, the C++ CPU kernels, the
XLA block loop, the dense products, the XLA reference) is a :class:`Backend`: the lowering platforms it serves,
whether it can run here, whether it supports one product (with a reason), and its candidate configs. An op
describes one product (:class:`Product`: op, direction, operands, tuning signature) and lists its backends in
priority order; :func:`route` does the rest:

* per lowering platform (``"cuda"``, ``"cpu"``, and ``"default"`` for every other), the candidates of the backends
  that serve it and support the product, the op's shipped default first;
* on each platform the candidate measured fastest for the product's signature, or the default
  (:func:`jaxsparse._tuning.choose`: modes off / cached / tune);
* ``lax.platform_dependent`` over the platforms, so the choice is made when lowering (``jit``, ``jax.export``);
* a :class:`jaxsparse.FallbackWarning` subclass, named by the backend, where a backend that could run on this
  machine does not support the operands and another one runs instead.

``implementation=`` of the ops maps to a subset of the backends (e.g. ``"xla"``: the block loop and the C++ kernels
it calls on CPU; ``"pallas"``: the GPU route); a forced subset that cannot run any product raises.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from collections.abc import Sequence
from types import ModuleType
from typing import Any
from typing import ClassVar
from typing import Protocol
from typing import runtime_checkable

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jaxsparse import _tuning
from jaxsparse import _utils
from jaxsparse._tuning import _measure

__all__ = [
    "Backend",
    "Config",
    "InStep",
    "Joint",
    "Product",
    "Reference",
    "Unsupported",
    "check_implementation",
    "import_kernels",
    "route",
]

PLATFORMS = ("cuda", "cpu", "default")


@dataclasses.dataclass(frozen=True)
class Config:
  """Static (non-differentiable) configuration of one op call."""

  implementation: str  # "auto" or a name the op maps to a subset of its backends
  precision: lax.PrecisionLike
  out_dtype: jnp.dtype
  # The forward of a differentiated call (its custom VJP's forward rule). Keyword-only: an op's config adds fields.
  in_step: bool = dataclasses.field(default=False, kw_only=True)


@dataclasses.dataclass(frozen=True)
class InStep:
  """How the routes of a differentiated call's forward are timed in its train step (:func:`_choose_in_step`).

  Attributes:
    measure: ``run -> measure``: a forward route followed by the step's backward products on their routes.
    weight_work: a candidate's name -> the per-call work on the weight it does that a backward route may do too
      (e.g. ``"split"``: a copy of the blocks into sub-blocks; ``"dense"``: the dense weight); ``""``: none.
    backward_work: ``platform -> set``: the ``weight_work`` of the backward products' routes, chosen now (tuned where
      tuning may) as the backward pass will choose them.
  """

  measure: Callable[[Callable], Callable]
  weight_work: Callable[[str], str]
  backward_work: Callable[[str], set[str]]


@dataclasses.dataclass(frozen=True)
class Product:
  """One product of an op, as the router sees it.

  Attributes:
    op: the op's name, e.g. ``"nm_matmul"`` (in warnings and tuning keys).
    direction: ``"fwd"``, ``"dx"`` or ``"dw"``.
    args: the operands (arrays or pytrees of them, traced or concrete); every candidate takes them.
    fields: the rest of the tuning signature (row bucket, shapes, block shape, density, dtypes, precision).
    make_args: builds concrete random operands of the same shapes and dtypes (called only to measure).
    dense: the dense product it stands in for (``x @ W`` of a dense layer), timed beside the candidates to warn
      where none beats it (:class:`jaxsparse.SlowerThanDenseWarning`); ``None``: not compared.
    in_step: for the forward of a differentiated call, how its routes are timed in the train step
      (:func:`_choose_in_step`); ``None``: the forward alone.
  """

  op: str
  direction: str
  args: tuple
  fields: dict[str, Any]
  make_args: Callable[[], tuple]
  dense: _measure.DenseProduct | None = None
  in_step: InStep | None = None

  @property
  def symbolic(self) -> bool:
    """Whether the row count is symbolic (``jax.export`` with shape polymorphism; :func:`_utils.row_bucket`)."""
    return self.fields.get("rows") == _utils.SYMBOLIC_ROWS


@dataclasses.dataclass(frozen=True)
class Unsupported:
  """Why a backend does not run a product; ``warn``: say so with the backend's fallback warning (a backend that
  should have run here, e.g. a kernel that failed to build or a GPU kernel that does not take these operands)."""

  reason: str
  warn: bool = False


@runtime_checkable
class Backend(Protocol):
  """One kernel family.

  Attributes:
    name: stable identifier (``implementation=`` subsets and warnings use it).
    title: how messages name it, e.g. ``"the Pallas GPU kernels"``.
    platforms: the lowering platforms it serves (``"cuda"``, ``"cpu"``, ``"default"``: every other).
    fallback_warning: the :class:`jaxsparse.FallbackWarning` subclass of its fallbacks.

  A backend whose class sets ``takes_symbolic_rows = True`` (the XLA formulations) also runs products whose row count
  is symbolic (``jax.export`` with shape polymorphism); the others are not asked about those.
  """

  name: str
  title: str
  platforms: tuple[str, ...]
  fallback_warning: type[Warning]

  def unsupported_reason(self, product: Product) -> Unsupported | None:
    """Why this backend cannot run ``product`` here (unavailable, or the operands), or ``None``."""
    ...

  def candidates(self, product: Product) -> Sequence[_tuning.Candidate]:
    """The ways this backend computes ``product`` (its shipped default first); each ``run(*product.args)``."""
    ...


@dataclasses.dataclass(frozen=True)
class Reference:
  """A backend that runs every product on every platform with one candidate: an op's XLA formulation (its
  reference), so each platform has a route and the dense product is always measured against the kernels.

  Attributes:
    name, title: as :class:`Backend`'s.
    run: ``(*product.args) -> outputs``.
    measure: what tuning times instead of ``run`` (see :class:`jaxsparse._tuning.Candidate`), or ``None``.
  """

  name: str
  title: str
  run: Callable[..., Any]
  measure: Callable[..., Any] | None = None
  platforms: tuple[str, ...] = PLATFORMS
  fallback_warning: type[Warning] = _utils.FallbackWarning
  takes_symbolic_rows: ClassVar[bool] = True

  def unsupported_reason(self, product: Product) -> None:
    return None

  def candidates(self, product: Product) -> list[_tuning.Candidate]:
    return [_tuning.Candidate(self.name, self.run, measure=self.measure, always_timed=True)]


def import_kernels(module: str) -> ModuleType | None:
  """``jaxsparse.pallas.<module>``, or ``None`` when it cannot be imported here (no Triton/Mosaic bits)."""
  try:
    return importlib.import_module(f"jaxsparse.pallas.{module}")
  except ImportError:
    return None


def check_implementation(implementation: Any, allowed: tuple, kernels: ModuleType | None = None) -> str:
  """Validates ``implementation``; returns ``"auto"`` for ``None``, else the name. ``"pallas"`` needs ``kernels``
  that can run here (else a ``RuntimeError`` saying why)."""
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got implementation={implementation!r}.")
  if implementation is None:
    return "auto"
  if implementation == "pallas" and (kernels is None or not kernels.available()):
    reason = "jaxsparse.pallas could not be imported" if kernels is None else kernels.unavailable_reason()
    raise RuntimeError(f"implementation='pallas' was requested but cannot run here: {reason}.")
  return implementation


def _platform_of(backend: Backend) -> str:
  return next((p for p in backend.platforms if p != "default"), "cpu")


def _candidates(product: Product, backends: Sequence[Backend], platform: str) -> list[_tuning.Candidate]:
  """The candidates of ``backends`` that serve ``platform`` and support ``product``, in the backends' order; warns
  for a backend that should have run here (naming the one that runs instead)."""
  out, skipped = [], []
  for b in backends:
    if platform not in b.platforms or (product.symbolic and not getattr(b, "takes_symbolic_rows", False)):
      continue  # a symbolic row count (jax.export's shape polymorphism): only the XLA formulations take one
    why = b.unsupported_reason(product)
    if why is None:
      _warn(product, skipped, b.title)
      skipped = []
      out.extend(c for c in b.candidates(product) if c.name not in {o.name for o in out})
    elif why.warn and _measure._has_device(_platform_of(b)):
      skipped.append((b, why.reason))
  _warn(product, skipped, "the XLA path")  # nothing of this platform runs it: the default branch does
  return out


def _warn(product: Product, skipped: list, instead: str) -> None:
  for b, reason in skipped:
    _utils.warn_at_caller(
        f"{product.op}: {b.title} cannot run these operands ({reason}); using {instead} instead.", b.fallback_warning
    )


@dataclasses.dataclass(frozen=True)
class Joint:
  """A candidate's ``value`` saying it is output ``index`` of ``run_all(*args)``: when every product of one
  :func:`route` call picks a ``Joint`` of the same ``run_all``, it runs once for all (e.g. one C++ kernel that
  writes both ``dX`` and ``dW``)."""

  run_all: Callable
  index: int


def route(
    products: Sequence[Product],
    backends: Sequence[Backend],
    *,
    default: Callable[[Product, list[_tuning.Candidate]], str] | None = None,
) -> tuple:
  """Runs each product on the candidate chosen for the platform it is lowered for (see the module docstring).

  Args:
    products: products of one op on the same operands (e.g. its ``dX`` and ``dW``), each routed on its own, all
      under one platform choice.
    backends: their backends in priority order (the op has already narrowed them to ``implementation=``'s subset).
    default: picks the shipped default's name among a product's candidates on a platform (default: the first).

  Returns:
    A tuple: for each product, what its chosen candidate's ``run(*product.args)`` returns.

  Raises:
    RuntimeError: no backend supports a product on any platform (e.g. under a forced ``implementation=``).
  """
  args = products[0].args
  runs, names = {}, {}
  for platform in PLATFORMS:
    per_product = [_candidates(p, backends, platform) for p in products]
    if not all(per_product):
      continue
    if default is not None:
      per_product = [_default_first(c, default(p, c)) for p, c in zip(products, per_product, strict=True)]
    runs[platform] = _platform_run(products, per_product, platform)
    names[platform] = tuple(tuple(c.name for c in cands) for cands in per_product) if all(
        len(c) == 1 for c in per_product) else platform
  if not runs:
    tried = ", ".join(b.name for b in backends)
    raise RuntimeError(f"{products[0].op}: no backend ({tried}) can run these operands here.")
  if list(runs) == ["cpu"]:  # e.g. a forced implementation="cpu" (the GPU kernels' interpret mode lowers for CPUs)
    titles = ", ".join(dict.fromkeys(b.title for b in backends if "cpu" in b.platforms))
    return lax.platform_dependent(*args, default=_unavailable(runs["cpu"], products[0].op, titles), **runs)
  if len(runs) == 1 or len(set(names.values())) == 1:  # one platform, or the same single route on every one
    return next(iter(runs.values()))(*args)
  default_run = runs.pop("default", None) or runs.pop("cuda", None) or runs.pop("cpu")
  return lax.platform_dependent(*args, default=default_run, **runs)


_unavailable_p = jax_core.Primitive("jaxsparse_unavailable")  # passes its operands through; lowering it raises
_unavailable_p.multiple_results = True
_unavailable_p.def_abstract_eval(lambda *avals, message: avals)


def _unavailable_lowering(ctx, *args, message):
  raise ValueError(message.format(platforms=" / ".join(ctx.module_context.platforms)))


def _unavailable_impl(*args, message):
  """Outside ``jit`` ``lax.platform_dependent`` calls the branch of the default device's platform directly."""
  platforms = {d.platform for a in args if isinstance(a, jax.Array) for d in a.devices()}
  platforms = platforms or {jax.default_backend()}
  raise ValueError(message.format(platforms=" / ".join(sorted(platforms))))


_unavailable_p.def_impl(_unavailable_impl)
mlir.register_lowering(_unavailable_p, _unavailable_lowering)
ad.primitive_jvps[_unavailable_p] = lambda primals, tangents, message: (
    _unavailable_p.bind(*primals, message=message), tangents)
batching.primitive_batchers[_unavailable_p] = lambda args, dims, message: (
    _unavailable_p.bind(*args, message=message), dims)


def _unavailable(run: Callable, op: str, titles: str) -> Callable:
  """The branch of the platforms no chosen backend serves (all but CPUs): lowering it raises a ``ValueError`` that
  says so (instead of XLA's "no handler registered" when the C++ CPU kernels are lowered for a GPU)."""
  message = (f"{op}: {titles} run only when lowered for 'cpu', and this call is lowered for {{platforms}}. Use "
             "implementation=None (each platform gets its own route), or run it on a CPU device (e.g. inside "
             "`with jax.default_device(jax.devices('cpu')[0])`).")

  def unavailable(*args):
    leaves, tree = jax.tree.flatten(args)
    return run(*jax.tree.unflatten(tree, _unavailable_p.bind(*leaves, message=message)))

  return unavailable


def _default_first(cands: list[_tuning.Candidate], name: str) -> list[_tuning.Candidate]:
  return sorted(cands, key=lambda c: c.name != name)


def _platform_run(products: Sequence[Product], per_product: list[list[_tuning.Candidate]], platform: str) -> Callable:
  """The products' runs on one platform: each product's candidate chosen when this platform's branch is traced (the
  shipped default on ``"default"``), and candidates of one :class:`Joint` run once."""

  def run(*args):
    if platform == "default":
      chosen = [c[0] for c in per_product]
    else:
      chosen = [_choose(p, c, platform) for p, c in zip(products, per_product, strict=True)]
    joint = {c.value.run_all for c in chosen if isinstance(c.value, Joint)}
    if len(joint) == 1 and all(isinstance(c.value, Joint) for c in chosen):
      out = joint.pop()(*args)
      return tuple(out[c.value.index] for c in chosen)
    return tuple(c.run(*args) for c in chosen)

  return run


# A differentiated forward's candidates timed alone within this factor of its choice are timed again in the step.
STEP_WITHIN = 1.5


def _choose(p: Product, cands: list[_tuning.Candidate], platform: str) -> _tuning.Candidate:
  chosen = _tuning.choose(p.op, p.direction, cands, p.make_args, platform=platform, fields=p.fields, dense=p.dense)
  return chosen if p.in_step is None else _choose_in_step(p, cands, chosen, platform)


def _choose_in_step(p: Product, cands: list[_tuning.Candidate], chosen: _tuning.Candidate,
                    platform: str) -> _tuning.Candidate:
  """The forward of a differentiated call: its choice timed alone, against the fastest route of each kind of per-call
  work on the weight that the step's backward routes also do and the choice does not (``p.in_step``), timed within
  :data:`STEP_WITHIN` of it alone; each timed as the forward followed by the step's backward products on their routes
  (direction ``"step"`` in the cache, against a dense layer's train step).

  In one jitted step XLA does such shared work (a copy of the blocks into sub-blocks, the dense weight) once, where
  timing the forward alone charges it in full: on an H200 a forward tuned alone took the dense route beside backward
  products on sub-blocks, and the step ran at 1.32 of dense against 1.09 with all three on sub-blocks
  (``benchmarks/results/gpu_unseen_shapes_2026-12-02_h200_seed101.md``, case 12); chosen in the step, the forward took
  the sub-blocks too and the step ran at 1.09 (``gpu_in_step_tuning_2026-12-02_h200.md``). Where the forward's choice
  does what the backward routes do, or no rival does, nothing more is timed."""
  _, alone = _tuning.recorded_decision(p.op, p.direction, platform, p.fields)
  if chosen.name not in alone:  # nothing timed (tuning off, or a decision without times): the forward's choice
    return chosen
  step = p.in_step
  shared = step.backward_work(platform) - {"", step.weight_work(chosen.name)}
  by_name = {c.name: c for c in cands}
  rivals = {}
  for name in sorted((n for n in alone if n in by_name), key=alone.get):
    if step.weight_work(name) in shared and alone[name] <= alone[chosen.name] * STEP_WITHIN:
      rivals.setdefault(step.weight_work(name), name)
  if not rivals:
    return chosen
  finalists = [dataclasses.replace(by_name[n], measure=step.measure(by_name[n].run), always_timed=True)
               for n in (chosen.name, *rivals.values())]
  dense = None if p.dense is None else dataclasses.replace(p.dense, step=True)
  pick = _tuning.choose(p.op, "step", finalists, p.make_args, platform=platform, fields=p.fields, dense=dense)
  return by_name[pick.name]
