"""The one error a bad checkpoint raises: it names the directory or file and what is wrong with it."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not match the model."""


class TagMismatchError(CheckpointError, AssertionError):
    """``checkpoint.tag_validation: Fail`` and the ranks' tags differ. DeepSpeed asserts there, so this is also an
    ``AssertionError``: code written for either catches it."""
