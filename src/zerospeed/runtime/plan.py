"""The training plan: which stage, offload and parallelisms one ``initialize()`` builds, decided once.

``plan_training(config, facts)`` is pure: it reads the validated config and a few facts about the model and
the objects the caller passed (``ModelFacts``, gathered by ``runtime/facts.py``), refuses every combination
that is not supported, and returns a frozen ``TrainPlan``. The refusals are rows of one table (``RULES``):
a predicate over (plan, config, facts), the config key the error names, the error kind and its message,
checked by one loop in table order. A new incompatible combination is one new row; a new feature is one
new field of ``TrainPlan``. Unit-tested without processes (tests/unit/test_train_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, ZeroSpeedConfig
from ..config.errors import NotSupportedYetError


@dataclass(frozen=True)
class OptimizerFacts:
    """What the combination rules need to know about the optimizer (the client's, or the config's)."""

    client: bool  # passed to initialize() (else built from the 'optimizer' section)
    compresses: bool = False  # a 1-bit optimizer: averages compressed momentum itself (no ZeRO)
    orthogonalizes: bool = False  # Muon: orthogonalises whole matrices
    deepspeed_name: str = ""  # its name in DeepSpeed's messages
    cpu_kernel: bool = True  # a client optimizer the fast CPU step runs (Adam/AdamW/Adagrad)
    class_name: str = ""


@dataclass(frozen=True)
class ModelFacts:
    """Facts about the model and the objects given to ``initialize()``, read before anything is built."""

    pipelined: bool = False  # a PipelineModule (its own grid)
    moe: bool = False  # holds Mixture-of-Experts layers
    autoep_only: bool = False  # every MoE layer is an AutoEP one (an HF block's experts, parallel/expert/auto/)
    expert_tp: bool = False  # an MoE layer splits its experts over the model-parallel axis
    tensor_parallel: bool = False  # AutoTP requested (tensor_parallel section or tp_model_init)
    mpu: bool = False  # an mpu was passed
    mpu_model_parallel: int = 1  # the mpu's model-parallel world size
    mpu_sequence_parallel: int | None = None  # the mpu's sequence-parallel size (None: it has no such groups)
    slice_parallel: int = 1  # the grid's slice (tensor) axis, pipeline topology or mpu
    optimizer: OptimizerFacts | None = None
    client_scheduler: bool = False


@dataclass(frozen=True)
class TrainPlan:
    """The frozen decisions of one ``initialize()``: every builder reads these, never the combinations."""

    stage: int
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: bool
    pipelined: bool
    tensor_parallel: bool  # AutoTP
    tp_split: bool  # parameters cut over a model axis (AutoTP, or a pipeline topology with a 'model' axis)
    sequence_parallel: int  # 1: off
    sequence_from_mpu: bool
    moe: bool
    folding: bool  # AutoEP + AutoTP: the tensor group's ranks also serve as expert-parallel ranks
    compressing: bool  # a 1-bit optimizer
    topk: bool  # gradient_compression top-k
    zenflow: bool
    data_efficiency: bool  # curriculum / progressive layer drop / random-LTD
    has_optimizer: bool

    @property
    def sequence(self) -> bool:
        return self.sequence_parallel > 1 or self.sequence_from_mpu


Predicate = Callable[[TrainPlan, ZeroSpeedConfig, ModelFacts], bool]
Message = Callable[[TrainPlan, ZeroSpeedConfig, ModelFacts], str]


@dataclass(frozen=True)
class Rule:
    """One refused combination: when ``when`` holds, raise ``error(key, message)``."""

    when: Predicate
    key: str
    message: Message
    error: type[ConfigError] = NotSupportedYetError


def _const(text: str) -> Message:
    return lambda p, c, f: text


_NOT_YET = " is not supported yet by zerospeed"


def _master_rules(mode: str) -> tuple[Rule, Rule]:
    """16-bit master weights (``fp16``/``bf16`` ``..._master_weights_and_grads``): DeepSpeed's stage rule, and
    where zerospeed lacks them."""
    key = f"{mode}_master_weights_and_grads"

    def on(c: ZeroSpeedConfig) -> bool:
        return bool(getattr(getattr(c, mode), key))

    stage0 = Rule(lambda p, c, f: on(c) and p.stage == 0, f"{mode}.{key}",
                  _const("is only supported with ZeRO stage 1, 2 or 3 (as in DeepSpeed), got stage 0"), ConfigError)
    lacking = Rule(lambda p, c, f: on(c) and (p.stage == 3 or p.moe or p.zenflow or p.offload_optimizer == "nvme"
                                              or c.zero_optimization.offload_optimizer.ratio < 1.0), f"{mode}.{key}",
                   _const("16-bit master weights with ZeRO stage 3, MoE layers, ZenFlow, NVMe offload or partial "
                          "offload (ratio < 1)" + _NOT_YET + " (stages 1 and 2, with or without CPU offload, are)"))
    return stage0, lacking


_DC_OFFLOADS = ("offload_opt_states", "offload_parameters", "offload_activation")


def _dc_on(c: ZeroSpeedConfig, *keys: str) -> bool:
    return c.compile.deepcompile and any(getattr(c.compile, k) for k in keys)


def _deepcompile_offload_rules() -> tuple[Rule, ...]:
    """DeepCompile's offload passes (``runtime/deepcompile_offload.py``, ``zero/stage3/graph_offload.py``): ZeRO-3
    passes, one offload target per run, and optimizer states not under ZeRO-Offload too (DeepSpeed's rules)."""
    return (
        Rule(lambda p, c, f: _dc_on(c, *_DC_OFFLOADS) and p.stage != 3, "compile",
             lambda p, c, f: f"compile.{next(k for k in _DC_OFFLOADS if getattr(c.compile, k))} is a pass of "
                             f"DeepCompile's ZeRO-3 (as in DeepSpeed), got ZeRO stage {p.stage}: use stage 3 or "
                             "drop it", ConfigError),
        Rule(lambda p, c, f: _dc_on(c, "offload_opt_states") and p.offload_optimizer != "none",
             "compile.offload_opt_states",
             _const("compile.offload_opt_states cannot be combined with zero_optimization.offload_optimizer set to "
                    "cpu or nvme (as in DeepSpeed): both manage the same optimizer state. Enable one of them"),
             ConfigError),
        Rule(lambda p, c, f: _dc_on(c, "offload_activation") and _dc_on(c, "offload_parameters", "offload_opt_states"),
             "compile.offload_activation",
             _const("compile.offload_activation cannot be combined with offload_parameters or offload_opt_states "
                    "(as in DeepSpeed): choose one offloading target per run"), ConfigError),
        Rule(lambda p, c, f: c.compile.autoep_non_moe and c.compile.deepcompile, "compile.autoep_non_moe",
             _const("compile.autoep_non_moe uses plain torch.compile and cannot be combined with DeepCompile (as in "
                    "DeepSpeed)"), ConfigError),
        Rule(lambda p, c, f: c.compile.autoep_non_moe and (p.stage == 3 or p.offload_optimizer != "none"
                                                            or p.offload_param or p.pipelined or p.folding
                                                            or p.sequence), "compile.autoep_non_moe",
             _const("compile.autoep_non_moe with ZeRO stage 3, ZeRO offload, a pipeline, AutoEP + AutoTP folding or "
                    "sequence parallelism is not supported yet (by zerospeed, nor by DeepSpeed)")),
        Rule(lambda p, c, f: _dc_on(c, "offload_parameters") and _dc_on(c, "offload_opt_states"),
             "compile.offload_parameters",
             _const("compile.offload_parameters and offload_opt_states cannot be enabled together (as in DeepSpeed): "
                    "choose one offloading target per run"), ConfigError),
    )


RULES: tuple[Rule, ...] = (
    Rule(lambda p, c, f: f.mpu_sequence_parallel is not None and "sequence_parallel_size" in c.model_fields_set
         and c.sequence_parallel_size != f.mpu_sequence_parallel, "sequence_parallel_size",
         lambda p, c, f: f"{c.sequence_parallel_size} but the mpu passed to initialize() has a sequence group of "
                         f"{f.mpu_sequence_parallel}; make them equal", ConfigError),
    Rule(lambda p, c, f: p.sequence and f.pipelined, "sequence_parallel_size",
         _const("sequence parallelism with a PipelineModule" + _NOT_YET)),
    Rule(lambda p, c, f: p.sequence and not p.sequence_from_mpu and f.mpu, "sequence_parallel_size",
         _const("sequence_parallel_size with an mpu that has no sequence groups" + _NOT_YET)),
    Rule(lambda p, c, f: f.mpu and not f.pipelined and not p.sequence and f.mpu_model_parallel != 1
         and not f.expert_tp, "mpu",
         lambda p, c, f: f"model parallelism through mpu (model-parallel world size {f.mpu_model_parallel}) is not "
                         "supported yet by zerospeed; only data-parallel groups from an mpu are"),
    Rule(lambda p, c, f: p.tensor_parallel and p.stage == 3, "zero_optimization.stage",
         _const("tensor parallelism with ZeRO stage 3" + _NOT_YET + "; use stage 0, 1 or 2")),
    Rule(lambda p, c, f: p.tensor_parallel and f.mpu and not f.pipelined and not p.sequence, "tensor_parallel",
         _const("tensor parallelism with an mpu is not supported yet by zerospeed (a PipelineModule's topology with "
                "a 'model' axis is)")),
    Rule(lambda p, c, f: p.tensor_parallel and p.sequence, "sequence_parallel_size",
         _const("Ulysses sequence parallelism together with tensor parallelism" + _NOT_YET)),
    Rule(lambda p, c, f: p.pipelined and p.stage >= 2, "zero_optimization.stage",
         lambda p, c, f: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism "
                         f"(got stage {p.stage}); use stage 0 or 1", ConfigError),
    Rule(lambda p, c, f: p.moe and p.sequence, "sequence_parallel_size",
         _const("sequence parallelism with Mixture-of-Experts layers" + _NOT_YET)),
    Rule(lambda p, c, f: p.moe and p.tensor_parallel and not p.folding, "tensor_parallel",
         _const("AutoTP with DeepSpeed MoE layers is not supported yet by zerospeed (expert tensor parallelism "
                "through an mpu is, and AutoTP with AutoEP's expert_parallel section)")),
    Rule(lambda p, c, f: p.folding and c.use_data_before_expert_parallelism, "use_data_before_expert_parallelism",
         _const("AutoEP + AutoTP folding lays expert groups over consecutive ranks; use_data_before_expert_"
                "parallelism with it" + _NOT_YET)),
    Rule(lambda p, c, f: p.folding and (p.pipelined or p.offload_optimizer != "none" or p.offload_param),
         "tensor_parallel", _const("AutoEP + AutoTP folding with a pipeline or ZeRO offload" + _NOT_YET)),
    Rule(lambda p, c, f: c.fp8.allgather_fp8 and p.stage != 3, "fp8.allgather_fp8",
         lambda p, c, f: "the fp8 weight all-gather needs ZeRO stage 3 (weights partitioned and gathered), got "
                         f"stage {p.stage}", ConfigError),
    Rule(lambda p, c, f: c.fp8.allgather_fp8 and (c.zero_optimization.zero_quantized_weights
                                                  or c.zero_optimization.zero_quantized_nontrainable_weights),
         "fp8.allgather_fp8", _const("both fp8.allgather_fp8 and ZeRO++ zero_quantized_weights quantise the weight "
                                     "all-gather; keep one"), ConfigError),
    *_deepcompile_offload_rules(),
    Rule(lambda p, c, f: p.offload_optimizer != "none" and p.stage == 0, "zero_optimization.offload_optimizer",
         _const("offload needs ZeRO stage 1, 2 or 3"), ConfigError),
    Rule(lambda p, c, f: c.zero_optimization.mics_shard_size > 0 and f.optimizer is not None
         and (f.optimizer.orthogonalizes or "lamb" in f.optimizer.class_name.lower()), "zero_optimization.mics_shard_size",
         _const("MiCS with Lamb or Muon (per-parameter norms and whole matrices over the shard group)" + _NOT_YET)),
    Rule(lambda p, c, f: c.zero_optimization.pipeline_loading_checkpoint and p.stage != 3,
         "zero_optimization.pipeline_loading_checkpoint",
         lambda p, c, f: "the serial (relay) checkpoint load is only for ZeRO stage 3, as in DeepSpeed (which asserts "
                         f"when it loads); got stage {p.stage}", ConfigError),
    Rule(lambda p, c, f: c.zero_optimization.legacy_stage1 and p.stage != 1, "zero_optimization.legacy_stage1",
         lambda p, c, f: f"legacy_stage1 is DeepSpeed's old ZeRO stage 1: it needs stage 1, got stage {p.stage}",
         ConfigError),
    Rule(lambda p, c, f: f.optimizer is not None and f.optimizer.client and not f.optimizer.cpu_kernel
         and p.offload_optimizer != "none" and c.zero_force_ds_cpu_optimizer, "zero_force_ds_cpu_optimizer",
         lambda p, c, f: f"ZeRO-Offload with a client optimizer ({f.optimizer.class_name}) that has no fast CPU "
                         "kernel runs its own step() on the host, usually slowly. Use Adam, AdamW or Adagrad, set the "
                         "optimizer in the config, or set \"zero_force_ds_cpu_optimizer\": false to run it anyway "
                         "(as in DeepSpeed).", ConfigError),
    Rule(lambda p, c, f: f.optimizer is not None and f.optimizer.orthogonalizes and (p.moe or p.tp_split),
         "optimizer.type", _const("Muon with tensor parallelism or Mixture-of-Experts layers" + _NOT_YET)),
    Rule(lambda p, c, f: p.compressing and p.stage > 0, "zero_optimization.stage",
         lambda p, c, f: f"{f.optimizer.deepspeed_name} is not compatible with ZeRO (as in DeepSpeed; got stage "
                         f"{p.stage}): use stage 0", ConfigError),
    Rule(lambda p, c, f: p.topk and p.stage > 1 and p.has_optimizer, "gradient_compression",
         lambda p, c, f: f"top-k works with ZeRO stages 0 and 1, got stage {p.stage}", ConfigError),
    Rule(lambda p, c, f: f.optimizer is not None and f.optimizer.orthogonalizes and p.offload_optimizer == "nvme"
         and p.stage > 0, "zero_optimization.offload_optimizer.device",
         _const("Muon with the optimizer offloaded to NVMe is not supported yet by zerospeed (cpu offload is)")),
    Rule(lambda p, c, f: p.compressing and p.moe, "optimizer",
         lambda p, c, f: f"{f.optimizer.deepspeed_name} with Mixture-of-Experts layers" + _NOT_YET),
    Rule(lambda p, c, f: c.zero_optimization.offload_optimizer.super_offload and (p.stage != 3 or p.zenflow),
         "zero_optimization.offload_optimizer.super_offload",
         lambda p, c, f: "SuperOffload is DeepSpeed's stage-3 optimizer: it needs zero_optimization.stage 3 (got "
                         f"{p.stage}) and no zenflow section", ConfigError),
    Rule(lambda p, c, f: p.moe and p.stage == 3 and c.zero_optimization.zero_quantized_gradients,
         "zero_optimization.zero_quantized_gradients",
         _const("ZeRO++ qgZ with Mixture-of-Experts layers" + _NOT_YET + " (qgZ's node layout is the data-parallel "
                "group's, not an expert-data-parallel one)")),
    Rule(lambda p, c, f: c.gradient_allreduce_op == "sum" and (p.zenflow or p.compressing
                                                                or c.zero_optimization.zero_quantized_gradients),
         "gradient_allreduce_op", _const("gradient_allreduce_op: \"sum\" with ZenFlow, a 1-bit optimizer or ZeRO++ "
                                         "qgZ (they average by themselves)" + _NOT_YET)),
    Rule(lambda p, c, f: not c.managed_gradient_accumulation and p.pipelined, "managed_gradient_accumulation",
         _const("managed_gradient_accumulation: false with pipeline parallelism (as in DeepSpeed: the pipeline "
                "schedule owns the accumulation boundary)"), ConfigError),
    Rule(lambda p, c, f: p.zenflow and p.moe, "zero_optimization.zenflow",
         _const("ZenFlow with MoE expert parameters" + _NOT_YET)),
    Rule(lambda p, c, f: p.data_efficiency and p.pipelined, "curriculum_learning",
         _const("curriculum_learning, progressive_layer_drop and random-LTD with a PipelineModule" + _NOT_YET)),
    Rule(lambda p, c, f: c.fp16.fp16_master_weights_and_grads and p.offload_optimizer != "cpu",
         "fp16.fp16_master_weights_and_grads", _const("requires ZeRO-Offload of the optimizer to the CPU "
                                                      "(offload_optimizer.device: cpu), as in DeepSpeed"), ConfigError),
    Rule(lambda p, c, f: c.bf16.bf16_master_weights_and_grads and not c.bf16.bf16_optimizer_states
         and p.offload_optimizer != "cpu", "bf16.bf16_master_weights_and_grads",
         _const("keeps the optimizer state in fp32, so it requires ZeRO-Offload of the optimizer to the CPU "
                "(offload_optimizer.device: cpu), as in DeepSpeed; or set bf16.bf16_optimizer_states: true"),
         ConfigError),
    *_master_rules("fp16"),
    *_master_rules("bf16"),
    Rule(lambda p, c, f: c.torch_autocast.enabled and p.pipelined, "torch_autocast",
         _const("torch_autocast with a PipelineModule" + _NOT_YET + " (the engine's forward applies it)")),
    Rule(lambda p, c, f: not f.client_scheduler and c.scheduler is not None and not p.has_optimizer, "scheduler",
         _const("a scheduler needs an optimizer"), ConfigError),
    Rule(lambda p, c, f: (c.compression_training.any_enabled or c.quantize_training.enabled) and p.pipelined,
         "compression_training", _const("compression training (compression_training, quantize_training) with "
                                        "pipeline parallelism" + _NOT_YET)),
    Rule(lambda p, c, f: (c.eigenvalue.enabled or c.quantize_training.eigenvalue.enabled) and p.tensor_parallel,
         "eigenvalue", _const("MoQ's eigenvalues under tensor parallelism (a Hessian-vector product through the "
                              "tensor-parallel collectives)" + _NOT_YET)),
    Rule(lambda p, c, f: (c.eigenvalue.enabled or c.quantize_training.eigenvalue.enabled) and p.stage == 3,
         "eigenvalue", _const("MoQ's eigenvalues under ZeRO stage 3 (partitioned block parameters)" + _NOT_YET
                              + "; use stage 0, 1 or 2")),
)


def decide(config: ZeroSpeedConfig, facts: ModelFacts) -> TrainPlan:
    """The decisions alone (no refusal): what ``plan_training`` checks the rules against."""
    zc = config.zero_optimization
    from_mpu = facts.mpu_sequence_parallel is not None
    sp = facts.mpu_sequence_parallel if from_mpu else config.sequence_parallel_size
    de = config.data_efficiency.data_routing.random_ltd.enabled
    opt = facts.optimizer
    return TrainPlan(
        stage=config.zero_stage, offload_optimizer=zc.offload_optimizer.device if zc.offload_optimizer.enabled
        else "none", offload_param=zc.offload_param.enabled and config.zero_stage == 3, pipelined=facts.pipelined and sp == 1 and not from_mpu,
        tensor_parallel=facts.tensor_parallel, tp_split=facts.tensor_parallel or facts.slice_parallel > 1,
        sequence_parallel=sp or 1,
        sequence_from_mpu=from_mpu, moe=facts.moe,
        folding=facts.moe and facts.tensor_parallel and facts.autoep_only, compressing=opt is not None and opt.compresses,
        topk=config.gradient_compression.type == "topk",
        zenflow=zc.offload_optimizer.enabled and zc.zenflow is not None,
        data_efficiency=config.curriculum_learning.enabled or config.progressive_layer_drop.enabled or de,
        has_optimizer=opt is not None)


def plan_training(config: ZeroSpeedConfig, facts: ModelFacts) -> TrainPlan:
    """Decide, then refuse the first unsupported combination (table order) with its key and message."""
    plan = decide(config, facts)
    for rule in RULES:
        if rule.when(plan, config, facts):
            raise rule.error(rule.key, rule.message(plan, config, facts))
    return plan


def check_rules(plan: TrainPlan, config: ZeroSpeedConfig, facts: ModelFacts) -> list[tuple[str, str]]:
    """Every rule that refuses (key, message), for tools that list all problems at once (``zerospeed plan``)."""
    return [(r.key, r.message(plan, config, facts)) for r in RULES if r.when(plan, config, facts)]


def describe(plan: TrainPlan) -> dict[str, Any]:
    """The plan as a plain dict (engine state dump, logs)."""
    from dataclasses import asdict

    return asdict(plan)
