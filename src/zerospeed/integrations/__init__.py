"""Where DeepSpeed users already are: PyTorch Lightning (``integrations.lightning``) and others.

Each integration imports its framework only when imported itself; zerospeed never requires them.
"""
