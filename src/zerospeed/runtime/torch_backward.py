"""PyTorch-style training through the engine (DeepSpeed master's 2026 training API).

* ``loss.backward()`` directly on what the engine returned, in place of ``engine.backward(loss)``. The
  engine's forward puts a gradient hook on each output tensor that requires grad. The first one to fire in a
  backward opens the engine's micro-step (as ``engine.backward`` does: the lockstep check, the reducer told
  whether this micro-step communicates, the engine's comms logger recording) and queues the closing
  callback at the end of autograd's graph task (the reducer's ``end_micro_step``, the counters). Each hook
  multiplies its output's gradient by ``loss_scale / gradient_accumulation_steps``: the factor
  ``engine.backward`` puts on the loss, one link later in the chain rule, so every parameter gets the same
  gradient. In a backward pass some engine already owns (its ``engine.backward``, or a direct pass another
  engine opened first: the GAN pattern, a generator's loss through the discriminator) the hooks step aside,
  so those gradients stay in ``p.grad`` as before; under ``torch.func`` transforms too (as in DeepSpeed: the
  transform computes gradients functionally, outside the engine's reduction).
* A backward the engine did not see: ``loss.backward()`` on what ``engine.module(...)`` returned (the engine's
  forward, and so its output hooks, bypassed), e.g. one loss summed over several engines' modules (DeepSpeed's
  shared-loss pattern). Stages 0-2 leave its gradients in ``p.grad``; ``engine._backward_epilogue()``
  (DeepSpeed's name) then takes them as one micro-step, times the factor ``engine.backward`` puts on the loss.
  Stage 3 cannot keep a full gradient beside a partitioned weight: when no engine owns the pass, the first
  gradient to reach the engine's parameters opens its micro-step there (each engine whose parameters the pass
  reaches opens its own), each gradient is taken times that factor, and the micro-step closes at the end of
  autograd's graph task; ``_backward_epilogue()`` then finds nothing left.
* ``coalesce_grad_reduction()``: several backward calls, one reduction. The reducer's store holds the
  gradients locally (stages 2-3: a full-size buffer for the time being) and the block's exit reduces once.
* ``managed_gradient_accumulation: false``: the caller owns the boundary. Every backward accumulates
  (stages 0-1 locally; stages 2-3 reduce as they go, as at any non-boundary micro-step), and every
  ``step()`` is the boundary: it reduces what is held and applies the update.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any
import weakref

import torch

from .. import comm

# Autograd graph tasks (backward passes, by ``torch._C._current_graph_task_id``: the same on autograd's device
# threads) that an engine owns; every other engine's output hooks stand aside in them.
_ENGINE_TASKS: set[int] = set()


def _functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jvp...) is running."""
    return bool(torch._C._functorch.peek_interpreter_stack() is not None)


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(out):
        yield out
    elif isinstance(out, Mapping):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)


