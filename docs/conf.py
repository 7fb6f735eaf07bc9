"""Sphinx configuration: `make docs` builds docs/ into site/ with warnings as errors.

Sphinx (with MyST for Markdown pages, Furo as the theme) rather than MkDocs: autodoc documents
the API from the docstrings it imports, sphinx-click the CLI from its click definitions, and
all of it is maintained; MkDocs' core has had no release since 2024 and Material for MkDocs is
in maintenance. Nothing here fetches from the network: the build runs offline.
"""

from __future__ import annotations

import asyncjobq

project = "asyncjobq"
author = "the asyncjobq developers"
copyright = "2026, the asyncjobq developers"
release = version = asyncjobq.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "conftest.py"]
# Docstrings quote names in single backquotes, as the README does: code, not titles.
default_role = "code"
# `--dsn` stays two hyphens, not an en dash; quotes stay straight, as in a terminal.
smartquotes = False

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True, "show-inheritance": False}

html_theme = "furo"
html_title = f"asyncjobq {release}"
html_static_path: list[str] = []
# No web fonts or CDN: the site works offline, as the dashboard does.
html_theme_options = {"navigation_with_keys": True}
