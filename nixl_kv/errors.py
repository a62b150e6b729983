"""The exceptions nixl_kv raises on purpose; each names what went wrong."""

from __future__ import annotations


class NixlKvError(Exception):
    """Base class of every error nixl_kv raises on purpose."""


class WireFormatError(NixlKvError):
    """Bytes received from a peer or a router could not be decoded or failed validation.

    This is the only exception the wire decoders raise, whatever the input. The message names the
    offending field as a dotted path (for example ``ctx_state.cache.model.head_dim``).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class IncompatibleStateError(NixlKvError):
    """The ctx and gen instances cannot exchange KV: layouts, dtypes or models differ in an unsupported way.

    Raised by ``inquire_support`` before any byte moves.
    """


class NotSupportedError(NixlKvError):
    """A configuration nixl_kv does not support (yet); raised before any work starts."""


class BufferExhaustedError(NixlKvError):
    """No free block or staging slot is left to satisfy an allocation."""


class TransferError(NixlKvError):
    """A transfer ended in failure: the peer refused, the read failed, the lease expired or a deadline passed."""


class AgentError(NixlKvError):
    """The transfer agent (NIXL) rejected an operation; the message carries the agent's reason."""
