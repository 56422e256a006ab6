/* Compiled loops of MLfabric's update scheduler (mlfabric.ps.scheduler._sched).
 *
 *     .venv/bin/python -m pytest tests/unit/test_ps_scheduler_native.py -q
 *
 * The Python/numpy scheduler (netstate.py, ordering.py, aggregation.py) spends its time in
 * interpreter overhead, not in arithmetic: the residual-capacity timelines it walks hold ~2-20
 * segments, yet a batch of 1,000 updates costs ~50k walks and ~20k subtractions at 5-20 us
 * each. This file runs the same loops on the same timelines, with the same float operations
 * in the same order, so every decision and every number is bit-identical to the Python path
 * (tests/unit/test_ps_scheduler_native.py compares them on random instances):
 *
 *   order(...)      Alg. 2 (Alg. 1 without deadlines) for one server: ordering.order_updates;
 *   order_list(...) a given list reserved in that order (MLfabric-S's second candidate list);
 *   aggregate(...)  Alg. 3's split enumeration for one server: aggregation.aggregate.
 *
 * Network state: link l (host h: up 2h, down 2h + 1) has a timeline of `n` breakpoints `t`
 * and residual rates `r` (rate r[j] on [t[j], t[j+1]), the last forever). Timelines are
 * immutable blocks in an arena; a reservation builds two new blocks and swaps the pointers,
 * so undoing one (a look-ahead drop) or restarting from a snapshot (a split) is a pointer
 * copy, as with the Python lists. Inputs come as C-contiguous float64 / int64 buffers (the
 * initial timelines in CSR form: link_ptr[L + 1] into times / rates); malformed input raises
 * ValueError / TypeError, never reads out of bounds.
 *
 * Compiled with -ffp-contract=off (setup.py): a fused multiply-add would round differently
 * from Python's separate multiply and add.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Alg. 3's pruning margin (aggregation._REL): prune only on a clear loss. */
#define REL 1e-12
/* cannot_fit's safety margin: the byte bound only rules a split out when it misses by more
 * than float rounding could explain (the walk decides the borderline cases exactly). */
#define FIT_MARGIN 1e-9

enum { KEPT = 0, DOOMED = 1, LOOK_AHEAD = 2, NO_CAPACITY = 3 };

/* ------------------------------------------------------------------ arena of timeline blocks */

typedef struct Chunk {
    struct Chunk *prev;
    size_t cap, used;
    double data[];
} Chunk;

typedef struct {
    Chunk *top;
} Arena;

typedef struct {
    Chunk *top;
    size_t used;
} Mark;

static double *arena_alloc(Arena *a, size_t n) {
    if (!a->top || a->top->used + n > a->top->cap) {
        size_t cap = n > ((size_t)1 << 16) ? n : ((size_t)1 << 16);
        Chunk *c = malloc(sizeof(Chunk) + cap * sizeof(double));
        if (!c) return NULL;
        c->prev = a->top;
        c->cap = cap;
        c->used = 0;
        a->top = c;
    }
    double *p = a->top->data + a->top->used;
    a->top->used += n;
    return p;
}

static Mark arena_mark(const Arena *a) {
    Mark m = {a->top, a->top ? a->top->used : 0};
    return m;
}

static void arena_release(Arena *a, Mark m) {
    while (a->top != m.top) {
        Chunk *c = a->top;
        a->top = c->prev;
        free(c);
    }
    if (a->top) a->top->used = m.used;
}

static void arena_free(Arena *a) { arena_release(a, (Mark){NULL, 0}); }

/* ------------------------------------------------------------------ timelines: walk, subtract */

typedef struct {
    Py_ssize_t n;
    const double *t;
    const double *r;
} TL;

/* Index of the segment holding x (bisect_right - 1); -1 if x is before the origin. */
static Py_ssize_t seg_of(const double *t, Py_ssize_t n, double x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < t[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo - 1;
}

/* netstate._walk: send `size` bytes from `start` at min(a, b); returns the completion time
 * (INFINITY if it never completes, NAN if start is before an origin). With pt != NULL the
 * rate profile is recorded (room for a->n + b->n + 1 entries). */
static double walk(const TL *a, const TL *b, double size, double start, double *pt, double *pr, Py_ssize_t *np_out) {
    Py_ssize_t ia = seg_of(a->t, a->n, start), ib = seg_of(b->t, b->n, start), np_ = 0;
    if (np_out) *np_out = 0;
    if (ia < 0 || ib < 0) return NAN;
    double t = start, rem = size;
    for (;;) {
        double na = ia + 1 < a->n ? a->t[ia + 1] : INFINITY;
        double nb = ib + 1 < b->n ? b->t[ib + 1] : INFINITY;
        double nxt = na < nb ? na : nb;
        double x = a->r[ia], y = b->r[ib];
        double r = x < y ? x : y;
        if (pt && (np_ > 0 || r > 0.0) && (np_ == 0 || pr[np_ - 1] != r)) {
            pt[np_] = t;
            pr[np_] = r;
            np_++;
        }
        if (r > 0.0) {
            if (nxt == INFINITY) break;
            double chunk = r * (nxt - t);
            if (chunk >= rem) break;
            rem -= chunk;
        } else if (nxt == INFINITY) {
            if (np_out) *np_out = np_;
            return INFINITY;
        }
        t = nxt;
        if (na == nxt) ia++;
        if (nb == nxt) ib++;
    }
    if (np_out) *np_out = np_;
    double x = a->r[ia], y = b->r[ib];
    return t + rem / (x < y ? x : y);
}

/* netstate._subtract: link `l` minus the profile (pt, pr, np_) on [pt[0], end), equal
 * neighbours merged, into a new arena block. 0 on success, -1 when out of memory. */
static int subtract(Arena *ar, const TL *l, const double *pt, const double *pr, Py_ssize_t np_, double end, TL *out) {
    Py_ssize_t cap = l->n + np_ + 2;
    double *ot = arena_alloc(ar, 2 * (size_t)cap);
    if (!ot) return -1;
    double *orr = ot + cap;
    double t = pt[0];
    Py_ssize_t i = seg_of(l->t, l->n, t), k = 0, j = 0;
    if (i < 0) i = 0; /* profiles never start before the origin (walk checked it) */
    memcpy(ot, l->t, (size_t)i * sizeof(double));
    memcpy(orr, l->r, (size_t)i * sizeof(double));
    k = i;
    if (l->t[i] < t) {
        ot[k] = l->t[i];
        orr[k] = l->r[i];
        k++;
    }
    while (t < end) {
        double nl = i + 1 < l->n ? l->t[i + 1] : INFINITY;
        double np2 = j + 1 < np_ ? pt[j + 1] : end;
        double nxt = nl < np2 ? nl : np2;
        double v = l->r[i] - pr[j];
        if (k == 0 || orr[k - 1] != v) {
            ot[k] = t;
            orr[k] = v;
            k++;
        }
        t = nxt;
        if (nl == nxt) i++;
        if (np2 == nxt) j++;
    }
    if (end < INFINITY) {
        double v = l->r[i];
        if (k == 0 || orr[k - 1] != v) {
            ot[k] = end;
            orr[k] = v;
            k++;
        }
        for (Py_ssize_t m = i + 1; m < l->n; m++) {
            if (orr[k - 1] != l->r[m]) {
                ot[k] = l->t[m];
                orr[k] = l->r[m];
                k++;
            }
        }
    }
    out->n = k;
    out->t = ot;
    out->r = orr;
    return 0;
}

/* netstate._stats: (first time with positive residual, peak residual). */
static void stats(const TL *l, double *first, double *peak) {
    double f = INFINITY, p = l->r[0];
    for (Py_ssize_t j = 0; j < l->n; j++) {
        if (f == INFINITY && l->r[j] > 0.0) f = l->t[j];
        if (l->r[j] > p) p = l->r[j];
    }
    *first = f;
    *peak = p;
}

/* ------------------------------------------------------------------ input checking */

typedef struct {
    Py_buffer b;
    int held;
} Buf;

static void buf_release(Buf *x) {
    if (x->held) PyBuffer_Release(&x->b);
    x->held = 0;
}

/* A C-contiguous 1-d buffer of float64 (kind 'd') or int64 (kind 'q') with `n` items
 * (n < 0: any length). */
static int get_buf(PyObject *o, Buf *x, char kind, Py_ssize_t n, const char *name) {
    if (PyObject_GetBuffer(o, &x->b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "_sched: %s must be a contiguous %s array", name,
                     kind == 'd' ? "float64" : "int64");
        return 0;
    }
    x->held = 1;
    const char *f = x->b.format ? x->b.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = x->b.itemsize == 8 && x->b.ndim <= 1 && strlen(f) == 1 &&
             (kind == 'd' ? *f == 'd' : (*f == 'q' || *f == 'l'));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "_sched: %s must be a 1-d %s array", name, kind == 'd' ? "float64" : "int64");
        return 0;
    }
    if (n >= 0 && x->b.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "_sched: %s must hold %zd items, got %zd", name, n, x->b.len / 8);
        return 0;
    }
    return 1;
}

