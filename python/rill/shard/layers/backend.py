"""Which kernels the layers run, chosen once when the model is built.

A `KernelLayer` has a torch reference (the oracle every kernel is tested against) and holds `ops`, a
`rill.kernels.ops.KernelOps` or None: None runs the reference, ops run that device's kernels. The runner picks
the ops for the model (`--attention-backend`); `install_ops` hands them to every kernel layer, which keeps
them only where they provide its op (`accepts`). A layer whose configuration the ops cannot run at all (for
example a sliding window with the CUDA kernels) says so in `unsupported`, and the runner then keeps the whole
model on the torch references (or refuses, when those kernels were asked for by name). A layer branches two
ways: its ops, or its reference.
"""

from __future__ import annotations

from torch import nn

from rill.kernels.ops import KernelOps


class KernelLayer(nn.Module):
    """A layer with a native kernel besides its torch reference. `ops` is None until `install_ops`."""

    ops: KernelOps | None = None

    def accepts(self, ops: KernelOps) -> bool:
        """Whether `ops` provide what this layer would call (a layer with an optional op overrides this)."""
        return True

    def use_ops(self, ops: KernelOps | None) -> None:
        """Runs on `ops` from now on (None: the reference); a layer may lay out its loaded weights for them
        here, once."""
        self.ops = ops if ops is not None and self.accepts(ops) else None

    def unsupported(self, ops: KernelOps) -> str | None:
        """Why this layer cannot run on `ops` at all (None: it can)."""
        return None


def unsupported_reasons(model: nn.Module, ops: KernelOps) -> list[str]:
    """Why some kernel layer of `model` cannot run `ops`, one line per distinct reason (empty: it can)."""
    reasons = {m.unsupported(ops) for m in model.modules() if isinstance(m, KernelLayer)}
    return sorted(reason for reason in reasons if reason)


def install_ops(model: nn.Module, ops: KernelOps | None) -> None:
    """Sets the ops of every kernel layer of `model`, once its weights are loaded."""
    for module in model.modules():
        if isinstance(module, KernelLayer):
            module.use_ops(ops)
