"""How an atomic model trains, beyond the optimizer: what fairchem users expect of a trainer.

* **Learning-rate schedule** (``lr_at``): per optimizer step, a linear warmup to the model's lr
  over ``schedule.warmup_epochs``, then a cosine decay to ``schedule.min_lr_factor`` × lr at the
  last step (``decay: none`` keeps lr). A pure function of the global step: a resumed run
  recomputes it, nothing to checkpoint.
* **Gradient-norm clipping** (``clip_grad_norm``): the global 2-norm of the gradients after their
  reduction over the graph and data-parallel groups (every rank clips the same gradients).
* **An exponential moving average of the weights** (``EMA``): ``θ̄ ← d·θ̄ + (1 − d)·θ`` after every
  step, with ``d = min(ema_decay, (1 + n)/(10 + n))`` at update n (a young average follows the
  weights). Evaluation and the finished model use θ̄; training continues on θ.
* **A divergence guard** (``Guard``): a non-finite loss, a loss above ``guard.loss_factor`` × its
  best for ``guard.patience`` epochs in a row, or a force cosine (val; train without a val split)
  below ``guard.min_force_cos`` at an evaluation after the warmup *where the loss has stopped
  falling* (no new best this epoch) stops the run with one line (``Diverged``); the trainer's failure
  path marks the MLflow run FAILED and exits non-zero, and no finished model or run record is
  written. A young model's forces can point the wrong way while its loss (energy term first) falls
  fast: a GemNet-T at lr 1e-3 had val cosine −0.36 with its loss falling 756 → 9.5 in 5 epochs, the
  single-process run alike (issue #37); the floor judges a run that no longer improves.

The EMA's average and the guard's record are part of the engine's state (resumable checkpoints):
a run killed and resumed trains bit for bit as one that never stopped.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from ..io import GnnPipeError


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
    """An exponential moving average of a module's parameters (its buffers are the module's own)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay, self.updates = decay, 0
        self.names = [n for n, _ in model.named_parameters()]
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for s, p in zip(self.shadow, model.parameters()):
            s.mul_(d).add_(p.detach(), alpha=1 - d)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module):
        """The module computes with the average inside (the weights as trained before no update)."""
        if not self.updates:  # nothing averaged yet (a loaded model: evaluate): the weights as they are
            yield
            return
        params = list(model.parameters())
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, s in zip(params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)

    def model_state(self, model: torch.nn.Module) -> dict:
        """The module's state dict with the averaged parameters (what the finished model holds)."""
        state = dict(model.state_dict())
        if self.updates:
            state.update(zip(self.names, (s.clone() for s in self.shadow)))
        return state

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        for s, n in zip(self.shadow, self.names):
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