/* The initial network: L links in CSR form. Checks the structure and the values
 * (times increasing from a common origin, rates finite and >= 0). */
typedef struct {
    Py_ssize_t L;
    TL *tl;
} Net;

static int load_net(Net *net, const Buf *ptr, const Buf *times, const Buf *rates) {
    const int64_t *p = ptr->b.buf;
    Py_ssize_t L = ptr->b.len / 8 - 1, M = times->b.len / 8;
    if (L < 2 || L % 2 || rates->b.len != times->b.len || p[0] != 0 || p[L] != M) {
        PyErr_SetString(PyExc_ValueError, "_sched: link_ptr must be 0..len(times) over an even number of links, "
                                          "times and rates of equal length");
        return 0;
    }
    const double *t = times->b.buf, *r = rates->b.buf;
    net->L = L;
    net->tl = PyMem_Malloc((size_t)L * sizeof(TL));
    if (!net->tl) {
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t l = 0; l < L; l++) {
        if (p[l + 1] <= p[l]) {
            PyErr_Format(PyExc_ValueError, "_sched: link %zd has an empty timeline", l);
            return 0;
        }
        net->tl[l].n = (Py_ssize_t)(p[l + 1] - p[l]);
        net->tl[l].t = t + p[l];
        net->tl[l].r = r + p[l];
        if (t[p[l]] != t[0]) {
            PyErr_Format(PyExc_ValueError, "_sched: link %zd does not start at the origin", l);
            return 0;
        }
        for (int64_t j = p[l]; j < p[l + 1]; j++) {
            if (!(r[j] >= 0.0 && r[j] < INFINITY) || (j > p[l] && !(t[j] > t[j - 1])) || !isfinite(t[j])) {
                PyErr_Format(PyExc_ValueError, "_sched: link %zd: times must increase and rates be finite, >= 0", l);
                return 0;
            }
        }
    }
    return 1;
}

static int check_hosts(const int64_t *h, Py_ssize_t n, Py_ssize_t hosts, const char *name) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (h[i] < 0 || h[i] >= hosts) {
            PyErr_Format(PyExc_ValueError, "_sched: %s[%zd] = %lld is not a host (0..%zd)", name, i, (long long)h[i],
                         hosts - 1);
            return 0;
        }
    }
    return 1;
}

static int check_sizes(const double *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(s[i] >= 0.0 && s[i] < INFINITY)) {
            PyErr_Format(PyExc_ValueError, "_sched: size %zd must be finite and >= 0", i);
            return 0;
        }
    }
    return 1;
}

/* Python objects for a recorded profile. */
static PyObject *floats(const double *x, Py_ssize_t n) {
    PyObject *tup = PyTuple_New(n);
    if (!tup) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyFloat_FromDouble(x[i]);
        if (!f) {
            Py_DECREF(tup);
            return NULL;
        }
        PyTuple_SET_ITEM(tup, i, f);
    }
    return tup;
}

/* ------------------------------------------------------------------ ordering (Alg. 1 / Alg. 2) */

typedef struct {
    Py_ssize_t N, L;
    const int64_t *src;
    const double *size;
    int64_t server;
    double start;
    TL *cur;      /* the state */
    double *ff;   /* per link: first time with residual */
    double *pk;   /* per link: peak residual */
    Arena arena;
    double *pt, *pr; /* profile scratch */
    Py_ssize_t scratch;
    /* remaining updates in (key, index) order: a doubly linked list */
    double *key;
    Py_ssize_t *next, *prev, head;
    char *alive;
    Py_ssize_t n_alive;
    Py_ssize_t *excl; /* stamp per update: excluded from ShrtUp when == stamp */
    Py_ssize_t stamp;
} Ord;

/* Grow the rate-profile scratch (times *pt, rates *pr, capacity *cap) to hold a walk over
   links a and b: at most one segment per breakpoint of either, plus the ends. 0 on no memory. */
static int profile_scratch(double **pt, double **pr, Py_ssize_t *cap, const TL *a, const TL *b) {
    Py_ssize_t need = a->n + b->n + 2;
    if (need <= *cap) return 1;
    Py_ssize_t grown = need * 2;
    double *t = PyMem_Realloc(*pt, (size_t)grown * sizeof(double));
    if (!t) return 0;
    *pt = t;
    double *r = PyMem_Realloc(*pr, (size_t)grown * sizeof(double));
    if (!r) return 0;
    *pr = r;
    *cap = grown;
    return 1;
}

static int ord_scratch(Ord *o, const TL *a, const TL *b) {
    return profile_scratch(&o->pt, &o->pr, &o->scratch, a, b);
}

