"""Sphinx configuration of jaxvla's documentation site.

The pages are the MyST Markdown files beside this one (docs/index.md is the root); the API
pages come from the package's docstrings (Google style, read by napoleon). The fast test
step builds the site with warnings as errors (tests/test_docs.py), so a broken link,
cross-reference or docstring fails CI.

  .venv/bin/python -m sphinx -W -b html docs docs/_build/html
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "jaxvla"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# GitHub's anchors for headings, so "page.md#a-heading" links work on the site and on GitHub.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = "jaxvla"
