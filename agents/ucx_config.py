"""UCX settings the UCX-based agents (NIXL's UCX backend, the UCX agent) apply before their UCX context starts."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

TCP_DEFAULTS = {
    # UCX's TCP transport connects with a blocking connect() when an endpoint is created, which NIXL does inside
    # add_remote_agent, under the agent's lock: loading the metadata of a peer whose host vanished (no RST) held that
    # lock, and so every other call of the agent (READs and status checks for live peers too), for the kernel's SYN
    # timeout, 135 s here. Non-blocking, the load returns at once (UCX warns that it "can lead to connection resets
    # due to high load on TCP/IP stack").
    "UCX_TCP_CONN_NB": "y",
    # Without it a connection to a host that vanished lives as long as the kernel retransmits (minutes: SYNs for
    # 2 min, data for 15), and the READs on it with it. With it the kernel closes the socket once data (a GET, UCX's
    # own keepalive, a SYN) has gone unacknowledged this long; UCX then fails the endpoint and closes it by force, so
    # its READs end FAILED and nothing of them lands afterwards. Measured: 1.0 to 1.2 s after the host vanished. A
    # stopped peer's kernel still acknowledges: it is never taken for dead.
    "UCX_TCP_USER_TIMEOUT": "1s",
    # A connection waiting for its peer's answers sends nothing, so nothing goes unacknowledged: keepalive probes
    # (after 10 s idle by default) are what find its host gone. Measured: a READ on an endpoint still wiring up when
    # the host vanished failed 11.5 s later with the default, within 3 s with these.
    "UCX_TCP_KEEPIDLE": "1s",
    "UCX_TCP_KEEPINTVL": "1s",
}


GPU_DEFAULTS = {
    # UCX's cuda_ipc transport turns GET (a NIXL READ) off when the GPU reports no NVLink: a READ between two
    # processes on one GPU (or GPUs over PCIe) then falls back to TCP emulation, about 0.5 GB/s on an H200, while
    # WRITE is unaffected. On, the same READ ran at 1.9 TB/s (256 MiB, issue 25).
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
}
# Set only where an NVIDIA driver is present: elsewhere UCX loads no cuda_ipc transport, and warns at start-up of
# every "unused environment variable" it was given.
NVIDIA_CONTROL_DEVICE = Path("/dev/nvidiactl")


def apply_ucx_defaults(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set ``TCP_DEFAULTS``, and ``GPU_DEFAULTS`` on a host with an NVIDIA driver, where the user chose nothing;
    returns the variables it set. (RDMA transports bound a dead peer by their own timeouts.)"""
    defaults = dict(TCP_DEFAULTS)
    if NVIDIA_CONTROL_DEVICE.exists():
        defaults.update(GPU_DEFAULTS)
    chosen = [name for name in defaults if name not in environ]
    for name in chosen:
        environ[name] = defaults[name]
    return chosen


def bound_tcp_failures(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """The name the agents call before UCX starts: ``apply_ucx_defaults`` (every default of this module, not only
    the TCP ones)."""
    return apply_ucx_defaults(environ)
