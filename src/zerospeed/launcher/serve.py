"""``zerospeed serve MODEL_DIR``: an OpenAI-compatible HTTP server (needs the ``serve`` extra).

MODEL_DIR is a Hugging Face causal-LM directory (GPT-2, Llama) or a zerospeed GPT saved with
``zerospeed.inference.model_dir.save_gpt_dir``. ``--config`` takes DeepSpeed-FastGen's engine config
(``state_manager`` limits, KV blocks, ``tensor_parallel``). Imports torch only when run.

Tensor parallelism (``--tp-size N`` or the config's ``tensor_parallel.tp_size``): run as is, the command forks
N-1 worker ranks on this machine (Gloo, a file rendezvous in a temporary directory); started N times by
``zerospeed launch`` / torchrun instead (``WORLD_SIZE`` = N), it uses those ranks. Every rank loads and
shards the model; rank 0 serves HTTP and the others run the engine's worker loop until the server stops.
``--quant int8|int4`` quantizes the (sharded) linear weights through ``init_inference``.
vLLM's flags (``--served-model-name``, ``--api-key``, ``--max-model-len``, ...) work as there: ``serve_flags``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from zerospeed.launcher.command import Command, UsageError
from zerospeed.launcher.serve_flags import add_vllm_arguments, apply_vllm_flags, check_unknown, kv_blocks_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (Hugging Face or zerospeed GPT)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", default=None, help="JSON file: FastGen engine config (state_manager, ...)")
    parser.add_argument("--kv-blocks", type=int, default=1024,
                        help="KV-cache blocks when the config gives no memory_config (default 1024)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--tp-size", "--tensor-parallel-size", "-tp", dest="tp_size", type=int, default=None,
                        help="tensor-parallel ranks (default: the config's tensor_parallel.tp_size, else 1)")
    parser.add_argument("--quant", "--quantization", "-q", dest="quant", default=None, choices=["int8", "int4"],
                        help="weight-only quantization of the linear layers (int8: symmetric, int4: asymmetric)")
    parser.add_argument("--q-groups", type=int, default=1, help="quantization groups per output row (default 1)")
    parser.add_argument("--enable-weight-updates", action="store_true",
                        help="open POST /v1/weights: a trainer may load new weights into the served model (RL)")
    add_vllm_arguments(parser)
    _refuse_unknown_flags(parser)


def _refuse_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Leftover arguments of this subcommand are an error with a did-you-mean (argparse alone has none)."""
    plain = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, extra = plain(args, namespace)
        try:
            check_unknown(parser, extra)
        except UsageError as exc:
            parser.error(str(exc))
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def engine_config(config_path: str | None, kv_blocks: int) -> dict[str, Any]:
    """The user's FastGen config, with ``memory_config`` defaulting to ``allocate`` ``kv_blocks`` blocks."""
    cfg: dict[str, Any] = json.loads(Path(config_path).read_text()) if config_path else {}
    sm = cfg.setdefault("state_manager", cfg.pop("manager", {}))
    sm.setdefault("memory_config", {"mode": "allocate", "size": kv_blocks})
    return cfg


