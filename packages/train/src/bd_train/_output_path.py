"""The check of a command-line output file, made before minutes of work rather than after."""

from __future__ import annotations

import os
from pathlib import Path


def output_path_error(flag: str, value: str, example: str) -> str | None:
    """Why `value`, given as `flag`, cannot take a file written at the end (a folder, a folder that
    does not exist or is not writable), as a message naming the flag; None when it can.
    `example` is a file name to suggest inside a folder given by mistake."""
    out = Path(value)
    if out.is_dir():
        return f"{flag} {value}: is a folder; give a file path in it, e.g. {str(out / example)!r}"
    if not out.parent.is_dir():
        return f"{flag} {value}: the folder {str(out.parent)!r} does not exist; create it first"
    if not os.access(out.parent, os.W_OK):
        return f"{flag} {value}: the folder {str(out.parent)!r} is not writable; give a path you can write to"
    return None
