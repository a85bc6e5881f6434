"""`CheckpointError`, in a module that imports nothing heavy (the tokenizer raises it, and
a process that only unpickles a `Tokenizer` must not load jax)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file and the problem."""
