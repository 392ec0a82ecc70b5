"""Errors of the export package. The CLI prints them as one line and exits with code 2."""


class ExportError(Exception):
    """A problem with the user's input (path, checkpoint, task, options): fix the input and rerun."""


class ParityError(ExportError):
    """The exported model's outputs drifted from the PyTorch model's beyond tolerance."""
