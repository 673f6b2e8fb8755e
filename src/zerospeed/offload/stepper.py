"""The offloaded optimizer step: what ``ZeroOptimizer`` runs instead of ``optimizer.step()`` under ZeRO-Offload.

``cpu``: the fp32 master and optimizer state live in host memory; each sub-group is stepped by the fused
CPU kernel (optimizers without one, e.g. Lamb or SGD, run their own ``step()`` on the host tensors).
``nvme``: the state of each sub-group lives in a swap file and is streamed through ``buffer_count``
aligned host buffers: while sub-group ``j`` is updated, ``j+1 .. j+buffer_count-2`` are being read and
``j-1`` written. The fp32 master travels with it: each sub-group's file holds its master range too
(``master_home.py``), the update runs on the swap buffer, and the group's ``master`` tensor stays parked
(no storage) between and during steps; the write-back after the step reads the updated master back range
by range (one all-gather run at a time). A group whose master *is* the model (one rank, fp32) keeps it.

Gradients arrive unscaled and clipped (the ``ZeroOptimizer`` did that). Under ``cpu`` offload on an
accelerator they already live on the host: the reducer hands each reduced bucket to ``HostGrads``, which
copies it off the device on a side stream into pinned host partitions (``grad_sink.py``). Under ``nvme``
at stages 2-3 they are in the swap files (``SwappedGrads``; on an accelerator each reduced bucket leaves the
device on a side stream first) and read with the state, then multiplied by the
optimizer's unscale/clip factor. Otherwise (stage 1 under nvme on CUDA) device partitions are copied to
host sub-group by sub-group on a side stream, one sub-group ahead of the CPU update. A read or write that fails
raises naming the file on every rank, *before* the updated master reaches the model (the write-back runs
only after a successful step); the stepper then refuses further steps (the state is half-updated: reload
a checkpoint).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from .. import comm
from ..config import ConfigError
from ..config.offload import AioConfig, OffloadOptimizerConfig
from ..zero import ShardedGroup
from .cpu_adam import kernel_for
from ..accelerator import get_accelerator
from .grad_sink import GRAD, HostGrads, SwappedGrads
from .master_home import MASTER, SwappedMaster
from .preflight import check_nvme_path
from .state_store import HostStore, SwappedState, state_layout, state_views
from .cores import host_step
from .partial import DeviceShare, HostWorker, split_subgroups
from .subgroups import SubGroup, plan_subgroups
from .swapper import AsyncSwapper, Handle, OffloadIOError, aligned_empty
from ..accelerator import can_pin_memory

KEY = "zero_optimization.offload_optimizer"


class _GradStager:
    """Host copies of a sub-group's gradient pieces (views on CPU; pinned copies, prefetched, on CUDA)."""

    def __init__(self, grads: list[torch.Tensor], pin: bool) -> None:
        self.grads = grads
        self.on_host = all(g.device.type == "cpu" for g in grads)
        self.pin = pin and can_pin_memory()
        self.ready: dict[int, tuple[list[torch.Tensor], Any]] = {}
        self.stream = None if self.on_host else torch.cuda.Stream()

    def prefetch(self, key: int, sg: SubGroup) -> None:
        if self.on_host or key in self.ready:
            return
        src = self.grads[sg.gi]
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host = [torch.empty(y - x, pin_memory=self.pin).copy_(src[x:y], non_blocking=True) for x, y in sg.pieces]
            event = torch.cuda.Event()
            event.record()
        self.ready[key] = (host, event)

    def take(self, key: int, sg: SubGroup) -> list[torch.Tensor]:
        if self.on_host:
            return [self.grads[sg.gi][x:y] for x, y in sg.pieces]
        self.prefetch(key, sg)
        host, event = self.ready.pop(key)
        event.synchronize()
        return host


