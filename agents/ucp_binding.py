"""A small ctypes binding over libucp (UCX's protocol layer): only the calls the UCX agent makes.

Why ctypes: ucxx, the maintained Python binding, has no RMA (no ``ucp_mem_map``, rkeys or ``ucp_get_nbx``).

Which libucp, in this order:

1. ``NIXL_KV_UCX_LIBRARY`` (a path), when set;
2. the ``libucp.so.0`` already in the process, if any: the mpich wheel's MPI bundles UCX (1.20) under the usual
   sonames, loaded by mpi4py before the agent in a multi-rank instance. Loading another UCX beside it does not
   work: its ``libuct`` binds to the loaded ``libucs.so.0`` by soname (``undefined symbol:
   ucs_ifname_to_ndev_index``), and ``dlmopen`` into a namespace of its own crashed in that namespace's libc
   (``printf_fp``, locale not initialised);
3. the mpich wheel's libucp in this environment (``<prefix>/lib/mpich``), when it is installed: the one a
   multi-rank instance of the same installation loads, so one-rank and multi-rank instances agree by default;
4. the PyPI wheel ``libucx-cu12`` (``libucx.load_library()``), never nixl's vendored copy (mangled names).

UCX does not promise wire compatibility across versions (a 1.22 reader segfaulted a 1.20 target here): the agent's
metadata carries the version, and a peer of another one is refused. Every process of a deployment, ctx and gen,
must therefore resolve to one UCX: where some load MPI and others do not, point ``NIXL_KV_UCX_LIBRARY`` at MPI's
libucp (or preload the wheel's everywhere).

The structures below are the leading fields of UCX 1.21/1.22's parameter structs (checked with ``offsetof`` against
the wheel's headers), padded to the full size; a field is only read when its bit is set in ``field_mask``.
``ucs_status_t`` is a one-byte enum: every status is ``c_int8``. Every failure raises UcxError, an AgentError.
ctypes releases the GIL during each foreign call, so a thread blocked in UCX does not stall Python.
"""

from __future__ import annotations

import ctypes as C
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nixl_kv.errors import AgentError

MIN_VERSION = (1, 15)  # ucp_get_nbx, ucp_am_send_nbx and these struct layouts are older; 1.20-1.22 were run
LIBRARY_ENV = "NIXL_KV_UCX_LIBRARY"
_RTLD_NOLOAD = 4
FEATURE_RMA, FEATURE_WAKEUP, FEATURE_AM = 1 << 1, 1 << 4, 1 << 6
THREAD_MODE_SERIALIZED = 1
ERR_HANDLING_MODE_PEER = 1
AM_FLAG_WHOLE_MSG = 1
AM_RECV_ATTR_FLAG_RNDV = 1 << 17
AM_SEND_FLAG_EAGER = 1 << 1
AM_SEND_FLAG_COPY_HEADER = 1 << 3
EP_CLOSE_FLAG_FORCE = 1
OK, INPROGRESS, ERR_BUSY, ERR_ENDPOINT_TIMEOUT = 0, 1, -15, -80
_ERR_LAST = -100

_vp = C.c_void_p
Request = int  # a ucs_status_ptr_t that is neither NULL nor an error: an operation in flight

AmHandler = Callable[[bytes, bytes], None]  # (header, data) of a whole eager message
ErrorHandler = Callable[[int, int], None]  # (endpoint, status)
_AM_CB = C.CFUNCTYPE(C.c_int, _vp, _vp, C.c_size_t, _vp, C.c_size_t, _vp)
_ERR_CB = C.CFUNCTYPE(None, _vp, _vp, C.c_int8)


