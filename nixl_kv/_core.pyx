# cython: boundscheck=False, wraparound=False
"""The compiled core: NIXL's data path through its C API (``csrc/nixl_capi.c``), no Python between NIXL calls.

Every call into NIXL releases the GIL once, whatever it does: a READ's make and post are one call
(``Agent.read``), the status of every READ a poll looks at is one call (``Agent.statuses``). ``nixl_kv.agents``'
``NixlAgent`` is the Python face of this module; ``scripts/bench_floor.py`` measures it against NIXL's Python
binding and against the plain C loop (``Agent.floor``) in one run.
"""

from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

import numpy as np

from nixl_kv.errors import AgentError


cdef extern from "nixl_capi.h" nogil:
    ctypedef int nkv_status_t
    ctypedef void *nkv_handle_t
    int NKV_SUCCESS
    int NKV_IN_PROG
    int NKV_SYNC_STRICT

    ctypedef struct nkv_agent_config_t:
        bint enable_prog_thread
        bint enable_listen_thread
        int listen_port
        int thread_sync
        unsigned int num_workers
        uint64_t pthr_delay_us
        uint64_t lthr_delay_us
        bint capture_telemetry

    ctypedef struct nkv_capi_t:
        nkv_status_t (*create_configured_agent)(const char *, const nkv_agent_config_t *, nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_agent)(nkv_handle_t) noexcept nogil
        nkv_status_t (*get_local_md)(nkv_handle_t, void **, size_t *) noexcept nogil
        nkv_status_t (*load_remote_md)(nkv_handle_t, const void *, size_t, char **) noexcept nogil
        nkv_status_t (*invalidate_remote_md)(nkv_handle_t, const char *) noexcept nogil
        nkv_status_t (*check_remote_md)(nkv_handle_t, const char *, nkv_handle_t) noexcept nogil
        nkv_status_t (*get_plugin_params)(nkv_handle_t, const char *, nkv_handle_t *, nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_mem_list)(nkv_handle_t) noexcept nogil
        nkv_status_t (*destroy_params)(nkv_handle_t) noexcept nogil
        nkv_status_t (*create_backend)(nkv_handle_t, const char *, nkv_handle_t, nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_backend)(nkv_handle_t) noexcept nogil
        nkv_status_t (*create_reg_dlist)(int, nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_reg_dlist)(nkv_handle_t) noexcept nogil
        nkv_status_t (*reg_dlist_add_desc)(nkv_handle_t, uintptr_t, size_t, uint64_t, const void *, size_t) noexcept nogil
        nkv_status_t (*register_mem)(nkv_handle_t, nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*deregister_mem)(nkv_handle_t, nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*agent_make_connection)(nkv_handle_t, const char *, nkv_handle_t) noexcept nogil
        nkv_status_t (*create_xfer_dlist)(int, nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_xfer_dlist)(nkv_handle_t) noexcept nogil
        nkv_status_t (*xfer_dlist_add_desc)(nkv_handle_t, uintptr_t, size_t, uint64_t) noexcept nogil
        nkv_status_t (*prep_xfer_dlist)(nkv_handle_t, const char *, nkv_handle_t, nkv_handle_t *,
                                        nkv_handle_t) noexcept nogil
        nkv_status_t (*release_xfer_dlist_handle)(nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*create_xfer_req)(nkv_handle_t, int, nkv_handle_t, nkv_handle_t, const char *,
                                        nkv_handle_t *, nkv_handle_t) noexcept nogil
        nkv_status_t (*post_xfer_req)(nkv_handle_t, nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*get_xfer_status)(nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*release_xfer_req)(nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*create_opt_args)(nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_opt_args)(nkv_handle_t) noexcept nogil
        nkv_status_t (*opt_args_set_notif_msg)(nkv_handle_t, const void *, size_t) noexcept nogil
        nkv_status_t (*opt_args_set_has_notif)(nkv_handle_t, bint) noexcept nogil
        nkv_status_t (*create_notif_map)(nkv_handle_t *) noexcept nogil
        nkv_status_t (*destroy_notif_map)(nkv_handle_t) noexcept nogil
        nkv_status_t (*get_notifs)(nkv_handle_t, nkv_handle_t, nkv_handle_t) noexcept nogil
        nkv_status_t (*notif_map_size)(nkv_handle_t, size_t *) noexcept nogil
        nkv_status_t (*notif_map_get_agent_at)(nkv_handle_t, size_t, const char **) noexcept nogil
        nkv_status_t (*notif_map_get_notifs_size)(nkv_handle_t, const char *, size_t *) noexcept nogil
        nkv_status_t (*notif_map_get_notif)(nkv_handle_t, const char *, size_t, const void **, size_t *) noexcept nogil
        nkv_status_t (*notif_map_clear)(nkv_handle_t) noexcept nogil
        nkv_status_t (*gen_notif)(nkv_handle_t, const char *, const void *, size_t, nkv_handle_t) noexcept nogil

    nkv_capi_t nkv_capi
    int nkv_capi_load(const char *path, char *error, size_t error_len)
    nkv_status_t nkv_read(nkv_handle_t agent, nkv_handle_t local, const int *local_idx, nkv_handle_t remote,
                          const int *remote_idx, size_t count, nkv_handle_t opt_args, nkv_handle_t *req)
    size_t nkv_statuses(nkv_handle_t agent, const nkv_handle_t *reqs, size_t count, nkv_status_t *out)
    nkv_status_t nkv_floor_loop(nkv_handle_t agent, nkv_handle_t local, nkv_handle_t remote, const int *idx,
                                size_t count, size_t rounds, double timeout_us, double *micros)


