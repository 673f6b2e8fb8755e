"""Per-rank peak memory predicted before any rank starts (``zerospeed plan``): pure, sizes in, bytes out.

The prediction follows zerospeed's own buffer rules (read from the code, not from DeepSpeed's tables). The peak
is at the start of backward, where the saved activations and the loss's gradients are all live; what exists
then adds whole:

* params: the model in the compute dtype (stage 3: only this rank's shards and the whole *persistent*
  parameters, ``stage3_param_persistence_threshold`` / ``stage3_model_persistence_threshold``; an fp32
  shard *is* its master slot, so it costs nothing extra);
* grads (``zero/grad_reducer.py``): stages 0 and 1 keep a full padded buffer in the accumulation dtype; stages
  2-3 released their partition after the last step (``GradReducer.zero``) and make it again at the first reduce
  of backward, after the peak; and autograd's gradient of the output head (``_head_grad``), made right after
  the logits' gradient and held to the end of backward;
* master: fp32 partition, none where the model itself is the master (one partition, fp32, no offload);
* optimizer state: per master element, Adam/AdamW/Lamb 2 fp32 tensors, SGD with momentum and Adagrad 1;
* stage 3 gathered parameters (``_gathered``): with DeepSpeed's default ``stage3_max_reuse_distance`` and
  ``stage3_max_live_parameters`` every non-persistent parameter stays gathered from its forward to its
  backward; a shorter reuse distance (0: release always) keeps only the last part of the model and gathers
  the rest again in backward (the unit in use, the prefetch window). On Gloo host tensors a gather is in place
  into each parameter's own storage, grown back where its last gather freed it (no staging output, no hole);
  qwZ / hpZ / offloaded gathers stage one;
* activations (``_backward_peak``): the per-architecture formula of ``plan_models.py`` times its measured
  ``backward_factor``; the vocabulary-wide fp32 tensors, when mmap-sized, count once each instead.

Buffers made after that point (``_after_phases``; ``buckets`` in the table) add only beyond what backward freed:
the reduce at the end of backward (the gradient partition at stages 1-3, the reduce-scatter outputs in flight,
stages 2-3's transient bucket buffers: the filling one and ``MAX_IN_FLIGHT``; stage 1's buckets are views of its
full buffer) and the optimizer step (the partition, and the two temporaries the size of the largest master
tensor that torch's per-tensor Adam/AdamW makes on CPU; its fused kernel, the default, makes none). Which memory a buffer can take is glibc's rule
(``MMAP_CEILING``): one below 32 MiB comes from the heap, where what backward freed stays resident, so it
adds only beyond the freed heap; a larger one is mmapped, so it adds only beyond the mapped memory backward
unmapped (the vocabulary-wide tensors). The stage-1/2 write-back gathers in place on Gloo host tensors (no buffer).
Under the engine's full heap trim (``ZEROSPEED_TRIM_HEAP=full``) freed heap goes back to the OS during backward: at
most ``TRIM_MIN_BYTES`` of the fragmented heap is resident at the peak, and a buffer of any size reuses what
backward freed. The default at stages 2-3 trims only when backward starts; the plan does not model that (it
predicts as without a trim: an upper bound).

Two kinds of *measured constants* (this machine: torch 2.13 CPU, glibc, forked Gloo ranks, glibc's default
heap: ``ZEROSPEED_MMAP_THRESHOLD`` unset) say what the formulas cannot: ``FRAMEWORK_BYTES``, what the first
steps of training cost beyond any model state (code pages of the kernels touched, autograd and Gloo buffers: the
tiny GPT's peak over start less its states and activations, under 1 MiB), and each architecture's
``backward_factor`` (``plan_models.py``), how far the steady-state peak rises above the saved activations
(backward's temporaries and the heap that training leaves fragmented from step to step). Both were fit on the
small shapes (``docs/benchmarks.md``, "Memory plan vs measurement", 2026-12-01); GPT-2-small is the check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..accelerator.host_malloc import TRIM_MIN_BYTES, heap_trim_setting
from ..zero.grad_reducer import MAX_IN_FLIGHT
from ..zero.partition import reduce_bucket_numel
from .plan_models import ModelSpec

MIB = 1024 * 1024
FRAMEWORK_BYTES = int(30.5 * MIB)  # measured: the tiny GPT's peak over start (micro-batch 4, seq 32) less its states
IMPORT_TORCH_BYTES = 220 * MIB  # measured default: RSS of `python -c "import torch, zerospeed"` here
# glibc (64-bit) serves requests of at least this many bytes with mmap whatever its dynamic threshold, and
# unmaps them at free; smaller ones come from the heap, where freed memory stays resident and fragmented.
MMAP_CEILING = 32 * MIB  # DEFAULT_MMAP_THRESHOLD_MAX: the dynamic threshold never rises above it

_STEP_TEMPORARIES = {"adam": 2, "adamw": 2}  # tensors the size of one master tensor that torch's step makes
_STATE_TENSORS = {"adam": 2, "adamw": 2, "lamb": 2, "fusedadam": 2, "cpuadam": 2, "adagrad": 1}
OWNERS = ("params", "grads", "master", "optimizer_state", "buckets", "gathered_params", "activations",
          "framework")


@dataclass(frozen=True)
class PlanInputs:
    """What the run will be: sizes from the config, overridden by the command line."""

    stage: int
    world: int
    micro_batch: int
    seq: int
    compute_bytes: int  # 4 fp32, 2 bf16/fp16
    accum_bytes: int  # gradient accumulation dtype: 4, or 2 under fp16
    reduce_bucket: int
    allgather_bucket: int
    prefetch: int
    max_live: int
    max_reuse: int
    param_persistence: int
    model_persistence: int
    optimizer: str  # lower-case DeepSpeed type name ("" = no optimizer)
    momentum: bool = True  # SGD only
    offload_optimizer: bool = False
    offload_param: bool = False
    staged_gathers: bool = False  # zero_quantized_weights or zero_hpz_partition_size > 1: buffered stage-3 gathers
    accumulation: int = 1  # gradient_accumulation_steps
    trim_heap: bool = False  # the engine's full heap trim in backward (``accelerator/host_malloc.py``, ``full``)
    fused_step: bool = False  # Adam/AdamW on torch's fused CPU kernel (the default: optim/factory.py): no temporaries


@dataclass
class MemoryPlan:
    """Predicted bytes per rank by owner; ``peak_over_start`` excludes the interpreter and torch import."""

    inputs: PlanInputs
    model: str
    num_params: int
    owners: dict[str, int] = field(default_factory=dict)
    baseline_bytes: int = IMPORT_TORCH_BYTES
    host_owners: tuple[str, ...] = ()  # owners that live in host memory under offload

    @property
    def peak_over_start(self) -> int:
        return sum(self.owners.values())

    @property
    def absolute(self) -> int:
        return self.peak_over_start + self.baseline_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "num_params": self.num_params, "stage": self.inputs.stage,
                "world_size": self.inputs.world, "micro_batch": self.inputs.micro_batch, "seq": self.inputs.seq,
                "bytes": dict(self.owners), "peak_over_start_bytes": self.peak_over_start,
                "baseline_bytes": self.baseline_bytes, "absolute_bytes": self.absolute,
                "host_owners": list(self.host_owners)}

    def table(self) -> str:
        i = self.inputs
        lines = [f"zerospeed plan: {self.model} ({self.num_params:,} params), ZeRO stage {i.stage}, world {i.world}, "
                 f"micro-batch {i.micro_batch}, seq {i.seq} (per rank, MiB)"]
        for name in OWNERS:
            where = " (host)" if name in self.host_owners else ""
            lines.append(f"  {name + where:<24}{self.owners.get(name, 0) / MIB:>10.2f}")
        lines.append(f"  {'peak over start':<24}{self.peak_over_start / MIB:>10.2f}")
        lines.append(f"  {'baseline (import torch)':<24}{self.baseline_bytes / MIB:>10.2f}")
        lines.append(f"  {'total (absolute RSS)':<24}{self.absolute / MIB:>10.2f}")
        return "\n".join(lines)

    def json_line(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


def inputs_from_config(cfg: Any, world: int, micro_batch: int | None = None, seq: int = 128,
                       stage: int | None = None) -> PlanInputs:
    """Read the sizes from a validated ``ZeroSpeedConfig`` (``zerospeed.config.load_config``)."""
    z = cfg.zero_optimization
    half = cfg.fp16.enabled or cfg.bf16.enabled
    try:
        batch = cfg.batch(world)
        mb, gas = batch.micro_batch_per_gpu, batch.gradient_accumulation_steps
    except ValueError:  # the command line gives the micro-batch; the config's batch keys need not resolve
        if micro_batch is None:
            raise
        mb, gas = micro_batch, cfg.gradient_accumulation_steps or 1
    mb = micro_batch if micro_batch is not None else mb
    opt = cfg.optimizer
    name = "" if opt is None else opt.type.lower().replace("_", "")
    params = {} if opt is None else dict(opt.params)
    if name and name not in _STATE_TENSORS and name != "sgd":
        raise ValueError(f"optimizer {opt.type!r}: its state size is not known to zerospeed plan (Adam, AdamW, "
                         "Lamb, Adagrad, SGD are); not supported yet by zerospeed plan")
    if z.offload_optimizer.device == "nvme" or z.offload_param.device == "nvme":
        raise ValueError("NVMe offload is not supported yet by zerospeed plan (its swap buffers are not modelled)")
    return PlanInputs(stage=z.stage if stage is None else stage, world=world, micro_batch=mb, seq=seq,
                      compute_bytes=2 if half else 4, accum_bytes=2 if cfg.fp16.enabled else 4,
                      reduce_bucket=z.reduce_bucket_size, allgather_bucket=z.allgather_bucket_size,
                      prefetch=z.stage3_prefetch_bucket_size, max_live=z.stage3_max_live_parameters,
                      max_reuse=z.stage3_max_reuse_distance, param_persistence=z.stage3_param_persistence_threshold,
                      model_persistence=z.stage3_model_persistence_threshold, optimizer=name,
                      momentum=float(params.get("momentum", 0.0)) > 0, offload_optimizer=z.offload_optimizer.enabled,
                      offload_param=z.offload_param.enabled,
                      staged_gathers=bool(z.zero_quantized_weights) or z.zero_hpz_partition_size > 1,
                      accumulation=gas, trim_heap=heap_trim_setting(z.stage if stage is None else stage) == "full",
                      fused_step=name in _STEP_TEMPORARIES and _fused_by_default(params))


def _fused_by_default(params: dict[str, Any]) -> bool:
    """Whether the factory picks torch's fused Adam kernel for these params (host parameters assumed)."""
    return params.get("fused") is not False and params.get("foreach") is None and not any(
        params.get(k) for k in ("torch_adam", "capturable", "differentiable"))


