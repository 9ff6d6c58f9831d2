"""The findings pane: every note of the report, each linked to the nodes and tensors it names.

Selecting a finding jumps the node table to them; one key excludes exactly the excludable ones (the screen
acts on the messages this pane posts, as for every widget of the main screen).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from qdebug.tui.findings_model import Finding
from qdebug.tui.model import LayerModel
from qdebug.tui.widgets import EXCLUDED_MARK


def finding_text(model: LayerModel, f: Finding) -> Text:
    """Finding ``f`` as the pane lists it: its number, the note with the names it mentions highlighted
    (nodes bold cyan, excluded ones magenta; tensors italic), then the nodes it links and what ``x`` does."""
    t = Text()
    t.append(f"{f.index + 1:>2} ", style="bold yellow")
    pos = 0
    for m in f.mentions:
        t.append(f.text[pos : m.start])
        if m.kind == "node":
            style = "bold magenta" if model.is_excluded(m.name) else "bold cyan"
        else:
            style = "italic cyan"
        t.append(f.text[m.start : m.end], style=style)
        pos = m.end
    t.append(f.text[pos:])
    if not f.linked:
        t.append("\n   names no node of the report", style="dim")
        return t
    t.append("\n   → ", style="dim")
    for i, name in enumerate(f.linked):
        if i:
            t.append(" · ", style="dim")
        excluded = model.is_excluded(name)
        t.append(name, style="bold magenta" if excluded else "")
        if excluded:
            t.append(f" {EXCLUDED_MARK}", style="bold magenta")
    if not f.targets:
        t.append("  (nothing to exclude)", style="dim")
    elif all(model.is_excluded(n) for n in f.targets):
        t.append(f"  x: include {'them' if len(f.targets) > 1 else 'it'} again", style="dim")
    else:
        k = len(f.targets)
        t.append(f"  x: exclude {k} node{'s' if k != 1 else ''}", style="dim")
    return t


class FindingsPanel(Vertical):
    """The report's notes (analyze's findings), each with the nodes it names: enter jumps, x excludes."""

    @dataclass
    class JumpRequested(Message):
        """The user picked finding ``index`` (enter or a click)."""

        index: int

    def __init__(self, model: LayerModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model

    def compose(self) -> ComposeResult:
        """Title line, then one entry per note."""
        yield Static(id="findings-title")
        yield OptionList(id="findings-list", compact=True)

    def on_mount(self) -> None:
        """Fill from the model."""
        m = self.model
        title = Text()
        title.append(f"Findings {len(m.findings)}", style="bold yellow")
        title.append(f" · {FINDINGS_HINT}", style="dim")
        self.query_one("#findings-title", Static).update(title)
        options = self.query_one("#findings-list", OptionList)
        if m.findings:
            options.add_options([Option(finding_text(m, f), id=str(f.index)) for f in m.findings])
        else:
            options.add_option(Option(Text("the report has no notes", style="dim"), disabled=True))

    def refresh_marks(self) -> None:
        """Redraw the entries after the exclusion set changed (in place: the list keeps its scroll)."""
        options = self.query_one("#findings-list", OptionList)
        for f in self.model.findings:
            options.replace_option_prompt_at_index(f.index, finding_text(self.model, f))

    @property
    def entries(self) -> OptionList:
        """The list of findings."""
        return self.query_one("#findings-list", OptionList)

    @property
    def highlighted(self) -> int | None:
        """The index of the finding under the list's cursor."""
        option = self.entries.highlighted_option
        return int(option.id) if option is not None and option.id is not None else None

    @on(OptionList.OptionSelected, "#findings-list")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(self.JumpRequested(int(event.option.id)))


FINDINGS_HINT = "enter jumps to the nodes · x excludes them · f closes"