IN_PROGRESS = 1  # a status: still moving; 0 is done, anything else failed (NIXL's negative codes)
_loaded = None  # the path of the library the table was filled from


def load(str path):
    """Fill the call table from ``path`` (a ``libnixl_capi.so``); AgentError naming what is missing. Once per
    process: a second call with another path is refused (two libnixl.so in one process do not share agents)."""
    global _loaded
    if _loaded is not None:
        if _loaded != path:
            raise AgentError(f"the NIXL C API is already loaded from {_loaded}, not {path}")
        return
    cdef char error[512]
    encoded = path.encode()
    if nkv_capi_load(encoded, error, sizeof(error)) != 0:
        raise AgentError(error.decode(errors="replace"))
    _loaded = path


def loaded():
    """The library the table was filled from, or None."""
    return _loaded


cdef inline void _check(nkv_status_t status, str what) except *:
    if status != NKV_SUCCESS:
        raise AgentError(f"NIXL could not {what} (status {status})")


cdef class Prepared:
    """A prepared descriptor list (``prep_xfer_dlist``): READs pick its entries by index."""

    cdef nkv_handle_t handle
    cdef readonly object owner  # the peer whose memory it describes, None for local memory
    cdef readonly Py_ssize_t count

    @property
    def live(self):
        return self.handle != NULL


cdef class Transfer:
    """One posted READ: its handle until released."""

    cdef nkv_handle_t handle
    cdef readonly str peer

    @property
    def live(self):
        return self.handle != NULL


