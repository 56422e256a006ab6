/* Compiled progressive filling for FlowNetwork's incremental re-solve (mlfabric.flow._fill).
 *
 * FlowNetwork.update() re-solves the flows at or above a divergence level on the capacity
 * the other flows leave. In numpy that costs ~0.6 us per re-solved flow plus ~100 us of
 * call overhead per update; the simulator's 624 x 400 parameter-server iteration re-solves
 * ~110M flows over 40k updates. This file does the same work in one call per update:
 *
 *   0. of the candidates (the flows at or above the divergence level), take only those the
 *      change can reach along the bottleneck structure (`reach`), plus the new flows;
 *   1. take the re-solved flows' old load off their links (all load, for a full solve);
 *   2. progressive filling on the residual capacity: a binary heap of link fill levels
 *      (residual / unfrozen weight) with lazy re-keying, since levels only rise as flows
 *      freeze below them; every link (and flow cap) within a relative `grow - 1` of the
 *      lowest level saturates in the same event, like maxmin._sequential_events;
 *   3. check that no kept candidate is faster than a bottleneck the filling saturated (else
 *      fall back to re-solving every candidate); write every flow's rate, put its new load
 *      on its links, update the links' shares, and emit the candidates and new flows sorted
 *      by rate, which is the new suffix of FlowNetwork's rate order.
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

/* A flow counts as tight on a saturated link when its rate is within this relative distance
 * of the link's share (the largest rate on it): generous, since a flow wrongly counted tight
 * only costs a re-solve, while one wrongly left out costs a fallback. */
#define TIGHT_RTOL 1e-9
/* When more than this fraction of the candidates is reached, all of them are re-solved:
 * the reach saves little there and a failed check would cost a second filling. */
#define REACH_MAX_FRACTION 0.8

/* One re-solve: the selected flows, the subset being re-solved, and the filling's scratch.
 * The scratch is sized for every selected flow, so a fallback from the reached subset to all
 * of them reuses it. Indices: `i` into the selection (sel), `k` into the re-solved subset,
 * `t` into the touched links (those of the subset's entries, in first-touch order). */
typedef struct {
    /* The network (FlowNetwork's arrays; see resolve's comment). */
    const int64_t *links;
    const double *weights, *cap, *capacity, *rate, *load;
    const int32_t *packed;
    const uint8_t *perturbed;
    int32_t *link_map;
    Py_ssize_t n_links;
    int unit, has_caps, skip_slack, full;
    double grow;
    /* The selection: flow slots, rates, and entries with weight > 0 (rows: selected flow i's
     * are row_link[row_ptr[i]:row_ptr[i + 1]], weights in row_weight unless unit), copied
     * once: the slot arrays are scattered over hundreds of MB on large runs, and every later
     * pass reads only these. */
    const int64_t *sel;
    const double *sel_rate;
    const int64_t *row_ptr;
    const int32_t *row_link;
    const double *row_weight;
    /* The subset re-solved now. */
    Py_ssize_t n;
    int32_t *subset;
    /* Its entries, as touched-link indices. */
    int64_t *flow_ptr;     /* (n + 1) entry range of each re-solved flow */
    int32_t *entry_link;   /* touched-link index of each entry */
    double *entry_weight;  /* its weight (not used for unit weights) */
    double *old_rate;      /* rate before (NaN: not solved) */
    /* Per touched link. */
    Py_ssize_t n_touched;
    int32_t *touched_link; /* link id */
    int64_t *count, *count0;
    double *weight, *weight0;
    double *kept;     /* load of the flows not re-solved */
    char *tight;      /* in the filling (not left out as slack) */
    double *residual, *new_load;
    double *level_at; /* the level at which it saturated in the filling (inf: it did not) */
    double *maxnr;    /* the largest rate of a candidate kept outside the subset (reach only) */
    int64_t *link_ptr, *fill;
    int32_t *flows_by_link, *sat;
    HeapItem *heap;
    /* Per re-solved flow. */
    CapItem *caps;
    Py_ssize_t n_caps;
    char *active;
    int32_t *in_filling; /* its entries on links in the filling */
    int32_t *multi;      /* the flows frozen in one event that need a pass over their entries */
    /* Output: the subset in freeze order (by level) with its rates. */
    int32_t *out_k;
    double *out_rate;
    Py_ssize_t events, retries;
} Fill;

