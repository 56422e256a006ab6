/* The event engine's compiled loop (mlfabric.flow._fill.run_events), for mlfabric.sim.engine.
 *
 * A large parameter-server iteration is ~40k events, and most are alike: a few flows finish,
 * the network re-solves, the changed flows get new finish times, the finished transfers count
 * down a barrier. In Python each such event costs ~150 us of interpreter and numpy-call
 * overhead on top of the re-solve (~6 s of a 624 x 400 run); here it costs none. The loop
 * runs whole events, exactly as Engine.run would, and hands back to Python at the first
 * thing it does not do itself:
 *
 *   STOP_TOP       between events: the next re-solve is not a partial one without new flows
 *                  (new flows, changed caps, a full solve);
 *   STOP_PAUSE     between events: `budget` events were run (Python checks its wall-time
 *                  limit) or the entry array needs compacting; the loop can go on after;
 *   STOP_REFRESHED the re-solve is done but the next finish is not simple: past the horizon,
 *                  a timer due, no finite finish, or the event limit reached (Python raises);
 *   STOP_POPPED    the finished flows are taken and removed; one of their transfers is on a
 *                  FIFO connection (Python releases the connection and completes them);
 *   STOP_READY     tasks became ready (Python activates them: routing, new flows, timers).
 *
 * With the engine's task mode (issue #37, see run_events' comment) it does the last two
 * itself as well: a ring step's event (a flow finishes, the next message of the connection
 * starts) no longer goes through ~0.7 ms of Python, and STOP_POPPED / STOP_READY remain for
 * timers and for batches with no room.
 *
 * Every step is the compiled helper the Python path calls too (fill_resolve, fill_remove,
 * fill_progress), in the same order on the same arrays, so results are bit-identical; the
 * engine tests run both paths. The arrays are read from the objects by attribute name (the
 * same private names FlowNetwork, _FlowClass and Engine use), checked for size and item size.
 *
 *     .venv/bin/python -m pytest tests/unit/test_sim.py -q -k compiled_loop
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_fill.h"

enum { STOP_TOP, STOP_REFRESHED, STOP_POPPED, STOP_READY, STOP_PAUSE };


#define MAX_VIEWS 64

typedef struct {
    Py_buffer view[MAX_VIEWS];
    int n;
} Views;

static void views_release(Views *v) {
    for (int i = 0; i < v->n; i++) PyBuffer_Release(&v->view[i]);
    v->n = 0;
}

/* obj.name as a contiguous buffer of >= min_items items of itemsize bytes; NULL with an error. */
static void *array_attr(Views *v, PyObject *obj, const char *name, Py_ssize_t itemsize, Py_ssize_t min_items,
                        int writable, Py_ssize_t *items) {
    if (v->n >= MAX_VIEWS) {
        PyErr_SetString(PyExc_RuntimeError, "_fill.run_events: too many arrays (raise MAX_VIEWS)");
        return NULL;
    }
    PyObject *attr = PyObject_GetAttrString(obj, name);
    if (!attr) return NULL;
    Py_buffer *view = &v->view[v->n];
    int failed = PyObject_GetBuffer(attr, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
    Py_DECREF(attr);
    if (failed) return NULL;
    v->n++;
    if (view->itemsize != itemsize || view->len < min_items * itemsize) {
        PyErr_Format(PyExc_ValueError, "_fill.run_events: %s must hold >= %zd items of %zd bytes", name, min_items,
                     itemsize);
        return NULL;
    }
    if (items) *items = view->len / itemsize;
    return view->buf;
}

static int number_attr(PyObject *obj, const char *name, double *out) {
    PyObject *attr = PyObject_GetAttrString(obj, name);
    if (!attr) return -1;
    *out = PyFloat_AsDouble(attr);
    Py_DECREF(attr);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int set_attr(PyObject *obj, const char *name, PyObject *value) {
    if (!value) return -1;
    int status = PyObject_SetAttrString(obj, name, value);
    Py_DECREF(value);
    return status;
}

/* Sort n (rate, key) pairs and write them back as the rate order's first n ids and rates:
 * the key is a position in the order when by_position, else the id itself. 0, or -1 with
 * MemoryError. */
static int sort_order(int64_t *order, double *order_rates, Ranked *pairs, Py_ssize_t n, int by_position) {
    qsort(pairs, n, sizeof(Ranked), ranked_compare);
    int64_t *ids = malloc((n + 1) * sizeof(int64_t));
    if (!ids) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) ids[i] = by_position ? order[pairs[i].id] : pairs[i].id;
    for (Py_ssize_t i = 0; i < n; i++) {
        order[i] = ids[i];
        order_rates[i] = pairs[i].rate;
    }
    free(ids);
    return 0;
}


static double seconds_since(const struct timespec *t0) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + 1e-9 * (double)(now.tv_nsec - t0->tv_nsec);
}

/* Buffers kept between calls of run_events (grow-only; the module holds the GIL). */
enum { K_SCRATCH, K_PAIRS, K_IMMEDIATE, K_NEW, K_RESOLVE, K_MARK, K_ISO, K_CHANGED, K_CHANGED_RATES, K_NEAR, K_COUNT };
static void *kept_buf[K_COUNT];
static size_t kept_size[K_COUNT];

static void *keep(int which, size_t bytes) {
    if (bytes > kept_size[which]) {
        size_t size = bytes > 2 * kept_size[which] ? bytes : 2 * kept_size[which];
        void *grown = realloc(kept_buf[which], size);
        if (!grown) return NULL;
        kept_buf[which] = grown;
        kept_size[which] = size;
    }
    return kept_buf[which];
}

/* The task mode's view of the graph and the engine (Engine._tasks_compiled): what it needs to
 * start the flows of ready transfers itself (their routes, computed up front), queue them on
 * FIFO connections, and complete zero-time tasks. */
typedef struct {
    const int8_t *kind;
    const int64_t *connection;
    const double *size_bytes, *duration_s;
    const int64_t *route_of, *route_ptr, *route_links;
    const double *route_weights;
    Py_ssize_t n_routes, n_route_entries;
    uint8_t *conn_busy;
    int64_t *queue_head, *queue_tail, *queue_next;
    Py_ssize_t n_conn;
    double *start_s, *link_bytes;
    /* Where new flows go: the network's slots and entries, the flow class's record. */
    int64_t *start, *length, *links;
    double *weights, *cap, *rate, *weight_sum;
    int32_t *packed;
    char *solved, *alive, *in_candidates;
    int64_t *task;
    double *record;
    Py_ssize_t slot_capacity, entry_capacity, slots, entries;
    /* Free slots: pool[0:n_pool] (at entry), then the ids freed in this call, in that order. */
    const int64_t *pool, *freed;
    Py_ssize_t n_pool, used;
    int unit;
    Py_ssize_t flows;
} Tasks;