static int is_local(const Ord *o, Py_ssize_t g) { return o->src[g] == o->server || o->size[g] <= 0.0; }

/* t_en of update g straight to the server on the current state. */
static double ord_t_en(const Ord *o, Py_ssize_t g) {
    if (is_local(o, g)) return o->start;
    return walk(&o->cur[2 * o->src[g]], &o->cur[2 * o->server + 1], o->size[g], o->start, NULL, NULL, NULL);
}

static void ord_remove(Ord *o, Py_ssize_t g) {
    if (!o->alive[g]) return;
    o->alive[g] = 0;
    o->n_alive--;
    if (o->prev[g] >= 0) o->next[o->prev[g]] = o->next[g];
    else o->head = o->next[g];
    if (o->next[g] >= 0) o->prev[o->next[g]] = o->prev[g];
}

/* ShrtUp (ordering._Fast.shortest): the remaining update with the smallest t_en, scanning in
 * key order and stopping at the first lower bound above the best exact t_en. If every
 * candidate is unreachable (all INF) the smallest index is returned, as the reference does. */
static double shortest(Ord *o, int use_excl, Py_ssize_t *g_out) {
    Py_ssize_t D = 2 * o->server + 1;
    double base = o->start >= o->ff[D] ? o->start : o->ff[D];
    double best = INFINITY;
    Py_ssize_t best_g = -1;
    for (Py_ssize_t g = o->head; g >= 0; g = o->next[g]) {
        double key = o->key[g];
        if (base + key > best) break;
        if (use_excl && o->excl[g] == o->stamp) continue;
        double fu = o->ff[2 * o->src[g]];
        double lb = (base >= fu ? base : fu) + key;
        if (lb > best) continue;
        double e = ord_t_en(o, g);
        if (e < best || (e == best && g < best_g)) {
            best = e;
            best_g = g;
        }
    }
    if (best_g < 0) {
        for (Py_ssize_t g = 0; g < o->N; g++) {
            if (o->alive[g] && !(use_excl && o->excl[g] == o->stamp)) {
                best_g = g;
                break;
            }
        }
    }
    *g_out = best_g;
    return best;
}

/* ordering._pick_due: the due update (index order) with the smallest t_en. */
static double pick_due(const Ord *o, const Py_ssize_t *due, Py_ssize_t n, Py_ssize_t *g_out) {
    double best = INFINITY;
    Py_ssize_t best_g = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t g = due[i];
        double e = ord_t_en(o, g);
        if (e < best || (e == best && g < best_g) || best_g < 0) {
            best = e;
            best_g = g;
        }
    }
    *g_out = best_g;
    return best;
}

/* Reserve update g on the state (NetUp); records its profile in o->pt/o->pr. Returns the
 * end, or NAN after setting an exception. The two replaced links are saved in `saved`. */
typedef struct {
    Py_ssize_t link[2];
    TL tl[2];
    double ff[2], pk[2];
    int count;
} Saved;

static double ord_reserve(Ord *o, Py_ssize_t g, Py_ssize_t *np_out, Saved *saved) {
    saved->count = 0;
    *np_out = 0;
    if (is_local(o, g)) return o->start;
    Py_ssize_t a = 2 * o->src[g], b = 2 * o->server + 1;
    if (!ord_scratch(o, &o->cur[a], &o->cur[b])) {
        PyErr_NoMemory();
        return NAN;
    }
    double end = walk(&o->cur[a], &o->cur[b], o->size[g], o->start, o->pt, o->pr, np_out);
    if (!(end < INFINITY)) {
        PyErr_SetString(PyExc_ValueError, "_sched: a transfer never completes: the path has no capacity left");
        return NAN;
    }
    Py_ssize_t links[2] = {a, b};
    for (int s = 0; s < 2; s++) {
        Py_ssize_t l = links[s];
        TL out;
        saved->link[s] = l;
        saved->tl[s] = o->cur[l];
        saved->ff[s] = o->ff[l];
        saved->pk[s] = o->pk[l];
        if (subtract(&o->arena, &o->cur[l], o->pt, o->pr, *np_out, end, &out) < 0) {
            PyErr_NoMemory();
            return NAN;
        }
        o->cur[l] = out;
        stats(&out, &o->ff[l], &o->pk[l]);
        saved->count = s + 1;
    }
    return end;
}

static void ord_undo(Ord *o, const Saved *saved) {
    for (int s = saved->count - 1; s >= 0; s--) {
        Py_ssize_t l = saved->link[s];
        o->cur[l] = saved->tl[s];
        o->ff[l] = saved->ff[s];
        o->pk[l] = saved->pk[s];
    }
}

static const double *sort_keys;
static int key_cmp(const void *x, const void *y) {
    Py_ssize_t a = *(const Py_ssize_t *)x, b = *(const Py_ssize_t *)y;
    double ka = sort_keys[a], kb = sort_keys[b];
    if (ka != kb) return ka < kb ? -1 : 1;
    return (a > b) - (a < b);
}

static void ord_free(Ord *o) {
    arena_free(&o->arena);
    PyMem_Free(o->cur);
    PyMem_Free(o->ff);
    PyMem_Free(o->pk);
    PyMem_Free(o->pt);
    PyMem_Free(o->pr);
    PyMem_Free(o->key);
    PyMem_Free(o->next);
    PyMem_Free(o->prev);
    PyMem_Free(o->alive);
    PyMem_Free(o->excl);
}

/* Common setup of order() and order_list(): state, keys (ordering._Fast), key order. */
static int ord_init(Ord *o, const Net *net, const int64_t *src, const double *size, Py_ssize_t N, int64_t server,
                    double start) {
    memset(o, 0, sizeof(*o));
    o->N = N;
    o->L = net->L;
    o->src = src;
    o->size = size;
    o->server = server;
    o->start = start;
    o->head = -1;
    Py_ssize_t L = net->L, M = N > 0 ? N : 1;
    o->cur = PyMem_Malloc((size_t)L * sizeof(TL));
    o->ff = PyMem_Malloc((size_t)L * sizeof(double));
    o->pk = PyMem_Malloc((size_t)L * sizeof(double));
    o->key = PyMem_Malloc((size_t)M * sizeof(double));
    o->next = PyMem_Malloc((size_t)M * sizeof(Py_ssize_t));
    o->prev = PyMem_Malloc((size_t)M * sizeof(Py_ssize_t));
    o->alive = PyMem_Malloc((size_t)M);
    o->excl = PyMem_Calloc((size_t)M, sizeof(Py_ssize_t));
    Py_ssize_t *idx = PyMem_Malloc((size_t)M * sizeof(Py_ssize_t));
    if (!o->cur || !o->ff || !o->pk || !o->key || !o->next || !o->prev || !o->alive || !o->excl || !idx) {
        PyMem_Free(idx);
        PyErr_NoMemory();
        return 0;
    }
    memcpy(o->cur, net->tl, (size_t)L * sizeof(TL));
    for (Py_ssize_t l = 0; l < L; l++) stats(&o->cur[l], &o->ff[l], &o->pk[l]);
    if (start < o->cur[0].t[0]) {
        PyMem_Free(idx);
        PyErr_Format(PyExc_ValueError, "_sched: start %g is before the network state's origin %g", start,
                     o->cur[0].t[0]);
        return 0;
    }
    Py_ssize_t D = 2 * server + 1;
    for (Py_ssize_t g = 0; g < N; g++) {
        /* the transfer time on the empty path (ordering._Fast: sizes / min(peaks), 0 when
         * local or empty, nan -> inf) */
        double pu = o->pk[2 * src[g]], pd = o->pk[D];
        double rate = pu < pd ? pu : pd;
        double k = (src[g] == server || size[g] <= 0.0) ? 0.0 : size[g] / rate;
        o->key[g] = isnan(k) ? INFINITY : k;
        o->alive[g] = 1;
        idx[g] = g;
    }
    sort_keys = o->key;
    qsort(idx, (size_t)N, sizeof(Py_ssize_t), key_cmp);
    for (Py_ssize_t i = 0; i < N; i++) {
        Py_ssize_t g = idx[i];
        o->prev[g] = i > 0 ? idx[i - 1] : -1;
        o->next[g] = i + 1 < N ? idx[i + 1] : -1;
    }
    o->head = N > 0 ? idx[0] : -1;
    o->n_alive = N;
    PyMem_Free(idx);
    return 1;
}

