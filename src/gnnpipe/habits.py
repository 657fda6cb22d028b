"""How every engine trains beyond the optimizer: what fairchem users expect of a trainer.

Each engine (node: ``parallel.single``, ``parallel.layout_engine``; atomic: ``atomic.atomic_engine``) builds one
:class:`Habits` from its config section (a node run's ``training:``, an atomic model's
``models.<name>.<kind>``: the same keys, the same meaning) and attaches it to its optimizer through
the ``engine.Engine`` protocol's step hooks (``register_step_pre_hook``, ``register_step_post_hook``),
so the engine's own loop holds no habit:

* **Learning-rate schedule** (``lr_at``): per optimizer step, a linear warmup to the run's lr over
  ``schedule.warmup_epochs``, then a cosine decay to ``schedule.min_lr_factor`` × lr at the last step
  (``decay: none`` keeps lr). A pure function of the global step (``begin_epoch`` sets it at
  ``epoch × steps_per_epoch``: an atomic run steps once a batch, a node run once an epoch): a
  resumed run recomputes it, nothing to checkpoint. Set before the step (the pre-step hook).
* **Gradient-norm clipping** (``clip_grad_norm``): the global 2-norm of the gradients after their
  reduction over the graph and data-parallel groups (every rank clips the same gradients); where
  the ranks hold different parameters (the stages of a pipeline) the engine gives the norm over all
  of them (``global_norm``), so the clip is the single process's. In the pre-step hook.
* **An exponential moving average of the weights** (``EMA``): ``θ̄ ← d·θ̄ + (1 − d)·θ`` after every
  step (the post-step hook), with ``d = min(ema_decay, (1 + n)/(10 + n))`` at update n (a young
  average follows the weights), over the parameters this rank holds. Evaluation and the finished
  model use θ̄ (``averaged``, ``final_state``); training continues on θ.
* **A divergence guard** (``Guard``, the task's per-epoch check): a non-finite loss, a loss above
  ``guard.loss_factor`` × its best for ``guard.patience`` epochs in a row, or (atomic runs) a force
  cosine (val; train without a val split) below ``guard.min_force_cos`` at an evaluation after the
  warmup *where the loss has stopped falling* (no new best this epoch) stops the run with one line
  (``Diverged``); the trainer's failure path marks the MLflow run FAILED and exits non-zero, and no
  finished model or run record is written. A young model's forces can point the wrong way while its
  loss (energy term first) falls fast: a GemNet-T at lr 1e-3 had val cosine −0.36 with its loss
  falling 756 → 9.5 in 5 epochs, the single-process run alike (issue #37); the floor judges a run
  that no longer improves.

The defaults differ by kind of run: an atomic section has them all on (warmup 2 epochs, cosine to
0.02, clip 10, EMA 0.99, guard 3× for 3 epochs); a node run has them all off, and then its engine
trains bit for bit as without them. The EMA's average and the guard's record are part of the
engine's state (resumable checkpoints): a run killed and resumed trains bit for bit as one that
never stopped.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
from torch import Tensor

from .io import GnnPipeError


class Diverged(GnnPipeError):
    """The divergence guard stopped the run (one line: what, when, and what to change)."""


def lr_at(step: int, total_steps: int, lr: float, warmup_steps: int, decay: str, min_lr_factor: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if decay == "none":
        return lr
    progress = (step - warmup_steps) / max(total_steps - warmup_steps - 1, 1)  # 0 .. 1 at the last step
    low = lr * min_lr_factor
    return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class EMA:
    """An exponential moving average of parameters (name -> parameter: a module's, or a stage's share)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        self.decay, self.params = decay, params
        self.restart()

    def restart(self) -> None:
        """The average starts at the weights as they are (a resume state without one)."""
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for n, p in self.params.items():
            self.shadow[n].mul_(d).add_(p.detach(), alpha=1 - d)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self):
        """The parameters hold the average inside (the weights as trained before no update)."""
        if not self.updates:  # nothing averaged yet (a loaded model: evaluate): the weights as they are
            yield
            return
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    def model_state(self, state: dict) -> dict:
        """``state`` (a state dict under the parameters' names) with the averaged parameters."""
        state = dict(state)
        if self.updates:
            state.update((n, s.clone()) for n, s in self.shadow.items())
        return state

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        for n, s in self.shadow.items():
            s.copy_(state["shadow"][n])