/* A free slot for a new flow (the oldest freed first, as FlowNetwork.add_flows), or -1. */
static int64_t take_slot(Tasks *t, Py_ssize_t n_freed) {
    if (t->used < t->n_pool) return t->pool[t->used++];
    if (t->used < t->n_pool + n_freed) return t->freed[t->used++ - t->n_pool];
    if (t->slots < t->slot_capacity) return t->slots++;
    return -1;
}

/* Room for n new flows of the given tasks (slots and entries)? */
static int room_for(const Tasks *t, const int64_t *tasks, Py_ssize_t n, Py_ssize_t n_freed) {
    Py_ssize_t entries = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = t->route_of[tasks[i]];
        if (r < 0 || r >= t->n_routes) return 0; /* no route: Python starts it (and says why not) */
        entries += t->route_ptr[r + 1] - t->route_ptr[r];
    }
    Py_ssize_t free_slots = (t->n_pool + n_freed - t->used) + (t->slot_capacity - t->slots);
    return n <= free_slots && t->entries + entries <= t->entry_capacity;
}

/* Engine._start_flows + FlowNetwork.add_flows + _FlowClass.add for n transfers (room checked):
 * the new flow ids go to new_ids[*n_new...]. */
static void start_flows(Tasks *t, const int64_t *tasks, Py_ssize_t n, Py_ssize_t n_freed, double now,
                        int64_t *new_ids, Py_ssize_t *n_new, Py_ssize_t *n_alive) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t task = tasks[i], r = t->route_of[task];
        int64_t id = take_slot(t, n_freed);
        int64_t first = t->route_ptr[r], len = t->route_ptr[r + 1] - first;
        double size = t->size_bytes[task];
        t->start[id] = t->entries;
        t->length[id] = len;
        int32_t *row = t->packed + id * PACKED;
        row[0] = len < PACKED ? (int32_t)len : -1;
        for (int64_t e = 0; e < len; e++) {
            int64_t link = t->route_links[first + e];
            double w = t->route_weights[first + e];
            t->links[t->entries + e] = link;
            t->weights[t->entries + e] = w;
            if (w != 1.0) t->unit = 0;
            if (len < PACKED) row[1 + e] = (int32_t)link;
            t->weight_sum[link] += w;
            t->link_bytes[link] += size * w;
        }
        t->entries += len;
        t->cap[id] = INFINITY;
        t->rate[id] = NAN;
        t->alive[id] = 1;
        t->solved[id] = 0;
        t->task[id] = task;
        double *rec = t->record + id * REC_WIDTH;
        rec[REC_REMAINING] = size * 8.0;
        rec[REC_RATE] = 0.0;
        rec[REC_STAMP] = now;
        rec[REC_FINISH] = INFINITY;
        new_ids[(*n_new)++] = id;
    }
    *n_alive += n;
    t->flows += n;
}

static inline int64_t t_connection(const Tasks *t, int64_t task) { return t->connection[task]; }

static int pair_compare(const void *a, const void *b) {
    const int64_t *x = a, *y = b;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    return (x[1] > y[1]) - (x[1] < y[1]);
}

/* Engine._activate for a batch of ready tasks (sorted), when every one is a zero-time delay, a
 * transfer that completes at once, or a routed transfer, and there is room for the flows: 1,
 * with the tasks completing now in immediate[*n_immediate]; 0 (nothing changed) otherwise. */
static int activate(Tasks *t, const int64_t *ready, Py_ssize_t n, Py_ssize_t n_freed, double now, int64_t *immediate,
                    Py_ssize_t *n_immediate, int64_t *scratch, int64_t *pairs, int64_t *new_ids, Py_ssize_t *n_new,
                    Py_ssize_t *n_alive) {
    Py_ssize_t n_net = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t task = ready[i];
        if (t->route_of[task] >= t->n_routes || t->connection[task] >= t->n_conn) return 0; /* Python raises */
        if (t->kind[task] != 0) { /* a delay */
            if (t->duration_s[task] > 0) return 0;
        } else if (t->route_of[task] == -2) {
            return 0;
        } else if (t->route_of[task] >= 0) {
            scratch[n_net++] = task;
        }
    }
    if (!room_for(t, scratch, n_net, n_freed)) return 0;
    *n_immediate = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t task = ready[i];
        t->start_s[task] = now;
        if (t->kind[task] != 0 || t->route_of[task] == -1) immediate[(*n_immediate)++] = task;
    }
    /* Engine._admit: transfers on no connection first, then the first of each idle connection
     * (by connection), the others queued behind it in task order. */
    Py_ssize_t n_start = 0, n_pairs = 0;
    for (Py_ssize_t i = 0; i < n_net; i++) {
        int64_t task = scratch[i], key = t_connection(t, task);
        if (key < 0) {
            scratch[n_start++] = task;
        } else if (t->conn_busy[key]) {
            t->queue_next[task] = -1;
            if (t->queue_tail[key] >= 0)
                t->queue_next[t->queue_tail[key]] = task;
            else
                t->queue_head[key] = task;
            t->queue_tail[key] = task;
        } else {
            t->conn_busy[key] = 1;
            pairs[2 * n_pairs] = key;
            pairs[2 * n_pairs + 1] = task;
            n_pairs++;
        }
    }
    if (n_pairs > 1) qsort(pairs, n_pairs, 2 * sizeof(int64_t), pair_compare);
    for (Py_ssize_t i = 0; i < n_pairs; i++) scratch[n_start++] = pairs[2 * i + 1];
    start_flows(t, scratch, n_start, n_freed, now, new_ids, n_new, n_alive);
    return 1;
}