cdef class Agent:
    """One NIXL agent through the C API: strict thread sync (the caller's thread posts while the progress loop polls),
    no NIXL progress thread unless asked (the transceiver's loop polls; a second spinning thread per agent halved
    throughput on a 2-core machine)."""

    cdef nkv_handle_t agent
    cdef nkv_handle_t notif_map
    cdef list backends
    cdef list registrations
    cdef readonly str name

    def __cinit__(self, str name, backends=("UCX",), bint progress_thread=False):
        if _loaded is None:
            raise AgentError("the NIXL C API is not loaded (nixl_kv._core.load)")
        cdef nkv_agent_config_t config
        config.enable_prog_thread = progress_thread
        config.enable_listen_thread = False
        config.listen_port = 0
        config.thread_sync = NKV_SYNC_STRICT
        config.num_workers = 1
        config.pthr_delay_us = 0
        config.lthr_delay_us = 100000
        config.capture_telemetry = False
        self.name = name
        self.backends = []
        self.registrations = []
        encoded = name.encode()
        cdef const char *cname = encoded
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.create_configured_agent(cname, &config, &self.agent)
        _check(status, f"create agent {name!r}")
        _check(nkv_capi.create_notif_map(&self.notif_map), "create a notification map")
        for backend in backends:
            self._add_backend(backend)

    cdef _add_backend(self, str backend):
        cdef nkv_handle_t mems = NULL
        cdef nkv_handle_t params = NULL
        cdef nkv_handle_t handle = NULL
        encoded = backend.encode()
        cdef const char *cbackend = encoded
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.get_plugin_params(self.agent, cbackend, &mems, &params)
            if status == NKV_SUCCESS:
                status = nkv_capi.create_backend(self.agent, cbackend, params, &handle)
            if mems != NULL:
                nkv_capi.destroy_mem_list(mems)
            if params != NULL:
                nkv_capi.destroy_params(params)
        _check(status, f"create the {backend} backend")
        self.backends.append(<uintptr_t>handle)

    cdef nkv_handle_t _live(self) except NULL:
        if self.agent == NULL:
            raise AgentError(f"agent {self.name!r} is closed")
        return self.agent

    def metadata(self):
        """This agent's metadata (what a peer loads to reach it)."""
        cdef nkv_handle_t agent = self._live()
        cdef void *data = NULL
        cdef size_t length = 0
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.get_local_md(agent, &data, &length)
        _check(status, "get the agent's metadata")
        try:
            return (<char *>data)[:length]
        finally:
            free(data)

    def register(self, int memory, const uint64_t[:, ::1] rows):
        """Register Nx3 (address, length, device) rows of one memory kind; returns the registration's index."""
        cdef nkv_handle_t agent = self._live()
        cdef nkv_handle_t dlist = NULL
        _check(nkv_capi.create_reg_dlist(memory, &dlist), "create a registration list")
        cdef Py_ssize_t i
        cdef nkv_status_t status = NKV_SUCCESS
        with nogil:
            for i in range(rows.shape[0]):
                status = nkv_capi.reg_dlist_add_desc(dlist, rows[i, 0], rows[i, 1], rows[i, 2], NULL, 0)
                if status != NKV_SUCCESS:
                    break
            if status == NKV_SUCCESS:
                status = nkv_capi.register_mem(agent, dlist, NULL)
        if status != NKV_SUCCESS:
            nkv_capi.destroy_reg_dlist(dlist)
            _check(status, "register memory")
        self.registrations.append(<uintptr_t>dlist)
        return len(self.registrations) - 1

    def deregister_all(self):
        """Deregister every registration; the first failure raised once all were tried."""
        cdef nkv_handle_t agent = self._live()
        cdef nkv_handle_t dlist
        failed = []
        for address in self.registrations:
            dlist = <nkv_handle_t><uintptr_t>address
            with nogil:
                status = nkv_capi.deregister_mem(agent, dlist, NULL)
            nkv_capi.destroy_reg_dlist(dlist)
            if status != NKV_SUCCESS:
                failed.append(status)
        self.registrations = []
        if failed:
            raise AgentError(f"NIXL could not deregister memory (status {failed[0]})")

    @property
    def registration_count(self):
        return len(self.registrations)

    def load_remote(self, const unsigned char[::1] metadata not None):
        """Load a peer's metadata; returns the name it describes, as bytes (not always text)."""
        cdef nkv_handle_t agent = self._live()
        cdef char *name = NULL
        cdef nkv_status_t status
        if metadata.shape[0] == 0:
            raise AgentError("NIXL could not load remote metadata: it is empty")
        with nogil:
            status = nkv_capi.load_remote_md(agent, &metadata[0], metadata.shape[0], &name)
        _check(status, "load remote metadata")
        try:
            return <bytes>name
        finally:
            free(name)

    def invalidate_remote(self, bytes name):
        cdef nkv_handle_t agent = self._live()
        cdef const char *cname = name
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.invalidate_remote_md(agent, cname)
        _check(status, f"remove remote agent {name!r}")

    def has_remote(self, bytes name):
        """Whether metadata of the agent ``name`` is loaded."""
        cdef nkv_handle_t agent = self._live()
        cdef const char *cname = name
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.check_remote_md(agent, cname, NULL)
        return status == NKV_SUCCESS

    def connect(self, str name):
        cdef nkv_handle_t agent = self._live()
        encoded = name.encode()
        cdef const char *cname = encoded
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.agent_make_connection(agent, cname, NULL)
        _check(status, f"connect to {name}")

    def prepare(self, owner, int memory, const uint64_t[:, ::1] rows not None):
        """Prepare Nx3 or strided Nx5 rows of local memory (``owner`` None) or of the peer ``owner``'s memory."""
        cdef nkv_handle_t agent = self._live()
        cdef nkv_handle_t dlist = NULL
        cdef Prepared prepared = Prepared.__new__(Prepared)
        encoded = b"" if owner is None else owner.encode()  # "": this agent's own memory
        cdef const char *cowner = encoded
        cdef Py_ssize_t i
        cdef nkv_status_t status
        cdef Py_ssize_t entries = _entries(rows)
        _check(nkv_capi.create_xfer_dlist(memory, &dlist), "create a descriptor list")
        with nogil:
            status = _add_rows(dlist, rows)
            if status == NKV_SUCCESS:
                status = nkv_capi.prep_xfer_dlist(agent, cowner, dlist, &prepared.handle, NULL)
            nkv_capi.destroy_xfer_dlist(dlist)
        _check(status, f"prepare descriptors of {owner or 'local memory'}")
        prepared.owner = owner
        prepared.count = entries
        return prepared

    def release_prepared(self, Prepared prepared not None):
        if prepared.handle == NULL or self.agent == NULL:
            return
        cdef nkv_handle_t handle = prepared.handle
        prepared.handle = NULL
        with nogil:
            nkv_capi.release_xfer_dlist_handle(self.agent, handle)

    def read(self, Prepared local not None, const int[::1] local_indices not None, Prepared remote not None,
             const int[::1] remote_indices not None, const unsigned char[::1] notification=None):
        """Post a READ of ``remote``'s entries into ``local``'s (one GIL release for make and post); the peer is
        notified when it is done if ``notification`` is not empty. AgentError if NIXL refuses it."""
        cdef nkv_handle_t agent = self._live()
        cdef Py_ssize_t count = local_indices.shape[0]
        if remote_indices.shape[0] != count or count == 0:
            raise AgentError(f"a READ needs as many remote entries as local ones, at least one ({count}, "
                             f"{remote_indices.shape[0]})")
        if local.handle == NULL or remote.handle == NULL:
            raise AgentError("a READ over a released descriptor list")
        _check_indices(local_indices, local.count, "local")
        _check_indices(remote_indices, remote.count, "remote")
        cdef nkv_handle_t opt = NULL
        cdef Transfer transfer = Transfer.__new__(Transfer)
        cdef nkv_status_t status
        if notification is not None and notification.shape[0] > 0:
            _check(nkv_capi.create_opt_args(&opt), "create READ options")
            nkv_capi.opt_args_set_notif_msg(opt, &notification[0], notification.shape[0])
            nkv_capi.opt_args_set_has_notif(opt, True)
        with nogil:
            status = nkv_read(agent, local.handle, &local_indices[0], remote.handle, &remote_indices[0], count, opt,
                              &transfer.handle)
            if opt != NULL:
                nkv_capi.destroy_opt_args(opt)
        if status != NKV_SUCCESS and status != NKV_IN_PROG:
            raise AgentError(f"NIXL refused to post the READ (status {status})")
        transfer.peer = remote.owner or ""
        return transfer

    def read_rows(self, str peer, int local_memory, const uint64_t[:, ::1] local_rows not None, int remote_memory,
                  const uint64_t[:, ::1] remote_rows not None, const unsigned char[::1] notification=None):
        """Post a READ of Nx3 (address, length, device) rows of ``peer`` into local rows, without prepared lists."""
        cdef nkv_handle_t agent = self._live()
        if _entries(local_rows) != _entries(remote_rows) or local_rows.shape[0] == 0:
            raise AgentError(f"a READ needs as many remote rows as local ones, at least one ({local_rows.shape[0]}, "
                             f"{remote_rows.shape[0]})")
        encoded = peer.encode()
        cdef const char *cpeer = encoded
        cdef nkv_handle_t local = NULL
        cdef nkv_handle_t remote = NULL
        cdef nkv_handle_t opt = NULL
        cdef Transfer transfer = Transfer.__new__(Transfer)
        cdef nkv_status_t status
        _check(nkv_capi.create_xfer_dlist(local_memory, &local), "describe local ranges")
        status = nkv_capi.create_xfer_dlist(remote_memory, &remote)
        if status != NKV_SUCCESS:
            nkv_capi.destroy_xfer_dlist(local)
            _check(status, "describe remote ranges")
        if notification is not None and notification.shape[0] > 0:
            nkv_capi.create_opt_args(&opt)
            nkv_capi.opt_args_set_notif_msg(opt, &notification[0], notification.shape[0])
            nkv_capi.opt_args_set_has_notif(opt, True)
        with nogil:
            status = _add_rows(local, local_rows)
            if status == NKV_SUCCESS:
                status = _add_rows(remote, remote_rows)
            if status == NKV_SUCCESS:
                status = nkv_capi.create_xfer_req(agent, 0, local, remote, cpeer, &transfer.handle, opt)
            if status == NKV_SUCCESS:
                status = nkv_capi.post_xfer_req(agent, transfer.handle, NULL)
                if status != NKV_SUCCESS and status != NKV_IN_PROG:
                    nkv_capi.release_xfer_req(agent, transfer.handle)
                    transfer.handle = NULL
            nkv_capi.destroy_xfer_dlist(local)
            nkv_capi.destroy_xfer_dlist(remote)
            if opt != NULL:
                nkv_capi.destroy_opt_args(opt)
        if status != NKV_SUCCESS and status != NKV_IN_PROG:
            raise AgentError(f"NIXL could not create the READ from {peer} (status {status})")
        transfer.peer = peer
        return transfer

    def status(self, Transfer transfer not None):
        """0 done, 1 in progress, negative failed (a released transfer reads failed)."""
        if transfer.handle == NULL or self.agent == NULL:
            return -3
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.get_xfer_status(self.agent, transfer.handle)
        return status

    def statuses(self, transfers):
        """The status of every transfer in one call (one GIL release for a whole poll)."""
        cdef Py_ssize_t count = len(transfers), i
        cdef nkv_handle_t *handles = <nkv_handle_t *>malloc(max(count, 1) * sizeof(nkv_handle_t))
        cdef nkv_status_t *found = <nkv_status_t *>malloc(max(count, 1) * sizeof(nkv_status_t))
        cdef Transfer transfer
        try:
            for i in range(count):
                transfer = transfers[i]
                handles[i] = transfer.handle
            with nogil:
                for i in range(count):
                    found[i] = nkv_capi.get_xfer_status(self.agent, handles[i]) if handles[i] != NULL else -3
            return [found[i] for i in range(count)]
        finally:
            free(handles)
            free(found)

    def release_transfer(self, Transfer transfer not None):
        """Release a transfer handle (NIXL cancels it if it can); its status, 0 when released."""
        if transfer.handle == NULL or self.agent == NULL:
            return 0
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.release_xfer_req(self.agent, transfer.handle)
        if status == NKV_SUCCESS:
            transfer.handle = NULL
        return status

    def notify(self, str peer, const unsigned char[::1] message not None):
        cdef nkv_handle_t agent = self._live()
        encoded = peer.encode()
        cdef const char *cpeer = encoded
        cdef const void *data = &message[0] if message.shape[0] else NULL
        cdef nkv_status_t status
        with nogil:
            status = nkv_capi.gen_notif(agent, cpeer, data, message.shape[0], NULL)
        _check(status, f"notify {peer}")

    def notifications(self):
        """Notifications since the last call, as (sender name bytes, message bytes)."""
        cdef nkv_handle_t agent = self._live()
        cdef nkv_status_t status
        cdef size_t agents = 0, count = 0, length = 0, a, n
        cdef const char *sender
        cdef const void *data
        with nogil:
            status = nkv_capi.get_notifs(agent, self.notif_map, NULL)
            if status == NKV_SUCCESS:
                status = nkv_capi.notif_map_size(self.notif_map, &agents)
        _check(status, "get notifications")
        found = []
        if agents == 0:
            return found
        try:
            for a in range(agents):
                _check(nkv_capi.notif_map_get_agent_at(self.notif_map, a, &sender), "read a notification's sender")
                _check(nkv_capi.notif_map_get_notifs_size(self.notif_map, sender, &count), "count notifications")
                name = <bytes>sender
                for n in range(count):
                    _check(nkv_capi.notif_map_get_notif(self.notif_map, sender, n, &data, &length),
                           "read a notification")
                    found.append((name, (<const char *>data)[:length] if length else b""))
        finally:
            nkv_capi.notif_map_clear(self.notif_map)
        return found

    def floor(self, Prepared local not None, Prepared remote not None, const int[::1] indices not None,
              Py_ssize_t rounds, double timeout_s=10.0):
        """The plain C loop (make + post + poll + release, no Python between rounds): each round's microseconds.
        AgentError if a round outlives ``timeout_s``."""
        cdef nkv_handle_t agent = self._live()
        micros = np.zeros(rounds, dtype=np.float64)
        cdef double[::1] out = micros
        _check_indices(indices, local.count, "local")
        _check_indices(indices, remote.count, "remote")
        cdef nkv_status_t status
        with nogil:
            status = nkv_floor_loop(agent, local.handle, remote.handle, &indices[0], indices.shape[0], rounds,
                                    timeout_s * 1e6, &out[0])
        _check(status, "run the floor loop")
        return micros

    def __dealloc__(self):
        self._destroy()

    def close(self):
        """Destroy the backends and the agent (the caller released transfers, lists and registrations first)."""
        self._destroy()

    cdef void _destroy(self) noexcept:
        """Once: an agent never closed is destroyed when collected (its UCX worker holds file descriptors)."""
        if self.agent == NULL:
            return
        cdef nkv_handle_t agent = self.agent
        self.agent = NULL
        if self.backends is not None:
            for address in self.backends:
                nkv_capi.destroy_backend(<nkv_handle_t><uintptr_t>address)
            self.backends = []
        if self.notif_map != NULL:
            nkv_capi.destroy_notif_map(self.notif_map)
            self.notif_map = NULL
        with nogil:
            nkv_capi.destroy_agent(agent)


