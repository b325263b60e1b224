"""Where measured dispatch decisions live: the tuning mode, an in-process memo and a persistent JSON cache.

A decision is keyed by a product's *signature* (op, direction, row bucket, shapes, block shape, density
bucket, dtypes, precision, device kind, jaxsparse and jax versions, the timing method) and records the name of
the candidate route that measured fastest, with the times measured. The file (``$JAXSPARSE_AUTOTUNE_CACHE``, else
``autotune.json`` in jaxsparse's per-user cache directory) is written atomically: under an exclusive lock
the current file is read, merged with the new entries and replaced by a complete temporary file, so two
processes tuning at once never leave a torn file and neither loses the other's entries; the new file gets the
permissions of a file created in place (``0o666`` less the umask).

A file there that gives no decisions is ignored with an :class:`AutotuneCacheWarning`, once. A cache of ours that
is of another format version, or is not valid JSON but begins as our writer begins its files (truncated by a crash or
a full disk), or an empty file is replaced on the next write. Any other file (JSON of another kind, say a config at
``$JAXSPARSE_AUTOTUNE_CACHE`` by mistake, or bytes that are not JSON) is never replaced: the decisions stay in the
process's memo (and the ``jaxsparse tune`` command fails unless it exports them), and the warning says to point
``$JAXSPARSE_AUTOTUNE_CACHE`` elsewhere. :func:`export_cache` never replaces such a file either.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from typing import Literal

from jaxsparse import _utils

try:  # POSIX advisory locks; elsewhere writes stay atomic but concurrent writers may drop each other's entries.
  import fcntl
except ImportError:  # pragma: no cover (Windows)
  fcntl = None

__all__ = [
    "AutotuneCacheWarning",
    "Mode",
    "autotune_mode",
    "cache_path",
    "check_export_path",
    "collect_keys",
    "current_budget_s",
    "current_mode",
    "export_cache",
    "import_cache",
    "lookup",
    "record",
    "set_autotune_mode",
    "unbounded_budget",
    "unsaved_decisions",
]

Mode = Literal["off", "cached", "tune", "auto"]
MODES = ("off", "cached", "tune", "auto")
FORMAT = "jaxsparse-autotune"
VERSION = 1
ENV_MODE = "JAXSPARSE_AUTOTUNE"
ENV_PATH = "JAXSPARSE_AUTOTUNE_CACHE"
ENV_BUDGET = "JAXSPARSE_AUTOTUNE_BUDGET"
# Seconds a first-trace measurement of one product signature may take (issue 35's bound on tuning cost); see
# :func:`current_budget_s`.
DEFAULT_BUDGET_S = 3.0


class AutotuneCacheWarning(UserWarning):
  """A tuning cache file was unreadable, foreign or of another version and is ignored (a cache of ours is rewritten
  on the next tuning; a file that is not one is never replaced: the decisions stay in the process).

  >>> import warnings, jaxsparse
  >>> warnings.simplefilter("error", jaxsparse.AutotuneCacheWarning)  # make a broken cache file an error
  >>> warnings.resetwarnings()
  """


def _check_mode(mode: Any, name: str) -> str:
  if mode not in MODES:
    raise ValueError(f"{name} must be one of {MODES}, got {mode!r}.")
  return mode


_global_mode: str | None = None  # set_autotune_mode; None: the environment's, else "auto"
_scoped_mode: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxsparse_autotune_mode", default=None)


def set_autotune_mode(mode: Mode | None) -> None:
  """Sets the process-wide tuning mode (``None``: back to ``$JAXSPARSE_AUTOTUNE``, else ``"auto"``).

  Modes: ``"off"`` uses the shipped defaults only; ``"cached"`` uses cached decisions where present and the
  defaults elsewhere, never measuring; ``"tune"`` measures a product's candidate routes the first time its
  signature is traced and caches the winner; ``"auto"`` (the default) is ``"tune"`` for products that run on a
  GPU and ``"cached"`` on CPU. The mode is read when a product is traced: functions already compiled keep the
  routes they were traced with.

  >>> import jaxsparse
  >>> jaxsparse.set_autotune_mode("off")  # the shipped defaults only, from now on
  >>> jaxsparse.set_autotune_mode(None)  # back to $JAXSPARSE_AUTOTUNE, else "auto"

  Args:
    mode: ``"off"``, ``"cached"``, ``"tune"``, ``"auto"`` or ``None``.

  Returns:
    ``None``.

  Raises:
    ValueError: ``mode`` is none of those.
  """
  global _global_mode
  _global_mode = None if mode is None else _check_mode(mode, "mode")


@contextlib.contextmanager
def autotune_mode(mode: Mode) -> Iterator[None]:
  """Context manager: products traced inside it use ``mode`` (see :func:`set_autotune_mode`).

  >>> import jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 64)), (32, 32))
  >>> with jaxsparse.autotune_mode("off"):
  ...   y = jaxsparse.ops.block_sparse_matmul(jnp.ones((2, 64)), w)
  >>> y.shape
  (2, 64)

  Args:
    mode: ``"off"``, ``"cached"``, ``"tune"`` or ``"auto"`` (see :func:`set_autotune_mode`).

  Yields:
    ``None``; the mode applies to products traced inside the ``with`` block (in this thread or task).
  """
  token = _scoped_mode.set(_check_mode(mode, "mode"))
  try:
    yield
  finally:
    _scoped_mode.reset(token)


_scoped_unbounded: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxsparse_autotune_unbounded", default=False)


def current_budget_s() -> float | None:
  """Seconds one product's first-trace measurement may take before it stops waiting for candidates to compile.

  ``$JAXSPARSE_AUTOTUNE_BUDGET`` (seconds, or ``"none"``), else :data:`DEFAULT_BUDGET_S`; ``None`` (no bound)
  inside :func:`unbounded_budget` (:func:`jaxsparse.autotune`, tuning ahead of time). The shipped default and the
  dense product are always timed; a candidate not compiled by then is left out of that decision (the cache entry
  names it under ``"unfinished"``, and :func:`jaxsparse.autotune` measures it later).
  """
  if _scoped_unbounded.get():
    return None
  raw = os.environ.get(ENV_BUDGET, "").strip()
  if not raw:
    return DEFAULT_BUDGET_S
  if raw.lower() == "none":
    return None
  try:
    budget = float(raw)
  except ValueError:
    budget = 0.0
  if not (math.isfinite(budget) and budget > 0):
    raise ValueError(f"${ENV_BUDGET} must be a positive number of seconds or 'none', got {raw!r}.")
  return budget


@contextlib.contextmanager
def unbounded_budget() -> Iterator[None]:
  """Context manager: measurements inside it wait for every candidate (no :func:`current_budget_s` bound)."""
  token = _scoped_unbounded.set(True)
  try:
    yield
  finally:
    _scoped_unbounded.reset(token)


def current_mode(platform: str) -> str:
  """The effective mode (``"off"``, ``"cached"`` or ``"tune"``) for a product running on ``platform``."""
  mode = _scoped_mode.get() or _global_mode or os.environ.get(ENV_MODE) or "auto"
  _check_mode(mode, f"${ENV_MODE}")
  if mode == "auto":
    return "tune" if platform in ("cuda", "gpu", "rocm") else "cached"
  return mode


def cache_path() -> Path:
  """The cache file: ``$JAXSPARSE_AUTOTUNE_CACHE``, else ``autotune.json`` in jaxsparse's cache directory."""
  if os.environ.get(ENV_PATH):
    return Path(os.environ[ENV_PATH])
  if os.environ.get("JAXSPARSE_CACHE_DIR"):
    return Path(os.environ["JAXSPARSE_CACHE_DIR"]) / "autotune.json"
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxsparse" / "autotune.json"