class TorchBackward:
    """The engine's side of ``loss.backward()``, ``coalesce_grad_reduction`` and unmanaged accumulation."""

    def __init__(self, engine: Any, managed: bool) -> None:
        self.engine = engine
        self.managed = managed  # managed_gradient_accumulation (DeepSpeed's default: true)
        self.open = False  # a direct backward's micro-step is open (closed by the queued callback)
        self.task = -1  # its graph task
        self.coalescing = False
        self.backwards = 0  # backward calls since the last step() (unmanaged: the samples counted)
        self._recording: Any = None
        self.adopted = False  # the open micro-step is a backward no engine owns (stage 3, see the docstring)
        reducer = None if engine.optimizer is None else engine.optimizer.reducer
        if reducer is not None and not reducer.parts.keeps_foreign_grads:
            # weakly: the reducer lives as long as the parameters' hooks, which the garbage collector cannot see
            # through, so a strong reference back to the engine would keep every engine (and its swap files) alive
            me, comms = weakref.ref(self), engine.comms
            reducer.adopter = lambda: (tb := me()) is not None and tb._adopt()
            reducer.scope = lambda: comm.recording(comms)

    # --- one micro-step (engine.backward, or loss.backward() on the outputs) ------------------------
    def loss_factor(self, scale_wrt_gas: bool = True) -> float:
        """What a backward multiplies the loss by: the fp16 loss scale over the accumulation steps."""
        eng = self.engine
        return eng.optimizer.loss_scaler.loss_scale / (eng.gradient_accumulation_steps() if scale_wrt_gas else 1)

    def begin(self, loss: torch.Tensor | None) -> None:
        eng = self.engine
        eng.observer.backward_start(loss)
        eng.lockstep.check(eng.dp_group)
        boundary = eng.is_gradient_accumulation_boundary() and not eng._inside_no_sync
        eng.optimizer.reducer.begin_micro_step(self.communicates(boundary))
        if eng.heap_trimmer is not None:  # host: the forward's freed heap leaves the peak (host_malloc.py)
            eng.heap_trimmer.trim()

    def end(self) -> None:
        eng = self.engine
        eng.optimizer.reducer.end_micro_step()
        eng.backwards_in_window += 1
        self.backwards += 1
        eng._accumulating = True
        eng.observer.backward_end()

    # --- loss.backward() -------------------------------------------------------------------------
    def watch(self, out: Any) -> Any:
        """Hook the forward's outputs (returned unchanged)."""
        if self.open:  # the last direct backward raised before its end: the engine's forward abandons the step
            self.open = False
            _ENGINE_TASKS.discard(self.task)
            self._stop_recording()
            raise RuntimeError("the previous loss.backward() through this engine raised before it ended: its step "
                               "is abandoned on every rank; continue with the next batch")
        if self.engine.optimizer is None or not torch.is_grad_enabled() or _functorch_active():
            return out
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)
        return out

    @contextmanager
    def engine_pass(self, root: torch.Tensor) -> Iterator[None]:
        """Around ``engine.backward``'s ``root.backward()``: the pass is this engine's (hooks stand aside)."""
        tasks: list[int] = []

        def own(grad: torch.Tensor) -> torch.Tensor:
            tasks.append(torch._C._current_graph_task_id())
            _ENGINE_TASKS.add(tasks[-1])
            return grad

        handle = root.register_hook(own) if root.requires_grad else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            _ENGINE_TASKS.difference_update(tasks)

    def _on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if not (self.open and task == self.task) and (task in _ENGINE_TASKS or _functorch_active()):
            return grad
        if not self.open:
            self.open, self.task = True, task
            _ENGINE_TASKS.add(task)
            self._recording = comm.recording(self.engine.comms)
            self._recording.__enter__()
            try:
                self.begin(None)
            except Exception as exc:
                self._fail(exc)
                raise
            torch.autograd.Variable._execution_engine.queue_callback(self._close)
        factor = self.loss_factor()
        return grad * factor if factor != 1.0 else grad

    def _close(self) -> None:
        self.open = False
        if not self.adopted:  # an adopted pass is no engine's: its task was never entered
            _ENGINE_TASKS.discard(self.task)
        try:
            with comm.recording(self.engine.comms) if self.adopted else nullcontext():
                self.end()
        except Exception as exc:
            self._fail(exc)
            raise
        finally:
            self._stop_recording()
            self._end_adoption()

    def _fail(self, exc: Exception) -> None:
        self.open = False
        if not self.adopted:
            _ENGINE_TASKS.discard(self.task)
        self._stop_recording()
        self._end_adoption()
        self.engine._abandon_step("backward", exc)

    # --- a backward the engine did not see ---------------------------------------------------------
    def _adopt(self) -> bool:
        """The reducer's adopter (stage 3): a gradient arrived outside a micro-step. In a backward no engine
        owns, open this engine's micro-step (closed at the end of the graph task) and say so."""
        if _ENGINE_TASKS or self.open or _functorch_active():
            return False  # another engine's pass (the GAN pattern): the reducer refuses the gradient
        self.open, self.task, self.adopted = True, torch._C._current_graph_task_id(), True
        try:
            with comm.recording(self.engine.comms):
                self.begin(None)
        except Exception as exc:
            self._fail(exc)
            raise
        self.engine.optimizer.reducer.grad_scale = self.loss_factor()
        torch.autograd.Variable._execution_engine.queue_callback(self._close)
        return True

    def _end_adoption(self) -> None:
        if self.adopted:
            self.adopted = False
            self.engine.optimizer.reducer.grad_scale = 1.0

    def take_left_grads(self) -> None:
        """``engine._backward_epilogue()``: the gradients a backward the engine did not see left in ``p.grad``
        (stages 0-2), taken as one micro-step, each times the loss factor (nothing left: nothing done)."""
        eng = self.engine
        if eng.optimizer is None:
            raise RuntimeError("engine._backward_epilogue() needs an optimizer")
        reducer = eng.optimizer.reducer
        if self.open or reducer.active:
            raise RuntimeError("engine._backward_epilogue() inside a backward pass: call it after loss.backward()")
        left = [p for p in reversed(list(reducer.where)) if p.grad is not None]
        if not left:
            return
        with eng._guarded("backward"):
            self.begin(None)
            reducer.grad_scale = self.loss_factor()
            try:
                for p in left:
                    reducer.take_p_grad(p)
            finally:
                reducer.grad_scale = 1.0
            self.end()

    def _stop_recording(self) -> None:
        if self._recording is not None:
            rec, self._recording = self._recording, None
            rec.__exit__(None, None, None)

    # --- the boundary ----------------------------------------------------------------------------
    def communicates(self, boundary: bool) -> bool:
        """Whether a backward now reduces (``boundary``: the engine's counter says the window ends)."""
        return boundary and self.managed and not self.coalescing

    def check_step(self) -> None:
        """Before ``step()`` (a usage error, raised before the step starts)."""
        if self.coalescing:
            raise RuntimeError("engine.step() inside coalesce_grad_reduction(): leave the block first (its exit "
                               "reduces the gradients of the backward calls inside)")

    def before_step(self) -> None:
        """``step()`` on the caller's boundary (unmanaged): reduce what the store holds."""
        if not self.managed and self.engine.optimizer is not None:
            self.engine.optimizer.reducer.flush()

    def samples(self, train_batch: int, gas: int) -> int:
        """Samples of the step that ends now: the batch, or (unmanaged) the micro-batches actually run."""
        n, self.backwards = self.backwards, 0
        return train_batch if self.managed else train_batch // gas * n

    @contextmanager
    def coalesce(self) -> Iterator[None]:
        eng = self.engine
        if eng.optimizer is None:
            raise RuntimeError("coalesce_grad_reduction() needs an optimizer")
        if not self.managed:
            raise RuntimeError("coalesce_grad_reduction() is not supported with managed_gradient_accumulation: "
                               "false (the caller already owns the accumulation boundary through step())")
        if self.coalescing or eng._inside_no_sync:
            raise RuntimeError("coalesce_grad_reduction() cannot be nested, nor used inside no_sync()")
        reducer = eng.optimizer.reducer
        reducer.store.hold()
        self.coalescing = True
        try:
            yield
        except BaseException:
            self.coalescing = False
            reducer.store.release()
            raise
        self.coalescing = False
        with eng._guarded("backward"):
            reducer.flush()
