"""Writes one API page per public module of jaxsparse from its ``__all__`` (called by ``conf.py``).

A public module is ``jaxsparse`` or any module under it whose dotted name has no part starting with ``_``
and which defines ``__all__``. Each name is documented once, on the page of the public module it belongs to
(the one whose name is the longest prefix of the object's ``__module__``); the other modules that re-export it
link there.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import types

import jaxsparse


def public_modules() -> list[types.ModuleType]:
  """``jaxsparse`` and its public submodules with an ``__all__``, in dotted-name order."""
  names = {"jaxsparse"}
  for info in pkgutil.walk_packages(jaxsparse.__path__, "jaxsparse.", onerror=lambda name: None):
    if any(part.startswith("_") for part in info.name.split(".")):
      continue
    names.add(info.name)
  modules = [importlib.import_module(name) for name in sorted(names)]
  return [m for m in modules if hasattr(m, "__all__")]


def _owner(obj, name: str, modules: list[types.ModuleType]) -> str:
  """The public module whose page documents ``obj``."""
  holders = [m.__name__ for m in modules if name in m.__all__ and getattr(m, name) is obj]
  origin = getattr(obj, "__module__", None) or ""
  prefixes = [h for h in holders if origin == h or origin.startswith(h + ".")]
  return max(prefixes, key=len) if prefixes else holders[0]


def entries() -> dict[str, list[tuple[str, str, str]]]:
  """Per public module: ``(name, kind, owner module)`` for every name of its ``__all__``."""
  modules = public_modules()
  out = {}
  for module in modules:
    rows = []
    for name in sorted(module.__all__, key=str.lower):
      obj = getattr(module, name)
      if isinstance(obj, types.ModuleType):
        rows.append((name, "module", obj.__name__))
        continue
      kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
      rows.append((name, kind, _owner(obj, name, modules)))
    out[module.__name__] = rows
  return out


def write_pages(directory: pathlib.Path) -> None:
  """Writes ``<module>.rst`` per public module and ``index.rst`` under ``directory`` (rewritten only on change)."""
  directory.mkdir(exist_ok=True)
  pages = entries()
  for module, rows in pages.items():
    title = f"``{module}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {module}", "   :no-members:", "",
             f".. currentmodule:: {module}", ""]
    own = [name for name, kind, owner in rows if kind != "module" and owner == module]
    if own:
      lines += [".. autosummary::", "   :toctree: _autosummary", "   :nosignatures:", ""]
      lines += [f"   {name}" for name in own]
      lines.append("")
    others = [(name, kind, owner) for name, kind, owner in rows if kind == "module" or owner != module]
    if others:
      lines += ["Also available here", "-------------------", ""]
      for name, kind, owner in others:
        if kind == "module":
          lines.append(f"- ``{name}``: the :doc:`{owner}` module")
        else:
          role = {"class": "class", "function": "func", "data": "data"}[kind]
          lines.append(f"- ``{name}``: :py:{role}:`{owner}.{name}`")
      lines.append("")
    _write(directory / f"{module}.rst", "\n".join(lines))
  index = ["API reference", "=============", "",
           "Every name in every public ``__all__``, generated from the docstrings. The command line tool is on",
           ":doc:`cli`.", "", ".. toctree::", "   :maxdepth: 1", ""]
  index += [f"   {module}" for module in pages]
  index += ["   cli", ""]
  _write(directory / "index.rst", "\n".join(index))


def _write(path: pathlib.Path, text: str) -> None:
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def _canonical_names() -> dict[int, str]:
  """``id(obj)`` -> the dotted name its reference entry has, for every documented public object."""
  names = {}
  for module, rows in entries().items():
    for name, kind, owner in rows:
      if kind == "module":
        continue
      obj = getattr(importlib.import_module(module), name)
      names[id(obj)] = f"{owner}.{name}"
  return names


_CANONICAL: dict[int, str] | None = None


def _lookup(dotted: str):
  """The object a dotted name denotes (importing its module), or ``None``."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for part in parts[i:]:
        obj = getattr(obj, part)
    except AttributeError:
      return None
    return obj
  return None


