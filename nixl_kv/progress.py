"""ContextProgress: how far a prefill batch has got, layer by layer, on one ctx rank."""

from __future__ import annotations

import threading


class ContextProgress:
    """The model marks each of this rank's layers done (any order); readers see the contiguous prefix.

    Thread-safe: the model's thread marks, the transceiver's progress loop reads.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError("a rank holds at least one layer")
        self.num_layers = num_layers
        self._done = [False] * num_layers
        self._ready = 0
        self._lock = threading.Lock()

    def mark_layer_done(self, local_layer: int) -> None:
        if not 0 <= local_layer < self.num_layers:
            raise ValueError(f"layer {local_layer} is not one of this rank's {self.num_layers} layers")
        with self._lock:
            self._done[local_layer] = True
            while self._ready < self.num_layers and self._done[self._ready]:
                self._ready += 1

    @property
    def layers_ready(self) -> int:
        """How many of this rank's layers, from its first, are done."""
        with self._lock:
            return self._ready
