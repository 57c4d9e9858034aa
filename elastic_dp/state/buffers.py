"""The model's buffers in the atomic step: BatchNorm's running statistics and any other
buffer a training forward changes in place (docs/design.md, atomic steps).

A step's forward writes them before its vote is known, so ``save`` copies them as the step
starts and ``restore`` puts them back when the step does not commit or commits as a no-op
(a non-finite loss): a discarded or re-run step leaves no trace in them. After a committed
step the replicas agree on them (``agree``): each rank's buffers, weighted by its share of
the global batch, travel as the ballot's payload (``comm.vote``) and every rank takes the
sample-weighted mean (integer buffers, such as ``num_batches_tracked``, rounded). The
payload is summed in float64, so buffers that are already equal on every rank (any buffer
the forward does not change, or BatchNorm's under ``--batch-stats global``) stay exactly
what they are. The buffers covered are the model's persistent ones (its state dict's)
of a floating-point or integer dtype.
"""

from __future__ import annotations

import torch


class ModelBuffers:
    """A model's persistent numeric buffers, saved at each step's start."""

    def __init__(self, model: torch.nn.Module) -> None:
        persistent = model.state_dict(keep_vars=True)
        self.names = [name for name, buffer in model.named_buffers()
                      if name in persistent and buffer.dtype != torch.bool and not buffer.is_complex()]
        self._model = model
        self._saved: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self.names)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers themselves (looked up each time: a loaded state replaces nothing, but
        a task may reassign a buffer)."""
        named = dict(self._model.named_buffers())
        return [named[n] for n in self.names]

    def copy(self) -> dict[str, torch.Tensor]:
        """The buffers, copied to the host."""
        return {n: b.detach().to("cpu", copy=True) for n, b in zip(self.names, self.tensors())}

    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Set the buffers from ``copy()``'s values."""
        with torch.no_grad():
            for name, buffer in zip(self.names, self.tensors()):
                buffer.copy_(values[name])

    def save(self) -> None:
        """Copy the buffers as a step starts (into the last step's copies: no allocation)."""
        tensors = self.tensors()
        if [t.shape for t in self._saved] != [t.shape for t in tensors]:
            self._saved = [torch.empty_like(t) for t in tensors]
        with torch.no_grad():
            for saved, t in zip(self._saved, tensors):
                saved.copy_(t)

    def restore(self) -> None:
        """Put back what ``save`` copied: the step leaves no trace in the buffers."""
        with torch.no_grad():
            for saved, t in zip(self._saved, self.tensors()):
                t.copy_(saved)

    def payload(self, weight: float) -> torch.Tensor:
        """This rank's buffers times ``weight`` (its share of the global batch), flat, in float64."""
        tensors = self.tensors()
        return torch.cat([t.detach().reshape(-1).double() for t in tensors]) * weight

    def agree(self, summed: torch.Tensor) -> None:
        """Take the sample-weighted mean the payloads summed to (integers rounded)."""
        offset = 0
        with torch.no_grad():
            for t in self.tensors():
                piece = summed[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
                t.copy_(piece if t.is_floating_point() else piece.round())


class BufferHistory:
    """A sharded strategy's buffers at the steps of its live chunk and its snapshots: a
    chunk exported at a step carries them (``ChunkState.buffers``), so that a re-cut,
    a rollback included, restores them with it."""

    def __init__(self, buffers: ModelBuffers) -> None:
        self.buffers = buffers
        self._at: dict[int, dict[str, torch.Tensor]] = {}

    def keep(self, step: int, steps: set[int]) -> None:
        """Keep the buffers of committed step ``step``; forget those not in ``steps``."""
        if self.buffers:
            self._at[step] = self.buffers.copy()
            self._at = {s: b for s, b in self._at.items() if s in steps}

    def of(self, step: int, live_step: int) -> dict[str, torch.Tensor] | None:
        """The buffers at ``step``: kept, or the model's own for the live chunk of a step
        that failed after its vote (agreed on, not yet kept)."""
        if not self.buffers:
            return None
        if step in self._at:
            return self._at[step]
        if step != live_step:
            raise ValueError(f"no buffers kept for step {step}")
        return self.buffers.copy()

    def current(self) -> dict[str, torch.Tensor] | None:
        return self.buffers.copy() if self.buffers else None

    def reset(self, step: int, values: dict[str, torch.Tensor] | None) -> None:
        """The model's buffers become ``values``, those of ``step`` (a chunk just imported)."""
        if values is not None:
            self.buffers.load(values)
            self._at = {step: values}
