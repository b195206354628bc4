"""The one base of the errors a user can act on."""


class MtptrainError(Exception):
    """A failure of the input, not of the code: its message names the file or setting and the fix. The CLI prints
    it as `error: ...` with exit code 1 and no traceback; any other exception is a bug and keeps its traceback."""