class UcxError(AgentError):
    """A UCX call failed; ``status`` is its ucs_status_t."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"UCX could not {what}: {status_string(status)} ({status})")
        self.status = status


class _Params(C.Structure):  # ucp_params_t, 88 bytes
    _fields_ = [("field_mask", C.c_uint64), ("features", C.c_uint64), ("_rest", C.c_byte * 72)]


class _WorkerParams(C.Structure):  # ucp_worker_params_t, 200 bytes
    _fields_ = [("field_mask", C.c_uint64), ("thread_mode", C.c_int), ("_rest", C.c_byte * 188)]


class _EpParams(C.Structure):  # ucp_ep_params_t, 104 bytes
    _fields_ = [
        ("field_mask", C.c_uint64),
        ("address", _vp),
        ("err_mode", C.c_int),
        ("err_cb", _vp),
        ("err_arg", _vp),
        ("_rest", C.c_byte * 64),
    ]


class _MemMapParams(C.Structure):  # ucp_mem_map_params_t, 48 bytes
    _fields_ = [("field_mask", C.c_uint64), ("address", _vp), ("length", C.c_size_t), ("_rest", C.c_byte * 24)]


class _RequestParams(C.Structure):  # ucp_request_param_t, 96 bytes
    _fields_ = [("op_attr_mask", C.c_uint32), ("flags", C.c_uint32), ("_rest", C.c_byte * 88)]


class _AmHandlerParams(C.Structure):  # ucp_am_handler_param_t, 32 bytes
    _fields_ = [("field_mask", C.c_uint64), ("id", C.c_uint), ("flags", C.c_uint), ("cb", _vp), ("arg", _vp)]


_EP_FIELD_ADDRESS, _EP_FIELD_ERR_MODE, _EP_FIELD_ERR_HANDLER = 1, 2, 4
_OP_ATTR_FIELD_FLAGS = 1 << 4
_NO_PARAMS = _RequestParams()


def _flags(flags: int) -> _RequestParams:
    return _RequestParams(_OP_ATTR_FIELD_FLAGS, flags)


_AM_SEND = _flags(AM_SEND_FLAG_EAGER | AM_SEND_FLAG_COPY_HEADER)  # eager: the receiver gets the whole message inline
_CLOSE = {False: _flags(0), True: _flags(EP_CLOSE_FLAG_FORCE)}

_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {  # name: (restype, argtypes)
    "ucp_config_read": (C.c_int8, [C.c_char_p, C.c_char_p, C.POINTER(_vp)]),
    "ucp_config_release": (None, [_vp]),
    "ucp_init_version": (C.c_int8, [C.c_uint, C.c_uint, C.POINTER(_Params), _vp, C.POINTER(_vp)]),
    "ucp_cleanup": (None, [_vp]),
    "ucp_worker_create": (C.c_int8, [_vp, C.POINTER(_WorkerParams), C.POINTER(_vp)]),
    "ucp_worker_destroy": (None, [_vp]),
    "ucp_worker_get_address": (C.c_int8, [_vp, C.POINTER(_vp), C.POINTER(C.c_size_t)]),
    "ucp_worker_release_address": (None, [_vp, _vp]),
    "ucp_worker_progress": (C.c_uint, [_vp]),
    "ucp_worker_get_efd": (C.c_int8, [_vp, C.POINTER(C.c_int)]),
    "ucp_worker_arm": (C.c_int8, [_vp]),
    "ucp_worker_signal": (C.c_int8, [_vp]),
    "ucp_worker_set_am_recv_handler": (C.c_int8, [_vp, C.POINTER(_AmHandlerParams)]),
    "ucp_ep_create": (C.c_int8, [_vp, C.POINTER(_EpParams), C.POINTER(_vp)]),
    "ucp_ep_close_nbx": (_vp, [_vp, C.POINTER(_RequestParams)]),
    "ucp_mem_map": (C.c_int8, [_vp, C.POINTER(_MemMapParams), C.POINTER(_vp)]),
    "ucp_mem_unmap": (C.c_int8, [_vp, _vp]),
    "ucp_rkey_pack": (C.c_int8, [_vp, _vp, C.POINTER(_vp), C.POINTER(C.c_size_t)]),
    "ucp_rkey_buffer_release": (None, [_vp]),
    "ucp_ep_rkey_unpack": (C.c_int8, [_vp, C.c_char_p, C.POINTER(_vp)]),
    "ucp_rkey_destroy": (None, [_vp]),
    "ucp_get_nbx": (_vp, [_vp, _vp, C.c_size_t, C.c_uint64, _vp, C.POINTER(_RequestParams)]),
    "ucp_am_send_nbx": (_vp, [_vp, C.c_uint, _vp, C.c_size_t, _vp, C.c_size_t, C.POINTER(_RequestParams)]),
    "ucp_request_check_status": (C.c_int8, [_vp]),
    "ucp_request_free": (None, [_vp]),
    "ucp_get_version": (None, [C.POINTER(C.c_uint)] * 3),
}


@functools.cache
def _libs() -> tuple[C.CDLL, tuple[int, int, int]]:
    """libucp, typed (``ucs_status_string`` is found through it, in its libucs), and its version; ImportError if
    neither a loaded libucp nor the ``libucx`` wheel is there, or the loaded one is too old."""
    ucp = _chosen_libucp()
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(ucp, name)
        function.restype, function.argtypes = restype, argtypes
    ucp.ucs_status_string.restype, ucp.ucs_status_string.argtypes = C.c_char_p, [C.c_int]
    parts = [C.c_uint() for _ in range(3)]
    ucp.ucp_get_version(*(C.byref(part) for part in parts))
    version = (parts[0].value, parts[1].value, parts[2].value)
    if version[:2] < MIN_VERSION:
        raise ImportError(f"the UCX agent needs libucp {MIN_VERSION[0]}.{MIN_VERSION[1]} or later; loaded: {version}")
    return ucp, version


def _chosen_libucp() -> C.CDLL:
    if path := os.environ.get(LIBRARY_ENV):
        try:
            return C.CDLL(path, mode=C.RTLD_LOCAL)
        except OSError as exc:
            raise ImportError(f"{LIBRARY_ENV}={path} cannot be loaded: {exc}") from exc
    try:
        return C.CDLL("libucp.so.0", mode=C.RTLD_LOCAL | _RTLD_NOLOAD)  # already in the process (MPI's)
    except OSError:
        pass
    mpich = Path(sys.prefix) / "lib" / "mpich" / "libucp.so.0"
    if mpich.exists():
        return C.CDLL(str(mpich), mode=C.RTLD_LOCAL)
    try:
        import libucx
    except ImportError as exc:
        raise ImportError(f"the UCX agent needs the libucx-cu12 wheel (pip install libucx-cu12): {exc}") from exc
    ucp = libucx.load_library()[-1]  # libucs, libucs_signal, libuct, libucp
    if ucp is None:
        raise ImportError("libucx.load_library() found no libucp, neither in the wheel nor on the system")
    return ucp


def _ucp() -> C.CDLL:
    return _libs()[0]


def version() -> tuple[int, int, int]:
    """The libucp in use (major, minor, release)."""
    return _libs()[1]


def status_string(status: int) -> str:
    return (_ucp().ucs_status_string(status) or b"unknown status").decode()


def _check(status: int, what: str) -> None:
    if status != OK:
        raise UcxError(what, status)


def _request(pointer: int | None, what: str) -> Request | None:
    """A ucs_status_ptr_t: None (completed at once), a request in flight, or UcxError (UCS_PTR_IS_ERR)."""
    if pointer is not None and pointer >= (1 << 64) + _ERR_LAST:
        raise UcxError(what, pointer - (1 << 64))
    return pointer


class Context:
    """A ucp_context with RMA, active messages and wakeup (an event fd a thread can sleep on)."""

    def __init__(self) -> None:
        ucp = _ucp()
        config = _vp()
        _check(ucp.ucp_config_read(None, None, C.byref(config)), "read its configuration")
        params = _Params(field_mask=1, features=FEATURE_RMA | FEATURE_AM | FEATURE_WAKEUP)
        handle = _vp()
        try:
            major, minor, _ = version()  # the API this binding speaks is the loaded library's own
            _check(ucp.ucp_init_version(major, minor, params, config, C.byref(handle)), "initialize")
        finally:
            ucp.ucp_config_release(config)
        self.handle: int = handle.value

    def mem_map(self, address: int, nbytes: int) -> int:
        params = _MemMapParams(field_mask=3, address=address, length=nbytes)
        memh = _vp()
        _check(_ucp().ucp_mem_map(self.handle, params, C.byref(memh)), f"map {nbytes} bytes at {address:#x}")
        return memh.value

    def rkey_pack(self, memh: int) -> bytes:
        buffer, size = _vp(), C.c_size_t()
        _check(_ucp().ucp_rkey_pack(self.handle, memh, C.byref(buffer), C.byref(size)), "pack a remote key")
        try:
            return C.string_at(buffer, size.value)
        finally:
            _ucp().ucp_rkey_buffer_release(buffer)

    def mem_unmap(self, memh: int) -> None:
        _check(_ucp().ucp_mem_unmap(self.handle, memh), "unmap memory")

    def cleanup(self) -> None:
        _ucp().ucp_cleanup(self.handle)


class Worker:
    """A ucp_worker in serialized mode: the caller keeps one thread at a time inside it (the agent's lock)."""

    def __init__(self, context: Context) -> None:
        params = _WorkerParams(field_mask=1, thread_mode=THREAD_MODE_SERIALIZED)
        handle = _vp()
        _check(_ucp().ucp_worker_create(context.handle, params, C.byref(handle)), "create a worker")
        self.handle: int = handle.value
        self._callbacks: list[Any] = []  # ctypes callbacks must outlive the worker

    def address(self) -> bytes:
        address, size = _vp(), C.c_size_t()
        _check(_ucp().ucp_worker_get_address(self.handle, C.byref(address), C.byref(size)), "get the worker address")
        try:
            return C.string_at(address, size.value)
        finally:
            _ucp().ucp_worker_release_address(self.handle, address)

    def progress(self) -> int:
        """One round of progress; the number of events it processed."""
        return _ucp().ucp_worker_progress(self.handle)

    def event_fd(self) -> int:
        fd = C.c_int()
        _check(_ucp().ucp_worker_get_efd(self.handle, C.byref(fd)), "get the worker's event fd")
        return fd.value

    def arm(self) -> bool:
        """Arm the event fd; False if events are pending (progress first)."""
        status = _ucp().ucp_worker_arm(self.handle)
        if status == ERR_BUSY:
            return False
        _check(status, "arm the worker's event fd")
        return True

    def signal(self) -> None:
        """Wake a thread waiting on the event fd."""
        _check(_ucp().ucp_worker_signal(self.handle), "signal the worker")

    def set_am_handler(self, am_id: int, handler: AmHandler) -> None:
        """``handler(header, data)`` runs inside ``progress`` for each whole eager message; rendezvous messages
        (only a peer that is not this agent sends them) are dropped."""

        def receive(_arg: int, header: int, header_len: int, data: int, data_len: int, param: int) -> int:
            if C.c_uint64.from_address(param).value & AM_RECV_ATTR_FLAG_RNDV:
                return OK
            handler(C.string_at(header, header_len) if header_len else b"", C.string_at(data, data_len))
            return OK  # the data is not kept: UCX may release it

        callback = _AM_CB(receive)
        self._callbacks.append(callback)
        params = _AmHandlerParams(field_mask=7, id=am_id, flags=AM_FLAG_WHOLE_MSG, cb=C.cast(callback, _vp).value)
        _check(_ucp().ucp_worker_set_am_recv_handler(self.handle, params), "set the active message handler")

    def connect(self, address: bytes, on_error: ErrorHandler) -> int:
        """An endpoint to a peer's worker address, in error mode PEER: a dead peer fails its operations instead of
        aborting the process (at the price of the cma transport, see the agent)."""
        callback = _ERR_CB(lambda _arg, ep, status: on_error(ep, status))
        buffer = C.create_string_buffer(address, len(address))
        params = _EpParams(
            field_mask=_EP_FIELD_ADDRESS | _EP_FIELD_ERR_MODE | _EP_FIELD_ERR_HANDLER,
            address=C.addressof(buffer),
            err_mode=ERR_HANDLING_MODE_PEER,
            err_cb=C.cast(callback, _vp).value,
        )
        endpoint = _vp()
        _check(_ucp().ucp_ep_create(self.handle, params, C.byref(endpoint)), "create an endpoint")
        self._callbacks.append(callback)
        return endpoint.value

    def destroy(self) -> None:
        _ucp().ucp_worker_destroy(self.handle)


def close_endpoint(endpoint: int, force: bool) -> Request | None:
    """Start closing an endpoint; the request (if any) completes when it is closed."""
    return _request(_ucp().ucp_ep_close_nbx(endpoint, _CLOSE[force]), "close an endpoint")


def rkey_unpack(endpoint: int, packed: bytes) -> int:
    rkey = _vp()
    _check(_ucp().ucp_ep_rkey_unpack(endpoint, packed, C.byref(rkey)), "unpack a remote key")
    return rkey.value


def rkey_destroy(rkey: int) -> None:
    _ucp().ucp_rkey_destroy(rkey)


def get(endpoint: int, local: int, nbytes: int, remote: int, rkey: int) -> Request | None:
    return _request(_ucp().ucp_get_nbx(endpoint, local, nbytes, remote, rkey, _NO_PARAMS), "post a GET")


def am_send(endpoint: int, am_id: int, header: bytes, data: C.Array[C.c_char]) -> Request | None:
    """Send an active message; ``data`` must stay alive until the returned request completes."""
    return _request(
        _ucp().ucp_am_send_nbx(endpoint, am_id, header, len(header), data, len(data), _AM_SEND),
        "send an active message",
    )


def request_status(request: Request) -> int:
    return _ucp().ucp_request_check_status(request)


def request_free(request: Request) -> None:
    _ucp().ucp_request_free(request)
