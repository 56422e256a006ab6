/* Compiled progressive filling for FlowNetwork's incremental re-solve (mlfabric.flow._fill).
 *
 * FlowNetwork.update() re-solves the flows at or above a divergence level on the capacity
 * the other flows leave. In numpy that costs ~0.6 us per re-solved flow plus ~100 us of
 * call overhead per update; the simulator's 624 x 400 parameter-server iteration re-solves
 * ~110M flows over 40k updates. This file does the same work in one call per update:
 *
 *   1. take the re-solved flows' old load off their links (all load, for a full solve);
 *   2. progressive filling on the residual capacity: a binary heap of link fill levels
 *      (residual / unfrozen weight) with lazy re-keying, since levels only rise as flows
 *      freeze below them; every link (and flow cap) within a relative `grow - 1` of the
 *      lowest level saturates in the same event, like maxmin._sequential_events;
 *   3. write every flow's rate, put its new load on its links, and emit the flows sorted
 *      by rate (freeze order), which is the re-solved suffix of FlowNetwork's rate order.
 *
 * Zero-weight entries neither load nor constrain a link; a flow with no loaded link gets its
 * cap (inf when none). The Python path (maxmin.solve_max_min) gives the same allocation up to
 * the tie tolerance; tests compare the two. Built by setup.py as an optional extension:
 * FlowNetwork falls back to numpy when it is missing.
 *
 *     .venv/bin/python -m pytest tests/unit/test_flow.py -q -k native
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* How many re-solved flows ahead the gather prefetches their slot data. */
#define PREFETCH_AHEAD 24
/* With slack links left out (see resolve), a link counts as slack when its load is below this
 * fraction of its capacity. Most re-solved entries of a fat-tree run are on links far below
 * it (host and core links of an oversubscribed tree: ~80% of entries under 90% load). */
#define SLACK_BELOW 0.99
/* Row width of the packed per-slot link lists: a count, then up to PACKED - 1 link ids. */
#define PACKED 8

typedef struct {
    double key;
    int32_t link; /* index into the touched-link arrays */
} HeapItem;

static int heap_less(const HeapItem *a, const HeapItem *b) {
    return a->key < b->key || (a->key == b->key && a->link < b->link);
}