/* 1. Gather the subset's entries as touched-link indices (map, counts, weights, the load the
 * subset carried); build the caps queue. */
static void gather(Fill *c) {
    Py_ssize_t k_entry = 0;
    c->n_caps = 0;
    c->flow_ptr[0] = 0;
    for (Py_ssize_t k = 0; k < c->n; k++) {
        if (c->has_caps && k + PREFETCH_AHEAD < c->n) __builtin_prefetch(&c->cap[c->sel[c->subset[k + PREFETCH_AHEAD]]]);
        Py_ssize_t i = c->subset[k];
        int64_t f = c->sel[i];
        double r = c->sel_rate[i]; /* NaN exactly when not solved (FlowNetwork's invariant) */
        int carried = !c->full && isfinite(r);
        c->old_rate[k] = r;
        for (int64_t e = c->row_ptr[i]; e < c->row_ptr[i + 1]; e++) {
            int32_t l = c->row_link[e];
            double w = c->unit ? 1.0 : c->row_weight[e];
            int32_t t = c->link_map[l];
            if (t < 0) {
                t = c->link_map[l] = (int32_t)c->n_touched;
                c->touched_link[t] = l;
                c->kept[t] = c->full ? 0.0 : c->load[l];
                c->tight[t] = !c->skip_slack || c->perturbed[l] || !(c->load[l] < c->capacity[l] * SLACK_BELOW);
                c->count[t] = 0;
                c->weight[t] = 0.0;
                c->maxnr[t] = -INFINITY;
                c->n_touched++;
            }
            if (carried) c->kept[t] -= w * r;
            c->count[t] += 1;
            c->weight[t] += w;
            if (!c->unit) c->entry_weight[k_entry] = w;
            c->entry_link[k_entry++] = t;
        }
        c->flow_ptr[k + 1] = k_entry;
        if (c->has_caps && isfinite(c->cap[f])) c->caps[c->n_caps++] = (CapItem){c->cap[f], (int32_t)k};
    }
    qsort(c->caps, c->n_caps, sizeof(CapItem), cap_compare);
    memcpy(c->count0, c->count, c->n_touched * sizeof(int64_t));
    memcpy(c->weight0, c->weight, c->n_touched * sizeof(double));
}

/* Forget the touched links (the scratch map back to all -1), e.g. before a fallback. */
static void untouch(Fill *c) {
    for (Py_ssize_t t = 0; t < c->n_touched; t++) c->link_map[c->touched_link[t]] = -1;
    c->n_touched = 0;
}

/* 2. Progressive filling of the subset on the capacity the kept flows leave: a binary heap of
 * link fill levels (residual / unfrozen weight) with lazy re-keying, since levels only rise as
 * flows freeze below them; every link (and flow cap) within a relative `grow - 1` of the
 * lowest level saturates in the same event, like maxmin._sequential_events. With skip_slack,
 * a left-out link that would end over capacity (or under a flow left unconstrained) is put
 * back and the filling redone (counted in `retries`). */
