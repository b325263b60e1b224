"""Sphinx configuration of the jaxsparse docs (``make docs``; Read the Docs: ``.readthedocs.yaml``).

The API pages are written at build time from each public module's ``__all__`` (``_api.py``), so a name added
to an ``__all__`` gets its reference entry without editing the docs. The notebooks are copied from
``notebooks/`` and rendered from their stored outputs (``nb_execution_mode = "off"``: the tests execute them).
Each current file of ``benchmarks/results/`` gets a page that includes it as written (no number is copied by hand).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS))

import _api  # noqa: E402

import jaxsparse  # noqa: E402

project = "jaxsparse"
author = "the jaxsparse authors"
copyright = "2026, the jaxsparse authors"
version = release = jaxsparse.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "sphinx_copybutton",
    "sphinxarg.ext",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints"]
templates_path = ["_templates"]
root_doc = "index"

# -- API reference -----------------------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "special-members": "__call__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # Attributes sections as fields: dataclass / NamedTuple members are documented once
autodoc_inherit_docstrings = False  # Flax's own docstrings (Module.setup, ...) reference Flax's private API
add_module_names = False
python_use_unqualified_type_names = True

# -- cross references --------------------------------------------------------------------------------------------
# Broken references fail the build (`make docs` passes -n -W). Names of other libraries resolve through
# intersphinx where their inventories can be fetched (Read the Docs); offline (CI, `make docs`) intersphinx is
# off and they are ignored here, as are the annotation-only names of typing and the standard library.
nitpicky = True
_EXTERNAL = r"(jax|jaxlib|flax|nnx|nn|linen|optax|numpy|np|jnp|torch|orbax|ocp|safetensors|matplotlib|typing|" \
            r"collections|abc|dataclasses|enum|os|pathlib|re|types|functools|builtins|tqdm|argparse|io)"
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL + r"(\..*)?"),
    # a Returns section's first words read as a type by napoleon (jaxsparse.formats.NMSparseMatrix.nbytes)
    (r"py:class", r"Bytes stored"),
    (r"py:.*", r"(Array|ArrayLike|DTypeLike|Sequence|Mapping|Callable|Iterable|Iterator|Any|Literal|NamedTuple|"
               r"PyTree|Module|Rngs|Variable|Param|Shape|Dtype|DType|Path|PathLike|PRNGKey|KeyArray|Self|"
               r"Mesh|NamedSharding|PartitionSpec|P|Sharding|GradientTransformation|Initializer|Tensor|"
               r"Precision|PrecisionLike|Optional|Union|Hashable|Generator|T|ClassVar|Protocol|"
               r"bool|int|float|str|bytes|tuple|list|dict|set|frozenset|object|type|None|callable|"
               r"optional|default|array|module|function|iterable|sequence|mapping|"
               r"[a-z_]+ of [a-z_]+)"),
]
if os.environ.get("READTHEDOCS") or os.environ.get("JAXSPARSE_DOCS_INTERSPHINX"):
  intersphinx_mapping = {
      "python": ("https://docs.python.org/3", None),
      "jax": ("https://docs.jax.dev/en/latest", None),
      "flax": ("https://flax.readthedocs.io/en/latest", None),
      "optax": ("https://optax.readthedocs.io/en/latest", None),
      "numpy": ("https://numpy.org/doc/stable", None),
  }
else:
  intersphinx_mapping = {}
  intersphinx_disabled_reftypes = ["*"]

# -- MyST / MyST-NB ------------------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = "off"
nb_merge_streams = True
# The results files under benchmarks/results are included as written by the scripts: they link to each other
# (and to files outside the docs) with relative paths.
suppress_warnings = ["myst.xref_missing", "myst.header"]

# -- HTML --------------------------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "jaxsparse"
html_theme_options = {
    "repository_url": "https://github.com/jaxsparse/jaxsparse",
    "use_repository_button": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}


def _prepare(app):
  """Copies the notebooks next to the guides and writes the API pages from the public ``__all__`` lists."""
  nb_dir = DOCS / "notebooks"
  nb_dir.mkdir(exist_ok=True)
  for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    target = nb_dir / nb.name
    if not target.exists() or target.read_bytes() != nb.read_bytes():
      shutil.copyfile(nb, target)
  _api.write_pages(DOCS / "api")
  _api.write_results_pages(ROOT / "benchmarks" / "results", DOCS / "results")


# Before autosummary reads the API pages (its builder-inited handler runs before any registered here).
_prepare(None)


def setup(app):
  app.connect("missing-reference", _api.resolve_alias)
  app.connect("autodoc-process-docstring", _api.split_attribute_names, priority=400)  # before napoleon
  app.connect("autodoc-process-signature", _api.init_signature)
