"""``python -m qdebug`` runs the CLI."""

from qdebug.cli.main import entry

entry()
