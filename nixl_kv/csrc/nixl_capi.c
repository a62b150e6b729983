/* The compiled core's C part: NIXL's C API opened at run time, and the calls of the data path that must not pay a
 * Python round trip per NIXL call (a READ's make + post, a batch of status checks, the floor's plain loop). */
#include "nixl_capi.h"

#include <dlfcn.h>
#include <stdio.h>
#include <time.h>

nkv_capi_t nkv_capi;

int nkv_capi_load(const char *path, char *error, size_t error_len) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        snprintf(error, error_len, "cannot open %s: %s", path, dlerror());
        return -1;
    }
    nkv_capi_t table;
#define NKV_LOAD(ret, name, ...)                                                                 \
    table.name = (nkv_##name##_fn)dlsym(lib, "nixl_capi_" #name);                                \
    if (!table.name) {                                                                           \
        snprintf(error, error_len, "%s has no nixl_capi_" #name " (nixl_kv needs nixl 1.5.1's C API)", path); \
        return -1;                                                                               \
    }
    NKV_CAPI_CALLS(NKV_LOAD)
#undef NKV_LOAD
    nkv_capi = table;
    return 0;
}

nkv_status_t nkv_read(nkv_handle_t agent, nkv_handle_t local, const int *local_idx, nkv_handle_t remote,
                      const int *remote_idx, size_t count, nkv_handle_t opt_args, nkv_handle_t *req) {
    *req = NULL;
    nkv_status_t made = nkv_capi.make_xfer_req(agent, NKV_OP_READ, local, local_idx, count, remote, remote_idx, count,
                                               req, opt_args);
    if (made != NKV_SUCCESS) {
        *req = NULL;
        return made;
    }
    nkv_status_t posted = nkv_capi.post_xfer_req(agent, *req, NULL);
    if (posted != NKV_SUCCESS && posted != NKV_IN_PROG) {
        nkv_capi.release_xfer_req(agent, *req);
        *req = NULL;
    }
    return posted;
}

size_t nkv_statuses(nkv_handle_t agent, nkv_handle_t const *reqs, size_t count, nkv_status_t *out) {
    size_t ended = 0;
    for (size_t i = 0; i < count; i++) {
        out[i] = nkv_capi.get_xfer_status(agent, reqs[i]);
        ended += out[i] != NKV_IN_PROG;
    }
    return ended;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

nkv_status_t nkv_floor_loop(nkv_handle_t agent, nkv_handle_t local, nkv_handle_t remote, const int *idx,
                            size_t count, size_t rounds, double timeout_us, double *micros) {
    for (size_t r = 0; r < rounds; r++) {
        double start = now_us();
        nkv_handle_t req;
        nkv_status_t s = nkv_capi.make_xfer_req(agent, NKV_OP_READ, local, idx, count, remote, idx, count, &req, NULL);
        if (s != NKV_SUCCESS) return s;
        s = nkv_capi.post_xfer_req(agent, req, NULL);
        while (s == NKV_IN_PROG && now_us() - start < timeout_us) s = nkv_capi.get_xfer_status(agent, req);
        if (nkv_capi.release_xfer_req(agent, req) != NKV_SUCCESS && s == NKV_IN_PROG) return NKV_TIMED_OUT;
        if (s == NKV_IN_PROG) return NKV_TIMED_OUT;
        if (s != NKV_SUCCESS) return s;
        micros[r] = now_us() - start;
    }
    return NKV_SUCCESS;
}