static void heap_push(HeapItem *heap, Py_ssize_t *size, double key, int32_t link) {
    Py_ssize_t i = (*size)++;
    HeapItem item = {key, link};
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!heap_less(&item, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = item;
}

static void heap_pop(HeapItem *heap, Py_ssize_t *size) {
    HeapItem last = heap[--(*size)];
    Py_ssize_t n = *size, i = 0;
    if (n == 0) return;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && heap_less(&heap[child + 1], &heap[child])) child++;
        if (!heap_less(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = last;
}

typedef struct {
    double cap;
    int32_t flow; /* index into the re-solved set */
} CapItem;

static int cap_compare(const void *a, const void *b) {
    const CapItem *x = a, *y = b;
    if (x->cap != y->cap) return x->cap < y->cap ? -1 : 1;
    return (x->flow > y->flow) - (x->flow < y->flow);
}

typedef struct {
    double rate;
    int64_t id;
} Ranked;

static int ranked_compare(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    if (x->rate != y->rate) return x->rate < y->rate ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Fill level of touched link t: the common rate at which its unfrozen flows saturate it. */
static inline double level_of(const double *residual, const double *weight, const int64_t *count, Py_ssize_t t) {
    return (count[t] > 0 && weight[t] > 0) ? residual[t] / weight[t] : INFINITY;
}

static int check_buffer(const Py_buffer *buffer, Py_ssize_t itemsize, Py_ssize_t min_items, const char *name) {
    if (buffer->itemsize != itemsize || buffer->len < min_items * itemsize) {
        PyErr_Format(PyExc_ValueError, "_fill.resolve: %s must hold >= %zd items of %zd bytes", name, min_items, itemsize);
        return 0;
    }
    return 1;
}

/* resolve(ids, start, length, links, weights, packed, cap, rate, solved, alive, capacity, load, perturbed,
 *         link_map, out_ids, out_rates, out_changed, out_changed_rates, full, unit, has_caps, skip_slack, grow,
 *         n_filter)
 *     -> (filling events, re-solved flows, changed, slack retries).
 *
 * The first `n_filter` ids are candidates (FlowNetwork's rate order from the divergence level
 * on, which may hold ids of since-removed flows, of reused slots and repeats): only live,
 * solved ones are re-solved, each once. The other ids are re-solved as given. out_ids may be
 * the memory `ids` is read from (the ids are copied first).
 *
 * ids: int64 flow slots; start/length: int64 per slot (entry range); links:
 * int64 and weights: float64 per entry (read only when not `unit`: all weights 1); packed:
 * int32 rows of PACKED per slot, [count, link ids...] or [-1, ...] (read only when `unit`): the
 * same links in one cache line, used instead of start/length/links where the count is >= 0
 * (on large runs the entry array is far bigger than the cache, and this read is most of the
 * gather's cost); cap,
 * rate: float64 per slot (rate in: old rate of solved flows, NaN for the others, out: new
 * rate); solved: bool per slot (set to true); alive: bool per slot; capacity, load: float64 per link (load in: of
 * all solved flows, out: at the new rates); link_map: int32 per link, all -1 on entry and on
 * return (scratch);
 * out_ids/out_rates: len(ids) items, the re-solved flows sorted by new rate; out_changed:
 * len(ids) items, its first `changed` are the flows whose rate is new or differs, and
 * out_changed_rates (float64, len(ids) items) their new rates. full: the
 * load in `load` is discarded and rebuilt. has_caps: false when every cap is inf (`cap` is
 * then not read).
 *
 * skip_slack (partial re-solves of solved flows only): links whose load is below SLACK_BELOW
 * of their capacity, and that are not marked in `perturbed` (uint8 per link: a flow left it
 * or its capacity changed since the last solve, so its load says little), are left out of
 * the filling, which then handles only the links that can
 * be bottlenecks. That is exact when it holds up: if every left-out link ends within its
 * capacity, the allocation is feasible and every flow keeps a saturated bottleneck on which
 * its rate is the largest, which characterizes the (unique) max-min allocation. A left-out
 * link that would end over capacity (or under a flow left unconstrained) is put back and the
 * filling redone; the retries are counted. */
static PyObject *resolve(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_ids, b_start, b_length, b_links, b_weights, b_packed, b_cap, b_rate, b_solved, b_alive, b_capacity, b_load, b_perturbed,
        b_map, b_out_ids, b_out_rates, b_out_changed, b_out_changed_rates;
    int full, unit, has_caps, skip_slack;
    double grow;
    Py_ssize_t n_filter;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*w*y*y*w*y*w*w*w*w*w*ppppdn", &b_ids, &b_start, &b_length, &b_links,
                          &b_weights, &b_packed, &b_cap, &b_rate, &b_solved, &b_alive, &b_capacity, &b_load,
                          &b_perturbed, &b_map, &b_out_ids, &b_out_rates, &b_out_changed, &b_out_changed_rates, &full,
                          &unit, &has_caps, &skip_slack, &grow, &n_filter))
        return NULL;

    PyObject *result = NULL;
    Py_ssize_t n = b_ids.len / 8, n_links = b_capacity.len / 8;
    Py_ssize_t slots = b_start.len / 8;
    int64_t *sel = NULL;            /* (n) the flows to re-solve */
    Py_ssize_t n_marked = 0;        /* sel[:n_marked] holds every candidate marked solved = 2 */
    char *solved = NULL;            /* set before the first mark (the exit path reads it) */
    /* The re-solved flows' entries, gathered once into contiguous arrays (the slot arrays
     * are scattered over hundreds of MB on large runs; every later pass reads only these). */
    int64_t *flow_start = NULL, *flow_length = NULL; /* (n) each re-solved flow's slot entry range */
    int64_t *flow_ptr = NULL;      /* (n + 1) entry range of each re-solved flow */
    int32_t *entry_link = NULL;    /* (nnz) touched-link index of each entry with weight > 0 */
    double *entry_weight = NULL;   /* (nnz) its weight */
    double *old_rate = NULL;       /* (n) rate before (NaN: not solved) */
    int32_t *touched_link = NULL;  /* (nnz) link id of each touched index */
    int64_t *count = NULL, *link_ptr = NULL, *fill = NULL, *count0 = NULL;
    double *weight0 = NULL;
    char *tight = NULL; /* per touched link: in the filling (not left out as slack) */
    int32_t *flows_by_link = NULL;
    double *residual = NULL, *weight = NULL, *new_load = NULL;
    HeapItem *heap = NULL;
    CapItem *caps = NULL;
    char *active = NULL;
    int32_t *in_filling = NULL; /* (n) per flow: its entries on links in the filling */
    int32_t *multi = NULL;      /* (n) the flows frozen in one event that need a pass over their entries */
    int32_t *sat = NULL; /* the links saturating in one event */
    Ranked *ranked = NULL;
    Py_ssize_t events = 0, n_changed = 0, n_touched = 0, retries = 0;
    skip_slack = skip_slack && !full;

    if (!check_buffer(&b_ids, 8, n, "ids") || !check_buffer(&b_length, 8, slots, "length") ||
        !check_buffer(&b_packed, 4, unit ? slots * PACKED : 0, "packed") ||
        !check_buffer(&b_cap, 8, slots, "cap") || !check_buffer(&b_rate, 8, slots, "rate") ||
        !check_buffer(&b_solved, 1, slots, "solved") || !check_buffer(&b_alive, 1, slots, "alive") ||
        !check_buffer(&b_load, 8, n_links, "load") ||
        !check_buffer(&b_perturbed, 1, n_links, "perturbed") ||
        !check_buffer(&b_map, 4, n_links, "link_map") || !check_buffer(&b_out_ids, 8, n, "out_ids") ||
        !check_buffer(&b_out_rates, 8, n, "out_rates") || !check_buffer(&b_out_changed, 8, n, "out_changed") ||
        !check_buffer(&b_out_changed_rates, 8, n, "out_changed_rates") ||
        !check_buffer(&b_links, 8, 0, "links") || !check_buffer(&b_weights, 8, b_links.len / 8, "weights"))
        goto done;

    const int64_t *start = b_start.buf, *length = b_length.buf, *links = b_links.buf;
    const double *weights = b_weights.buf, *cap = b_cap.buf, *capacity = b_capacity.buf;
    const int32_t *packed = b_packed.buf;
    double *rate = b_rate.buf, *load = b_load.buf, *out_rates = b_out_rates.buf;
    solved = b_solved.buf;
    const char *alive = b_alive.buf;
    const uint8_t *perturbed = b_perturbed.buf;
    int32_t *link_map = b_map.buf;
    int64_t *out_ids = b_out_ids.buf, *out_changed = b_out_changed.buf;
    double *out_changed_rates = b_out_changed_rates.buf;
    Py_ssize_t n_entries = b_links.len / 8;

    /* The ids to re-solve, copied (out_ids may alias the input); candidates are filtered and
     * marked solved = 2 while taken (reset to 1 with the new rates, or on an error). */
    sel = malloc((n + 1) * sizeof(int64_t));
    if (!sel) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const int64_t *given = b_ids.buf;
        Py_ssize_t n_given = n;
        if (n_filter > n_given) n_filter = n_given;
        n = 0;
        for (Py_ssize_t i = 0; i < n_given; i++) {
            if (i + PREFETCH_AHEAD < n_filter && given[i + PREFETCH_AHEAD] >= 0 && given[i + PREFETCH_AHEAD] < slots) {
                __builtin_prefetch(&alive[given[i + PREFETCH_AHEAD]]);
                __builtin_prefetch(&solved[given[i + PREFETCH_AHEAD]]);
            }
            int64_t f = given[i];
            if (f < 0 || f >= slots) {
                PyErr_Format(PyExc_ValueError, "_fill.resolve: flow slot %lld is out of range", (long long)f);
                goto done;
            }
            if (i < n_filter) {
                if (alive[f] != 1 || solved[f] != 1) continue;
                solved[f] = 2;
                n_marked = n + 1;
            }
            sel[n++] = f;
        }
    }
    const int64_t *ids = sel;
    /* Validate entry ranges (link ids are checked in the gather), so the loops below can
     * index without checks. The slot arrays are large and the ids scattered: prefetching a
     * few flows ahead hides most of the cache misses. */
    Py_ssize_t nnz = 0;
    flow_start = malloc((n + 1) * sizeof(int64_t));
    flow_length = malloc((n + 1) * sizeof(int64_t));
    if (!flow_start || !flow_length) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            if (unit) {
                __builtin_prefetch(&packed[ids[i + PREFETCH_AHEAD] * PACKED]);
            } else {
                __builtin_prefetch(&start[ids[i + PREFETCH_AHEAD]]);
                __builtin_prefetch(&length[ids[i + PREFETCH_AHEAD]]);
            }
        }
        int64_t f = ids[i]; /* in range: checked in the selection */
        if (unit && packed[f * PACKED] >= 0) { /* flow_start -1: the links are in the packed row */
            if (packed[f * PACKED] >= PACKED) {
                PyErr_Format(PyExc_ValueError, "_fill.resolve: packed row of slot %lld is corrupt", (long long)f);
                goto done;
            }
            flow_start[i] = -1;
            flow_length[i] = packed[f * PACKED];
            nnz += flow_length[i];
            continue;
        }
        if (start[f] < 0 || length[f] < 0 || start[f] + length[f] > n_entries) {
            PyErr_Format(PyExc_ValueError, "_fill.resolve: flow slot %lld is out of range", (long long)f);
            goto done;
        }
        /* Kept: the gather below then reads them without a second cache miss. */
        flow_start[i] = start[f];
        flow_length[i] = length[f];
        nnz += length[f];
    }

    /* At most min(entries, links) distinct links are touched: the per-link arrays are sized
     * by that (a large re-solve would otherwise zero megabytes per update for nothing). */
    Py_ssize_t max_touched = (nnz < n_links ? nnz : n_links) + 1;
    flow_ptr = malloc((n + 1) * sizeof(int64_t));
    entry_link = malloc((nnz + 1) * sizeof(int32_t));
    entry_weight = malloc((unit ? 1 : nnz + 1) * sizeof(double)); /* not used for unit weights */
    old_rate = malloc((n + 1) * sizeof(double));
    touched_link = malloc(max_touched * sizeof(int32_t));
    count = calloc(max_touched, sizeof(int64_t));
    weight = calloc(max_touched, sizeof(double));
    count0 = malloc(max_touched * sizeof(int64_t));
    weight0 = malloc(max_touched * sizeof(double));
    tight = malloc(max_touched);
    residual = malloc(max_touched * sizeof(double));
    new_load = calloc(max_touched, sizeof(double));
    link_ptr = calloc(max_touched + 1, sizeof(int64_t));
    fill = malloc(max_touched * sizeof(int64_t));
    flows_by_link = malloc((nnz + 1) * sizeof(int32_t));
    heap = malloc(max_touched * sizeof(HeapItem));
    sat = malloc(max_touched * sizeof(int32_t));
    caps = malloc((n + 1) * sizeof(CapItem));
    active = malloc(n + 1);
    in_filling = malloc((n + 1) * sizeof(int32_t));
    multi = malloc((n + 1) * sizeof(int32_t));
    if (!flow_ptr || !entry_link || !entry_weight || !old_rate || !touched_link || !count || !weight || !residual ||
        !new_load || !link_ptr || !fill || !flows_by_link || !heap || !sat || !caps || !active || !count0 ||
        !weight0 || !tight || !in_filling || !multi) {
        PyErr_NoMemory();
        goto done;
    }

    /* 1. Gather: entries with weight > 0 (a zero weight neither loads nor constrains) as
     * touched-link indices; the old load comes off (all load, for a full solve). */
    if (full) memset(load, 0, n_links * sizeof(double));
    Py_ssize_t n_caps = 0, k_entry = 0;
    flow_ptr[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            int64_t ahead = ids[i + PREFETCH_AHEAD];
            if (flow_start[i + PREFETCH_AHEAD] >= 0)
                __builtin_prefetch(&links[flow_start[i + PREFETCH_AHEAD]]);
            else
                __builtin_prefetch(&packed[ahead * PACKED]);
            __builtin_prefetch(&rate[ahead]);
            if (has_caps) __builtin_prefetch(&cap[ahead]);
            if (!unit) __builtin_prefetch(&weights[flow_start[i + PREFETCH_AHEAD]]);
        }
        int64_t f = ids[i];
        double r = rate[f]; /* NaN exactly when not solved (FlowNetwork's invariant) */
        int take_off = !full && isfinite(r);
        old_rate[i] = r;
        const int32_t *row = flow_start[i] < 0 ? &packed[f * PACKED + 1] : NULL;
        for (int64_t j = 0; j < flow_length[i]; j++) {
            int64_t e = flow_start[i] + j; /* an entry index when not packed */
            double w = unit ? 1.0 : weights[e];
            if (!(w > 0)) continue;
            int64_t l = row ? row[j] : links[e];
            if (l < 0 || l >= n_links) {
                PyErr_Format(PyExc_ValueError, "_fill.resolve: link id %lld out of range", (long long)l);
                goto done;
            }
            int32_t t = link_map[l];
            if (t < 0) { /* first touch: load[l] is still the old load of every flow */
                t = link_map[l] = (int32_t)n_touched;
                touched_link[n_touched] = (int32_t)l;
                tight[n_touched++] = !skip_slack || perturbed[l] || !(load[l] < capacity[l] * SLACK_BELOW);
            }
            if (take_off) load[l] -= w * r;
            count[t] += 1;
            weight[t] += w;
            if (!unit) entry_weight[k_entry] = w;
            entry_link[k_entry++] = t;
        }
        flow_ptr[i + 1] = k_entry;
        if (has_caps && isfinite(cap[f])) caps[n_caps++] = (CapItem){cap[f], (int32_t)i};
    }
    qsort(caps, n_caps, sizeof(CapItem), cap_compare);

    memcpy(count0, count, n_touched * sizeof(int64_t));
    memcpy(weight0, weight, n_touched * sizeof(double));
    Py_ssize_t n_out;
    for (;;) {
        /* Link -> re-solved flows index (counting sort) over the links in the filling. */
        link_ptr[0] = 0;
        for (Py_ssize_t t = 0; t < n_touched; t++) link_ptr[t + 1] = link_ptr[t] + (tight[t] ? count0[t] : 0);
        memcpy(fill, link_ptr, n_touched * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t n_in = 0;
            for (int64_t k = flow_ptr[i]; k < flow_ptr[i + 1]; k++) {
                if (!tight[entry_link[k]]) continue;
                flows_by_link[fill[entry_link[k]]++] = (int32_t)i;
                n_in++;
            }
            in_filling[i] = n_in;
        }
        Py_ssize_t heap_size = 0;
        for (Py_ssize_t t = 0; t < n_touched; t++) {
            new_load[t] = 0.0;
            if (!tight[t]) continue;
            count[t] = count0[t];
            weight[t] = weight0[t];
            double r = capacity[touched_link[t]] - load[touched_link[t]];
            residual[t] = r > 0 ? r : 0.0;
            double level = level_of(residual, weight, count, t);
            if (isfinite(level)) heap_push(heap, &heap_size, level, (int32_t)t);
        }
        memset(active, 1, n);

        /* 2. Progressive filling: one event per distinct level (within grow). */
        Py_ssize_t next_cap = 0;
        n_out = 0;
        events = 0;
        for (;;) {
            /* The lowest valid heap entry (entries whose level rose are re-keyed lazily). */
            while (heap_size) {
                HeapItem top = heap[0];
                double level = level_of(residual, weight, count, top.link);
                if (level == top.key) break;
                heap_pop(heap, &heap_size);
                if (isfinite(level)) heap_push(heap, &heap_size, level, top.link);
            }
            while (next_cap < n_caps && !active[caps[next_cap].flow]) next_cap++;
            double link_level = heap_size ? (heap[0].key > 0 ? heap[0].key : 0.0) : INFINITY;
            double cap_level = next_cap < n_caps ? caps[next_cap].cap : INFINITY;
            double current = link_level < cap_level ? link_level : cap_level;
            if (current == INFINITY) break;
            events++;
            double threshold = current * grow;
            /* Every link at or below the threshold saturates now (levels read before freezing). */
            Py_ssize_t n_sat = 0;
            while (heap_size) {
                HeapItem top = heap[0];
                double level = level_of(residual, weight, count, top.link);
                if (level != top.key) {
                    heap_pop(heap, &heap_size);
                    if (isfinite(level)) heap_push(heap, &heap_size, level, top.link);
                    continue;
                }
                if (top.key > threshold) break;
                heap_pop(heap, &heap_size);
                sat[n_sat++] = top.link;
            }
            Py_ssize_t first_new = n_out, n_multi = 0;
            for (Py_ssize_t s = 0; s < n_sat; s++) {
                int32_t t = sat[s];
                int64_t alone = 0; /* unit-weight flows whose only link in the filling is t */
                for (int64_t k = link_ptr[t]; k < link_ptr[t + 1]; k++) {
                    int32_t i = flows_by_link[k];
                    if (!active[i]) continue;
                    active[i] = 0;
                    out_ids[n_out++] = i; /* re-solved-set index for now; made a slot id below */
                    if (unit && in_filling[i] == 1)
                        alone++;
                    else
                        multi[n_multi++] = i;
                }
                /* Most flows cross one link that can fill: their share of t is accounted in
                 * one step, with no pass over their entries. */
                residual[t] -= alone * current;
                weight[t] -= alone;
                count[t] -= alone;
                new_load[t] += alone * current;
            }
            while (next_cap < n_caps && caps[next_cap].cap <= threshold) {
                int32_t i = caps[next_cap++].flow;
                if (!active[i]) continue;
                active[i] = 0;
                out_ids[n_out++] = i;
                multi[n_multi++] = i;
            }
            for (Py_ssize_t k = first_new; k < n_out; k++) out_rates[k] = current;
            /* The others' load goes on every link of theirs in the filling (the current level
             * is <= every level on their path). */
            for (Py_ssize_t m = 0; m < n_multi; m++) {
                int32_t i = multi[m];
                for (int64_t e = flow_ptr[i]; e < flow_ptr[i + 1]; e++) {
                    int32_t t = entry_link[e];
                    if (!tight[t]) continue;
                    double w = unit ? 1.0 : entry_weight[e];
                    residual[t] -= w * current;
                    weight[t] -= w;
                    count[t] -= 1;
                    new_load[t] += w * current;
                }
            }
        }
        /* What is left is unconstrained (no loaded link, no cap): rate inf, no accounted load. */
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!active[i]) continue;
            out_ids[n_out] = i;
            out_rates[n_out++] = INFINITY;
        }
        if (!skip_slack) break;
        /* The left-out links' new load; one over capacity, or under an unconstrained flow,
         * goes into the filling and the filling is redone. */
        int redo = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            int64_t i = out_ids[k];
            double r = out_rates[k];
            for (int64_t e = flow_ptr[i]; e < flow_ptr[i + 1]; e++) {
                int32_t t = entry_link[e];
                if (tight[t]) continue;
                if (r == INFINITY) {
                    tight[t] = 1;
                    redo = 1;
                } else {
                    new_load[t] += (unit ? 1.0 : entry_weight[e]) * r;
                }
            }
        }
        for (Py_ssize_t t = 0; t < n_touched; t++) {
            if (!tight[t] && load[touched_link[t]] + new_load[t] > capacity[touched_link[t]]) {
                tight[t] = 1;
                redo = 1;
            }
        }
        if (!redo) break;
        retries++;
    }

    /* 3. Rates, solved flags, the flows whose rate changed, new load; out_ids become slots. */
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t i = out_ids[k], f = ids[i];
        double r = out_rates[k];
        if (!(old_rate[i] == r)) { /* NaN (new flow) never equals */
            out_changed_rates[n_changed] = r;
            out_changed[n_changed++] = f;
        }
        out_ids[k] = f;
        rate[f] = r;
        solved[f] = 1;
    }
    for (Py_ssize_t t = 0; t < n_touched; t++) load[touched_link[t]] += new_load[t];
    /* Freeze order is by level; rounding can only break it by a hair, but the order must hold. */
    for (Py_ssize_t k = 1; k < n; k++) {
        if (out_rates[k] < out_rates[k - 1]) {
            ranked = malloc(n * sizeof(Ranked));
            if (!ranked) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t j = 0; j < n; j++) ranked[j] = (Ranked){out_rates[j], out_ids[j]};
            qsort(ranked, n, sizeof(Ranked), ranked_compare);
            for (Py_ssize_t j = 0; j < n; j++) {
                out_rates[j] = ranked[j].rate;
                out_ids[j] = ranked[j].id;
            }
            break;
        }
    }
    n_marked = 0;
    result = Py_BuildValue("nnnn", events, n, n_changed, retries);