static void progressive_fill(Fill *c) {
    const Py_ssize_t n = c->n, n_touched = c->n_touched;
    for (;;) {
        /* Link -> re-solved flows index (counting sort) over the links in the filling. */
        c->link_ptr[0] = 0;
        for (Py_ssize_t t = 0; t < n_touched; t++) c->link_ptr[t + 1] = c->link_ptr[t] + (c->tight[t] ? c->count0[t] : 0);
        memcpy(c->fill, c->link_ptr, n_touched * sizeof(int64_t));
        for (Py_ssize_t k = 0; k < n; k++) {
            int32_t n_in = 0;
            for (int64_t e = c->flow_ptr[k]; e < c->flow_ptr[k + 1]; e++) {
                if (!c->tight[c->entry_link[e]]) continue;
                c->flows_by_link[c->fill[c->entry_link[e]]++] = (int32_t)k;
                n_in++;
            }
            c->in_filling[k] = n_in;
        }
        Py_ssize_t heap_size = 0;
        for (Py_ssize_t t = 0; t < n_touched; t++) {
            c->new_load[t] = 0.0;
            c->level_at[t] = INFINITY;
            if (!c->tight[t]) continue;
            c->count[t] = c->count0[t];
            c->weight[t] = c->weight0[t];
            double r = c->capacity[c->touched_link[t]] - c->kept[t];
            c->residual[t] = r > 0 ? r : 0.0;
            double level = level_of(c->residual, c->weight, c->count, t);
            if (isfinite(level)) heap_push(c->heap, &heap_size, level, (int32_t)t);
        }
        memset(c->active, 1, n);

        Py_ssize_t next_cap = 0, n_out = 0;
        c->events = 0;
        for (;;) {
            /* The lowest valid heap entry (entries whose level rose are re-keyed lazily). */
            while (heap_size) {
                HeapItem top = c->heap[0];
                double level = level_of(c->residual, c->weight, c->count, top.link);
                if (level == top.key) break;
                heap_pop(c->heap, &heap_size);
                if (isfinite(level)) heap_push(c->heap, &heap_size, level, top.link);
            }
            while (next_cap < c->n_caps && !c->active[c->caps[next_cap].flow]) next_cap++;
            double link_level = heap_size ? (c->heap[0].key > 0 ? c->heap[0].key : 0.0) : INFINITY;
            double cap_level = next_cap < c->n_caps ? c->caps[next_cap].cap : INFINITY;
            double current = link_level < cap_level ? link_level : cap_level;
            if (current == INFINITY) break;
            c->events++;
            double threshold = current * c->grow;
            /* Every link at or below the threshold saturates now (levels read before freezing). */
            Py_ssize_t n_sat = 0;
            while (heap_size) {
                HeapItem top = c->heap[0];
                double level = level_of(c->residual, c->weight, c->count, top.link);
                if (level != top.key) {
                    heap_pop(c->heap, &heap_size);
                    if (isfinite(level)) heap_push(c->heap, &heap_size, level, top.link);
                    continue;
                }
                if (top.key > threshold) break;
                heap_pop(c->heap, &heap_size);
                c->sat[n_sat++] = top.link;
            }
            Py_ssize_t first_new = n_out, n_multi = 0;
            for (Py_ssize_t s = 0; s < n_sat; s++) {
                int32_t t = c->sat[s];
                int64_t alone = 0; /* unit-weight flows whose only link in the filling is t */
                c->level_at[t] = current;
                for (int64_t e = c->link_ptr[t]; e < c->link_ptr[t + 1]; e++) {
                    int32_t k = c->flows_by_link[e];
                    if (!c->active[k]) continue;
                    c->active[k] = 0;
                    c->out_k[n_out++] = k;
                    if (c->unit && c->in_filling[k] == 1)
                        alone++;
                    else
                        c->multi[n_multi++] = k;
                }
                /* Most flows cross one link that can fill: their share of t is accounted in
                 * one step, with no pass over their entries. */
                c->residual[t] -= alone * current;
                c->weight[t] -= alone;
                c->count[t] -= alone;
                c->new_load[t] += alone * current;
            }
            while (next_cap < c->n_caps && c->caps[next_cap].cap <= threshold) {
                int32_t k = c->caps[next_cap++].flow;
                if (!c->active[k]) continue;
                c->active[k] = 0;
                c->out_k[n_out++] = k;
                c->multi[n_multi++] = k;
            }
            for (Py_ssize_t o = first_new; o < n_out; o++) c->out_rate[o] = current;
            /* The others' load goes on every link of theirs in the filling (the current level
             * is <= every level on their path). */
            for (Py_ssize_t m = 0; m < n_multi; m++) {
                int32_t k = c->multi[m];
                for (int64_t e = c->flow_ptr[k]; e < c->flow_ptr[k + 1]; e++) {
                    int32_t t = c->entry_link[e];
                    if (!c->tight[t]) continue;
                    double w = c->unit ? 1.0 : c->entry_weight[e];
                    c->residual[t] -= w * current;
                    c->weight[t] -= w;
                    c->count[t] -= 1;
                    c->new_load[t] += w * current;
                }
            }
        }
        /* What is left is unconstrained (no loaded link, no cap): rate inf, no accounted load. */
        for (Py_ssize_t k = 0; k < n; k++) {
            if (!c->active[k]) continue;
            c->out_k[n_out] = (int32_t)k;
            c->out_rate[n_out++] = INFINITY;
        }
        if (!c->skip_slack) return;
        /* The left-out links' new load; one over capacity, or under an unconstrained flow,
         * goes into the filling and the filling is redone. */
        int redo = 0;
        for (Py_ssize_t o = 0; o < n; o++) {
            int32_t k = c->out_k[o];
            double r = c->out_rate[o];
            for (int64_t e = c->flow_ptr[k]; e < c->flow_ptr[k + 1]; e++) {
                int32_t t = c->entry_link[e];
                if (c->tight[t]) continue;
                if (r == INFINITY) {
                    c->tight[t] = 1;
                    redo = 1;
                } else {
                    c->new_load[t] += (c->unit ? 1.0 : c->entry_weight[e]) * r;
                }
            }
        }
        for (Py_ssize_t t = 0; t < n_touched; t++) {
            if (!c->tight[t] && c->kept[t] + c->new_load[t] > c->capacity[c->touched_link[t]]) {
                c->tight[t] = 1;
                redo = 1;
            }
        }
        if (!redo) return;
        c->retries++;
    }
}

