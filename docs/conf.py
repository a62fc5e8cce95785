"""Sphinx configuration: Markdown pages (MyST), the API reference from the docstrings."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))  # the local settings_table extension

project = "fastreduce"
author = "the fastreduce developers"
copyright = "the fastreduce developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "settings_table",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_heading_anchors = 3  # links such as usage.md#non-blocking-and-coalesced-all-reduce

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = []

html_theme = "alabaster"
html_title = "fastreduce"

# The docstrings write `name` for code, as Markdown does.
default_role = "literal"

# Docstrings whose text is not valid reStructuredText (an indented example without "::",
# a name ending in "_" read as a link). Shown as preformatted text until they are fixed
# in src/; every other docstring is rendered normally.
PREFORMATTED_DOCSTRINGS = {
    "fastreduce.torch.gradsync",
    "fastreduce.torch.custom_ops",
    "fastreduce.torch.custom_ops.allreduce_",
}


def _preformat(app, what, name, obj, options, lines):
    if name in PREFORMATTED_DOCSTRINGS and lines:
        lines[:] = ["::", ""] + ["   " + line for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _preformat)