def _shard(n: int, world: int) -> int:
    return max(1, -(-n // world))


def _buckets(numels: list[int], world: int, cap: int) -> list[int]:
    """Padded elements of each gradient bucket (``plan_partitions``' rule: reverse order, capped)."""
    out: list[int] = []
    current = 0
    for n in reversed(numels):
        padded = _shard(n, world) * world
        if current and current + padded > cap:
            out.append(current)
            current = 0
        current += padded
    return out + ([current] if current else [])


def _persistent(numels: list[int], i: PlanInputs) -> list[bool]:
    """Stage 3's rule (``zero/stage3/setup.py``): whole below the thresholds, in parameters() order."""
    if i.world == 1 and not i.offload_param:
        return [True] * len(numels)
    total, out = 0, []
    for n in numels:
        keep = n <= i.param_persistence and total + n <= i.model_persistence
        total += n if keep else 0
        out.append(keep)
    return out


def _gathered(units: list[int], i: PlanInputs) -> tuple[int, int, int]:
    """Stage 3 at the backward peak (``zero/stage3/fetcher.py``'s rules): padded elements gathered, and the
    flat output and send buffer of the largest coalesced all-gather.

    ``units`` are the padded sizes of the non-persistent parameters (each stands for its module's unit). A
    parameter released in forward stays gathered ("kept") when its module is used again within
    ``stage3_max_reuse_distance`` elements of the recorded order; one ``x`` elements before the end of forward
    is used again about ``2x`` elements later (the rest of forward, then backward down to it), so the last
    ``max_reuse / 2`` elements of the model are kept, within ``stage3_max_live_parameters``. When that covers
    the model (DeepSpeed's defaults, 1e9 each, up to ~500M parameters), the whole model is gathered when
    backward starts and backward gathers nothing. Otherwise
    backward gathers again: the kept part, the largest unit being used and the prefetched units
    (``stage3_prefetch_bucket_size``, within the live cap), with that prefetch's all-gather in flight. A
    staged gather's output counts only when heap-sized (a mapped one is made while backward frees memory, or
    in forward before the activations peak).
    """
    total = sum(units)
    largest = max(units, default=0)
    kept = min(total, i.max_reuse // 2)
    if kept >= total and total <= i.max_live:
        window = min(total, max(i.prefetch, largest))  # forward's largest gather
        return total, window, window // i.world
    kept = max(0, min(kept, i.max_live - largest))  # nothing is kept beyond the live cap
    window = max(0, min(i.prefetch, total - kept - largest, i.max_live - kept - largest))
    out = min(total, max(window, largest))  # one coalesced gather: the prefetch, or a larger unit on its own
    return min(total, kept + largest + window), out, out // i.world


def _state_tensors(i: PlanInputs) -> int:
    if i.optimizer == "sgd":
        return int(i.momentum)
    return _STATE_TENSORS.get(i.optimizer, 0)


def _backward_peak(model: ModelSpec, i: PlanInputs) -> tuple[int, int]:
    """Bytes of the activations at the start of backward, and their mapped share.

    The saved activations times the architecture's ``backward_factor`` (backward's temporaries and the heap they
    leave fragmented), except the vocabulary-wide fp32 tensors when they are mmap-sized (``b·t·V·4`` each: the
    saved log-softmax, the gradient ``nll_loss`` writes and the logits' gradient): counted once each, not scaled
    (a mapped chunk is unmapped at free and leaves no fragment), and given back once backward has passed the loss.
    Under the heap trim (``i.trim_heap``) the fragmented heap above the saved activations (the factor's part
    beyond 1) is given back at the start of backward and whenever ``TRIM_MIN_BYTES`` more is free, so at most
    that much of it is resident at the peak.
    """
    saved = model.activations(i.micro_batch, i.seq, i.compute_bytes)
    one = i.micro_batch * i.seq * model.shape.vocab_size * 4
    scaled, mapped = (saved, 0) if one < MMAP_CEILING else (saved - one, 3 * one)
    extra = scaled * (model.backward_factor - 1.0)
    if i.trim_heap:
        extra = min(extra, TRIM_MIN_BYTES)
    return int(scaled + extra) + mapped, mapped


def _head_grad(model: ModelSpec, i: PlanInputs) -> int:
    """The output head's weight gradient (``V·c`` elements): autograd makes it right after the logits' gradient,
    and the head, tied to the token embedding in both architectures, keeps it until the embedding's gradient is
    added at the end of backward (only then does the reducer's hook take it)."""
    return model.shape.vocab_size * model.shape.n_embd * i.compute_bytes


def _after_peak(sizes: list[int], freed_heap: int, freed_mapped: int) -> int:
    """Bytes that buffers made after the backward peak (alive together) add to it: a heap-sized one takes freed
    heap first, a mapped one the mapped memory backward gave back; only what exceeds those adds."""
    heap = sum(b for b in sizes if b < MMAP_CEILING)
    mapped = sum(b for b in sizes if b >= MMAP_CEILING)
    return max(0, heap - freed_heap) + max(0, mapped - freed_mapped)


def _bucket_pool(buckets: list[int]) -> list[int]:
    """Stages 2-3: the transient bucket buffers one micro-step makes, in reduce order (``BucketStore._spare``).

    A bucket takes a spent buffer of this micro-step that is large enough (the first one), else a new one; a
    buffer is spent when its collective completes, which launching a bucket forces for the oldest once
    ``MAX_IN_FLIGHT`` are in flight. Every buffer made is held until the end of the micro-step: in the steady
    state ``MAX_IN_FLIGHT`` + 1 of the common size, plus each larger bucket that no spent buffer fits (GPT-2's
    tied embedding, reduced last).
    """
    made: list[int] = []
    spare: list[int] = []
    pending: list[int] = []
    for size in buckets:
        fit = next((k for k, s in enumerate(spare) if s >= size), None)
        buf = spare.pop(fit) if fit is not None else size
        if fit is None:
            made.append(size)
        while len(pending) >= MAX_IN_FLIGHT:
            spare.append(pending.pop(0))
        pending.append(buf)
    return made


def _after_phases(numels: list[int], buckets: list[int], partition: int, i: PlanInputs) -> list[list[int]]:
    """The buffers alive together after the backward peak, per phase (bytes): the reduce at the end of backward
    (``zero/grad_reducer.py``) and the optimizer step."""
    parts = 1 if i.stage == 0 else i.world
    grad_partition = [partition * i.accum_bytes] if i.stage >= 1 and parts > 1 else []
    reduce = list(grad_partition)
    if i.stage >= 2 and parts > 1:  # transient bucket buffers (stage 1's are views of its full buffer)
        reduce += [b * i.accum_bytes for b in _bucket_pool(buckets)]
        if i.accumulation > 1:
            # a reduce-scatter lands straight in the partition where it overwrites (the first micro-step of an
            # accumulation window, and stage 1 always); later micro-steps add through an output per bucket in flight
            reduce += [b // parts * i.accum_bytes for b in sorted(buckets, reverse=True)[:MAX_IN_FLIGHT]]
    step = list(grad_partition)
    if i.optimizer in _STEP_TEMPORARIES and not i.offload_optimizer and not i.fused_step and numels:
        # torch's per-tensor Adam/AdamW (``torch_adam``, or ``foreach`` set; the fused kernel makes none) makes
        # two temporaries the size of each master tensor in turn (sqrt, then the division): the largest counts
        step += [max(_shard(n, parts) for n in numels) * 4] * _STEP_TEMPORARIES[i.optimizer]
    return [reduce, step]


def _stage3_params(model: ModelSpec, i: PlanInputs) -> tuple[int, int]:
    """Stage 3: bytes of the parameters a rank keeps (its shards, the whole persistent ones) and of those gathered
    at the backward peak (``_gathered``), with a heap-sized staging output where gathers are buffered."""
    persist = _persistent(list(model.numels), i)
    whole = sum(n for n, p in zip(model.numels, persist) if p)
    cut = [n for n, p in zip(model.numels, persist) if not p]
    shard_bytes = 0 if i.compute_bytes == 4 and not i.offload_param else i.compute_bytes
    kept = whole * i.compute_bytes + sum(_shard(n, i.world) for n in cut) * shard_bytes
    live, out, _ = _gathered([_shard(n, i.world) * i.world for n in cut], i)
    # the coalesced all-gather's output; on Gloo host tensors a plain gather is in place into the parameters'
    # own buffers (``GatherOp._gather_in_place``, each storage grown back where the last gather freed it), so only
    # qwZ / hpZ / offloaded gathers stage one
    staging = out * i.compute_bytes if i.offload_param or i.staged_gathers else 0
    return kept, live * i.compute_bytes + (staging if staging < MMAP_CEILING else 0)


def predict(model: ModelSpec, i: PlanInputs) -> MemoryPlan:
    """Predicted per-rank peak memory of training ``model`` as ``i`` says (see the module docstring)."""
    if i.stage not in (0, 1, 2, 3) or i.world < 1 or i.micro_batch < 1 or i.seq < 1:
        raise ValueError(f"stage must be 0-3 and world, micro-batch, seq >= 1 (got {i})")
    numels = [n for n, t in zip(model.numels, model.trainable) if t]
    frozen = sum(n for n, t in zip(model.numels, model.trainable) if not t)
    parts = 1 if i.stage == 0 else i.world
    partition = sum(_shard(n, parts) for n in numels)  # this rank's flat partition (elements)
    buckets = _buckets(numels, parts, reduce_bucket_numel(i.reduce_bucket, numels, i.stage, parts))
    o: dict[str, int] = dict.fromkeys(OWNERS, 0)
    if i.stage < 3:
        o["params"] = (sum(numels) + frozen) * i.compute_bytes
    else:
        o["params"], o["gathered_params"] = _stage3_params(model, i)
    # at the backward peak: stages 0-1 hold the full gradient buffer; stages 2-3 released their partition after
    # the last step and make it again at the first reduce, after the peak (``GradReducer.zero``), unless an earlier
    # micro-step of the accumulation window made it
    held = i.stage >= 2 and parts > 1 and i.accumulation > 1
    o["grads"] = partition * parts * i.accum_bytes if i.stage < 2 or parts == 1 else partition * i.accum_bytes * held
    o["grads"] += _head_grad(model, i)  # autograd's, before the reducer takes it
    o["master"] = 0 if parts == 1 and i.compute_bytes == 4 else partition * 4  # an fp32 model is its own master
    o["optimizer_state"] = _state_tensors(i) * partition * 4
    o["activations"], freed_mapped = _backward_peak(model, i)
    phases = _after_phases(numels, buckets, 0 if held else partition, i)
    if i.trim_heap:  # the trimmed heap went back to the OS too: a buffer of any size reuses what backward freed
        o["buckets"] = max(max(0, sum(sizes) - o["activations"]) for sizes in phases)
    else:
        o["buckets"] = max(_after_peak(sizes, o["activations"] - freed_mapped, freed_mapped) for sizes in phases)
    o["framework"] = FRAMEWORK_BYTES
    host = ("master", "optimizer_state") if i.offload_optimizer else ()
    return MemoryPlan(i, model.name, model.num_params, o, host_owners=host + (("params",) if i.offload_param else ()))