done:
    for (Py_ssize_t k = 0; k < n_marked; k++)
        if (solved[sel[k]] == 2) solved[sel[k]] = 1;
    free(sel);
    /* The scratch map goes back to all -1, after an error too. */
    if (touched_link)
        for (Py_ssize_t t = 0; t < n_touched; t++) link_map[touched_link[t]] = -1;
    free(flow_start);
    free(flow_length);
    free(flow_ptr);
    free(entry_link);
    free(entry_weight);
    free(old_rate);
    free(touched_link);
    free(count);
    free(weight);
    free(count0);
    free(weight0);
    free(tight);
    free(residual);
    free(new_load);
    free(link_ptr);
    free(fill);
    free(flows_by_link);
    free(heap);
    free(caps);
    free(active);
    free(in_filling);
    free(multi);
    free(sat);
    free(ranked);
    PyBuffer_Release(&b_ids);
    PyBuffer_Release(&b_start);
    PyBuffer_Release(&b_length);
    PyBuffer_Release(&b_links);
    PyBuffer_Release(&b_weights);
    PyBuffer_Release(&b_packed);
    PyBuffer_Release(&b_cap);
    PyBuffer_Release(&b_rate);
    PyBuffer_Release(&b_solved);
    PyBuffer_Release(&b_alive);
    PyBuffer_Release(&b_capacity);
    PyBuffer_Release(&b_load);
    PyBuffer_Release(&b_perturbed);
    PyBuffer_Release(&b_map);
    PyBuffer_Release(&b_out_ids);
    PyBuffer_Release(&b_out_rates);
    PyBuffer_Release(&b_out_changed);
    PyBuffer_Release(&b_out_changed_rates);
    return result;
}

