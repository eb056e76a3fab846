"""Sphinx configuration: numpydoc API reference plus Markdown guides, built offline."""

import sklearn_casgd

project = "sklearn_casgd"
author = "sklearn_casgd developers"
release = sklearn_casgd.__version__

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "myst_parser",
    "matplotlib.sphinxext.plot_directive",
]
plot_html_show_source_link = False
plot_html_show_formats = False
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
# The API pages list each class's methods from its docstring sections.
numpydoc_show_class_members = False
html_theme = "alabaster"
myst_heading_anchors = 3
