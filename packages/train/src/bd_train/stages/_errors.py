"""The error every stage raises when it refuses to start or go on (a leaf module: `_guard` and
`_run` both raise it)."""


class StageError(RuntimeError):
    """A stage refused to start or continue (mismatched checkpoint, missing file); nothing was lost."""


class CanvasTooSmall(StageError):
    """A problem does not fit the canvas: `key` (`canvas.prompt_len` or `canvas.max_new_tokens`),
    what does not fit (`finding`) and the fix (`remedy`), so a caller can say it in its own terms."""

    def __init__(self, key: str, finding: str, remedy: str):
        super().__init__(f"{key}: {finding}; {remedy}")
        self.key, self.finding, self.remedy = key, finding, remedy
