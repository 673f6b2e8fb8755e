"""The one error a bad checkpoint raises: it names the directory or file and what is wrong with it."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not match the model."""
