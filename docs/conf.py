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