class OffloadStepper:
    """Steps the master shards of ``groups`` on the host, with state in memory or in swap files."""

    def __init__(self, groups: list[ShardedGroup], optimizer: torch.optim.Optimizer, cfg: OffloadOptimizerConfig,
                 aio: AioConfig, sub_group_size: int, dp_group: comm.Group | None, rank: int = 0,
                 stream_grads: bool = False, state_dtype: torch.dtype = torch.float32) -> None:
        self.groups, self.optimizer, self.cfg, self.dp_group = groups, optimizer, cfg, dp_group
        self.kernel = kernel_for(optimizer)
        for g in groups:  # initialize() builds groups with a separate (host) master on an accelerator
            assert not (g.alias and g.params and g.params[0].device.type != "cpu"), \
                "offload on an accelerator needs a master separate from the model (separate_master=True)"
        if self.kernel is not None:
            for pg in optimizer.param_groups:
                try:
                    self.kernel.check(pg)
                except ValueError as exc:
                    raise ConfigError(KEY, str(exc)) from None
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in groups]
        self.subgroups = [plan_subgroups(g, gi, sub_group_size) for gi, g in enumerate(groups)]
        self.partitioned = any(g.num_partitions > 1 for g in groups)
        self.broken: str | None = None
        self.swapper: AsyncSwapper | None = None
        self.host: HostStore | None = None
        self.swapped: SwappedState | None = None
        self.last_stats: dict[str, float] = {}
        # Where the reducer puts the reduced gradients instead of device buffers: the swap files (nvme, stages
        # 2-3) or host partitions (cpu offload on an accelerator); None on a CPU-only machine under cpu offload.
        self.sink: SwappedGrads | HostGrads | None = None
        self.stream_grads = stream_grads
        self.share: DeviceShare | None = None  # partial offload: the sub-groups stepped on the device
        self.worker: HostWorker | None = None
        self.host_thread = ""  # the thread that ran the last host step (a worker thread under partial offload)
        if self.kernel is None and any(g.master is not None and g.master.dtype != torch.float32 for g in groups):
            raise ConfigError(KEY, f"16-bit master weights under offload are stepped by the CPU Adam/AdamW/Adagrad "
                                   f"kernel (DeepSpeedCPUAdam in DeepSpeed); {type(optimizer).__name__} has none")
        if cfg.device == "cpu":
            if self.kernel is not None:
                self.host = HostStore(groups, optimizer, self.kernel, self.steps, state_dtype)
            if cfg.ratio < 1.0:
                self._init_partial()
            if stream_grads:  # on an accelerator: the gradient partitions live on the host too
                self.sink = HostGrads([g.plan.partition_numel for g in groups], cfg.pin_memory, get_accelerator())
        else:
            self._init_nvme(aio, rank)

    def _init_partial(self) -> None:
        if self.kernel is None or self.host is None:
            raise ConfigError(f"{KEY}.ratio", f"partial offload (ratio {self.cfg.ratio}) steps Adam, AdamW or Adagrad "
                                              f"on both sides; {type(self.optimizer).__name__} is not supported yet by "
                                              "zerospeed with ratio < 1 (use ratio 1)")
        jobs = [sg for sgs in self.subgroups for sg in sgs]
        device_jobs, self.host_jobs = split_subgroups(jobs, self.cfg.ratio)
        self.share = DeviceShare(device_jobs, self.host, self.kernel, self.groups[0].device)

    def sync_for_checkpoint(self) -> None:
        """Bring state held on the device (partial offload on an accelerator) into ``optimizer.state``."""
        if self.share is not None:
            self.share.flush()

    def state_bytes_by_home(self) -> dict[str, int]:
        """Optimizer state bytes by where the step uses it: ``device`` (partial offload's device share) and
        ``host`` (offloaded). Accounting, not measurement."""
        device = 0 if self.share is None else self.share.state_bytes()
        return {"device": device, "host": self.host_state_bytes() - device}

    def _init_nvme(self, aio: AioConfig, rank: int) -> None:
        if self.kernel is None:
            raise ConfigError(KEY, f"device 'nvme' streams the state of Adam, AdamW and Adagrad; "
                                   f"{type(self.optimizer).__name__} has no flat kernel: use device 'cpu'")
        # A group with its own fp32 master swaps it too (one more region per file); an aliased one cannot.
        grad = (GRAD,) if self.stream_grads else ()
        self.keys = [self.kernel.state_keys + (() if g.alias else (MASTER,)) + grad for g in self.groups]
        jobs = [sg for sgs in self.subgroups for sg in sgs]
        need = sum(state_layout(sg, self.keys[sg.gi])[0] for sg in jobs)
        root = check_nvme_path(self.cfg.nvme_path, need, f"{KEY}.nvme_path")
        self.swapper = AsyncSwapper(root, aio.block_size, aio.intra_op_parallelism, prefix=f"zerospeed_rank{rank}_",
                                    queue_depth=aio.queue_depth)
        biggest = max((state_layout(sg, self.keys[sg.gi])[0] for sg in jobs), default=4096)
        self.buffers = [aligned_empty(biggest, pin=self.cfg.pin_memory) for _ in range(self.cfg.buffer_count)]
        self.swapped = SwappedState(self.groups, self.subgroups, self.kernel, self.swapper, self.steps,
                                    self.optimizer.param_groups, self.keys)
        for gi, g in enumerate(self.groups):
            if g.alias or g.master_home is not None:
                continue
            # The files start with the initial state and the master: a master built as a placeholder
            # (``master_deferred``) is loaded from the model straight into the files by ``park_master``.
            for sg in self.subgroups[gi]:
                self.swapped.ensure(sg, None if g.master_deferred else g.master_range(sg.lo, sg.hi).detach().cpu())
            g.park_master(SwappedMaster(self.subgroups[gi], self.keys[gi], self.swapper))
        if self.stream_grads:
            on_device = any(g.device.type != "cpu" for g in self.groups)
            self.sink = SwappedGrads(self.subgroups, self.keys, self.swapper, self.swapped.ensure,
                                     get_accelerator() if on_device else None, self.cfg.pin_memory)
        self._install_mapping()

    def _install_mapping(self) -> None:
        """Make ``optimizer.state`` the swapped mapping, adopting what a load put in a plain dict."""
        assert self.swapped is not None
        current = self.optimizer.state
        if current is self.swapped:
            return
        self.optimizer.state = self.swapped  # type: ignore[assignment]
        for mp, st in list(current.items()):
            if mp in self.swapped.where:
                self.swapped[mp] = st

    # --- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """Update every master shard from the (unscaled, clipped) fp32 gradient partitions ``grads``."""
        if self.broken:
            raise RuntimeError(f"offloaded optimizer state is inconsistent after an earlier failure ({self.broken}); "
                               "reload a checkpoint")
        error: BaseException | None = None
        try:
            with host_step(self.cfg.cpuadam_cores_perc):  # the host step's share of the cores (offload/cores.py)
                self._dispatch(grads)
        except Exception as exc:  # noqa: BLE001 - any failure (I/O, memory, a kernel) is agreed across ranks
            error = exc
        failed = comm.all_reduce_max_flag(error is not None, group=self.dp_group) if self.partitioned else error is not None
        if error is not None:
            self.broken = str(error)
            raise error
        if failed:
            self.broken = "the offloaded optimizer step failed on another rank"
            raise RuntimeError("the offloaded optimizer step failed on another rank (see its error); the weights "
                               "were not updated")

    def _dispatch(self, grads: list[torch.Tensor]) -> None:
        if self.kernel is None:
            self.optimizer.step()  # cpu offload of an optimizer without a flat kernel: its own step on host
        elif self.swapper is None:
            self._step_host(grads)
        else:
            if self.sink is not None and self.sink.error is not None:
                raise self.sink.error  # a gradient read or write failed during backward
            self._step_nvme(grads)

    def on_skipped_step(self) -> None:
        """The optimizer skipped this step (overflow) before calling ``step``: nothing to undo here
        (SuperOffload's speculative stepper overrides it)."""

    def _begin(self) -> None:
        for s in self.steps:
            s += 1

    def _step_host(self, grads: list[torch.Tensor]) -> None:
        assert self.host is not None and self.kernel is not None
        if self.host.adopt() and self.share is not None:
            self.share.reload()  # a checkpoint load put new state in the host store
        self._begin()
        if self.share is None:
            self._host_jobs(grads, [sg for sgs in self.subgroups for sg in sgs])
            return
        if self.worker is None:
            self.worker = HostWorker()
        host_half = self.worker.submit(lambda: self._host_jobs(grads, self.host_jobs))
        t0 = time.perf_counter()
        try:
            self.share.step(grads, self.steps, self.optimizer.param_groups)
        finally:
            t_device = time.perf_counter() - t0
            host_half.result()  # re-raises the host half's error, after the device half is done
        self.last_stats = {"device_s": t_device, "step_s": time.perf_counter() - t0,
                           "device_subgroups": float(len(self.share.jobs)), "host_subgroups": float(len(self.host_jobs))}

    def _host_jobs(self, grads: list[torch.Tensor], jobs: list[SubGroup]) -> None:
        assert self.host is not None and self.kernel is not None
        self.host_thread = threading.current_thread().name
        stager = _GradStager(grads, self.cfg.pin_memory)
        for j, sg in enumerate(jobs):
            if j + 1 < len(jobs):
                stager.prefetch(j + 1, jobs[j + 1])
            self.kernel.step(sg.masters, stager.take(j, sg), self.host.piece_states(sg), self.steps[sg.gi],
                             self.optimizer.param_groups[sg.gi])

    def _step_nvme(self, grads: list[torch.Tensor]) -> None:
        assert self.swapper is not None and self.swapped is not None and self.kernel is not None
        self._install_mapping()
        self._begin()
        stager = _GradStager(grads, self.cfg.pin_memory)
        sw = self.swapper
        jobs = [sg for sgs in self.subgroups for sg in sgs]
        free = list(range(len(self.buffers)))
        reads: dict[int, tuple[int, Handle | None]] = {}
        writes: deque[tuple[int, Handle]] = deque()
        depth = max(1, len(self.buffers) - 2)
        t_read = t_write = t_compute = 0.0

        def acquire() -> int:
            nonlocal t_write
            if not free:
                t0 = time.perf_counter()
                b, h = writes.popleft()
                try:
                    h.wait()
                finally:
                    free.append(b)
                    t_write += time.perf_counter() - t0
            return free.pop()

        def start_read(j: int) -> None:
            sg, b = jobs[j], acquire()
            view = self.buffers[b][: state_layout(sg, self.keys[sg.gi])[0]]
            if sg.name in sw.sizes:
                reads[j] = (b, sw.read(sg.name, view))
            else:
                self.swapped.fresh(sg, view)  # type: ignore[union-attr]
                reads[j] = (b, None)

        try:
            for j in range(min(depth, len(jobs))):
                start_read(j)
            for j, sg in enumerate(jobs):
                if j + depth < len(jobs):
                    start_read(j + depth)
                if j + 1 < len(jobs):
                    stager.prefetch(j + 1, jobs[j + 1])
                b, h = reads.pop(j)
                t0 = time.perf_counter()
                if h is not None:
                    h.wait()
                t1 = time.perf_counter()
                view = self.buffers[b][: state_layout(sg, self.keys[sg.gi])[0]]
                states = state_views(view, sg, self.keys[sg.gi])
                masters = states.pop(MASTER, sg.masters)  # the buffer's master region, or the model (aliased)
                grad = self._file_grads(sg, states.pop(GRAD)) if self.sink else stager.take(j, sg)
                self.kernel.step(masters, grad, states, self.steps[sg.gi], self.optimizer.param_groups[sg.gi])
                t_read, t_compute = t_read + t1 - t0, t_compute + time.perf_counter() - t1
                if self.sink:  # the gradient region is not written back
                    writes.append((b, sw.write(sg.name, view[: self.sink.offset(sg)], offset=0)))
                else:
                    writes.append((b, sw.write(sg.name, view)))
            t0 = time.perf_counter()
            while writes:
                b, h = writes.popleft()
                free.append(b)
                h.wait()
            t_write += time.perf_counter() - t0
        finally:
            for _, h in [*reads.values(), *writes]:  # let nothing in flight touch a buffer after we leave
                if h is not None:
                    try:
                        h.wait()
                    except OffloadIOError:
                        pass
        self.last_stats = {"read_wait_s": t_read, "compute_s": t_compute, "write_wait_s": t_write,
                           "subgroups": float(len(jobs))}

    def _file_grads(self, sg: SubGroup, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient pieces read with the state: zero if no gradient arrived this step, else unscaled and
        clipped by the optimizer's multiplier."""
        assert self.sink is not None
        if not self.sink.holds(sg):
            for p in pieces:
                p.zero_()
        elif self.sink.scale != 1.0:
            for p in pieces:
                p.mul_(self.sink.scale)
        return pieces

    # --- accounting / lifecycle ----------------------------------------------------------------------
    def host_state_bytes(self) -> int:
        """Optimizer state held in host memory (swap buffers under nvme)."""
        if self.host is not None:
            return self.host.host_bytes()
        if self.swapper is not None:
            return sum(b.numel() for b in self.buffers)
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.numel() > 1)

    def disk_bytes(self) -> int:
        return 0 if self.swapper is None else self.swapper.disk_bytes()

    def close(self, restore: bool = True) -> None:
        """Remove the swap files. With ``restore`` a parked master is first read back into memory (the model
        stays trainable); a run that is finishing passes ``restore=False`` (a master larger than RAM would
        not fit back)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.swapper is not None:
            if restore and not self.broken:
                for g in self.groups:
                    g.unpark_master()
            self.swapper.close()
