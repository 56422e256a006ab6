/* What _fill.c's kernel offers the other C file of the extension (_events.c, the event
 * engine's compiled loop): the network's arrays as pointers, one re-solve, one removal. */
#ifndef MLFABRIC_FILL_H
#define MLFABRIC_FILL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Row width of the packed per-slot link lists: a count, then up to PACKED - 1 link ids. */
#define PACKED 8

/* The network's per-slot link lists, where the flows' rows are read from. */
typedef struct {
    const int64_t *start, *length, *links;
    const double *weights;
    const int32_t *packed;
    Py_ssize_t n_links, n_entries;
    int unit;
} Slots;

/* A (rate, id) pair, ordered by rate then id: a stable sort by rate of ids in ascending
 * order (FlowNetwork's rate order), or of positions. */
typedef struct {
    double rate;
    int64_t id;
} Ranked;

static inline int ranked_compare(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    if (x->rate != y->rate) return x->rate < y->rate ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* First index in rates[lo:hi] (ascending) whose rate is >= value. */
static inline Py_ssize_t lower_bound(const double *rates, Py_ssize_t lo, Py_ssize_t hi, double value) {
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (rates[mid] < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* FlowNetwork's arrays (see resolve's comment in _fill.c for each one's meaning). */
typedef struct {
    Slots s;
    Py_ssize_t slots;
    const double *cap;
    double *rate;
    char *solved;
    const char *alive;
    const double *capacity;
    double *load;
    uint8_t *perturbed;
    double *share;
    int32_t *link_map;
    int has_caps;
} Net;

/* One re-solve's arguments (the first twelve fields) and results. */
typedef struct {
    const int64_t *ids;
    Py_ssize_t n_given;
    const double *id_rates;
    Py_ssize_t n_filter;
    int64_t *out_ids;
    double *out_rates;
    int64_t *out_changed;
    double *out_changed_rates;
    int full, skip_slack, use_reach;
    double grow;
    Py_ssize_t events, n_out, n_changed, retries, n_resolved, fallbacks, read, grows;
} Resolve;

/* One re-solve: 0, or -1 with a Python error set. */
int fill_resolve(const Net *net, Resolve *r);

/* FlowNetwork.remove_flows' bookkeeping for n distinct live flows (checked first: -1 with a
 * ValueError, changing nothing); sets *lowest (lowest old rate, inf if none solved) and *dead
 * (their entries). */
int fill_remove(const Net *net, double *weight_sum, const int64_t *ids, Py_ssize_t n, double *lowest, Py_ssize_t *dead);

/* Columns of the event engine's per-flow record (engine._FlowClass.record). */
enum { REC_REMAINING, REC_RATE, REC_STAMP, REC_FINISH, REC_WIDTH };

/* The event engine's finish times after an update (see progress in _fill.c); returns how
 * many flows were written to `near`. Ids must be in range. */
Py_ssize_t fill_progress(const int64_t *ids, const double *new_rates, Py_ssize_t n, double *record,
                         char *in_candidates, int64_t *near, double now, double horizon);

/* 0 when every id is in [0, limit); else -1 with ValueError "<what> <id> is out of range". */
int fill_ids_in_range(const int64_t *ids, Py_ssize_t n, Py_ssize_t limit, const char *what);

/* The event engine's finished candidates (see take in _fill.c): those due by threshold go
 * to out (finish set to inf, unmarked), the others stay in cand in order; returns how many
 * stay and sets *taken. Ids must be in range. */
Py_ssize_t fill_take(int64_t *cand, Py_ssize_t n, double *record, char *in_candidates, double threshold, int64_t *out,
                     Py_ssize_t *taken);

/* How many flows the event engine's finish-time candidate set holds after a rebuild (its
 * horizon: the CANDIDATES-th earliest finish), and past how many its horizon is lowered
 * (engine._FlowClass reads both from the module). */
#define CANDIDATES 2048
#define CANDIDATES_MAX (4 * CANDIDATES)

/* The event engine's look at its candidates (see earliest in _fill.c): keeps those due by
 * *horizon (lowering it past CANDIDATES_MAX), sets *first to their earliest finish; returns
 * how many are kept. Ids must be in range. */
Py_ssize_t fill_earliest(int64_t *cand, Py_ssize_t n, const double *record, char *in_candidates, double *horizon,
                         double *first);

/* The event engine's new candidate set (see rebuild in _fill.c): writes the flows due by the
 * new *horizon to cand (ascending) and marks them; returns how many, or -1 with MemoryError. */
Py_ssize_t fill_rebuild(const double *record, Py_ssize_t rows, char *in_candidates, int64_t *cand, double *horizon,
                        double *first);

/* The event engine's compiled loop (_events.c). */
PyObject *run_events(PyObject *self, PyObject *args);

#endif