class Guard:
    """Stops a diverging run (module docstring); ``check`` once per epoch with its record row."""

    def __init__(self, loss_factor: Optional[float], patience: int, min_force_cos: Optional[float],
                 after_epoch: int, hint: str):
        self.loss_factor, self.patience, self.min_force_cos = loss_factor, patience, min_force_cos
        self.after_epoch, self.hint = after_epoch, hint
        self.best, self.best_epoch, self.above = math.inf, -1, 0

    def check(self, epoch: int, row: dict, where: str) -> None:
        loss = row["loss"]
        if not math.isfinite(loss):
            raise Diverged(f"{where}: training diverged: non-finite loss ({loss}); {self.hint}")
        falling = loss < self.best  # a new best: the loss still falls
        if falling:
            self.best, self.best_epoch = loss, epoch
        self.above = self.above + 1 if self.loss_factor is not None and loss > self.loss_factor * self.best else 0
        if self.loss_factor is not None and self.above >= self.patience:
            raise Diverged(f"{where}: training diverged: loss {loss:.4g} above {self.loss_factor:g}x its best "
                           f"{self.best:.4g} (epoch {self.best_epoch}) for {self.above} epochs; {self.hint}")
        cos = row.get("val_force_cos")
        cos, split = (cos, "val") if cos is not None else (row.get("train_force_cos"), "train")
        if self.min_force_cos is not None and cos is not None and epoch >= self.after_epoch \
                and cos < self.min_force_cos and not falling:
            raise Diverged(f"{where}: training diverged: {split} force cosine {cos:.3f} below the floor "
                           f"{self.min_force_cos:g} after the warmup, and the loss {loss:.4g} no longer falls "
                           f"(best {self.best:.4g} at epoch {self.best_epoch}); {self.hint}")

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "above": self.above}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch, self.above = float(state["best"]), int(state["best_epoch"]), int(state["above"])


class Habits:
    """One run's habits on its engine's optimizer (module docstring). ``section``: the config section that
    holds the keys (``schedule``, ``clip_grad_norm``, ``ema_decay``, ``guard``); ``params``: the parameters
    this rank holds, by name; ``global_norm``: the local gradient norm -> the norm over every rank's
    parameters, where ranks hold different ones (None: the local norm is the whole model's)."""

    def __init__(self, section, *, lr: float, steps_per_epoch: int, epochs: int,
                 params: dict[str, torch.nn.Parameter], hint: str,
                 global_norm: Optional[Callable[[Tensor], Tensor]] = None):
        sched, guard = section.schedule, section.guard
        self.lr, self.decay, self.min_lr_factor = lr, sched.decay, sched.min_lr_factor
        self.steps_per_epoch, self.total_steps = steps_per_epoch, epochs * steps_per_epoch
        self.warmup_steps = round(sched.warmup_epochs * steps_per_epoch)
        self.clip, self.global_norm = section.clip_grad_norm, global_norm
        self.ema = EMA(params, section.ema_decay) if section.ema_decay is not None else None
        self.guard = Guard(guard.loss_factor, guard.patience, getattr(guard, "min_force_cos", None),
                           after_epoch=math.ceil(sched.warmup_epochs), hint=hint)
        self.step = 0  # the global optimizer step about to be taken

    def attach(self, engine) -> "Habits":
        """Drive the habits from ``engine``'s optimizer steps (``engine.Engine``'s step hooks)."""
        engine.register_step_pre_hook(self._before_step)
        engine.register_step_post_hook(self._after_step)
        return self

    def begin_epoch(self, epoch: int) -> None:
        """The engine starts epoch ``epoch``: its first step is ``epoch × steps_per_epoch``."""
        self.step = epoch * self.steps_per_epoch

    def _before_step(self, opt, args, kwargs) -> None:
        if self.warmup_steps or self.decay != "none":
            lr = lr_at(self.step, self.total_steps, self.lr, self.warmup_steps, self.decay, self.min_lr_factor)
            for group in opt.param_groups:
                group["lr"] = lr
        if self.clip is not None:  # torch.nn.utils.clip_grad_norm_, with the norm over every rank's share
            params = [p for group in opt.param_groups for p in group["params"]]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if self.global_norm is not None:
                norm = self.global_norm(norm)
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm)

    def _after_step(self, opt, args, kwargs) -> None:
        if self.ema is not None:
            self.ema.update()
        self.step += 1

    def averaged(self):
        """A context in which the parameters hold their moving average (where the run keeps one)."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    def final_state(self, state: dict) -> dict:
        """``state`` as the finished model holds it: the averaged parameters where the run keeps an average."""
        return self.ema.model_state(state) if self.ema is not None else state

    def check(self, epoch: int, row: dict, where: str) -> None:
        """The divergence guard on the epoch's record row (the task's per-epoch check)."""
        self.guard.check(epoch, row, where)

    def state_dict(self) -> dict:
        """What the engine's resume state holds of the habits (its keys ``guard`` and ``ema``)."""
        return {"guard": self.guard.state_dict(), **({"ema": self.ema.state_dict()} if self.ema is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """A resume state; one of a gnnpipe before the habits (no ``guard``, ``ema``) resumes with a fresh
        guard and the average started at the loaded weights."""
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        if self.ema is not None:
            if "ema" in state:
                self.ema.load_state_dict(state["ema"])
            else:
                self.ema.restart()