def build_engine(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """``(loaded model, ServingEngine)`` on this rank (sharded / quantized as asked)."""
    from zerospeed.inference import ServingEngine, init_inference
    from zerospeed.inference.config import parse_dtype
    from zerospeed.inference.model_dir import load_model_dir

    dtype = parse_dtype(args.dtype)
    loaded = load_model_dir(args.model_dir, dtype)
    model: Any = loaded.model
    if args.chat_template is not None:
        _set_chat_template(loaded.tokenizer, args.chat_template)
    sm = cfg["state_manager"]
    if args.kv_cache_memory is not None:
        tp = int(cfg.get("tensor_parallel", {}).get("tp_size", 1))
        if tp > 1 and "." in args.kv_cache_memory and not args.kv_cache_memory[-1].isalpha():
            raise UsageError("--kv-cache-memory as a fraction with tensor parallelism is not supported yet "
                             "(ranks could size their caches differently); give bytes, e.g. 2GiB")
        size = kv_blocks_for(model, args.kv_cache_memory, int(sm.get("kv_block_size", 128)), dtype.itemsize, tp)
        sm["memory_config"] = {"mode": "allocate", "size": size}
    if args.quant:
        tp = cfg.get("tensor_parallel", {})
        weight = {"num_bits": 8 if args.quant == "int8" else 4, "q_groups": args.q_groups,
                  "q_type": "symmetric" if args.quant == "int8" else "asymmetric"}
        model = init_inference(model, dtype=dtype, quant={"weight": weight}, tensor_parallel=tp)
    engine = ServingEngine(model, cfg, decode=loaded.tokenizer.decode, eos_token_ids=loaded.eos_token_ids,
                           seed=args.seed, prefix_caching=args.enable_prefix_caching,
                           speculative=getattr(args, "speculative", None))
    return loaded, engine


def _set_chat_template(tok: Any, template: str) -> None:
    """``--chat-template``: a file's contents or the template text itself, on a Hugging Face tokenizer."""
    if not hasattr(tok, "apply_chat_template"):
        raise UsageError("--chat-template needs a model directory with a Hugging Face tokenizer")
    path = Path(template)
    tok.chat_template = path.read_text() if len(template) < 4096 and path.is_file() else template


def serve_app(make_app: Any, host: str, port: int, options: Any) -> int:
    """Run ``make_app(options)`` under uvicorn until stopped; 1 if the engine loop died, else 0."""
    import dataclasses

    import uvicorn

    died: list[BaseException] = []
    server: Any = None

    def on_fatal(exc: BaseException) -> None:
        died.append(exc)
        print(f"zerospeed serve: the engine loop died ({type(exc).__name__}: {exc}); stopping", file=sys.stderr,
              flush=True)
        server.should_exit = True

    app = make_app(dataclasses.replace(options, on_fatal=on_fatal))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=10))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on (uvicorn.run swallows it too)
        pass
    return 1 if died else 0


def _worker(rank: int, tp: int, store: str, args: argparse.Namespace, cfg: dict[str, Any]) -> None:
    """A forked tensor-parallel rank: join the group, shard, run rank 0's forwards until it stops."""
    from zerospeed import comm

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(tp), "LOCAL_RANK": str(rank)})
    comm.init_distributed(dist_backend="gloo", store=comm.file_store(store, tp), rank=rank, world_size=tp)
    build_engine(args, cfg)[1].run_worker()


def _fork_workers(tp: int, args: argparse.Namespace, cfg: dict[str, Any]) -> str:
    """Start ranks 1..tp-1 (forked, Gloo); the rendezvous file for rank 0. Any worker failing ends the server."""
    import multiprocessing as mp

    store = os.path.join(tempfile.mkdtemp(prefix="zs-serve-"), "store")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, tp, store, args, cfg), daemon=True) for r in range(1, tp)]
    for p in procs:
        p.start()

    def watch(p: Any) -> None:
        p.join()
        if p.exitcode != 0:
            print(f"zerospeed serve: tensor-parallel rank {procs.index(p) + 1} exited with {p.exitcode}; stopping",
                  file=sys.stderr, flush=True)
            os._exit(1)

    for p in procs:
        threading.Thread(target=watch, args=(p,), daemon=True).start()
    return store


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise UsageError("zerospeed serve needs the serve extra: pip install 'zerospeed[serve]'") from None
    from zerospeed.inference.server import ServeOptions, create_app

    cfg = apply_vllm_flags(args, engine_config(args.config, args.kv_blocks))
    tp_cfg = cfg.setdefault("tensor_parallel", cfg.pop("tp", {}))
    if args.tp_size is not None:
        tp_cfg["tp_size"] = args.tp_size
    tp = int(tp_cfg.get("tp_size", 1))
    if tp < 1:
        raise UsageError(f"--tp-size must be >= 1, got {tp}")
    if tp > 1:
        from zerospeed import comm

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by zerospeed launch / torchrun
            comm.init_distributed()
        else:
            store = _fork_workers(tp, args, cfg)
            comm.init_distributed(dist_backend="gloo", store=comm.file_store(store, tp), rank=0, world_size=tp)
    try:
        loaded, engine = build_engine(args, cfg)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if engine.tp_rank != 0:
        engine.run_worker()
        return 0
    names = tuple(args.served_model_name or ())
    options = ServeOptions(served_model_names=names, api_key=args.api_key or os.environ.get("ZEROSPEED_API_KEY"),
                           allow_weight_updates=args.enable_weight_updates)
    return serve_app(lambda opts: create_app(loaded, engine, opts), args.host, args.port, options)


COMMAND = Command(
    name="serve",
    help="serve a model over an OpenAI-compatible HTTP API",
    description="Serve MODEL_DIR with continuous batching over a paged KV cache: /v1/completions, "
    "/v1/chat/completions (SSE streaming), /v1/models, /health, /metrics.",
    add_arguments=add_arguments,
    run=run,
)
