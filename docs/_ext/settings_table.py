"""The ``fastreduce-settings`` directive: the table of every variable fastreduce reads,
generated from ``fastreduce.settings.SETTINGS`` so the page never drifts from the code."""

from __future__ import annotations

from docutils import nodes
from docutils.parsers.rst import Directive, directives

SECTION_TITLES = {
    "checks": "Checks and diagnostics",
    "host": "Host all-reduce",
    "gpu": "GPU tensors",
    "torch": "torch.distributed backend",
    "horovod": "Horovod layer (fastreduce.horovod)",
}


def _inline(text: str) -> list[nodes.Node]:
    """Text with `backquoted` parts as literals."""
    parts = text.split("`")
    return [nodes.literal(p, p) if i % 2 else nodes.Text(p) for i, p in enumerate(parts) if p]


def _row(*cells: list[nodes.Node]) -> nodes.row:
    row = nodes.row()
    for cell in cells:
        entry = nodes.entry()
        entry += nodes.paragraph("", "", *cell)
        row += entry
    return row


def _table(settings) -> nodes.table:
    table = nodes.table(classes=["fastreduce-settings"])
    group = nodes.tgroup(cols=4)
    table += group
    for width in (28, 18, 14, 40):
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    head += _row(*([nodes.Text(t)] for t in ("variable", "value", "default", "meaning")))
    group += head
    body = nodes.tbody()
    for s in settings:
        body += _row([nodes.literal(s.name, s.name)], [nodes.Text(s.kind)],
                     [nodes.Text(s.default)], _inline(s.doc))
    group += body
    return table


class SettingsDirective(Directive):
    """Render SETTINGS grouped by section; ``:section:`` limits it to one section."""

    has_content = False
    option_spec = {"section": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        from fastreduce.settings import SETTINGS

        wanted = self.options.get("section")
        sections = list(dict.fromkeys(s.section for s in SETTINGS))
        unknown = [s for s in sections if s not in SECTION_TITLES]
        if unknown:
            raise self.error(f"fastreduce-settings: no title for section(s) {unknown}; "
                             f"add them to SECTION_TITLES in {__file__}")
        if wanted is not None and wanted not in sections:
            raise self.error(f"fastreduce-settings: no section {wanted!r}; "
                             f"the sections are {', '.join(sections)}")
        out: list[nodes.Node] = []
        for section in sections:
            if wanted is not None and section != wanted:
                continue
            if wanted is None:
                out.append(nodes.rubric(text=SECTION_TITLES[section]))
            out.append(_table([s for s in SETTINGS if s.section == section]))
        return out


def setup(app):
    app.add_directive("fastreduce-settings", SettingsDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
