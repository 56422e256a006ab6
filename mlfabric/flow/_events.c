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

#include "_fill.h"

enum { STOP_TOP, STOP_REFRESHED, STOP_POPPED, STOP_READY, STOP_PAUSE };


#define MAX_VIEWS 40

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

/* run_events(network, flow_class, engine, cand_buf, freed, out_tasks, t_timer, max_events, budget)
 *     -> (stop, events run, partial updates, "none" updates, freed ids, tasks out, candidates)
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
    Py_buffer b_cand, b_freed, b_out;
    double t_timer;
    Py_ssize_t max_events, budget;
    if (!PyArg_ParseTuple(args, "OOOw*w*w*dnn", &network, &flow_class, &engine, &b_cand, &b_freed, &b_out, &t_timer,
                          &max_events, &budget))
        return NULL;
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
    double now, events_d, done_d, horizon, rtol;
    if (number_attr(engine, "now", &now) || number_attr(engine, "events", &events_d) ||
        number_attr(engine, "done", &done_d) || number_attr(flow_class, "horizon", &horizon) ||
        number_attr(config, "batch_rtol", &rtol))
        goto done;
    Py_ssize_t events = (Py_ssize_t)events_d, n_done_tasks = (Py_ssize_t)done_d;
    int64_t *cand = b_cand.buf, *freed = b_freed.buf, *out_tasks = b_out.buf;
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

    changed = malloc((order_cap + 1) * sizeof(int64_t));
    changed_rates = malloc((order_cap + 1) * sizeof(double));
    /* The flows newly near (at most the re-solved ones), then the tasks made ready. */
    near = malloc(((order_cap > n_tasks ? order_cap : n_tasks) + 1) * sizeof(int64_t));
    if (!changed || !changed_rates || !near) {
        PyErr_NoMemory();
        goto done;
    }

    int stop = STOP_TOP;
    Py_ssize_t run = 0, n_partial = 0, n_none = 0;
    const int can_refresh = n_pending == 0 && caps_changed_d == 0 && incremental_d != 0;
    int capacity_changed = capacity_changed_d != 0; /* since the last update (reset by one) */
    for (;;) {
        /* The re-solve (FlowNetwork.update, partial path with no new flows) and the new finish
         * times (_FlowClass.refresh). */
        if (!can_refresh) break;
        if (run >= budget) {
            stop = STOP_PAUSE;
            break;
        }
        Py_ssize_t n_changed = 0;
        if (dirty) {
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
        if (threshold > horizon || t_timer <= threshold) break;

        /* The event: take the finished flows (_FlowClass.pop_finished) and remove them. */
        events++;
        now = at;
        Py_ssize_t taken;
        int64_t *finished = freed + n_freed;
        n_cand = fill_take(cand, n_cand, record, in_candidates, threshold, finished, &taken);
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
        if (fill_remove(&net, weight_sum, finished, taken, &lowest, &dead) < 0) goto done;
        if (lowest < divergence) divergence = lowest;
        n_alive -= taken;
        n_freed += taken;
        dead_entries += dead;
        dirty = 1;
        run++;
        if (on_connection) {
            stop = STOP_POPPED;
            break;
        }

        /* Complete the transfers and release their dependents (Engine._complete). */
        Py_ssize_t n_ready = 0;
        for (Py_ssize_t i = 0; i < n_out; i++) {
            int64_t t = out_tasks[i];
            state[t] = 2; /* engine._DONE */
            finish_s[t] = now;
        }
        n_done_tasks += n_out;
        for (Py_ssize_t i = 0; i < n_out; i++) {
            int64_t t = out_tasks[i];
            if (dep_ptr[t] < 0 || dep_ptr[t + 1] > n_edges) {
                PyErr_Format(PyExc_ValueError, "_fill.run_events: task %lld's edges are out of range", (long long)t);
                goto done;
            }
            for (int64_t e = dep_ptr[t]; e < dep_ptr[t + 1]; e++) {
                int64_t after = dep_dst[e];
                if (after < 0 || after >= n_tasks) {
                    PyErr_Format(PyExc_ValueError, "_fill.run_events: edge %lld leads to task %lld, not in the graph",
                                 (long long)e, (long long)after);
                    goto done;
                }
                if (dep_any[e])
                    any_wait[after] = 0;
                else
                    need[after] -= 1;
            }
        }
        for (Py_ssize_t i = 0; i < n_out; i++) {
            int64_t t = out_tasks[i];
            for (int64_t e = dep_ptr[t]; e < dep_ptr[t + 1]; e++) {
                int64_t after = dep_dst[e];
                if (state[after] == 0 && need[after] == 0 && !any_wait[after]) {
                    state[after] = 1; /* engine._ACTIVE */
                    near[n_ready++] = after;
                }
            }
        }
        stop = STOP_TOP;
        if (n_ready) {
            pairs = realloc(pairs, (n_ready + 1) * sizeof(Ranked));
            if (!pairs) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t i = 0; i < n_ready; i++) pairs[i] = (Ranked){0.0, near[i]};
            qsort(pairs, n_ready, sizeof(Ranked), ranked_compare);
            for (Py_ssize_t i = 0; i < n_ready; i++) out_tasks[i] = pairs[i].id;
            n_out = n_ready;
            stop = STOP_READY;
            break;
        }
        n_out = 0;
        if (n_done_tasks >= n_tasks) { /* the graph is done: Python ends the run */
            stop = STOP_PAUSE;
            break;
        }
        /* FlowNetwork.adopt_removed compacts the entry array (the layout only: results do not change). */
        if ((double)dead_entries > fmax((double)(entries / 2), compact_min_dead)) {
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
    result = Py_BuildValue("innnnnn", stop, run, n_partial, n_none, n_freed, n_out, n_cand);

done:
    free(changed);
    free(changed_rates);
    free(near);
    free(pairs);
    views_release(&v);
    Py_XDECREF(graph);
    Py_XDECREF(config);
    PyBuffer_Release(&b_cand);
    PyBuffer_Release(&b_freed);
    PyBuffer_Release(&b_out);
    return result;
}
