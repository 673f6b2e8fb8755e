"""Ends right after many small collectives, while an object (here a global, as an engine would) still
refers to the process group: before zerospeed let Gloo's workers settle at exit, most such runs aborted
with ``terminate called without an active exception``. Imports only what it needs, so that the exit
comes quickly after the last collective."""

import torch

from zerospeed import comm

comm.init_distributed()
GROUP = comm.world_group()
out = torch.empty(1000 * comm.get_world_size())
for _ in range(200):
    comm.all_gather(out, torch.ones(1000), group=GROUP)