static int emit(PyObject *out, Py_ssize_t g, int kind, Py_ssize_t pos, double end, double begin, const Ord *o,
                Py_ssize_t np_) {
    PyObject *pt = floats(o->pt, np_), *pr = pt ? floats(o->pr, np_) : NULL;
    PyObject *item = pr ? Py_BuildValue("(nin" "ddOO)", g, kind, pos, end, begin, pt, pr) : NULL;
    Py_XDECREF(pt);
    Py_XDECREF(pr);
    if (!item) return 0;
    int rc = PyList_Append(out, item);
    Py_DECREF(item);
    return rc == 0;
}

static int emit_drop(PyObject *out, Py_ssize_t g, int kind) {
    PyObject *item = Py_BuildValue("(nin" "dd()())", g, kind, (Py_ssize_t)0, 0.0, 0.0);
    if (!item) return 0;
    int rc = PyList_Append(out, item);
    Py_DECREF(item);
    return rc == 0;
}

/* Parse the common arguments: link_ptr, times, rates, src, sizes, server, start. */
typedef struct {
    Buf ptr, times, rates, src, sizes, extra;
    Net net;
    Py_ssize_t N;
} Common;

static void common_release(Common *c) {
    buf_release(&c->ptr);
    buf_release(&c->times);
    buf_release(&c->rates);
    buf_release(&c->src);
    buf_release(&c->sizes);
    buf_release(&c->extra);
    PyMem_Free(c->net.tl);
}

static int common_load(Common *c, PyObject *ptr, PyObject *times, PyObject *rates, PyObject *src, PyObject *sizes,
                       long long server) {
    if (!get_buf(ptr, &c->ptr, 'q', -1, "link_ptr") || !get_buf(times, &c->times, 'd', -1, "times") ||
        !get_buf(rates, &c->rates, 'd', -1, "rates") || !load_net(&c->net, &c->ptr, &c->times, &c->rates))
        return 0;
    Py_ssize_t hosts = c->net.L / 2;
    if (!get_buf(src, &c->src, 'q', -1, "src")) return 0;
    c->N = c->src.b.len / 8;
    if (!get_buf(sizes, &c->sizes, 'd', c->N, "sizes")) return 0;
    if (!check_hosts(c->src.b.buf, c->N, hosts, "src") || !check_sizes(c->sizes.b.buf, c->N)) return 0;
    if (server < 0 || server >= hosts) {
        PyErr_Format(PyExc_ValueError, "_sched: server %lld is not a host (0..%zd)", server, hosts - 1);
        return 0;
    }
    return 1;
}

/* order(link_ptr, times, rates, src, sizes, server, deadlines or None, start) -> list of
 * decisions (index, kind, position, end, begin, profile times, profile rates), in the order
 * ordering.order_updates makes them. */