/* Which candidates a change can reach (sel[:n_cand], sorted by rate; the flows after them are
 * new). Max-min rates propagate along the bottleneck structure only: a changed link changes
 * the flows *tight* on it (rate within TIGHT_RTOL of its share, the largest rate on it), and
 * a flow whose rate changes changes every saturated link it crosses (share < inf; 0 where
 * unknown: every flow counts as tight there). The changed links start as those in `hot`
 * (FlowNetwork's perturbed links, plus every link of a new flow) and grow in `hot`. A flow
 * is only tight on links whose share is at least its rate, so one pass in rate order finds
 * almost everything; a link turning hot with a share at or below the current rate can make
 * earlier flows tight, and the pass goes back over them once it is past that level.
 * Marks `reached`; returns how many. */
static Py_ssize_t reach(const Fill *c, Py_ssize_t n_cand, Py_ssize_t n_sel, const double *share, uint8_t *hot,
                        char *reached) {
    for (int64_t e = c->row_ptr[n_cand]; e < c->row_ptr[n_sel]; e++) hot[c->row_link[e]] = 1;
    Py_ssize_t n_reached = 0, back = -1, i = 0;
    double back_until = -INFINITY; /* go back once the pass is above this rate */
    while (i < n_cand || back >= 0) {
        if (back >= 0 && (i >= n_cand || c->sel_rate[i] > back_until)) {
            i = back;
            back = -1;
            continue;
        }
        double r = c->sel_rate[i];
        if (!reached[i]) {
            int hit = 0;
            for (int64_t e = c->row_ptr[i]; e < c->row_ptr[i + 1] && !hit; e++) {
                int32_t l = c->row_link[e];
                hit = hot[l] && r >= share[l] * (1.0 - TIGHT_RTOL);
            }
            if (hit) {
                reached[i] = 1;
                n_reached++;
                for (int64_t e = c->row_ptr[i]; e < c->row_ptr[i + 1]; e++) {
                    int32_t l = c->row_link[e];
                    if (hot[l] || !(share[l] < INFINITY)) continue;
                    hot[l] = 1;
                    double lowest = share[l] * (1.0 - TIGHT_RTOL);
                    if (lowest > r) continue; /* its tight flows lie ahead */
                    /* Earlier flows at or above `lowest` may be tight on l: binary search. */
                    Py_ssize_t lo = 0, hi = i;
                    while (lo < hi) {
                        Py_ssize_t mid = lo + (hi - lo) / 2;
                        if (c->sel_rate[mid] < lowest) lo = mid + 1; else hi = mid;
                    }
                    if (lo < i && (back < 0 || lo < back)) back = lo;
                    if (r * (1.0 + TIGHT_RTOL) > back_until) back_until = r * (1.0 + TIGHT_RTOL);
                }
            }
        }
        i++;
    }
    return n_reached;
}