static int id_compare(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The graph's dependency arrays and the engine's countdown state (Engine._complete). */
typedef struct {
    const int64_t *dep_ptr, *dep_dst;
    const char *dep_any;
    Py_ssize_t n_tasks, n_edges;
    int64_t *need;
    char *any_wait;
    int8_t *state;
    double *finish_s;
} Deps;

/* Engine._complete: the tasks are done now; their dependents made ready go to ready (sorted).
 * Returns how many, or -1 with ValueError on a corrupt graph. */
static Py_ssize_t complete_tasks(Deps *d, const int64_t *tasks, Py_ssize_t n, double now, int64_t *ready) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t t = tasks[i];
        d->state[t] = 2; /* engine._DONE */
        d->finish_s[t] = now;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t t = tasks[i];
        if (d->dep_ptr[t] < 0 || d->dep_ptr[t + 1] > d->n_edges) {
            PyErr_Format(PyExc_ValueError, "_fill.run_events: task %lld's edges are out of range", (long long)t);
            return -1;
        }
        for (int64_t e = d->dep_ptr[t]; e < d->dep_ptr[t + 1]; e++) {
            int64_t after = d->dep_dst[e];
            if (after < 0 || after >= d->n_tasks) {
                PyErr_Format(PyExc_ValueError, "_fill.run_events: edge %lld leads to task %lld, not in the graph",
                             (long long)e, (long long)after);
                return -1;
            }
            if (d->dep_any[e])
                d->any_wait[after] = 0;
            else
                d->need[after] -= 1;
        }
    }
    Py_ssize_t n_ready = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t t = tasks[i];
        for (int64_t e = d->dep_ptr[t]; e < d->dep_ptr[t + 1]; e++) {
            int64_t after = d->dep_dst[e];
            if (d->state[after] == 0 && d->need[after] == 0 && !d->any_wait[after]) {
                d->state[after] = 1; /* engine._ACTIVE */
                ready[n_ready++] = after;
            }
        }
    }
    if (n_ready > 1) qsort(ready, n_ready, sizeof(int64_t), id_compare);
    return n_ready;
}


/* Saturation as the kernel sees it (_fill.c's TIGHT_RTOL). */
#define ISOLATED_RTOL 1e-9

/* An event whose change stays local (issue #37): the flows that finished left no other flow
 * tight on their links (each link was below capacity, or is now empty), and each new flow,
 * given the others' rates, gets the least residual capacity of its links, on a link where it
 * is then the fastest (the link's other load is at most its rate) and with no saturated link
 * on its way. Then every other flow keeps its rate, and this is the max-min allocation the
 * re-solve would find (a ring's step: each flow alone on its NICs, below capacity elsewhere).
 * Unit weights and no caps only. Returns 1 with the new flows solved (rates, loads, shares,
 * rate order; changed lists them), 0 with nothing changed when a flow is not so isolated. */
static int solve_isolated(Net *net, const int64_t *ids, Py_ssize_t n, int64_t *order, double *order_rates,
                          Py_ssize_t *order_n, Py_ssize_t order_cap, double *r_out, int64_t *changed,
                          double *changed_rates) {
    if (*order_n + n > order_cap) return 0;
    double *load = net->load;
    const double *capacity = net->capacity;
    Py_ssize_t k;
    /* Check, adding the loads tentatively (a later new flow sees the earlier ones). */
    for (k = 0; k < n; k++) {
        int64_t f = ids[k], first = net->s.start[f], len = net->s.length[f];
        if (len <= 0) break;
        double best = INFINITY, other = 0.0;
        int ok = 1;
        for (int64_t e = first; e < first + len; e++) {
            int64_t l = net->s.links[e];
            if (!(load[l] < capacity[l] * (1.0 - ISOLATED_RTOL))) {
                ok = 0; /* a saturated link: someone may be tight there */
                break;
            }
            double residual = capacity[l] - load[l];
            if (residual < best) {
                best = residual;
                other = load[l];
            }
        }
        if (!ok || !(best > 0) || !isfinite(best) || other > best) break;
        r_out[k] = best;
        for (int64_t e = first; e < first + len; e++) load[net->s.links[e]] += best;
    }
    if (k < n) { /* undo */
        for (Py_ssize_t j = 0; j < k; j++) {
            int64_t f = ids[j];
            for (int64_t e = net->s.start[f]; e < net->s.start[f] + net->s.length[f]; e++) load[net->s.links[e]] -= r_out[j];
        }
        return 0;
    }
    for (k = 0; k < n; k++) {
        int64_t f = ids[k];
        double r = r_out[k];
        net->rate[f] = r;
        net->solved[f] = 1;
        for (int64_t e = net->s.start[f]; e < net->s.start[f] + net->s.length[f]; e++) {
            int64_t l = net->s.links[e];
            /* The new flow is the fastest on a link it saturates (its other load is at most
             * its rate): that is the link's share; elsewhere the link keeps slack. */
            if (load[l] < capacity[l] * (1.0 - ISOLATED_RTOL))
                net->share[l] = INFINITY;
            else if (net->share[l] == INFINITY || net->share[l] < r)
                net->share[l] = r;
        }
        /* Into the rate order after the equal rates (a stable sort's place for it). */
        Py_ssize_t lo = 0, hi = *order_n;
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (order_rates[mid] <= r)
                lo = mid + 1;
            else
                hi = mid;
        }
        memmove(order + lo + 1, order + lo, (*order_n - lo) * sizeof(int64_t));
        memmove(order_rates + lo + 1, order_rates + lo, (*order_n - lo) * sizeof(double));
        order[lo] = f;
        order_rates[lo] = r;
        (*order_n)++;
        changed[k] = f;
        changed_rates[k] = r;
    }
    return 1;
}

/* run_events(network, flow_class, engine, cand_buf, freed, out_tasks, t_timer, max_events, budget[, pool, pending,
 *            pause_after_s])
 *     -> (stop, events run, partial updates, "none" updates, freed ids, tasks out, candidates,
 *         full updates, free slots used, pending new flows)
 *
 * pause_after_s (optional): the loop also pauses (STOP_PAUSE) once this much wall time has
 * passed (checked every 64 events; every event when <= 0), so that progress is reported on
 * time however long the events are.
 *
 * Task mode (engine._tasks_compiled, pool and pending given): the loop also runs what
 * Engine._settle would with the tasks made ready (zero-time delays and transfers complete,
 * routed transfers start flows from engine._route_of/_route_ptr/_route_links/_route_weights,
 * FIFO connections queue on engine._queue_head/_tail/_next and release), re-solves with
 * the new flows (FlowNetwork.update's rules, or solve_isolated where the change stays
 * local), and takes past-horizon finishes itself. It hands a batch of ready tasks back
 * (STOP_READY) only when one needs a timer or has no room for its flow. pool (int64): the
 * network's free slots at entry, taken first (then the ids freed in this call); pending
 * (int64, >= the network's slots): engine._pending_count new flows from Python on entry,
 * the new flows not yet solved on return. Also written back in task mode: the network's
 * _slots, _entries, _unit_weights (_dirty when flows are pending); the engine's flows.
 *
 * network: a FlowNetwork (native, no new flows pending); flow_class: its engine._FlowClass;
 * engine: the Engine (one priority class, no message latency). cand_buf (int64, >= the flow
 * class's record rows): holds the candidates on entry, their first `candidates` items on
 * return. freed (int64, >= the network's slots): the ids removed, in order (Python puts them
 * on the network's free list). out_tasks (int64, >= the graph's tasks): the tasks popped
 * (STOP_POPPED) or made ready (STOP_READY, sorted). Scalars written back: the network's
 * _order_n, _n_alive, _divergence, _dirty, _dead_entries; the flow class's horizon (lowered
 * when too many flows are due by it); the engine's now, events, done. */