_lock = threading.Lock()
_memo: dict[str, dict] = {}
_loaded_from: Path | None = None
_unsaved: dict[str, str] = {}  # key -> why the cache file lacks this process's decision (its write's OSError)


_NOT_OURS = "is not a jaxsparse tuning cache"
# How the files this module writes begin (json.dump with indent=1 and sort_keys: "entries" is the first key): a file
# that is not valid JSON but begins so is a cache of ours cut short, which may be replaced.
_OWN_PREFIX = b'{\n "entries": {'
_warned_foreign: set[Path] = set()  # foreign files at the cache path already warned about (once each)


def _parse(path: Path) -> tuple[dict[str, dict], str | None, bool]:
  """``(entries, why, ours)`` of the file at ``path``: ``why`` says why a file that exists gives no entries (``None``:
  read, or absent); ``ours`` is false for a file read that is not a jaxsparse tuning cache of any format version."""
  try:
    raw = path.read_bytes()
  except FileNotFoundError:
    return {}, None, True
  except OSError as e:  # writing it tells whether it is a directory or a file of other permissions
    return {}, f"cannot be read ({e})", True
  if not raw.strip():  # nothing to lose (a file made by mkstemp, say)
    return {}, "is empty", True
  try:
    doc = json.loads(raw.decode("utf-8"))
  except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: nested too deep
    ours = raw.startswith(_OWN_PREFIX) or f'"format": "{FORMAT}"'.encode() in raw
    return {}, f"is not valid JSON ({e})", ours
  if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), dict):
    return {}, _NOT_OURS, False
  if doc.get("version") != VERSION:
    return {}, f"has format version {doc.get('version')!r}, this jaxsparse reads version {VERSION}", True
  entries = {k: v for k, v in doc["entries"].items() if isinstance(v, dict) and isinstance(v.get("choice"), str)}
  return entries, None, True