/* remove(ids, start, length, links, weights, rate, solved, alive, weight_sum, load, perturbed, unit)
 *     -> (lowest rate among the removed solved flows (inf if none), their link entries).
 *
 * FlowNetwork.remove_flows' bookkeeping: the flows' weight and load come off their links,
 * their links are marked in `perturbed` (uint8 per link), and they become dead (alive and
 * solved false, rate NaN). Raises ValueError, changing
 * nothing, when an id is not a live flow or repeats. */
static PyObject *remove_flows(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_ids, b_start, b_length, b_links, b_weights, b_rate, b_solved, b_alive, b_weight_sum, b_load,
        b_perturbed;
    int unit;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*w*w*w*w*p", &b_ids, &b_start, &b_length, &b_links, &b_weights, &b_rate,
                          &b_solved, &b_alive, &b_weight_sum, &b_load, &b_perturbed, &unit))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = b_ids.len / 8, slots = b_start.len / 8, n_links = b_load.len / 8, n_entries = b_links.len / 8;
    if (!check_buffer(&b_length, 8, slots, "length") || !check_buffer(&b_rate, 8, slots, "rate") ||
        !check_buffer(&b_solved, 1, slots, "solved") || !check_buffer(&b_alive, 1, slots, "alive") ||
        !check_buffer(&b_weight_sum, 8, n_links, "weight_sum") || !check_buffer(&b_weights, 8, n_entries, "weights") ||
        !check_buffer(&b_perturbed, 1, n_links, "perturbed"))
        goto done;
    const int64_t *ids = b_ids.buf, *start = b_start.buf, *length = b_length.buf, *links = b_links.buf;
    const double *weights = b_weights.buf;
    double *rate = b_rate.buf, *weight_sum = b_weight_sum.buf, *load = b_load.buf;
    char *solved = b_solved.buf, *alive = b_alive.buf;
    uint8_t *perturbed = b_perturbed.buf;
    /* Check every id first (alive is set to 2 while seen, to find repeats), then act. */
    Py_ssize_t bad = -1;
    int repeat = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t f = ids[i];
        if (f < 0 || f >= slots || alive[f] != 1 || start[f] < 0 || start[f] + length[f] > n_entries) {
            bad = i;
            repeat = f >= 0 && f < slots && alive[f] == 2;
            break;
        }
        alive[f] = 2;
    }
    for (Py_ssize_t i = 0; i < (bad < 0 ? n : bad); i++) alive[ids[i]] = 1;
    if (bad >= 0) {
        if (repeat)
            PyErr_SetString(PyExc_ValueError, "remove_flows: flow ids must not repeat");
        else
            PyErr_Format(PyExc_ValueError, "remove_flows: flow id %lld is not a live flow of this FlowNetwork",
                         (long long)ids[bad]);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int64_t e = start[ids[i]]; e < start[ids[i]] + length[ids[i]]; e++) {
            if (links[e] < 0 || links[e] >= n_links) {
                PyErr_Format(PyExc_ValueError, "remove_flows: link id %lld out of range", (long long)links[e]);
                goto done;
            }
        }
    }
    double lowest = INFINITY;
    Py_ssize_t dead = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t f = ids[i];
        double r = rate[f];
        int loaded = solved[f] && isfinite(r);
        if (solved[f] && r < lowest) lowest = r;
        for (int64_t e = start[f]; e < start[f] + length[f]; e++) {
            double w = unit ? 1.0 : weights[e];
            weight_sum[links[e]] -= w;
            perturbed[links[e]] = 1;
            if (loaded) load[links[e]] -= w * r;
        }
        dead += length[f];
        alive[f] = 0;
        solved[f] = 0;
        rate[f] = NAN;
    }
    result = Py_BuildValue("dn", lowest, dead);
