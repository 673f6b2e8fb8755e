"""What the server tests share: a tiny GPT whose greedy text is not flat, an app run by uvicorn on
127.0.0.1 in a thread (one process, no interpreter spawn), and the one-process greedy reference."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from zerospeed.inference import init_inference
from zerospeed.models.gpt import GPT, GPTConfig


def tiny_gpt(seed: int = 5) -> GPT:
    """One layer, weights scaled up so greedy decoding picks varied tokens."""
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app: Any, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 in a daemon thread while the block runs; yields the base URL."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def greedy_text(loaded: Any, prompt: str, n: int) -> str:
    """``n`` greedy tokens after ``prompt`` from the inference engine in this process (the reference)."""
    eng = init_inference(loaded.model, dtype="fp32")
    ids = torch.tensor([list(prompt.encode())])
    return loaded.tokenizer.decode(eng.generate(ids, max_new_tokens=n)[0, ids.shape[1]:].tolist())