static PyObject *order(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_ptr, *o_times, *o_rates, *o_src, *o_sizes, *o_dl;
    long long server;
    double start;
    if (!PyArg_ParseTuple(args, "OOOOOLOd", &o_ptr, &o_times, &o_rates, &o_src, &o_sizes, &server, &o_dl, &start))
        return NULL;
    Common c;
    memset(&c, 0, sizeof(c));
    Ord o;
    memset(&o, 0, sizeof(o));
    PyObject *out = NULL;
    Py_ssize_t *bucket_ptr = NULL, *bucket = NULL, *due = NULL, *due2 = NULL;
    if (!common_load(&c, o_ptr, o_times, o_rates, o_src, o_sizes, server)) goto done;
    Py_ssize_t N = c.N;
    const int64_t *dl = NULL;
    if (o_dl != Py_None) {
        if (!get_buf(o_dl, &c.extra, 'q', N, "deadlines")) goto done;
        dl = c.extra.b.buf;
    }
    if (!ord_init(&o, &c.net, c.src.b.buf, c.sizes.b.buf, N, server, start)) goto done;
    /* deadline buckets for d = 0..N + 2 (larger deadlines are never due nor doomed), index order */
    Py_ssize_t B = N + 3;
    bucket_ptr = PyMem_Calloc((size_t)B + 1, sizeof(Py_ssize_t));
    bucket = PyMem_Malloc((size_t)(N > 0 ? N : 1) * sizeof(Py_ssize_t));
    due = PyMem_Malloc((size_t)(N > 0 ? N : 1) * sizeof(Py_ssize_t));
    due2 = PyMem_Malloc((size_t)(N > 0 ? N : 1) * sizeof(Py_ssize_t));
    out = PyList_New(0);
    if (!bucket_ptr || !bucket || !due || !due2 || !out) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    if (dl) {
        for (Py_ssize_t g = 0; g < N; g++)
            if (dl[g] >= 0 && dl[g] < B) bucket_ptr[dl[g] + 1]++;
        for (Py_ssize_t d = 0; d < B; d++) bucket_ptr[d + 1] += bucket_ptr[d];
        Py_ssize_t *fill = PyMem_Malloc((size_t)B * sizeof(Py_ssize_t));
        if (!fill) {
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(fill, bucket_ptr, (size_t)B * sizeof(Py_ssize_t));
        for (Py_ssize_t g = 0; g < N; g++)
            if (dl[g] >= 0 && dl[g] < B) bucket[fill[dl[g]]++] = g;
        PyMem_Free(fill);
        for (Py_ssize_t g = 0; g < N; g++) {
            if (dl[g] < 1) {
                ord_remove(&o, g);
                if (!emit_drop(out, g, DOOMED)) goto fail;
            }
        }
    }
    Py_ssize_t p = 1, checked = 0;
    while (o.n_alive > 0) {
        /* doomed: only the bucket dl == p - 1 can become doomed after a kept update */
        if (dl) {
            while (checked < p - 1) {
                checked++;
                if (checked >= B) continue;
                for (Py_ssize_t j = bucket_ptr[checked]; j < bucket_ptr[checked + 1]; j++) {
                    Py_ssize_t g = bucket[j];
                    if (o.alive[g]) {
                        ord_remove(&o, g);
                        if (!emit_drop(out, g, DOOMED)) goto fail;
                    }
                }
            }
            if (o.n_alive == 0) break;
        }
        Py_ssize_t n_due = 0, g_star;
        if (dl && p < B)
            for (Py_ssize_t j = bucket_ptr[p]; j < bucket_ptr[p + 1]; j++)
                if (o.alive[bucket[j]]) due[n_due++] = bucket[j];
        double e_star = n_due ? pick_due(&o, due, n_due, &g_star) : shortest(&o, 0, &g_star);
        ord_remove(&o, g_star);
        if (e_star == INFINITY) {
            if (!emit_drop(out, g_star, NO_CAPACITY)) goto fail;
            continue;
        }
        Py_ssize_t np_;
        Saved saved;
        double end = ord_reserve(&o, g_star, &np_, &saved);
        if (isnan(end)) goto fail;
        if (n_due && o.n_alive > 0) {
            /* look-ahead on the reserved state: who would take position p + 1? The other
             * updates due at p are doomed at p + 1 and cannot be "next". */
            o.stamp++;
            Py_ssize_t n_doomed_next = 0;
            for (Py_ssize_t i = 0; i < n_due; i++)
                if (due[i] != g_star) {
                    o.excl[due[i]] = o.stamp;
                    n_doomed_next++;
                }
            Py_ssize_t n_due2 = 0, g_next = -1;
            if (p + 1 < B)
                for (Py_ssize_t j = bucket_ptr[p + 1]; j < bucket_ptr[p + 2]; j++)
                    if (o.alive[bucket[j]]) due2[n_due2++] = bucket[j];
            double e_next = INFINITY;
            if (n_due2) e_next = pick_due(&o, due2, n_due2, &g_next);
            else if (o.n_alive > n_doomed_next) e_next = shortest(&o, 1, &g_next);
            if (g_next >= 0 && e_star > e_next) {
                ord_undo(&o, &saved);
                if (!emit_drop(out, g_star, LOOK_AHEAD)) goto fail;
                continue;
            }
        }
        double begin = np_ > 0 ? o.pt[0] : end;
        if (is_local(&o, g_star)) begin = start;
        if (!emit(out, g_star, KEPT, p, e_star, begin, &o, np_)) goto fail;
        p++;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(bucket_ptr);
    PyMem_Free(bucket);
    PyMem_Free(due);
    PyMem_Free(due2);
    ord_free(&o);
    common_release(&c);
    return out;
}

/* order_list(link_ptr, times, rates, src, sizes, server, order, start) -> decisions: the
 * updates of `order` reserved in that order (ordering.list_order), an unreachable one dropped
 * ("no-capacity"). */
static PyObject *order_list(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_ptr, *o_times, *o_rates, *o_src, *o_sizes, *o_list;
    long long server;
    double start;
    if (!PyArg_ParseTuple(args, "OOOOOLOd", &o_ptr, &o_times, &o_rates, &o_src, &o_sizes, &server, &o_list, &start))
        return NULL;
    Common c;
    memset(&c, 0, sizeof(c));
    Ord o;
    memset(&o, 0, sizeof(o));
    PyObject *out = NULL;
    char *seen = NULL;
    if (!common_load(&c, o_ptr, o_times, o_rates, o_src, o_sizes, server)) goto done;
    if (!get_buf(o_list, &c.extra, 'q', -1, "order")) goto done;
    Py_ssize_t K = c.extra.b.len / 8;
    const int64_t *lst = c.extra.b.buf;
    seen = PyMem_Calloc((size_t)(c.N > 0 ? c.N : 1), 1);
    if (!seen) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < K; i++) {
        if (lst[i] < 0 || lst[i] >= c.N || seen[lst[i]]) {
            PyErr_SetString(PyExc_ValueError, "_sched: order must list distinct update indices");
            goto done;
        }
        seen[lst[i]] = 1;
    }
    if (!ord_init(&o, &c.net, c.src.b.buf, c.sizes.b.buf, c.N, server, start)) goto done;
    out = PyList_New(0);
    if (!out) goto done;
    Py_ssize_t p = 1;
    for (Py_ssize_t i = 0; i < K; i++) {
        Py_ssize_t g = lst[i], np_;
        double e = ord_t_en(&o, g);
        if (e == INFINITY) {
            if (!emit_drop(out, g, NO_CAPACITY)) goto fail;
            continue;
        }
        Saved saved;
        double end = ord_reserve(&o, g, &np_, &saved);
        if (isnan(end)) goto fail;
        double begin = np_ > 0 ? o.pt[0] : end;
        if (is_local(&o, g)) begin = start;
        if (!emit(out, g, KEPT, p, e, begin, &o, np_)) goto fail;
        p++;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(seen);
    ord_free(&o);
    common_release(&c);
    return out;
}

/* ------------------------------------------------------------------ aggregation (Alg. 3) */

typedef struct {
    Py_ssize_t N, L, k, B; /* kept updates, links, aggregators, batch size */
    const int64_t *src, *order, *hosts;
    const double *size, *ends;
    int64_t server;
    double start;
    int sync;
    const TL *initial;
    TL *cur;
    /* the direct reservations' effect: log entry i = (step, link, new timeline) */
    Py_ssize_t n_log;
    Py_ssize_t *log_step, *log_link;
    TL *log_tl;
    double *commit_direct, *prefix_sum, *commit; /* commit: per position of the current split */
    Arena arena;
    double *pt, *pr;
    Py_ssize_t scratch;
    /* record mode (the chosen split): Python lists */
    PyObject *members, *groups;
} Agg;

static int agg_scratch(Agg *a, const TL *x, const TL *y) {
    return profile_scratch(&a->pt, &a->pr, &a->scratch, x, y);
}

/* Append head + (profile times, profile rates) to `list`; steals `head`. */
static int append_record(PyObject *list, PyObject *head, const double *pt, const double *pr, Py_ssize_t np_) {
    PyObject *t = head ? floats(pt, np_) : NULL, *r = t ? floats(pr, np_) : NULL;
    PyObject *tail = r ? PyTuple_Pack(2, t, r) : NULL, *item = tail ? PySequence_Concat(head, tail) : NULL;
    int ok = item && PyList_Append(list, item) == 0;
    Py_XDECREF(item);
    Py_XDECREF(tail);
    Py_XDECREF(t);
    Py_XDECREF(r);
    Py_XDECREF(head);
    return ok;
}

/* Subtract the recorded profile (a->pt, a->pr, np_) ending at `end` from links up and down. */
static int agg_apply(Agg *a, Py_ssize_t up, Py_ssize_t down, Py_ssize_t np_, double end) {
    TL out;
    if (subtract(&a->arena, &a->cur[up], a->pt, a->pr, np_, end, &out) < 0) goto oom;
    a->cur[up] = out;
    if (subtract(&a->arena, &a->cur[down], a->pt, a->pr, np_, end, &out) < 0) goto oom;
    a->cur[down] = out;
    return 1;
oom:
    PyErr_NoMemory();
    return 0;
}

/* Walk up -> down from `from` on the current state, recording the profile. */
static double agg_walk(Agg *a, Py_ssize_t up, Py_ssize_t down, double size, double from, Py_ssize_t *np_) {
    *np_ = 0;
    if (!agg_scratch(a, &a->cur[up], &a->cur[down])) {
        PyErr_NoMemory();
        return NAN;
    }
    double e = walk(&a->cur[up], &a->cur[down], size, from, a->pt, a->pr, np_);
    if (isnan(e)) PyErr_SetString(PyExc_ValueError, "_sched: a transfer starts before the network state's origin");
    return e;
}

/* Result of one split. */
typedef struct {
    int status; /* 1 feasible, 0 infeasible or pruned, -1 error */
    double obj_async, obj_sync;
} SplitOut;

/* aggregation._Splits.det_agg(n) with the same pruning against `bound`; in record mode the
 * members' and groups' schedules are appended to a->members / a->groups. */
static SplitOut det_agg(Agg *a, Py_ssize_t n, double bound, int record) {
    SplitOut res = {0, 0.0, 0.0};
    Py_ssize_t N = a->N, D = 2 * a->server + 1;
    Mark mark = arena_mark(&a->arena);
    /* the ordering step's snapshot n: the initial state plus the first n direct reservations */
    memcpy(a->cur, a->initial, (size_t)a->L * sizeof(TL));
    for (Py_ssize_t j = 0; j < a->n_log && a->log_step[j] < n; j++) a->cur[a->log_link[j]] = a->log_tl[j];
    int has_tmax = n > 0; /* t_max is None for n = 0: group 1's constraint is vacuous */
    double t_max = has_tmax ? a->commit_direct[n - 1] : 0.0;
    double known = a->prefix_sum[n];
    for (Py_ssize_t i = 0; i < n; i++) a->commit[i] = a->commit_direct[i];
    double limit = bound < INFINITY ? bound * (1 + REL) : INFINITY;
    double ready = a->start;
    Py_ssize_t aid = 0, i = n, mstart = n;
    for (;;) {
        int closing = i >= N, local = 0;
        double e = 0.0;
        Py_ssize_t g = -1, host = -1, np_ = 0;
        if (!closing) {
            if (aid >= a->k) goto out; /* updates left after the last aggregator: infeasible */
            g = a->order[i];
            host = a->hosts[aid];
            local = a->src[g] == host || a->size[g] <= 0.0;
            if (local) e = a->start;
            else e = agg_walk(a, 2 * a->src[g], 2 * host + 1, a->size[g], a->start, &np_);
            if (isnan(e)) goto fail;
            closing = has_tmax && e > t_max;
        }
        if (closing) {
            if (i > mstart) { /* close the group: its aggregate goes to the server from `ready` */
                Py_ssize_t ah = a->hosts[aid], anp = 0;
                double big = a->size[a->order[mstart]];
                for (Py_ssize_t m = mstart + 1; m < i; m++)
                    if (a->size[a->order[m]] > big) big = a->size[a->order[m]];
                double arrival = ready;
                if (big > 0.0) {
                    arrival = agg_walk(a, 2 * ah, D, big, ready, &anp);
                    if (isnan(arrival)) goto fail;
                    if (arrival == INFINITY) {
                        PyErr_SetString(PyExc_ValueError,
                                        "_sched: an aggregate never completes: the path has no capacity left");
                        goto fail;
                    }
                    if (!agg_apply(a, 2 * ah, D, anp, arrival)) goto fail;
                }
                double c = has_tmax ? (t_max >= arrival ? t_max : arrival) : arrival;
                for (Py_ssize_t m = mstart; m < i; m++) a->commit[m] = c;
                known += (double)(i - mstart) * c;
                t_max = c;
                has_tmax = 1;
                if (record && !append_record(a->groups,
                                             Py_BuildValue("(nLnndddd)", aid + 1, (long long)ah, mstart, i, ready,
                                                           big, arrival, c),
                                             a->pt, a->pr, anp))
                    goto fail;
                if (i < N) {
                    /* every update still to place commits at >= t_max (running maximum) */
                    double lb = a->sync ? t_max : (known + (double)(N - i) * t_max) / (double)N;
                    if (lb > limit) goto out;
                }
            }
            if (i >= N) break;
            aid++;
            mstart = i;
            ready = a->start;
            continue;
        }
        if (e == INFINITY) goto out;
        if (!local && !agg_apply(a, 2 * a->src[g], 2 * host + 1, np_, e)) goto fail;
        if (record && !append_record(a->members, Py_BuildValue("(nLd)", g, (long long)host, e), a->pt, a->pr,
                                     local ? 0 : np_))
            goto fail;
        ready = ready >= e ? ready : e;
        i++;
    }
    /* objectives(): a plain left-to-right sum, as aggregation.objectives computes it */
    double total = 0.0, worst = 0.0;
    for (Py_ssize_t m = 0; m < N; m++) {
        total += a->commit[m];
        if (m == 0 || a->commit[m] > worst) worst = a->commit[m];
    }
    res.status = 1;
    res.obj_async = N ? total / (double)N : 0.0;
    res.obj_sync = N ? worst : 0.0;
    goto out;
fail:
    res.status = -1;
out:
    arena_release(&a->arena, mark);
    return res;
}

/* A lower bound of split n's objective from its direct group alone: every later update
 * commits at >= the direct group's last commit (n = 0: no bound). Nondecreasing in n. */
static double prefix_bound(const Agg *a, Py_ssize_t n) {
    if (n == 0) return -INFINITY;
    double cd = a->commit_direct[n - 1];
    return a->sync ? cd : (a->prefix_sum[n] + (double)(a->N - n) * cd) / (double)a->N;
}

/* Bytes link `l` can still carry on [t0, t1] (NetState.capacity_integral). */
static double capacity_integral(const TL *l, double t0, double t1) {
    if (t1 <= t0) return 0.0;
    Py_ssize_t i = seg_of(l->t, l->n, t0);
    if (i < 0) i = 0;
    double total = 0.0, t = t0 > l->t[0] ? t0 : l->t[0];
    while (t < t1) {
        double nxt = i + 1 < l->n ? l->t[i + 1] : INFINITY;
        double seg_end = nxt < t1 ? nxt : t1;
        total += l->r[i] * (seg_end - t);
        t = seg_end;
        i++;
        if (i >= l->n) i = l->n - 1;
    }
    return total;
}

/* aggregation._Splits.cannot_fit: the k aggregators provably cannot take updates n.. (a
 * byte bound on their down links, see the Python docstring), with a rounding margin. */
static int cannot_fit(const Agg *a, Py_ssize_t n, const double *suffix_need, const double *suffix_big,
                      const double *suffix_local) {
    if (n == 0 || n >= a->N) return 0;
    double need = suffix_need[n], biggest = suffix_big[n];
    double t = a->commit_direct[n - 1], cap = 0.0;
    Py_ssize_t S = a->server;
    for (Py_ssize_t j = 0; j < a->k; j++) {
        Py_ssize_t h = a->hosts[j];
        cap += capacity_integral(&a->initial[2 * h + 1], a->start, t) + suffix_local[j * (a->N + 1) + n];
        if (cap >= need * (1 - FIT_MARGIN)) return 0;
        t = walk(&a->initial[2 * h], &a->initial[2 * S + 1], biggest, t, NULL, NULL, NULL);
        if (!(t < INFINITY)) return cap < need * (1 - FIT_MARGIN) && t == INFINITY;
    }
    return cap < need * (1 - FIT_MARGIN);
}

static void agg_free(Agg *a) {
    arena_free(&a->arena);
    PyMem_Free(a->cur);
    PyMem_Free(a->log_step);
    PyMem_Free(a->log_link);
    PyMem_Free(a->log_tl);
    PyMem_Free(a->commit_direct);
    PyMem_Free(a->prefix_sum);
    PyMem_Free(a->commit);
    PyMem_Free(a->pt);
    PyMem_Free(a->pr);
}

/* aggregate(link_ptr, times, rates, src, sizes, server, order, ends, prof_ptr, prof_t, prof_r,
 *           hosts, sync, start)
 * -> (split, splits_tried, obj_async, obj_sync, members, groups)
 *
 * `order` are the kept updates in application order, `ends[i]` the end of order[i]'s direct
 * transfer and prof_* its rate profile (CSR); `hosts[j]` is group j + 1's aggregator. The
 * split is the one aggregation.aggregate chooses (smallest objective, ties to the smaller
 * n); members: (index, aggregator host, end, profile times, profile rates) of each update
 * of an aggregated group; groups: (slot, host, first, last + 1 position, ready, aggregate
 * size, arrival, commit, profile times, profile rates). */
static PyObject *aggregate(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_ptr, *o_times, *o_rates, *o_src, *o_sizes, *o_order, *o_ends, *o_pptr, *o_pt, *o_pr, *o_hosts;
    long long server;
    int sync;
    double start;
    if (!PyArg_ParseTuple(args, "OOOOOLOOOOOOpd", &o_ptr, &o_times, &o_rates, &o_src, &o_sizes, &server, &o_order,
                          &o_ends, &o_pptr, &o_pt, &o_pr, &o_hosts, &sync, &start))
        return NULL;
    Common c;
    memset(&c, 0, sizeof(c));
    Buf b_ends = {0}, b_pptr = {0}, b_pt = {0}, b_pr = {0}, b_hosts = {0};
    Agg a;
    memset(&a, 0, sizeof(a));
    PyObject *result = NULL;
    double *suffix_need = NULL, *suffix_big = NULL, *suffix_local = NULL;
    char *seen = NULL, *walked = NULL;
    if (!common_load(&c, o_ptr, o_times, o_rates, o_src, o_sizes, server)) goto done;
    if (!get_buf(o_order, &c.extra, 'q', -1, "order")) goto done;
    Py_ssize_t N = c.extra.b.len / 8, hosts_n = c.net.L / 2;
    if (!get_buf(o_ends, &b_ends, 'd', N, "ends") || !get_buf(o_pptr, &b_pptr, 'q', N + 1, "prof_ptr") ||
        !get_buf(o_pt, &b_pt, 'd', -1, "prof_t") || !get_buf(o_pr, &b_pr, 'd', b_pt.b.len / 8, "prof_r") ||
        !get_buf(o_hosts, &b_hosts, 'q', -1, "hosts"))
        goto done;
    a.N = N;
    a.L = c.net.L;
    a.B = c.N;
    a.k = b_hosts.b.len / 8;
    a.src = c.src.b.buf;
    a.size = c.sizes.b.buf;
    a.order = c.extra.b.buf;
    a.hosts = b_hosts.b.buf;
    a.ends = b_ends.b.buf;
    a.server = server;
    a.start = start;
    a.sync = sync;
    a.initial = c.net.tl;
    const int64_t *pp = b_pptr.b.buf;
    const double *prt = b_pt.b.buf, *prr = b_pr.b.buf;
    Py_ssize_t P = b_pt.b.len / 8;
    seen = PyMem_Calloc((size_t)(a.B > 0 ? a.B : 1), 1);
    if (!seen) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < N; i++) {
        if (a.order[i] < 0 || a.order[i] >= a.B || seen[a.order[i]]) {
            PyErr_SetString(PyExc_ValueError, "_sched: order must list distinct update indices");
            goto done;
        }
        seen[a.order[i]] = 1;
        if (pp[i] < 0 || pp[i + 1] < pp[i] || pp[i + 1] > P || !(a.ends[i] >= start && a.ends[i] < INFINITY)) {
            PyErr_SetString(PyExc_ValueError, "_sched: prof_ptr must index prof_t in order and ends be finite");
            goto done;
        }
    }
    if (N > 0 && pp[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "_sched: prof_ptr must start at 0");
        goto done;
    }
    if (!check_hosts(a.hosts, a.k, hosts_n, "hosts")) goto done;
    for (Py_ssize_t j = 0; j < a.k; j++) {
        for (Py_ssize_t m = 0; m < j; m++)
            if (a.hosts[m] == a.hosts[j]) {
                PyErr_SetString(PyExc_ValueError, "_sched: aggregator hosts must be distinct");
                goto done;
            }
        if (a.hosts[j] == server) {
            PyErr_SetString(PyExc_ValueError, "_sched: an aggregator may not sit on the server host");
            goto done;
        }
    }
    if (start < a.initial[0].t[0]) {
        PyErr_Format(PyExc_ValueError, "_sched: start %g is before the network state's origin", start);
        goto done;
    }
    Py_ssize_t M = N > 0 ? N : 1;
    a.cur = PyMem_Malloc((size_t)a.L * sizeof(TL));
    a.log_step = PyMem_Malloc((size_t)2 * M * sizeof(Py_ssize_t));
    a.log_link = PyMem_Malloc((size_t)2 * M * sizeof(Py_ssize_t));
    a.log_tl = PyMem_Malloc((size_t)2 * M * sizeof(TL));
    a.commit_direct = PyMem_Malloc((size_t)M * sizeof(double));
    a.prefix_sum = PyMem_Malloc((size_t)(M + 1) * sizeof(double));
    a.commit = PyMem_Malloc((size_t)M * sizeof(double));
    suffix_need = PyMem_Malloc((size_t)(M + 1) * sizeof(double));
    suffix_big = PyMem_Malloc((size_t)(M + 1) * sizeof(double));
    suffix_local = PyMem_Malloc((size_t)(a.k > 0 ? a.k : 1) * (size_t)(M + 1) * sizeof(double));
    a.members = PyList_New(0);
    a.groups = PyList_New(0);
    if (!a.cur || !a.log_step || !a.log_link || !a.log_tl || !a.commit_direct || !a.prefix_sum || !a.commit ||
        !suffix_need || !suffix_big || !suffix_local || !a.members || !a.groups) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    /* the direct reservations, replayed once (the ordering step's snapshots) */
    memcpy(a.cur, a.initial, (size_t)a.L * sizeof(TL));
    Py_ssize_t D = 2 * server + 1;
    double running = start;
    a.prefix_sum[0] = 0.0;
    for (Py_ssize_t i = 0; i < N; i++) {
        Py_ssize_t g = a.order[i], np_ = (Py_ssize_t)(pp[i + 1] - pp[i]);
        if (a.src[g] != server && a.size[g] > 0.0 && np_ > 0) {
            Py_ssize_t links[2] = {2 * a.src[g], D};
            for (int s = 0; s < 2; s++) {
                TL out;
                if (subtract(&a.arena, &a.cur[links[s]], prt + pp[i], prr + pp[i], np_, a.ends[i], &out) < 0) {
                    PyErr_NoMemory();
                    goto done;
                }
                a.cur[links[s]] = out;
                a.log_step[a.n_log] = i;
                a.log_link[a.n_log] = links[s];
                a.log_tl[a.n_log] = out;
                a.n_log++;
            }
        }
        running = running >= a.ends[i] ? running : a.ends[i];
        a.commit_direct[i] = running;
        a.prefix_sum[i + 1] = a.prefix_sum[i] + running;
    }
    suffix_need[N] = 0.0;
    suffix_big[N] = 0.0;
    for (Py_ssize_t i = N - 1; i >= 0; i--) {
        double z = a.size[a.order[i]];
        suffix_need[i] = suffix_need[i + 1] + z;
        suffix_big[i] = suffix_big[i + 1] > z ? suffix_big[i + 1] : z;
    }
    /* bytes of updates n.. that sit on aggregator j's own host (they use no link) */
    for (Py_ssize_t j = 0; j < a.k; j++) {
        double *col = suffix_local + j * (N + 1);
        col[N] = 0.0;
        for (Py_ssize_t i = N - 1; i >= 0; i--)
            col[i] = col[i + 1] + (a.src[a.order[i]] == a.hosts[j] ? a.size[a.order[i]] : 0.0);
    }
    /* aggregation.aggregate's search: all direct (n = N, always feasible), then an incumbent
     * near the feasibility boundary (galloping up from the first split the bounds leave),
     * then every split the bounds do not rule out, ascending (the prefix bound grows with n,
     * so the first split it rules out ends the pass) */
    SplitOut best = det_agg(&a, N, INFINITY, 0);
    if (best.status < 0) goto done;
    double best_val = sync ? best.obj_sync : best.obj_async;
    Py_ssize_t best_n = N, tried = 1;
    walked = PyMem_Calloc((size_t)N + 1, 1);
    if (!walked) {
        PyErr_NoMemory();
        goto done;
    }
    if (a.k > 0 && N > 0) {
        Py_ssize_t n = 1, step = 1;
        while (n < N && prefix_bound(&a, n) <= best_val * (1 + REL) &&
               cannot_fit(&a, n, suffix_need, suffix_big, suffix_local))
            n++;
        for (; n < N; n += step, step *= 2) {
            if (prefix_bound(&a, n) > best_val * (1 + REL)) break;
            if (cannot_fit(&a, n, suffix_need, suffix_big, suffix_local)) continue;
            walked[n] = 1;
            tried++;
            SplitOut r = det_agg(&a, n, best_val, 0);
            if (r.status < 0) goto done;
            if (r.status == 1) {
                double val = sync ? r.obj_sync : r.obj_async;
                if (val < best_val || (val == best_val && n < best_n)) {
                    best = r;
                    best_val = val;
                    best_n = n;
                }
                break;
            }
        }
        for (n = 0; n < N; n++) {
            if (walked[n]) continue;
            if (prefix_bound(&a, n) > best_val * (1 + REL)) break;
            if (cannot_fit(&a, n, suffix_need, suffix_big, suffix_local)) continue;
            tried++;
            SplitOut r = det_agg(&a, n, best_val, 0);
            if (r.status < 0) goto done;
            if (r.status == 0) continue;
            double val = sync ? r.obj_sync : r.obj_async;
            if (val < best_val || (val == best_val && n < best_n)) {
                best = r;
                best_val = val;
                best_n = n;
            }
        }
    }
    /* the chosen split once more, recording its schedules */
    SplitOut rec = det_agg(&a, best_n, INFINITY, 1);
    if (rec.status <= 0) {
        if (rec.status == 0) PyErr_SetString(PyExc_RuntimeError, "_sched: the chosen split is not reproducible");
        goto done;
    }
    result = Py_BuildValue("(nnddOO)", best_n, tried, rec.obj_async, rec.obj_sync, a.members, a.groups);
done:
    Py_XDECREF(a.members);
    Py_XDECREF(a.groups);
    PyMem_Free(suffix_need);
    PyMem_Free(suffix_big);
    PyMem_Free(suffix_local);
    PyMem_Free(seen);
    PyMem_Free(walked);
    agg_free(&a);
    buf_release(&b_ends);
    buf_release(&b_pptr);
    buf_release(&b_pt);
    buf_release(&b_pr);
    buf_release(&b_hosts);
    common_release(&c);
    return result;
}

static PyMethodDef methods[] = {
    {"order", order, METH_VARARGS, "Alg. 2 (Alg. 1 without deadlines) for one server (see the file header)."},
    {"order_list", order_list, METH_VARARGS, "A given list of updates reserved in that order, one server."},
    {"aggregate", aggregate, METH_VARARGS, "Alg. 3's split enumeration for one server (see the file header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sched", "Compiled loops of MLfabric's scheduler.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sched(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "KEPT", KEPT) < 0 || PyModule_AddIntConstant(m, "DOOMED", DOOMED) < 0 ||
              PyModule_AddIntConstant(m, "LOOK_AHEAD", LOOK_AHEAD) < 0 ||
              PyModule_AddIntConstant(m, "NO_CAPACITY", NO_CAPACITY) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