done:
    PyBuffer_Release(&b_ids);
    PyBuffer_Release(&b_start);
    PyBuffer_Release(&b_length);
    PyBuffer_Release(&b_links);
    PyBuffer_Release(&b_weights);
    PyBuffer_Release(&b_rate);
    PyBuffer_Release(&b_solved);
    PyBuffer_Release(&b_alive);
    PyBuffer_Release(&b_weight_sum);
    PyBuffer_Release(&b_load);
    PyBuffer_Release(&b_perturbed);
    return result;
}

/* Columns of the event engine's per-flow record (engine._FlowClass.record). */
enum { REC_REMAINING, REC_RATE, REC_STAMP, REC_FINISH, REC_WIDTH };

/* progress(ids, new_rates, record, in_candidates, near, now, horizon) -> number of ids written to `near`.
 *
 * The event engine's bookkeeping after an update, for the flows whose rate changed (`ids`,
 * int64, with their new rates in `new_rates`, float64, same order). `record` is float64 with
 * REC_WIDTH columns per flow id (one cache line holds a flow's remaining bits, rate, stamp and
 * finish time): each flow drains its remaining bits at its old rate since its stamp, then
 * gets the new rate, `stamp = now` and `finish = now + remaining / rate` (inf at rate 0 with
 * bits left, `now` when nothing is left). Flows now finishing by `horizon` that are not
 * `in_candidates` (bool per flow id) yet are marked and written to `near` (int64, len(ids)). */
