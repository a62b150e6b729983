/* NIXL's C API (libnixl_capi.so, shipped in the nixl wheels beside libnixl.so), declared by hand: no header ships.
 * The calls, their arguments and the status codes are those of NIXL's src/bindings/rust/wrapper.h (nixl 1.5.1).
 * The library is opened at run time from the nixl_cu1X package that `import nixl` picked (one libnixl.so in the
 * process), so every call goes through the function table below. */
#ifndef NIXL_KV_NIXL_CAPI_H
#define NIXL_KV_NIXL_CAPI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef int nkv_status_t;         /* nixl_capi_status_t */
#define NKV_SUCCESS 0
#define NKV_IN_PROG 1
#define NKV_TIMED_OUT -100        /* ours: a round of the floor loop outlived its deadline */
#define NKV_MEM_DRAM 0
#define NKV_MEM_VRAM 1
#define NKV_OP_READ 0
#define NKV_SYNC_STRICT 1

typedef void *nkv_handle_t;       /* every opaque nixl_capi_*_t */

typedef struct {                  /* nixl_capi_agent_config_t */
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync;
    unsigned int num_workers;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
} nkv_agent_config_t;

#define NKV_CAPI_CALLS(X) \
    X(nkv_status_t, create_configured_agent, const char *, const nkv_agent_config_t *, nkv_handle_t *) \
    X(nkv_status_t, destroy_agent, nkv_handle_t) \
    X(nkv_status_t, get_local_md, nkv_handle_t, void **, size_t *) \
    X(nkv_status_t, load_remote_md, nkv_handle_t, const void *, size_t, char **) \
    X(nkv_status_t, invalidate_remote_md, nkv_handle_t, const char *) \
    X(nkv_status_t, check_remote_md, nkv_handle_t, const char *, nkv_handle_t) \
    X(nkv_status_t, get_plugin_params, nkv_handle_t, const char *, nkv_handle_t *, nkv_handle_t *) \
    X(nkv_status_t, destroy_mem_list, nkv_handle_t) \
    X(nkv_status_t, destroy_params, nkv_handle_t) \
    X(nkv_status_t, create_backend, nkv_handle_t, const char *, nkv_handle_t, nkv_handle_t *) \
    X(nkv_status_t, destroy_backend, nkv_handle_t) \
    X(nkv_status_t, create_reg_dlist, int, nkv_handle_t *) \
    X(nkv_status_t, destroy_reg_dlist, nkv_handle_t) \
    X(nkv_status_t, reg_dlist_add_desc, nkv_handle_t, uintptr_t, size_t, uint64_t, const void *, size_t) \
    X(nkv_status_t, register_mem, nkv_handle_t, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, deregister_mem, nkv_handle_t, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, agent_make_connection, nkv_handle_t, const char *, nkv_handle_t) \
    X(nkv_status_t, create_xfer_dlist, int, nkv_handle_t *) \
    X(nkv_status_t, destroy_xfer_dlist, nkv_handle_t) \
    X(nkv_status_t, xfer_dlist_add_desc, nkv_handle_t, uintptr_t, size_t, uint64_t) \
    X(nkv_status_t, prep_xfer_dlist, nkv_handle_t, const char *, nkv_handle_t, nkv_handle_t *, nkv_handle_t) \
    X(nkv_status_t, release_xfer_dlist_handle, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, make_xfer_req, nkv_handle_t, int, nkv_handle_t, const int *, size_t, nkv_handle_t, \
      const int *, size_t, nkv_handle_t *, nkv_handle_t) \
    X(nkv_status_t, create_xfer_req, nkv_handle_t, int, nkv_handle_t, nkv_handle_t, const char *, nkv_handle_t *, \
      nkv_handle_t) \
    X(nkv_status_t, post_xfer_req, nkv_handle_t, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, get_xfer_status, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, release_xfer_req, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, destroy_xfer_req, nkv_handle_t) \
    X(nkv_status_t, create_opt_args, nkv_handle_t *) \
    X(nkv_status_t, destroy_opt_args, nkv_handle_t) \
    X(nkv_status_t, opt_args_set_notif_msg, nkv_handle_t, const void *, size_t) \
    X(nkv_status_t, opt_args_set_has_notif, nkv_handle_t, bool) \
    X(nkv_status_t, create_notif_map, nkv_handle_t *) \
    X(nkv_status_t, destroy_notif_map, nkv_handle_t) \
    X(nkv_status_t, get_notifs, nkv_handle_t, nkv_handle_t, nkv_handle_t) \
    X(nkv_status_t, notif_map_size, nkv_handle_t, size_t *) \
    X(nkv_status_t, notif_map_get_agent_at, nkv_handle_t, size_t, const char **) \
    X(nkv_status_t, notif_map_get_notifs_size, nkv_handle_t, const char *, size_t *) \
    X(nkv_status_t, notif_map_get_notif, nkv_handle_t, const char *, size_t, const void **, size_t *) \
    X(nkv_status_t, notif_map_clear, nkv_handle_t) \
    X(nkv_status_t, gen_notif, nkv_handle_t, const char *, const void *, size_t, nkv_handle_t)

#define NKV_DECLARE(ret, name, ...) typedef ret (*nkv_##name##_fn)(__VA_ARGS__);
NKV_CAPI_CALLS(NKV_DECLARE)
#undef NKV_DECLARE

typedef struct {
#define NKV_MEMBER(ret, name, ...) nkv_##name##_fn name;
    NKV_CAPI_CALLS(NKV_MEMBER)
#undef NKV_MEMBER
} nkv_capi_t;

/* The table, once nkv_capi_load succeeded. */
extern nkv_capi_t nkv_capi;

/* Open `path` (libnixl_capi.so) and fill the table; 0, or -1 with a message in `error` naming what is missing. */
int nkv_capi_load(const char *path, char *error, size_t error_len);

/* Post a READ of prepared entries (make + post in one call): the request's handle in *req; the status of the post
 * (NKV_SUCCESS: done already, NKV_IN_PROG, or an error, with *req released). */
nkv_status_t nkv_read(nkv_handle_t agent, nkv_handle_t local, const int *local_idx, nkv_handle_t remote,
                      const int *remote_idx, size_t count, nkv_handle_t opt_args, nkv_handle_t *req);

/* The status of `count` requests at once (one call for a whole poll). Returns how many are no longer IN_PROG. */
size_t nkv_statuses(nkv_handle_t agent, nkv_handle_t const *reqs, size_t count, nkv_status_t *out);

/* The plain C loop of the floor: `rounds` times make + post + poll + release over prepared lists, each round's
 * microseconds in `micros`. 0, the failing status, or NKV_TIMED_OUT once a round outlived `timeout_us` (the READ
 * is released; one UCX cannot cancel may still land). */
nkv_status_t nkv_floor_loop(nkv_handle_t agent, nkv_handle_t local, nkv_handle_t remote, const int *idx,
                            size_t count, size_t rounds, double timeout_us, double *micros);

#endif
