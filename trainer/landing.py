"""Overlapped rounds' local copy: where it started, and when a committed average lands in it.

With ``outer.overlap`` delayed or eager, a worker's local copy trains the next round
while the round in flight is averaged. When that round commits, θ moves; the local
copy moves by the same amount (θ_new − origin) at an inner step, keeping the progress
it made, and θ becomes its new origin. ``outer.land_step`` = K fixes that step (the
K-th of the flight, waiting there for the commit if need be), which makes an overlapped
run reproducible step for step; 0 lands it at the first step after the commit.

``Landing`` is owned by ``trainer.diloco.DiLoCoWorker``: the worker says when a round
starts (``begin``), commits (``due``) or is dropped (``reset``); the worker's inner loop
asks ``gate`` before each step.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

# outer.land_step: how often a step waiting for the round in flight checks whether to stop.
LAND_POLL_SECONDS = 0.05


class Landing:
    def __init__(self, *, global_params: list[torch.Tensor], land_step: Callable[[], int], ranks,
                 lock: threading.Lock, local: Callable[[], list[torch.Tensor]], local_written: Callable[[], None]) -> None:
        """``local()``: the local copy's tensors θ pairs with; ``local_written()``: called after
        writing them (DDP replicas sync); ``lock``: the worker's, held while θ or the copy moves."""
        self.global_params = global_params
        self.land_step = land_step
        self.ranks = ranks
        self.lock = lock
        self.local = local
        self.local_written = local_written
        # Where the local copy started this round when that is not θ (overlapped rounds).
        self.origin: list[torch.Tensor] | None = None
        # A committed average waits to move the local copy (at its next step, or at land_step).
        self.rebase_due = False
        # Steps taken since the round in flight was launched, and set once it has committed or
        # given up (then the inner loop stops waiting for it).
        self.steps_in_flight = 0
        self.settled = threading.Event()
        self.settled.set()

    def start(self) -> list[torch.Tensor]:
        """Where the local copy started this round: θ, or ``origin`` when rounds overlap."""
        return self.origin if self.origin is not None else self.global_params

    def begin(self, start: list[torch.Tensor]) -> None:
        """The local copy (already written, under the lock) starts the next round from ``start``
        while the round in flight is averaged."""
        self.origin = start
        self.rebase_due = False
        self.steps_in_flight = 0
        self.settled.clear()

    def due(self) -> None:
        """The round in flight committed (θ moved, under the lock): the local copy follows."""
        self.rebase_due = True

    def settle(self) -> None:
        """The round in flight committed (after the outer step) or will not: stop waiting for it."""
        self.settled.set()

    def reset(self, origin: list[torch.Tensor] | None = None) -> None:
        """No round in flight: the local copy starts from θ (or, resumed, from ``origin``)."""
        self.origin = origin
        self.rebase_due = False
        self.settled.set()

    @torch.no_grad()
    def rebase_if_due(self) -> None:
        if not self.rebase_due:
            return
        with self.lock:
            for p, o, g in zip(self.local(), self.start(), self.global_params):
                p.add_((g - o).to(p.device, p.dtype))
            self.local_written()
            self.origin = [g.clone() for g in self.global_params]
            self.rebase_due = False

    def gate(self, should_stop: Callable[[], bool] | None) -> bool:
        """Before an inner step: False to stop. A committed average of the round in flight lands
        now, unless ``outer.land_step`` = K holds it for the K-th step of the flight, which waits
        for the round to commit (or give up) if it has not."""
        if should_stop is not None and should_stop():
            return False
        land_step = self.land_step()
        if self.steps_in_flight + 1 == land_step:
            while not self.settled.wait(LAND_POLL_SECONDS):
                if should_stop is not None and should_stop():
                    return False
        self.steps_in_flight += 1
        if self.steps_in_flight >= land_step:  # an average that came in earlier waits for its step
            self.rebase_if_due()
        return True

    def host_gate(self, should_stop: Callable[[], bool] | None) -> bool:
        """``gate`` on a multi-rank host, where every decision is the ranks' together (one
        all-reduce of three flags per step, every rank deciding the same from the same answer):
        a stop asked of any rank stops all; rank 0, whose round protocol runs the round, says
        when it is over (``settle``: on a commit, only once every rank has applied its outer
        step); and an average lands only at a step at which every rank has it. Ranks that took
        it at different steps would train different models for a while (FSDP: shards of two
        starts; DDP: replicas that never become one again)."""
        land_step = self.land_step()
        while True:
            asked = should_stop is not None and should_stop()
            unsettled = self.ranks.rank == 0 and not self.settled.is_set()
            stop, unsettled, not_landed = self.ranks.any(asked, unsettled, not self.rebase_due)
            if stop:
                return False
            if not (unsettled and self.steps_in_flight + 1 == land_step):
                break
            time.sleep(LAND_POLL_SECONDS)
        self.steps_in_flight += 1
        if self.steps_in_flight >= land_step and not not_landed:
            self.rebase_if_due()
        return True