static PyObject *progress(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_ids, b_new, b_record, b_in, b_near;
    double now, horizon;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*dd", &b_ids, &b_new, &b_record, &b_in, &b_near, &now, &horizon))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = b_ids.len / 8, n_near = 0;
    Py_ssize_t slots = b_record.len / (8 * REC_WIDTH);
    if (!check_buffer(&b_new, 8, n, "new_rates") || !check_buffer(&b_record, 8, 0, "record") ||
        !check_buffer(&b_in, 1, slots, "in_candidates") || !check_buffer(&b_near, 8, n, "near"))
        goto done;
    const int64_t *ids = b_ids.buf;
    const double *new_rates = b_new.buf;
    double *record = b_record.buf;
    char *in_candidates = b_in.buf;
    int64_t *near = b_near.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= slots) {
            PyErr_Format(PyExc_ValueError, "_fill.progress: flow id %lld is out of range", (long long)ids[i]);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(&record[ids[i + PREFETCH_AHEAD] * REC_WIDTH]);
        int64_t f = ids[i];
        double *row = &record[f * REC_WIDTH];
        double left = row[REC_REMAINING] - row[REC_RATE] * (now - row[REC_STAMP]);
        if (!(left > 0)) left = 0.0;
        double r = new_rates[i];
        row[REC_REMAINING] = left;
        row[REC_STAMP] = now;
        row[REC_RATE] = r;
        /* as numpy's left / r: inf at rate 0 with bits left, 0 at rate inf, NaN (0/0) -> 0 */
        double t = left / r;
        if (isnan(t)) t = 0.0;
        t += now;
        row[REC_FINISH] = t;
        if (t <= horizon && !in_candidates[f]) {
            in_candidates[f] = 1;
            near[n_near++] = f;
        }
    }
    result = PyLong_FromSsize_t(n_near);
done:
    PyBuffer_Release(&b_ids);
    PyBuffer_Release(&b_new);
    PyBuffer_Release(&b_record);
    PyBuffer_Release(&b_in);
    PyBuffer_Release(&b_near);
    return result;
}

static PyMethodDef methods[] = {
    {"resolve", resolve, METH_VARARGS, "Progressive filling of FlowNetwork's re-solved flows (see the file header)."},
    {"remove", remove_flows, METH_VARARGS, "FlowNetwork.remove_flows' bookkeeping (see the function's comment)."},
    {"progress", progress, METH_VARARGS, "The event engine's finish times for flows whose rate changed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fill", "Compiled progressive filling for FlowNetwork.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fill(void) { return PyModule_Create(&module); }