PyObject *run_events(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *network, *flow_class, *engine, *graph = NULL, *config = NULL;
    Py_buffer b_cand, b_freed, b_out, b_pool, b_pending;
    memset(&b_pool, 0, sizeof(b_pool));
    memset(&b_pending, 0, sizeof(b_pending));
    double t_timer;
    Py_ssize_t max_events, budget;
    /* pool and pending (the task mode's free slots and new flows) are optional: without them
     * the loop hands tasks made ready back to Python, as before #37. */
    double pause_after_s = INFINITY; /* wall seconds after which the loop pauses (progress reports) */
    if (!PyArg_ParseTuple(args, "OOOw*w*w*dnn|y*w*d", &network, &flow_class, &engine, &b_cand, &b_freed, &b_out, &t_timer,
                          &max_events, &budget, &b_pool, &b_pending, &pause_after_s))
        return NULL;
    struct timespec started;
    clock_gettime(CLOCK_MONOTONIC, &started);
    int64_t *scratch = NULL, *pairbuf = NULL, *immediate = NULL, *new_ids = NULL, *rbuf = NULL;
    char *mark = NULL;
    Tasks T;
    memset(&T, 0, sizeof(T));
    int tasks_mode = 0;
    Py_ssize_t n_new = 0, n_full = 0, n_isolated = 0;
    /* The last removal left nobody tight on its links (see solve_isolated). */
    int removal_isolated = 0;
    double *iso_rates = NULL;
    PyObject *result = NULL;
    Views v = {.n = 0};
    int64_t *changed = NULL, *near = NULL;
    double *changed_rates = NULL;
    Ranked *pairs = NULL;

    graph = PyObject_GetAttrString(engine, "graph");
    config = graph ? PyObject_GetAttrString(engine, "config") : NULL;
    if (!config) goto done;

    /* The network. */
    Py_ssize_t slots, n_links, n_entries, order_cap;
    Net net;
    net.s.start = array_attr(&v, network, "_start", 8, 0, 0, &slots);
    if (!net.s.start) goto done;
    net.slots = slots;
    net.capacity = array_attr(&v, network, "_capacity", 8, 0, 0, &n_links);
    if (!net.capacity) goto done;
    net.s.n_links = n_links;
    net.s.length = array_attr(&v, network, "_length", 8, slots, 0, NULL);
    net.s.links = net.s.length ? array_attr(&v, network, "_links", 8, 0, 0, &n_entries) : NULL;
    net.s.weights = net.s.links ? array_attr(&v, network, "_weights", 8, n_entries, 0, NULL) : NULL;
    net.s.packed = net.s.weights ? array_attr(&v, network, "_packed", 4, slots * PACKED, 0, NULL) : NULL;
    net.cap = net.s.packed ? array_attr(&v, network, "_cap", 8, slots, 0, NULL) : NULL;
    net.rate = net.cap ? array_attr(&v, network, "_rate", 8, slots, 1, NULL) : NULL;
    net.solved = net.rate ? array_attr(&v, network, "_solved", 1, slots, 1, NULL) : NULL;
    net.alive = net.solved ? array_attr(&v, network, "_alive", 1, slots, 1, NULL) : NULL;
    net.load = net.alive ? array_attr(&v, network, "_load", 8, n_links, 1, NULL) : NULL;
    net.perturbed = net.load ? array_attr(&v, network, "_perturbed", 1, n_links, 1, NULL) : NULL;
    net.share = net.perturbed ? array_attr(&v, network, "_share", 8, n_links, 1, NULL) : NULL;
    net.link_map = net.share ? array_attr(&v, network, "_link_map", 4, n_links, 1, NULL) : NULL;
    double *weight_sum = net.link_map ? array_attr(&v, network, "_weight_sum", 8, n_links, 1, NULL) : NULL;
    int64_t *order = weight_sum ? array_attr(&v, network, "_order", 8, 0, 1, &order_cap) : NULL;
    double *order_rates = order ? array_attr(&v, network, "_order_rates", 8, order_cap, 1, NULL) : NULL;
    if (!order_rates) goto done;
    net.s.n_entries = n_entries;
    double order_n_d, n_alive_d, divergence, dirty_d, dead_d, entries_d, unit_d, any_cap_d, reach_d, tie_rtol,
        incremental_d, caps_changed_d, capacity_changed_d, compact_min_dead, keep_margin, full_solve_fraction;
    if (number_attr(network, "_order_n", &order_n_d) || number_attr(network, "_n_alive", &n_alive_d) ||
        number_attr(network, "_divergence", &divergence) || number_attr(network, "_dirty", &dirty_d) ||
        number_attr(network, "_dead_entries", &dead_d) || number_attr(network, "_entries", &entries_d) ||
        number_attr(network, "_unit_weights", &unit_d) || number_attr(network, "_any_cap", &any_cap_d) ||
        number_attr(network, "reach", &reach_d) || number_attr(network, "tie_rtol", &tie_rtol) ||
        number_attr(network, "incremental", &incremental_d) || number_attr(network, "_caps_changed", &caps_changed_d) ||
        number_attr(network, "_capacity_changed", &capacity_changed_d) ||
        number_attr(network, "_compact_min_dead", &compact_min_dead) ||
        number_attr(network, "_keep_margin", &keep_margin) ||
        number_attr(network, "_full_solve_fraction_native", &full_solve_fraction))
        goto done;
    Py_ssize_t order_n = (Py_ssize_t)order_n_d, n_alive = (Py_ssize_t)n_alive_d, dead_entries = (Py_ssize_t)dead_d;
    const Py_ssize_t entries = (Py_ssize_t)entries_d;
    int dirty = dirty_d != 0;
    net.s.unit = unit_d != 0;
    net.has_caps = any_cap_d != 0;
    if (order_n < 0 || order_n > order_cap) {
        PyErr_SetString(PyExc_ValueError, "_fill.run_events: the rate order is corrupt");
        goto done;
    }
    PyObject *pending = PyObject_GetAttrString(network, "_pending_new");
    if (!pending) goto done;
    Py_ssize_t n_pending = PyObject_Length(pending);
    Py_DECREF(pending);
    if (n_pending < 0) goto done;

    /* The flow class and the engine. */
    Py_ssize_t rows, n_tasks, n_edges;
    double *record = array_attr(&v, flow_class, "record", 8, 0, 1, &rows);
    rows = record ? rows / REC_WIDTH : 0;
    char *in_candidates = record ? array_attr(&v, flow_class, "in_candidates", 1, rows, 1, NULL) : NULL;
    int64_t *task = in_candidates ? array_attr(&v, flow_class, "task", 8, rows, 1, NULL) : NULL;
    const int64_t *dep_ptr = task ? array_attr(&v, graph, "dep_ptr", 8, 1, 0, &n_tasks) : NULL;
    n_tasks = dep_ptr ? n_tasks - 1 : 0;
    const int64_t *dep_dst = dep_ptr ? array_attr(&v, graph, "dep_dst", 8, 0, 0, &n_edges) : NULL;
    const char *dep_any = dep_dst ? array_attr(&v, graph, "dep_any", 1, n_edges, 0, NULL) : NULL;
    const int64_t *connection = dep_any ? array_attr(&v, graph, "connection", 8, n_tasks, 0, NULL) : NULL;
    int64_t *need = connection ? array_attr(&v, engine, "need", 8, n_tasks, 1, NULL) : NULL;
    char *any_wait = need ? array_attr(&v, engine, "any_wait", 1, n_tasks, 1, NULL) : NULL;
    int8_t *state = any_wait ? array_attr(&v, engine, "state", 1, n_tasks, 1, NULL) : NULL;
    double *finish_s = state ? array_attr(&v, engine, "finish_s", 8, n_tasks, 1, NULL) : NULL;
    if (!finish_s) goto done;
    if (rows < slots || dep_ptr[n_tasks] > n_edges) {
        PyErr_SetString(PyExc_ValueError, "_fill.run_events: the flow class or the graph is inconsistent");
        goto done;
    }
    {
        PyObject *flag = PyObject_GetAttrString(engine, "_tasks_compiled");
        if (!flag) goto done;
        tasks_mode = PyObject_IsTrue(flag);
        Py_DECREF(flag);
        if (tasks_mode < 0) goto done;
        if (!b_pending.obj) tasks_mode = 0;
    }
    if (tasks_mode) {
        double slots_d, flows_d;
        Py_ssize_t n_route_ptr, n_conn_q;
        T.kind = array_attr(&v, graph, "kind", 1, n_tasks, 0, NULL);
        T.connection = connection;
        T.size_bytes = T.kind ? array_attr(&v, graph, "size_bytes", 8, n_tasks, 0, NULL) : NULL;
        T.duration_s = T.size_bytes ? array_attr(&v, graph, "duration_s", 8, n_tasks, 0, NULL) : NULL;
        T.route_of = T.duration_s ? array_attr(&v, engine, "_route_of", 8, n_tasks, 0, NULL) : NULL;
        T.route_ptr = T.route_of ? array_attr(&v, engine, "_route_ptr", 8, 1, 0, &n_route_ptr) : NULL;
        T.route_links = T.route_ptr ? array_attr(&v, engine, "_route_links", 8, 0, 0, &T.n_route_entries) : NULL;
        T.route_weights = T.route_links ? array_attr(&v, engine, "_route_weights", 8, T.n_route_entries, 0, NULL) : NULL;
        T.conn_busy = T.route_weights ? array_attr(&v, engine, "_connection_busy", 1, 0, 1, &T.n_conn) : NULL;
        T.queue_head = T.conn_busy ? array_attr(&v, engine, "_queue_head", 8, T.n_conn, 1, &n_conn_q) : NULL;
        T.queue_tail = T.queue_head ? array_attr(&v, engine, "_queue_tail", 8, T.n_conn, 1, NULL) : NULL;
        T.queue_next = T.queue_tail ? array_attr(&v, engine, "_queue_next", 8, n_tasks, 1, NULL) : NULL;
        T.start_s = T.queue_next ? array_attr(&v, engine, "start_s", 8, n_tasks, 1, NULL) : NULL;
        T.link_bytes = T.start_s ? array_attr(&v, engine, "link_bytes", 8, n_links, 1, NULL) : NULL;
        if (!T.link_bytes) goto done;
        T.n_routes = n_route_ptr - 1;
        if (T.route_ptr[T.n_routes] > T.n_route_entries) {
            PyErr_SetString(PyExc_ValueError, "_fill.run_events: the routes are inconsistent");
            goto done;
        }
        for (Py_ssize_t i = 0; i < T.n_route_entries; i++)
            if (T.route_links[i] < 0 || T.route_links[i] >= n_links) {
                PyErr_SetString(PyExc_ValueError, "_fill.run_events: a route crosses a link out of range");
                goto done;
            }
        /* (Each task's route and connection are checked when it becomes ready: a pass over
         * every task per call cost more than the events of a 1,024-rank ring.) */
        /* The same arrays FlowNetwork.add_flows writes (checked above for their sizes). */
        T.start = (int64_t *)net.s.start;
        T.length = (int64_t *)net.s.length;
        T.links = (int64_t *)net.s.links;
        T.weights = (double *)net.s.weights;
        T.packed = (int32_t *)net.s.packed;
        T.cap = (double *)net.cap;
        T.rate = net.rate;
        T.solved = net.solved;
        T.alive = (char *)net.alive;
        T.weight_sum = weight_sum;
        T.in_candidates = in_candidates;
        T.task = task;
        T.record = record;
        T.slot_capacity = slots;
        T.entry_capacity = n_entries;
        if (number_attr(network, "_slots", &slots_d) || number_attr(engine, "flows", &flows_d)) goto done;
        T.slots = (Py_ssize_t)slots_d;
        T.entries = entries;
        T.flows = (Py_ssize_t)flows_d;
        T.unit = net.s.unit;
        T.pool = b_pool.buf;
        T.n_pool = b_pool.len / 8;
        T.freed = b_freed.buf;
        if (T.slots > slots || b_pending.len / 8 < slots) {
            PyErr_SetString(PyExc_ValueError, "_fill.run_events: the network's slots are inconsistent");
            goto done;
        }
        for (Py_ssize_t i = 0; i < T.n_pool; i++)
            if (T.pool[i] < 0 || T.pool[i] >= T.slots || net.alive[T.pool[i]]) {
                PyErr_SetString(PyExc_ValueError, "_fill.run_events: a free slot is in use");
                goto done;
            }
        /* Kept between calls (grown when too small): fresh pages for the task-sized ones at
         * every call cost more than the events between two calls. */
        scratch = keep(K_SCRATCH, (n_tasks + 1) * sizeof(int64_t));
        pairbuf = keep(K_PAIRS, (2 * n_tasks + 2) * sizeof(int64_t));
        immediate = keep(K_IMMEDIATE, (n_tasks + 1) * sizeof(int64_t));
        new_ids = keep(K_NEW, (slots + 1) * sizeof(int64_t));
        rbuf = keep(K_RESOLVE, (order_cap + slots + 1) * sizeof(int64_t));
        mark = keep(K_MARK, slots + 1);
        if (mark) memset(mark, 0, slots + 1);
        iso_rates = keep(K_ISO, (slots + 1) * sizeof(double));
        if (!scratch || !pairbuf || !immediate || !new_ids || !rbuf || !mark || !iso_rates) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Deps deps = {dep_ptr, dep_dst, dep_any, n_tasks, n_edges, need, any_wait, state, finish_s};
    double now, events_d, done_d, horizon, rtol;
    if (number_attr(engine, "now", &now) || number_attr(engine, "events", &events_d) ||
        number_attr(engine, "done", &done_d) || number_attr(flow_class, "horizon", &horizon) ||
        number_attr(config, "batch_rtol", &rtol))
        goto done;
    Py_ssize_t events = (Py_ssize_t)events_d, n_done_tasks = (Py_ssize_t)done_d;
    int64_t *cand = b_cand.buf, *freed = b_freed.buf, *out_tasks = b_out.buf;
    const Py_ssize_t freed_cap = b_freed.len / 8;
    Py_ssize_t n_cand, n_freed = 0, n_out = 0;
    PyObject *n_cand_obj = PyObject_GetAttrString(flow_class, "candidates");
    if (!n_cand_obj) goto done;
    n_cand = PyObject_Length(n_cand_obj);
    Py_DECREF(n_cand_obj);
    if (n_cand < 0) goto done;
    if (b_cand.len / 8 < rows || b_cand.len / 8 < n_cand || b_freed.len / 8 < slots || b_out.len / 8 < n_tasks) {
        PyErr_SetString(PyExc_ValueError, "_fill.run_events: an output buffer is too small");
        goto done;
    }
    if (fill_ids_in_range(cand, n_cand, rows, "_fill.run_events: candidate flow") < 0) goto done;

    changed = keep(K_CHANGED, (order_cap + 1) * sizeof(int64_t));
    changed_rates = keep(K_CHANGED_RATES, (order_cap + 1) * sizeof(double));
    /* The flows newly near (at most the re-solved ones), then the tasks made ready. */
    near = keep(K_NEAR, ((order_cap > n_tasks ? order_cap : n_tasks) + 1) * sizeof(int64_t));
    if (!changed || !changed_rates || !near) {
        PyErr_NoMemory();
        goto done;
    }

    int stop = STOP_TOP;
    Py_ssize_t run = 0, n_partial = 0, n_none = 0;
    if (tasks_mode) {
        /* The flows Python started since the last update come in the pending buffer. */
        double count_d;
        if (number_attr(engine, "_pending_count", &count_d)) goto done;
        n_new = (Py_ssize_t)count_d;
        if (n_new < 0 || n_new > slots) {
            PyErr_SetString(PyExc_ValueError, "_fill.run_events: too many pending flows");
            goto done;
        }
        memcpy(new_ids, b_pending.buf, n_new * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < n_new; i++)
            if (new_ids[i] < 0 || new_ids[i] >= T.slots || !net.alive[new_ids[i]] || net.solved[new_ids[i]]) {
                PyErr_SetString(PyExc_ValueError, "_fill.run_events: a pending flow is not a new live flow");
                goto done;
            }
        if (n_new) dirty = 1;
        n_pending = 0;
    }
    const int can_refresh = n_pending == 0 && caps_changed_d == 0 && incremental_d != 0;
    int capacity_changed = capacity_changed_d != 0; /* since the last update (reset by one) */
    for (;;) {
        /* The re-solve (FlowNetwork.update, partial path with no new flows) and the new finish
         * times (_FlowClass.refresh). */
        if (!can_refresh) break;
        /* Flows this loop started may have split weights (spraying): the re-solve and the
         * removal must then read the weights, not the packed unit rows. */
        if (tasks_mode) net.s.unit = T.unit;
        if (!n_new && (run >= budget || (pause_after_s < INFINITY && run > 0 &&
                                          (pause_after_s <= 0 || run % 64 == 0) &&
                                          seconds_since(&started) >= pause_after_s))) {
            stop = STOP_PAUSE;
            break;
        }
        Py_ssize_t n_changed = 0;
        if (dirty && removal_isolated && T.unit && !net.has_caps && !capacity_changed &&
            (n_new == 0 || solve_isolated(&net, new_ids, n_new, order, order_rates, &order_n, order_cap, iso_rates,
                                          changed, changed_rates))) {
            n_changed = n_new;
            n_new = 0;
            n_isolated++;
            if (order_n > 2 * n_alive + 1024) {
                pairs = realloc(pairs, (slots + 1) * sizeof(Ranked));
                if (!pairs) {
                    PyErr_NoMemory();
                    goto done;
                }
                Py_ssize_t n = 0;
                for (Py_ssize_t f = 0; f < slots; f++)
                    if (net.alive[f] && net.solved[f]) pairs[n++] = (Ranked){net.rate[f], f};
                if (sort_order(order, order_rates, pairs, n, 0) < 0) goto done;
                order_n = n;
            }
            divergence = INFINITY;
            memset(net.perturbed, 0, n_links);
            dirty = 0;
        } else if (n_new) {
            /* FlowNetwork.update with new flows (started by this loop). Below c_l / W_l no link
             * of a new flow can fill, so nothing else changes there. */
            for (Py_ssize_t i = 0; i < n_new; i++) {
                int64_t f = new_ids[i];
                for (int64_t e = net.s.start[f]; e < net.s.start[f] + net.s.length[f]; e++) {
                    int64_t link = net.s.links[e];
                    double w = weight_sum[link];
                    if (w > 0 && net.capacity[link] / w < divergence) divergence = net.capacity[link] / w;
                }
            }
            Py_ssize_t split =
                divergence < INFINITY ? lower_bound(order_rates, 0, order_n, divergence * (1.0 - keep_margin)) : order_n;
            Py_ssize_t n_suffix = order_n - split, n_resolve, n_filter;
            double full_above = full_solve_fraction * (double)n_alive;
            int reach_only = reach_d != 0 && (double)n_new <= fmin(64.0, 0.01 * (double)n_alive) && !capacity_changed;
            int full = 0;
            if ((double)(n_suffix + n_new) <= full_above || reach_only) {
                memcpy(rbuf, order + split, n_suffix * sizeof(int64_t));
                memcpy(rbuf + n_suffix, new_ids, n_new * sizeof(int64_t));
                n_resolve = n_suffix + n_new;
                n_filter = n_suffix;
            } else {
                /* The live solved flows of the suffix, each once (the last of repeats, as
                 * FlowNetwork._distinct keeps), then the new ones. */
                Py_ssize_t m = 0;
                for (Py_ssize_t i = order_n - 1; i >= split; i--) {
                    int64_t f = order[i];
                    if (f >= 0 && f < slots && net.alive[f] && net.solved[f] && !mark[f]) {
                        mark[f] = 1;
                        rbuf[m++] = f;
                    }
                }
                for (Py_ssize_t i = 0; i < m; i++) mark[rbuf[i]] = 0;
                for (Py_ssize_t i = 0; i < m / 2; i++) {
                    int64_t x = rbuf[i];
                    rbuf[i] = rbuf[m - 1 - i];
                    rbuf[m - 1 - i] = x;
                }
                memcpy(rbuf + m, new_ids, n_new * sizeof(int64_t));
                m += n_new;
                full = (double)m > full_above;
                if (full) {
                    m = 0;
                    for (Py_ssize_t f = 0; f < T.slots; f++)
                        if (net.alive[f]) rbuf[m++] = f;
                    split = 0;
                }
                n_resolve = m;
                n_filter = 0;
            }
            if (split + n_resolve > order_cap) {
                PyErr_SetString(PyExc_RuntimeError, "_fill.run_events: the rate order is too small (engine bug)");
                goto done;
            }
            Resolve r = {rbuf, n_resolve, order_rates + split, n_filter, order + split, order_rates + split, changed,
                         changed_rates, full, 0, reach_d != 0 && !full, 1.0 + tie_rtol};
            if (fill_resolve(&net, &r) < 0) goto done;
            order_n = split + r.n_out;
            n_changed = r.n_changed;
            if (0 < split && split < order_n && order_rates[split] < order_rates[split - 1]) {
                pairs = realloc(pairs, (order_n + 1) * sizeof(Ranked));
                if (!pairs) {
                    PyErr_NoMemory();
                    goto done;
                }
                for (Py_ssize_t i = 0; i < order_n; i++) pairs[i] = (Ranked){order_rates[i], i};
                if (sort_order(order, order_rates, pairs, order_n, 1) < 0) goto done;
            }
            if (full)
                n_full++;
            else if (r.n_resolved)
                n_partial++;
            else
                n_none++;
            n_new = 0;
            if (order_n > 2 * n_alive + 1024) {
                pairs = realloc(pairs, (slots + 1) * sizeof(Ranked));
                if (!pairs) {
                    PyErr_NoMemory();
                    goto done;
                }
                Py_ssize_t n = 0;
                for (Py_ssize_t f = 0; f < slots; f++)
                    if (net.alive[f] && net.solved[f]) pairs[n++] = (Ranked){net.rate[f], f};
                if (sort_order(order, order_rates, pairs, n, 0) < 0) goto done;
                order_n = n;
            }
            divergence = INFINITY;
            memset(net.perturbed, 0, n_links);
            dirty = 0;
            capacity_changed = 0;
        } else if (dirty) {
            Py_ssize_t split =
                divergence < INFINITY ? lower_bound(order_rates, 0, order_n, divergence * (1.0 - keep_margin)) : order_n;
            Py_ssize_t n_resolve = order_n - split;
            /* FlowNetwork.update's rule: with the reach, none unless a capacity changed. */
            if (!((double)n_resolve <= full_solve_fraction * (double)n_alive) && (reach_d == 0 || capacity_changed))
                break;
            Py_ssize_t n_resolved = 0;
            if (n_resolve) {
                Resolve r = {order + split, n_resolve, order_rates + split, n_resolve, order + split,
                             order_rates + split, changed, changed_rates, 0, 1, reach_d != 0, 1.0 + tie_rtol};
                if (fill_resolve(&net, &r) < 0) goto done;
                order_n = split + r.n_out;
                n_changed = r.n_changed;
                n_resolved = r.n_resolved;
                /* FlowNetwork._restore_order_at: rounding put a re-solved rate below a kept one. */
                if (0 < split && split < order_n && order_rates[split] < order_rates[split - 1]) {
                    pairs = realloc(pairs, (order_n + 1) * sizeof(Ranked));
                    if (!pairs) {
                        PyErr_NoMemory();
                        goto done;
                    }
                    for (Py_ssize_t i = 0; i < order_n; i++) pairs[i] = (Ranked){order_rates[i], i};
                    if (sort_order(order, order_rates, pairs, order_n, 1) < 0) goto done;
                }
            }
            if (n_resolved)
                n_partial++;
            else
                n_none++;
            if (order_n > 2 * n_alive + 1024) { /* mostly stale entries: rebuild from the live flows */
                pairs = realloc(pairs, (slots + 1) * sizeof(Ranked));
                if (!pairs) {
                    PyErr_NoMemory();
                    goto done;
                }
                Py_ssize_t n = 0;
                for (Py_ssize_t f = 0; f < slots; f++)
                    if (net.alive[f] && net.solved[f]) pairs[n++] = (Ranked){net.rate[f], f};
                if (sort_order(order, order_rates, pairs, n, 0) < 0) goto done;
                order_n = n;
            }
            divergence = INFINITY;
            memset(net.perturbed, 0, n_links);
            dirty = 0;
            capacity_changed = 0;
        } else {
            n_none++;
        }
        if (n_changed) {
            Py_ssize_t n_near = fill_progress(changed, changed_rates, n_changed, record, in_candidates, near, now, horizon);
            memcpy(cand + n_cand, near, n_near * sizeof(int64_t));
            n_cand += n_near;
        }

        /* The next finish (_FlowClass.next_finish) and the event's checks. */
        stop = STOP_REFRESHED;
        if (n_alive == 0) break;
        double first = INFINITY;
        if (n_cand) n_cand = fill_earliest(cand, n_cand, record, in_candidates, &horizon, &first);
        if (!n_cand && (n_cand = fill_rebuild(record, rows, in_candidates, cand, &horizon, &first)) < 0) goto done;
        if (!n_cand || !isfinite(first) || events + 1 > max_events) break;
        double at = now > first ? now : first;
        double threshold = at + rtol * fabs(at);
        if ((threshold > horizon && !tasks_mode) || t_timer <= threshold) break;
        /* The ids freed in this call must fit their buffer (flows come and go in task mode). */
        if (n_freed + (threshold > horizon ? n_alive : n_cand) > freed_cap) break;

        /* The event: take the finished flows (_FlowClass.pop_finished) and remove them. */
        events++;
        now = at;
        Py_ssize_t taken;
        int64_t *finished = freed + n_freed;
        if (threshold <= horizon) {
            n_cand = fill_take(cand, n_cand, record, in_candidates, threshold, finished, &taken);
        } else {
            /* _FlowClass.pop_finished past the horizon: every flow due by the threshold, in id
             * order; the candidates keep those that are not. */
            Py_ssize_t kept = 0;
            for (Py_ssize_t i = 0; i < n_cand; i++)
                if (record[cand[i] * REC_WIDTH + REC_FINISH] > threshold) cand[kept++] = cand[i];
            n_cand = kept;
            taken = 0;
            for (Py_ssize_t f = 0; f < rows; f++)
                if (record[f * REC_WIDTH + REC_FINISH] <= threshold) {
                    finished[taken++] = f;
                    in_candidates[f] = 0;
                    record[f * REC_WIDTH + REC_FINISH] = INFINITY;
                }
        }
        int on_connection = 0;
        n_out = 0;
        for (Py_ssize_t i = 0; i < taken; i++) {
            int64_t t = task[finished[i]];
            if (t < 0 || t >= n_tasks) {
                PyErr_Format(PyExc_ValueError, "_fill.run_events: flow %lld has no task", (long long)finished[i]);
                goto done;
            }
            out_tasks[n_out++] = t;
            task[finished[i]] = -1;
            on_connection |= connection[t] >= 0;
        }
        double lowest;
        Py_ssize_t dead;
        /* Links the finished flows saturated: someone else may be tight there (unless emptied). */
        Py_ssize_t n_sat = 0;
        if (tasks_mode)
            for (Py_ssize_t i = 0; i < taken && n_sat <= n_tasks; i++) {
                int64_t f = finished[i];
                if (f < 0 || f >= slots) break;
                for (int64_t e = net.s.start[f]; e < net.s.start[f] + net.s.length[f]; e++) {
                    int64_t l = net.s.links[e];
                    if (!(net.load[l] < net.capacity[l] * (1.0 - ISOLATED_RTOL)) && n_sat <= n_tasks) scratch[n_sat++] = l;
                }
            }
        if (fill_remove(&net, weight_sum, finished, taken, &lowest, &dead) < 0) goto done;
        removal_isolated = tasks_mode && n_sat <= n_tasks && (!dirty || removal_isolated);
        for (Py_ssize_t i = 0; i < n_sat && removal_isolated; i++) {
            if (weight_sum[scratch[i]] > 0) removal_isolated = 0;
            else net.share[scratch[i]] = INFINITY; /* empty now */
        }
        if (lowest < divergence) divergence = lowest;
        n_alive -= taken;
        n_freed += taken;
        dead_entries += dead;
        dirty = 1;
        run++;
        if (on_connection) {
            /* Engine._release: the next transfer queued on each freed connection starts. */
            Py_ssize_t n_follow = 0;
            if (tasks_mode)
                for (Py_ssize_t i = 0; i < n_out; i++) {
                    int64_t key = connection[out_tasks[i]];
                    if (key >= 0 && T.queue_head[key] >= 0) scratch[n_follow++] = T.queue_head[key];
                }
            if (!tasks_mode || !room_for(&T, scratch, n_follow, n_freed)) {
                stop = STOP_POPPED;
                break;
            }
            for (Py_ssize_t i = 0; i < n_out; i++) {
                int64_t key = connection[out_tasks[i]];
                if (key < 0) continue;
                int64_t head = T.queue_head[key];
                if (head >= 0) {
                    T.queue_head[key] = T.queue_next[head];
                    if (T.queue_head[key] < 0) T.queue_tail[key] = -1;
                } else {
                    T.conn_busy[key] = 0;
                }
            }
            start_flows(&T, scratch, n_follow, n_freed, now, new_ids, &n_new, &n_alive);
        }

        /* Complete the transfers and release their dependents (Engine._complete). */
        n_done_tasks += n_out;
        Py_ssize_t n_ready = complete_tasks(&deps, out_tasks, n_out, now, near);
        if (n_ready < 0) goto done;
        stop = STOP_TOP;
        if (n_ready) {
            memcpy(out_tasks, near, n_ready * sizeof(int64_t));
            n_out = n_ready;
            stop = STOP_READY;
            if (!tasks_mode) break;
            /* Engine._settle: run what can run now, until a batch needs Python (a timer, a
             * transfer without a route, no room for its flows). */
            int handed = 0;
            while (n_out) {
                Py_ssize_t n_imm = 0;
                if (!activate(&T, out_tasks, n_out, n_freed, now, immediate, &n_imm, scratch, pairbuf, new_ids, &n_new,
                              &n_alive)) {
                    handed = 1;
                    break;
                }
                n_done_tasks += n_imm;
                n_out = n_imm ? complete_tasks(&deps, immediate, n_imm, now, out_tasks) : 0;
                if (n_out < 0) goto done;
            }
            if (handed) break;
            stop = STOP_TOP;
        }
        n_out = 0;
        if (n_done_tasks >= n_tasks) { /* the graph is done: Python ends the run */
            stop = STOP_PAUSE;
            break;
        }
        /* FlowNetwork.adopt_removed compacts the entry array (the layout only: results do not change). */
        if ((double)dead_entries > fmax((double)((tasks_mode ? T.entries : entries) / 2), compact_min_dead)) {
            stop = STOP_PAUSE;
            break;
        }
    }

    if (set_attr(network, "_order_n", PyLong_FromSsize_t(order_n)) ||
        set_attr(network, "_n_alive", PyLong_FromSsize_t(n_alive)) ||
        set_attr(network, "_divergence", PyFloat_FromDouble(divergence)) ||
        set_attr(network, "_dirty", PyBool_FromLong(dirty)) ||
        set_attr(network, "_capacity_changed", PyBool_FromLong(capacity_changed)) ||
        set_attr(network, "_dead_entries", PyLong_FromSsize_t(dead_entries)) ||
        set_attr(engine, "now", PyFloat_FromDouble(now)) || set_attr(engine, "events", PyLong_FromSsize_t(events)) ||
        set_attr(engine, "done", PyLong_FromSsize_t(n_done_tasks)) ||
        set_attr(flow_class, "horizon", PyFloat_FromDouble(horizon)))
        goto done;
    if (tasks_mode) {
        memcpy(b_pending.buf, new_ids, n_new * sizeof(int64_t));
        if (set_attr(network, "_slots", PyLong_FromSsize_t(T.slots)) ||
            set_attr(network, "_entries", PyLong_FromSsize_t(T.entries)) ||
            set_attr(network, "_unit_weights", PyBool_FromLong(T.unit)) ||
            set_attr(engine, "flows", PyLong_FromSsize_t(T.flows)) ||
            (n_new && set_attr(network, "_dirty", PyBool_FromLong(1))))
            goto done;
    }
    result = Py_BuildValue("innnnnnnnn", stop, run, n_partial, n_none, n_freed, n_out, n_cand, n_full, T.used, n_new);

done:
    free(pairs);
    views_release(&v);
    Py_XDECREF(graph);
    Py_XDECREF(config);
    PyBuffer_Release(&b_cand);
    PyBuffer_Release(&b_freed);
    PyBuffer_Release(&b_out);
    PyBuffer_Release(&b_pool);
    PyBuffer_Release(&b_pending);
    return result;
}
