"""Messages posted by the verify worker thread (not by a widget).

Widget messages live on the widget that posts them (``NodeTable.NodeHighlighted``,
``DetailPanel.JumpRequested``...). The verify worker runs in a thread owned by
the main screen and reports through these; ``post_message`` is thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message


@dataclass
class VerifyProgress(Message):
    """The verify callable reported progress."""

    bubble = False  # for the main screen only: the app has nothing to do with it

    fraction: float
    """Done share in ``[0, 1]``."""
    text: str
    """What it is doing now (e.g. ``"quantizing"``, ``"evaluating 120/512"``)."""