def resolve_alias(app, env, node, contnode):
  """``missing-reference`` handler for names of jaxsparse that are documented under another name.

  A docstring may name an object where it is defined or re-exported (``jaxsparse.BlockSparseMatrix``,
  ``jaxsparse.formats._nm_masks.nm_mask``); this links it to its reference entry (``jaxsparse.formats...``), attributes
  included. A name of jaxsparse that has no public entry (a private constant, a private module) is shown as code
  without a link instead of failing the build; a name that does not exist still fails it.
  """
  global _CANONICAL
  if node.get("refdomain") != "py":
    return None
  if _CANONICAL is None:
    _CANONICAL = _canonical_names()
  target = node["reftarget"].lstrip("~.")
  scopes = [".".join(filter(None, [node.get("py:module"), node.get("py:class")])), node.get("py:module")]
  # the module (and class) whose docstring holds the reference: "...: docstring of jaxsparse.ops._x.f"
  source = re.search(r"docstring of ([\w.]+)", node.source or "")
  if source:
    parts = source.group(1).split(".")
    scopes += [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
  scopes.append(None)
  for scope in dict.fromkeys(scopes):
    dotted = f"{scope}.{target}" if scope else target
    if not dotted.startswith("jaxsparse"):
      continue
    if _lookup(dotted) is None:
      # an attribute without a class attribute (a dataclass field): shown as code if its owner exists
      owner, _, _ = dotted.rpartition(".")
      if owner.count(".") > 0 and inspect.isclass(_lookup(owner)):
        return contnode
      continue
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
      canonical = _CANONICAL.get(id(_lookup(".".join(parts[:i]))))
      if canonical is None:
        continue
      new_target = ".".join([canonical, *parts[i:]])
      if new_target == dotted:
        break
      domain = env.get_domain("py")
      for reftype in (node["reftype"], "obj"):
        found = domain.resolve_xref(env, node["refdoc"], app.builder, reftype, new_target, node, contnode)
        if found is not None:
          return found
      break
    return contnode
  return None


def split_attribute_names(app, what, name, obj, options, lines):
  """``autodoc-process-docstring``: ``a, b: text`` in an Args or Attributes section becomes one entry per name.

  Napoleon would read ``b`` as the type of ``a``, and does not read names continued on the next line; the
  docstrings use the short form for options passed through to Flax (``use_bias, dtype, ...: as nnx.Linear``).
  """
  in_section = False
  out = []
  pending = None  # an entry whose names continue on the next line: "a, b,\n    c: text"
  for line in lines:
    stripped = line.strip()
    if pending is not None:
      indent, names = pending
      line = f"{indent}{names} {stripped}"
      stripped = line.strip()
      pending = None
    elif stripped in ("Attributes:", "Args:", "Returns:", "Raises:", "Yields:", "Example:", "Examples:"):
      in_section = stripped in ("Attributes:", "Args:")
    if in_section and re.match(r"^\s+[\w*]+(?:, [\w*]+)*,$", line):
      pending = (line[: len(line) - len(line.lstrip())], stripped)
      continue
    match = re.match(r"^(\s+)([\w*]+(?:, [\w*]+)+): (.*)$", line) if in_section else None
    if match:
      indent, names, text = match.groups()
      out += [f"{indent}{n}: {text}" for n in names.split(", ")]
    else:
      out.append(line)
  lines[:] = out


def init_signature(app, what, name, obj, options, signature, return_annotation):
  """``autodoc-process-signature``: a Flax NNX layer's signature from its ``__init__`` (names and defaults).

  NNX's metaclass defines ``__call__(cls, *args, **kwargs)``, which autodoc would show instead.
  """
  if what != "class" or not signature or not signature.startswith("(*args"):
    return None
  from sphinx.util.inspect import stringify_signature  # noqa: PLC0415 -- only under Sphinx

  init = inspect.signature(obj.__init__)
  params = list(init.parameters.values())[1:]
  # Without annotations: Flax's own (``A``, ``VariableMetadata``) name its private aliases, and the Args section
  # says what each argument is.
  return stringify_signature(init.replace(parameters=params), show_annotation=False), return_annotation


# The machine kind a results file was measured on, from the end of its name.
_MACHINES = {"h100": "NVIDIA H100", "h200": "NVIDIA H200", "h200x2": "2 x NVIDIA H200", "cpu": "CPU"}


def write_results_pages(results: pathlib.Path, directory: pathlib.Path) -> None:
  """One page per current results file (``benchmarks/results/*.md``) that includes it, and an index of them."""
  directory.mkdir(exist_ok=True)
  files = sorted(p for p in results.glob("*.md") if p.name != "README.md")
  for stale in directory.glob("*.md"):
    if stale.name != "index.md" and not (results / stale.name).exists():
      stale.unlink()
  rows = []
  for path in files:
    _write(directory / path.name, f"```{{include}} ../../benchmarks/results/{path.name}\n:heading-offset: 0\n```\n")
    title = path.read_text().splitlines()[0].lstrip("# ").strip()
    tags = [tag for tag in path.stem.split("_") if tag in _MACHINES]
    machine = _MACHINES[tags[-1]] if tags else "GPU (see the file)" if path.name.startswith("gpu_") else "CPU"
    rows.append(f"| [{path.stem}]({path.name}) | {machine} | {title.replace('|', '/')} |")
  index = [
      "# Recorded results", "",
      "Every current file of `benchmarks/results/`, as the benchmark scripts wrote it (with the command, the machine",
      "and the commit). Older runs and one-off investigations are kept in `benchmarks/results/archive/`.", "",
      "```{toctree}", ":hidden:", "", *[p.stem for p in files], "```", "",
      "| file | machine | what it measures |", "|---|---|---|", *rows, "",
  ]
  _write(directory / "index.md", "\n".join(index))