/* resolve(ids, start, length, links, weights, packed, cap, rate, solved, alive, capacity, load, perturbed,
 *         share, link_map, out_ids, out_rates, out_changed, out_changed_rates, full, unit, has_caps,
 *         skip_slack, use_reach, grow, n_filter)
 *     -> (filling events, flows out, changed, slack retries, re-solved flows, reach fallbacks).
 *
 * The first `n_filter` ids are candidates (FlowNetwork's rate order from the divergence level
 * on, which may hold ids of since-removed flows, of reused slots and repeats): only live,
 * solved ones are taken, each once. The other ids are new flows, taken as given. out_ids may
 * be the memory `ids` is read from (the ids are copied first).
 *
 * ids: int64 flow slots; start/length: int64 per slot (entry range); links:
 * int64 and weights: float64 per entry (read only when not `unit`: all weights 1); packed:
 * int32 rows of PACKED per slot, [count, link ids...] or [-1, ...] (read only when `unit`): the
 * same links in one cache line, used instead of start/length/links where the count is >= 0
 * (on large runs the entry array is far bigger than the cache, and this read is most of the
 * gather's cost); cap, rate: float64 per slot (rate in: old rate of solved flows, NaN for the
 * others, out: new rate); solved: bool per slot (set to true); alive: bool per slot; capacity,
 * load: float64 per link (load in: of all solved flows, out: at the new rates); perturbed:
 * uint8 per link (in: a flow left it or its capacity changed since the last solve; the reach
 * marks more); share: float64 per link, the largest rate on a saturated link, inf on an
 * unsaturated one, 0 where unknown (kept up to date for the links in the filling); link_map:
 * int32 per link, all -1 on entry and on return (scratch);
 * out_ids/out_rates: len(ids) items, the taken flows sorted by rate; out_changed: len(ids)
 * items, its first `changed` are the flows whose rate is new or differs, and
 * out_changed_rates (float64, len(ids) items) their new rates. full: the
 * load in `load` is discarded and rebuilt. has_caps: false when every cap is inf (`cap` is
 * then not read).
 *
 * use_reach (partial re-solves): only the candidates a change can reach (see `reach`) and the
 * new flows are re-solved; the others keep their rates and load. That is exact when it holds
 * up: the filling then checks, on every link where it saturates, that no kept candidate has
 * a higher rate there (else the kept flow would have to slow down); when one does, all the
 * candidates are re-solved instead (a fallback, counted).
 *
 * skip_slack (partial re-solves of solved flows only): links whose load is below SLACK_BELOW
 * of their capacity, and that are not marked in `perturbed`, are left out of the filling,
 * which then handles only the links that can be bottlenecks. That is exact when it holds up:
 * if every left-out link ends within its capacity, the allocation is feasible and every flow
 * keeps a saturated bottleneck on which its rate is the largest, which characterizes the
 * (unique) max-min allocation. A left-out link that would end over capacity (or under a flow
 * left unconstrained) is put back and the filling redone; the retries are counted. */
