"""Which implementation the layers with a native kernel run, chosen once when the model is built.

`Backend.TORCH` runs the plain-torch references (the oracle every kernel is tested against); `Backend.CPU` the
C++ kernels of `rill.kernels.cpu`; `Backend.CUDA` the CUDA kernels of `rill.kernels`. The runner picks one for
the model (`--attention-backend`), then `use_backend` hands it to every `KernelLayer`; a layer never asks at
call time which to use. A layer whose configuration a backend cannot run (for example a sliding window with
the CUDA kernels) says so in `backend_unsupported`, and the runner then keeps the whole model on the torch
references (or refuses, when that backend was asked for by name).
"""

from __future__ import annotations

import enum

from torch import nn


class Backend(enum.Enum):
    TORCH = "torch"
    CPU = "cpu"
    CUDA = "cuda"


class KernelLayer(nn.Module):
    """A layer with a native kernel besides its torch reference. `backend` is TORCH until `use_backend`."""

    backend: Backend = Backend.TORCH

    def set_backend(self, backend: Backend) -> None:
        """Runs `backend` from now on; a layer may lay out its loaded weights for it here (once)."""
        self.backend = backend

    def backend_unsupported(self, backend: Backend) -> str | None:
        """Why this layer cannot run `backend` (None: it can)."""
        return None


def unsupported_reasons(model: nn.Module, backend: Backend) -> list[str]:
    """Why some kernel layer of `model` cannot run `backend`, one line per distinct reason (empty: it can)."""
    reasons = {m.backend_unsupported(backend) for m in model.modules() if isinstance(m, KernelLayer)}
    return sorted(reason for reason in reasons if reason)


def use_backend(model: nn.Module, backend: Backend) -> None:
    """Sets the backend of every kernel layer of `model`, once its weights are loaded: children before their
    parents, so a parent can build on what its children prepared (a decoder stack on their packed weights)."""
    for module in reversed(list(model.modules())):
        if isinstance(module, KernelLayer):
            module.set_backend(backend)