def _read(path: Path) -> dict[str, dict]:
  """The entries of the file at ``path``; ``{}`` (with a warning) for a corrupt, foreign or other-version file."""
  entries, why, ours = _parse(path)
  if not ours:
    _warn_foreign(path, why)
  elif why is not None:
    _utils.warn_at_caller(f"jaxsparse: the tuning cache file {path} {why}; ignoring it (it is replaced on the next "
                          "tuning).", AutotuneCacheWarning)
  return entries


def _warn_foreign(path: Path, why: str | None) -> None:
  """Warns, once per path, that the file at the cache path is not ours and is left alone (call under ``_lock``)."""
  if path in _warned_foreign:
    return
  _warned_foreign.add(path)
  detail = "" if why == _NOT_OURS else f" (it {why})"
  _utils.warn_at_caller(
      f"jaxsparse: the tuning cache file {path} {_NOT_OURS}{detail}; ignoring it and not replacing it: tuning "
      f"decisions are kept for this process only. Set ${ENV_PATH} to another file (or remove this one) to keep "
      "them.", AutotuneCacheWarning)


def _load() -> None:
  """Fills the memo from the cache file, once per process and file location (called under ``_lock``)."""
  global _loaded_from
  path = cache_path()
  if _loaded_from != path:
    _memo.clear()
    _memo.update(_read(path))
    _loaded_from = path


_collectors: list[set[str]] = []  # the sets of `collect_keys` blocks open now


@contextlib.contextmanager
def collect_keys() -> Iterator[set[str]]:
  """Yields a set that gathers the key of every product signature looked up (met by measured dispatch) in the block."""
  keys: set[str] = set()
  with _lock:
    _collectors.append(keys)
  try:
    yield keys
  finally:
    with _lock:
      _collectors.remove(keys)


def lookup(key: str) -> dict | None:
  """The cached decision for ``key`` (``{"choice": name, ...}``), or ``None``."""
  with _lock:
    _load()
    for keys in _collectors:
      keys.add(key)
    return _memo.get(key)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError) as e:  # "File exists: <a parent>" named the parent, not the problem
    raise NotADirectoryError(f"{path}: its folder cannot be made, {e.filename} is a file, not a folder.") from None
  if fcntl is None:
    yield
    return
  with open(f"{path}.lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, entries: dict[str, dict]) -> None:
  """Merges ``entries`` into the file at ``path``: read, merge and atomic replace under the lock. A file there that is
  not a tuning cache is left alone (no lock file made beside it either) with a ``ValueError``."""
  why, ours = _parse(path)[1:]
  if not ours:
    raise ValueError(_foreign(path, why))
  with _locked(path):
    current, why, ours = _parse(path)  # a problem of the own file was reported when it was loaded
    if not ours:  # written since the check above
      raise ValueError(_foreign(path, why))
    merged = {**current, **entries}

    def write(tmp: str) -> None:
      with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "entries": merged}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())

    _utils.atomic_write(path, write)


def _foreign(path: Path, why: str | None) -> str:
  detail = "" if why == _NOT_OURS else f" (it {why})"
  return f"{path} exists and {_NOT_OURS}{detail}; not replacing it: write to a new file, or remove it first."