static PyObject *resolve(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_ids, b_start, b_length, b_links, b_weights, b_packed, b_cap, b_rate, b_solved, b_alive, b_capacity, b_load,
        b_perturbed, b_share, b_map, b_out_ids, b_out_rates, b_out_changed, b_out_changed_rates;
    int full, unit, has_caps, skip_slack, use_reach;
    double grow;
    Py_ssize_t n_filter;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*w*y*y*w*w*w*w*w*w*w*w*pppppdn", &b_ids, &b_start, &b_length, &b_links,
                          &b_weights, &b_packed, &b_cap, &b_rate, &b_solved, &b_alive, &b_capacity, &b_load,
                          &b_perturbed, &b_share, &b_map, &b_out_ids, &b_out_rates, &b_out_changed,
                          &b_out_changed_rates, &full, &unit, &has_caps, &skip_slack, &use_reach, &grow, &n_filter))
        return NULL;

    PyObject *result = NULL;
    Py_ssize_t n = b_ids.len / 8, n_links = b_capacity.len / 8;
    Py_ssize_t slots = b_start.len / 8;
    Fill c;
    memset(&c, 0, sizeof c);
    int64_t *sel = NULL;     /* (n) the taken flows: candidates first, then new ones */
    Py_ssize_t n_marked = 0; /* sel[:n_marked] holds every candidate marked solved = 2 */
    char *solved = NULL;     /* set before the first mark (the exit path reads it) */
    double *sel_rate = NULL, *row_weight = NULL;
    int64_t *row_ptr = NULL;
    int32_t *row_link = NULL;
    char *reached = NULL;
    Ranked *ranked = NULL;
    Py_ssize_t n_changed = 0, n_cand = 0, fallbacks = 0;
    skip_slack = skip_slack && !full;
    use_reach = use_reach && !full;

    if (!check_buffer(&b_ids, 8, n, "ids") || !check_buffer(&b_length, 8, slots, "length") ||
        !check_buffer(&b_packed, 4, unit ? slots * PACKED : 0, "packed") ||
        !check_buffer(&b_cap, 8, slots, "cap") || !check_buffer(&b_rate, 8, slots, "rate") ||
        !check_buffer(&b_solved, 1, slots, "solved") || !check_buffer(&b_alive, 1, slots, "alive") ||
        !check_buffer(&b_load, 8, n_links, "load") || !check_buffer(&b_perturbed, 1, n_links, "perturbed") ||
        !check_buffer(&b_share, 8, n_links, "share") ||
        !check_buffer(&b_map, 4, n_links, "link_map") || !check_buffer(&b_out_ids, 8, n, "out_ids") ||
        !check_buffer(&b_out_rates, 8, n, "out_rates") || !check_buffer(&b_out_changed, 8, n, "out_changed") ||
        !check_buffer(&b_out_changed_rates, 8, n, "out_changed_rates") ||
        !check_buffer(&b_links, 8, 0, "links") || !check_buffer(&b_weights, 8, b_links.len / 8, "weights"))
        goto done;

    const int64_t *start = b_start.buf, *length = b_length.buf;
    double *rate = b_rate.buf, *load = b_load.buf, *share = b_share.buf, *out_rates = b_out_rates.buf;
    solved = b_solved.buf;
    const char *alive = b_alive.buf;
    uint8_t *perturbed = b_perturbed.buf;
    int64_t *out_ids = b_out_ids.buf, *out_changed = b_out_changed.buf;
    double *out_changed_rates = b_out_changed_rates.buf;
    Py_ssize_t n_entries = b_links.len / 8;
    c.links = b_links.buf;
    c.weights = b_weights.buf;
    c.cap = b_cap.buf;
    c.capacity = b_capacity.buf;
    c.rate = rate;
    c.load = load;
    c.packed = b_packed.buf;
    c.perturbed = perturbed;
    c.link_map = b_map.buf;
    c.n_links = n_links;
    c.unit = unit;
    c.has_caps = has_caps;
    c.skip_slack = skip_slack;
    c.full = full;
    c.grow = grow;

    /* The ids to take, copied (out_ids may alias the input); candidates are filtered and
     * marked solved = 2 while taken (reset to 1 at the end, or on an error). */
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
                n_cand = n + 1;
            }
            sel[n++] = f;
        }
    }
    c.sel = sel;
    /* Copy each taken flow's rate and entries with weight > 0 (validated: the loops below
     * index without checks). The slot arrays are large and the ids scattered: prefetching a
     * few flows ahead hides most of the cache misses. */
    Py_ssize_t nnz = 0, room = (PACKED - 1) * (n + 1);
    sel_rate = malloc((n + 1) * sizeof(double));
    row_ptr = malloc((n + 1) * sizeof(int64_t));
    row_link = malloc(room * sizeof(int32_t));
    row_weight = unit ? NULL : malloc(room * sizeof(double));
    if (!sel_rate || !row_ptr || !row_link || (!unit && !row_weight)) {
        PyErr_NoMemory();
        goto done;
    }
    row_ptr[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            int64_t ahead = sel[i + PREFETCH_AHEAD];
            if (unit) {
                __builtin_prefetch(&c.packed[ahead * PACKED]);
            } else {
                __builtin_prefetch(&start[ahead]);
                __builtin_prefetch(&length[ahead]);
            }
            __builtin_prefetch(&rate[ahead]);
        }
        int64_t f = sel[i]; /* in range: checked in the selection */
        sel_rate[i] = rate[f];
        const int32_t *row = NULL;
        int64_t first = 0, count = 0;
        if (unit && c.packed[f * PACKED] >= 0) {
            row = &c.packed[f * PACKED + 1];
            count = c.packed[f * PACKED];
            if (count >= PACKED) {
                PyErr_Format(PyExc_ValueError, "_fill.resolve: packed row of slot %lld is corrupt", (long long)f);
                goto done;
            }
        } else {
            first = start[f];
            count = length[f];
            if (first < 0 || count < 0 || first + count > n_entries) {
                PyErr_Format(PyExc_ValueError, "_fill.resolve: flow slot %lld is out of range", (long long)f);
                goto done;
            }
        }
        if (nnz + count > room) {
            room = 2 * (nnz + count);
            int32_t *more_links = realloc(row_link, room * sizeof(int32_t));
            if (more_links) row_link = more_links;
            double *more_weights = unit ? NULL : realloc(row_weight, room * sizeof(double));
            if (more_weights) row_weight = more_weights;
            if (!more_links || (!unit && !more_weights)) {
                PyErr_NoMemory();
                goto done;
            }
        }
        for (int64_t j = 0; j < count; j++) {
            double w = row || unit ? 1.0 : c.weights[first + j];
            if (!(w > 0)) continue; /* neither loads nor constrains a link */
            int64_t l = row ? row[j] : c.links[first + j];
            if (l < 0 || l >= n_links) {
                PyErr_Format(PyExc_ValueError, "_fill.resolve: link id %lld out of range", (long long)l);
                goto done;
            }
            if (!unit) row_weight[nnz] = w;
            row_link[nnz++] = (int32_t)l;
        }
        row_ptr[i + 1] = nnz;
    }
    c.sel_rate = sel_rate;
    c.row_ptr = row_ptr;
    c.row_link = row_link;
    c.row_weight = row_weight;

    /* At most min(entries, links) distinct links are touched: the per-link arrays are sized
     * by that (a large re-solve would otherwise zero megabytes per update for nothing). */
    Py_ssize_t max_touched = (nnz < n_links ? nnz : n_links) + 1;
    c.subset = malloc((n + 1) * sizeof(int32_t));
    c.flow_ptr = malloc((n + 1) * sizeof(int64_t));
    c.entry_link = malloc((nnz + 1) * sizeof(int32_t));
    c.entry_weight = malloc((unit ? 1 : nnz + 1) * sizeof(double)); /* not used for unit weights */
    c.old_rate = malloc((n + 1) * sizeof(double));
    c.touched_link = malloc(max_touched * sizeof(int32_t));
    c.count = malloc(max_touched * sizeof(int64_t));
    c.count0 = malloc(max_touched * sizeof(int64_t));
    c.weight = malloc(max_touched * sizeof(double));
    c.weight0 = malloc(max_touched * sizeof(double));
    c.kept = malloc(max_touched * sizeof(double));
    c.tight = malloc(max_touched);
    c.residual = malloc(max_touched * sizeof(double));
    c.new_load = malloc(max_touched * sizeof(double));
    c.level_at = malloc(max_touched * sizeof(double));
    c.maxnr = malloc(max_touched * sizeof(double));
    c.link_ptr = malloc((max_touched + 1) * sizeof(int64_t));
    c.fill = malloc(max_touched * sizeof(int64_t));
    c.flows_by_link = malloc((nnz + 1) * sizeof(int32_t));
    c.sat = malloc(max_touched * sizeof(int32_t));
    c.heap = malloc(max_touched * sizeof(HeapItem));
    c.caps = malloc((n + 1) * sizeof(CapItem));
    c.active = malloc(n + 1);
    c.in_filling = malloc((n + 1) * sizeof(int32_t));
    c.multi = malloc((n + 1) * sizeof(int32_t));
    c.out_k = malloc((n + 1) * sizeof(int32_t));
    c.out_rate = malloc((n + 1) * sizeof(double));
    reached = calloc(n + 1, 1);
    if (!c.subset || !c.flow_ptr || !c.entry_link || !c.entry_weight || !c.old_rate || !c.touched_link || !c.count ||
        !c.count0 || !c.weight || !c.weight0 || !c.kept || !c.tight || !c.residual || !c.new_load || !c.level_at ||
        !c.maxnr || !c.link_ptr || !c.fill || !c.flows_by_link || !c.sat || !c.heap || !c.caps || !c.active ||
        !c.in_filling || !c.multi || !c.out_k || !c.out_rate || !reached) {
        PyErr_NoMemory();
        goto done;
    }

    /* The subset: the reached candidates and the new flows, or everything. */
    c.n = 0;
    if (use_reach && n_cand > 0) {
        Py_ssize_t n_reached = reach(&c, n_cand, n, share, perturbed, reached);
        if (n_reached > REACH_MAX_FRACTION * n_cand) use_reach = 0;
    } else {
        use_reach = 0;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!use_reach || i >= n_cand || reached[i]) c.subset[c.n++] = (int32_t)i;

    for (;;) {
        gather(&c);
        if (use_reach) {
            /* The largest rate of a kept candidate on each touched link. */
            for (Py_ssize_t i = 0; i < n_cand; i++) {
                if (reached[i]) continue;
                double r = sel_rate[i];
                for (int64_t e = row_ptr[i]; e < row_ptr[i + 1]; e++) {
                    int32_t t = c.link_map[row_link[e]];
                    if (t >= 0 && r > c.maxnr[t]) c.maxnr[t] = r;
                }
            }
        }
        progressive_fill(&c);
        if (!use_reach) break;
        int holds = 1;
        for (Py_ssize_t t = 0; t < c.n_touched && holds; t++)
            holds = !(c.maxnr[t] > c.level_at[t] * grow);
        if (holds) break;
        /* A kept candidate is faster than a re-solved flow's bottleneck: re-solve all of them. */
        fallbacks++;
        untouch(&c);
        use_reach = 0;
        c.n = 0;
        for (Py_ssize_t i = 0; i < n; i++) c.subset[c.n++] = (int32_t)i;
    }

    /* 3. Rates, the flows whose rate changed, new load, link shares. */
    for (Py_ssize_t o = 0; o < c.n; o++) {
        int32_t k = c.out_k[o];
        int64_t f = sel[c.subset[k]];
        double r = c.out_rate[o];
        if (!(c.old_rate[k] == r)) { /* NaN (new flow) never equals */
            out_changed_rates[n_changed] = r;
            out_changed[n_changed++] = f;
        }
        rate[f] = r;
    }
    for (Py_ssize_t i = 0; i < n; i++) solved[sel[i]] = 1;
    n_marked = 0;
    if (full) memset(load, 0, n_links * sizeof(double));
    for (Py_ssize_t t = 0; t < c.n_touched; t++) {
        int32_t l = c.touched_link[t];
        load[l] = c.kept[t] + c.new_load[t];
        if (c.tight[t])
            share[l] = c.level_at[t];
        else /* left out as slack: saturated only by a coincidence, and then its share is unknown */
            share[l] = load[l] < c.capacity[l] * (1.0 - TIGHT_RTOL) ? INFINITY : 0.0;
    }
    /* Freeze order is by level; rounding can only break it by a hair, but the order must hold. */
    for (Py_ssize_t o = 1; o < c.n; o++) {
        if (c.out_rate[o] < c.out_rate[o - 1]) {
            ranked = malloc(c.n * sizeof(Ranked));
            if (!ranked) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t j = 0; j < c.n; j++) ranked[j] = (Ranked){c.out_rate[j], c.out_k[j]};
            qsort(ranked, c.n, sizeof(Ranked), ranked_compare);
            for (Py_ssize_t j = 0; j < c.n; j++) {
                c.out_rate[j] = ranked[j].rate;
                c.out_k[j] = (int32_t)ranked[j].id;
            }
            break;
        }
    }
    /* The taken flows by rate: the re-solved ones merged with the kept candidates (in rate order already). */
    {
        Py_ssize_t o = 0, i = use_reach ? 0 : n_cand, w = 0;
        for (;;) {
            while (i < n_cand && reached[i]) i++;
            int has_kept = i < n_cand, has_solved = o < c.n;
            if (!has_kept && !has_solved) break;
            if (has_solved && (!has_kept || c.out_rate[o] <= sel_rate[i])) {
                out_ids[w] = sel[c.subset[c.out_k[o]]];
                out_rates[w++] = c.out_rate[o++];
            } else {
                out_ids[w] = sel[i];
                out_rates[w++] = sel_rate[i++];
            }
        }
    }
    result = Py_BuildValue("nnnnnn", c.events, n, n_changed, c.retries, c.n, fallbacks);

done:
    for (Py_ssize_t k = 0; k < n_marked; k++)
        if (solved[sel[k]] == 2) solved[sel[k]] = 1;
    /* The scratch map goes back to all -1, after an error too. */
    if (c.touched_link) untouch(&c);
    free(sel);
    free(sel_rate);
    free(row_ptr);
    free(row_link);
    free(row_weight);
    free(reached);
    free(ranked);
    free(c.subset);
    free(c.flow_ptr);
    free(c.entry_link);
    free(c.entry_weight);
    free(c.old_rate);
    free(c.touched_link);
    free(c.count);
    free(c.count0);
    free(c.weight);
    free(c.weight0);
    free(c.kept);
    free(c.tight);
    free(c.residual);
    free(c.new_load);
    free(c.level_at);
    free(c.maxnr);
    free(c.link_ptr);
    free(c.fill);
    free(c.flows_by_link);
    free(c.sat);
    free(c.heap);
    free(c.caps);
    free(c.active);
    free(c.in_filling);
    free(c.multi);
    free(c.out_k);
    free(c.out_rate);
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
    PyBuffer_Release(&b_share);
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
