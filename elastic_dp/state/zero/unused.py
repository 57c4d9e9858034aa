"""Parameters without a gradient in a step, under ZeRO: each parameter's own step count in
the flat chunks (docs/zero.md, parameters without a gradient).

Plain PyTorch leaves a parameter that no sample of a step used with a ``None`` gradient,
and its optimizer skips it: the value and the state stay, and the parameter's own step
count does not advance (a Mixture-of-Experts' expert that no token chose). ZeRO keeps a
bucket's optimizer state as one flat chunk per rank with one 0-dim state (the step count),
so it keeps, per parameter, how many updates it had (``OwnSteps``: the same on every rank,
since the vote says which parameters some rank used), and a chunk whose parameters are not
all used and in step is updated piece by piece (``step_pieces``): each used parameter's
part of the chunk is an optimizer parameter of its own, with views of the chunk's state
and the 0-dim state of its own count (``Clock``); the unused parts are left alone. A
parameter never updated has no state: its first update initialises it as torch's
optimizer does. A chunk's 0-dim state is always that of its bucket's highest count
(``bucket_step``), the same on every rank, so a re-cut takes it from any chunk.
"""

from __future__ import annotations

import inspect

import torch


def make_optimizer(base: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of ``base``'s class and defaults over ``groups``."""
    accepted = inspect.signature(type(base)).parameters  # defaults may hold more (AdamW)
    return type(base)(groups, **{k: v for k, v in base.defaults.items() if k in accepted})


class Clock:
    """The 0-dim optimizer state (a step count; NAdam's ``mu_product`` too) of a parameter
    after ``s`` updates, for one param group: what a one-element parameter stepped ``s``
    times holds (it depends on the count and the group's settings, not on the gradients)."""

    def __init__(self, base: torch.optim.Optimizer, group: dict, device: torch.device) -> None:
        self._param = torch.nn.Parameter(torch.zeros(1, device=device))
        self._optimizer = make_optimizer(base, [{**{k: v for k, v in group.items() if k != "params"},
                                                 "params": [self._param]}])
        self._at: list[dict[str, torch.Tensor]] = [{}]
        self._tensors: dict[str, torch.Tensor] = {}  # the state's tensors after one update (their keys, dtypes)

    def at(self, s: int) -> dict[str, torch.Tensor]:
        """The 0-dim state after ``s`` updates (copies; empty at 0 and for an optimizer without any)."""
        while len(self._at) <= s:
            self._param.grad = torch.ones_like(self._param)
            self._optimizer.step()
            state = self._optimizer.state[self._param]
            if not self._tensors:
                self._tensors = {k: v.detach().clone() for k, v in state.items()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0}
            self._at.append({k: v.detach().clone() for k, v in state.items()
                             if isinstance(v, torch.Tensor) and v.dim() == 0})
        return {k: v.clone() for k, v in self._at[s].items()}

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """The state's tensors after one update, as examples of their keys and dtypes."""
        self.at(1)
        return self._tensors


class OwnSteps:
    """Each stepped parameter's count of updates, in the order of ``names`` (replicated:
    every rank applies the same votes), and the counts at the steps a chunk is kept of."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.counts = [0] * len(names)
        self._at: dict[int, list[int]] = {}

    def of(self, step: int, live_step: int) -> dict[str, int]:
        """The counts at ``step``, by parameter name (kept, or the live ones)."""
        if step in self._at:
            return dict(zip(self.names, self._at[step]))
        if step != live_step:
            raise ValueError(f"no step counts kept for step {step}")
        return dict(zip(self.names, self.counts))

    def keep(self, step: int, steps: set[int]) -> None:
        """Keep the counts of committed step ``step``; forget those not in ``steps``."""
        self._at[step] = list(self.counts)
        self._at = {s: c for s, c in self._at.items() if s in steps}

    def reset(self, step: int, counts: dict[str, int] | None) -> None:
        """The counts become ``counts`` (a chunk's, by name; None: none updated yet), those of ``step``."""
        self.counts = [0 if counts is None else counts.get(n, 0) for n in self.names]
        self._at = {step: list(self.counts)}


def bucket_step(counts: list[int], members: list[int]) -> int:
    """The highest count among a bucket's parameters (``members``: their indices in ``counts``)."""
    return max((counts[i] for i in members), default=0)


@torch.no_grad()
def step_pieces(base: torch.optim.Optimizer, group: dict, clock: Clock, state: dict, master: torch.Tensor,
                grad: torch.Tensor, pieces: list[tuple[int, int, int]], after: int) -> None:
    """Update the used pieces of a master chunk: ``pieces`` are (own count, start, end) in
    the chunk, each stepped as a parameter of its own (``state``: the chunk's optimizer
    state, changed in place through views; a piece with count 0 starts fresh and its new
    state is copied in). Afterwards the chunk's 0-dim state is ``clock.at(after)``, its
    bucket's highest count (``state`` is created with zeros when the chunk had none)."""
    params, fresh = [], []
    views: dict[torch.Tensor, dict] = {}
    for count, a, e in pieces:
        piece = torch.nn.Parameter(master.detach()[a:e])  # shares the chunk's storage
        piece.grad = grad[a:e]
        params.append(piece)
        if count > 0:
            views[piece] = {**{k: v[a:e] for k, v in state.items() if v.dim() > 0}, **clock.at(count)}
        else:
            fresh.append((piece, a, e))
    if params:
        optimizer = make_optimizer(base, [{**{k: v for k, v in group.items() if k != "params"}, "params": params}])
        for piece, values in views.items():
            optimizer.state[piece] = values
        optimizer.step()
        for piece, a, e in fresh:
            for k, v in optimizer.state[piece].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if k not in state:
                        state[k] = torch.zeros(master.numel(), dtype=v.dtype, device=v.device)
                    state[k][a:e] = v
    if after > 0:
        state.update(clock.at(after))
        for k, v in clock.tensor_state().items():  # a chunk none of whose pieces was ever used
            if k not in state:
                state[k] = torch.zeros(master.numel(), dtype=v.dtype, device=master.device)