cdef void _check_indices(const int[::1] indices, Py_ssize_t count, str which) except *:
    cdef Py_ssize_t i
    for i in range(indices.shape[0]):
        if indices[i] < 0 or indices[i] >= count:
            raise AgentError(f"{which} entry {indices[i]} is outside the prepared list of {count}")


cdef nkv_status_t _add_rows(nkv_handle_t dlist, const uint64_t[:, ::1] rows) noexcept nogil:
    """Nx3 (address, length, device) rows, or strided Nx5 ones (.., stride, count: ``count`` entries ``stride``
    bytes apart), as one descriptor an entry."""
    cdef Py_ssize_t i
    cdef uint64_t j
    cdef nkv_status_t status = NKV_SUCCESS
    for i in range(rows.shape[0]):
        if rows.shape[1] == 3:
            status = nkv_capi.xfer_dlist_add_desc(dlist, rows[i, 0], rows[i, 1], rows[i, 2])
        else:
            for j in range(rows[i, 4]):
                status = nkv_capi.xfer_dlist_add_desc(dlist, rows[i, 0] + j * rows[i, 3], rows[i, 1], rows[i, 2])
                if status != NKV_SUCCESS:
                    return status
        if status != NKV_SUCCESS:
            return status
    return status


cdef Py_ssize_t _entries(const uint64_t[:, ::1] rows) except -1:
    """How many descriptors ``rows`` make; AgentError unless they are Nx3 or Nx5."""
    if rows.shape[1] == 3:
        return rows.shape[0]
    if rows.shape[1] != 5:
        raise AgentError(f"descriptor rows of width {rows.shape[1]}, expected Nx3 or Nx5")
    cdef Py_ssize_t i, total = 0
    for i in range(rows.shape[0]):
        total += rows[i, 4]
    return total