def check_export_path(path: str | os.PathLike) -> None:
  """Raises a ``ValueError`` where :func:`export_cache` would fail for ``path`` (a file there that is not a tuning
  cache, or a directory), before the work whose decisions are to be exported."""
  if Path(path).is_dir():
    raise ValueError(f"{path} is a directory; the tuning cache is exported to a file (e.g. {Path(path) / 'a.json'}).")
  _, why, ours = _parse(Path(path))
  if not ours:
    raise ValueError(_foreign(Path(path), why))


def _write_own(entries: dict[str, dict], what: str) -> None:
  """Merges ``entries`` into this process's cache file; a file that cannot be written only warns (call under
  ``_lock``, with ``entries`` already in the memo)."""
  try:
    _write(cache_path(), entries)
  except ValueError:  # a file that is not ours: never replaced (it may be someone's config)
    path = cache_path()
    _unsaved.update(dict.fromkeys(entries, f"the tuning cache {path} {_NOT_OURS} and is not replaced"))
    _warn_foreign(path, _parse(path)[1])
  except OSError as e:
    _unsaved.update(dict.fromkeys(entries, f"cannot write the tuning cache {cache_path()} ({e})"))
    _utils.warn_at_caller(
        f"jaxsparse: cannot write the tuning cache {cache_path()} ({e}); {what} kept for this process only.",
        AutotuneCacheWarning,
    )
  else:
    for key in entries:
      _unsaved.pop(key, None)


def unsaved_decisions() -> dict[str, str]:
  """``{key: why}`` of the decisions this process made or imported that its cache file could not take (each write
  failure also warned, :class:`AutotuneCacheWarning`): the ``jaxsparse tune`` command fails on them."""
  with _lock:
    return dict(_unsaved)


def record(key: str, entry: dict) -> None:
  """Stores a decision in the memo and the cache file (a file that cannot be written only warns)."""
  with _lock:
    _load()
    _memo[key] = entry
    _write_own({key: entry}, "the decision is")


def export_cache(path: str | os.PathLike) -> int:
  """Writes every decision this process knows (its memo and the cache file, as it is now) to ``path``; returns how many.

  With :func:`import_cache`, a cluster tunes once: tune on one machine, export, import on the others.

  >>> import os, tempfile, jaxsparse
  >>> path = os.path.join(tempfile.mkdtemp(), "tuned.json")
  >>> jaxsparse.export_tuning_cache(path) >= 0 and jaxsparse.import_tuning_cache(path) >= 0
  True

  Args:
    path: the file to write (merged into, if it is already a tuning cache; one of another format version is
      replaced).

  Returns:
    The number of decisions written.

  Raises:
    ValueError: ``path`` is a file but not a jaxsparse tuning cache (it is left as it is).
    OSError: ``path`` cannot be written (its directory cannot be created, or it is a directory).
  """
  with _lock:
    _load()
    # The file as it is now: other processes sharing it may have added decisions since this one read it.
    entries = {**_parse(cache_path())[0], **_memo}
  _write(Path(path), entries)
  return len(entries)


def import_cache(path: str | os.PathLike) -> int:
  """Merges the decisions of the cache file at ``path`` into this process and its cache file; returns how many.

  >>> import os, tempfile, jaxsparse
  >>> path = os.path.join(tempfile.mkdtemp(), "tuned.json")
  >>> _ = jaxsparse.export_tuning_cache(path)
  >>> jaxsparse.import_tuning_cache(path) >= 0
  True

  Args:
    path: a file written by :func:`export_cache` (or any jaxsparse tuning cache of this format version).

  When this process's own cache file (:func:`cache_path`) cannot be written, the decisions are still imported,
  for this process only, with an :class:`AutotuneCacheWarning` (as a decision measured here would be).

  Returns:
    The number of decisions imported.

  Raises:
    ValueError: ``path`` is not a readable jaxsparse tuning cache of this format version.
  """
  entries, why, _ = _parse(Path(path))
  if why is not None or not Path(path).exists():
    raise ValueError(f"import_cache: cannot import {path}: it {why or 'does not exist'}.")
  with _lock:
    _load()
    _memo.update(entries)
    _write_own(entries, "the imported decisions are")
  return len(entries)


def known_keys() -> set[str]:
  """The keys of every decision this process knows (memo and cache file)."""
  with _lock:
    _load()
    return set(_memo)


def clear_memo() -> None:
  """Forgets the in-process decisions (the next lookup re-reads the file). For tests."""
  global _loaded_from
  with _lock:
    _memo.clear()
    _unsaved.clear()
    _warned_foreign.clear()
    _loaded_from = None
