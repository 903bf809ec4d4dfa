"""The error every stage raises when it refuses to start or go on (a leaf module: `_guard` and
`_run` both raise it)."""


class StageError(RuntimeError):
    """A stage refused to start or continue (mismatched checkpoint, missing file); nothing was lost."""
