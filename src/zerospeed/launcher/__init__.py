"""The ``zerospeed`` command line: ``zerospeed launch`` and, later, ``report`` and ``to-fp32``.

Nothing here imports ``torch``: ``zerospeed --help`` stays fast, and the ranks are started by PyTorch's
elastic agent (``python -m torch.distributed.run``) running as a child process.
"""
