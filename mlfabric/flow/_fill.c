/* Compiled progressive filling for FlowNetwork's incremental re-solve (mlfabric.flow._fill).
 *
 * FlowNetwork.update() re-solves the flows at or above a divergence level on the capacity
 * the other flows leave. In numpy that costs ~0.6 us per re-solved flow plus ~100 us of
 * call overhead per update; in the simulator's 624 x 400 parameter-server iteration ~113M
 * flows are at or above that level over 40k updates (the reach below re-solves 23M of them).
 * This file does the same work in one call per update:
 *
 *   0. of the candidates (the flows at or above the divergence level), take only those the
 *      change can reach along the bottleneck structure (`reach`), plus the new flows;
 *   1. take the re-solved flows' old load off their links (all load, for a full solve);
 *   2. progressive filling on the residual capacity: a binary heap of link fill levels
 *      (residual / unfrozen weight) with lazy re-keying, since levels only rise as flows
 *      freeze below them; every link (and flow cap) within a relative `grow - 1` of the
 *      lowest level saturates in the same event, like maxmin._sequential_events;
 *   3. check that no kept candidate is faster than a bottleneck the filling saturated (else
 *      take those candidates too, with what they reach, and fill again; after
 *      REACH_MAX_GROWS rounds, re-solve every candidate); write every flow's rate, put its new load
 *      on its links, update the links' shares, and rewrite the part of FlowNetwork's rate
 *      order that changed.
 *
 * It also holds the event engine's per-event helpers (progress, earliest, take, rebuild).
 * The pointer-level cores (fill_resolve, fill_remove, fill_progress, fill_earliest,
 * fill_rebuild; _fill.h) are what the engine's compiled loop in _events.c calls.
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

#include "_fill.h"

/* How many re-solved flows ahead the gather prefetches their slot data. */
#define PREFETCH_AHEAD 24
/* How many frozen flows ahead the filling prefetches their entries (twice that: their range). */
#define PREFETCH_STEP 6
/* With slack links left out (see resolve), a link counts as slack when its load is below this
 * fraction of its capacity. Most re-solved entries of a fat-tree run are on links far below
 * it (host and core links of an oversubscribed tree: ~80% of entries under 90% load). */
#define SLACK_BELOW 0.99

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
 * only costs a re-solve, while one wrongly left out would cost exactness. */
#define TIGHT_RTOL 1e-9
/* When the reach takes more than this fraction of the candidates, all of them are re-solved:
 * the reach saves little there and a failed check would cost a second filling. */
#define REACH_MAX_FRACTION 0.8
/* When the reach does not hold, the candidates found faster than a new bottleneck join the
 * re-solved flows (with every flow tight on their links) and the filling runs again, at most
 * this many times before every candidate is re-solved. Halving-doubling on fat-tree:k=16 fell
 * back on 21% of its partial re-solves, each re-solving the whole suffix (mean 109 of 569
 * flows, median 5 reached): most of an 8,192-host run's time (#37). */
#define REACH_MAX_GROWS 8

/* One filling: the flows re-solved and its scratch. Indices: `k` into the re-solved flows
 * (sel), `t` into the touched links (those of their entries, in first-touch order). */
typedef struct {
    /* The network (FlowNetwork's arrays; see resolve's comment). */
    const double *cap, *capacity, *load;
    const uint8_t *perturbed;
    int32_t *link_map;
    int unit, has_caps, skip_slack, full;
    double grow;
    /* The re-solved flows: slots, old rates (NaN: not solved), and entries with weight > 0
     * (flow k's are rows.link[row_start[k]:row_end[k]], weights in rows.weight unless unit),
     * copied once: the slot arrays are scattered over hundreds of MB on large runs, and
     * every later pass reads only these. */
    Py_ssize_t n;
    const int64_t *sel;
    const double *old_rate;
    const int64_t *row_start, *row_end;
    const int32_t *row_link;
    const double *row_weight;
    /* Their entries, as touched-link indices. */
    int64_t *flow_ptr;    /* (n + 1) entry range of each re-solved flow */
    int32_t *entry_link;  /* touched-link index of each entry */
    double *entry_weight; /* its weight (not used for unit weights) */
    /* Per touched link. */
    Py_ssize_t n_touched;
    int32_t *touched_link; /* link id */
    int64_t *count, *count0;
    double *weight, *weight0;
    double *kept; /* load of the flows not re-solved */
    char *tight;  /* in the filling (not left out as slack) */
    double *residual, *new_load;
    double *level_at; /* the level at which it saturated in the filling (inf: it did not) */
    int64_t *link_ptr, *fill;
    int32_t *flows_by_link, *sat;
    HeapItem *heap;
    /* Per re-solved flow. */
    CapItem *caps;
    Py_ssize_t n_caps;
    char *active;
    int32_t *in_filling; /* its entries on links in the filling */
    int32_t *multi;      /* the flows frozen in one event that need a pass over their entries */
    /* Output: the re-solved flows in freeze order (by level) with their rates. */
    int32_t *out_k;
    double *out_rate;
    Py_ssize_t events, retries;
} Fill;

/* Scratch memory kept between calls (calls are serialized by the GIL). A re-solve needs ~40
 * arrays; allocated per update, the large ones came back from the kernel as fresh zeroed
 * pages every time (page faults and clearing: ~5% of a 40k-update run). Each array has its
 * slot, grown as needed and never given back (the largest re-solve's size stays). */
enum {
    S_FLOW_PTR, S_ENTRY_LINK, S_ENTRY_WEIGHT, S_TOUCHED_LINK, S_COUNT, S_COUNT0, S_WEIGHT, S_WEIGHT0, S_KEPT,
    S_TIGHT, S_RESIDUAL, S_NEW_LOAD, S_LEVEL_AT, S_LINK_PTR, S_FILL, S_FLOWS_BY_LINK, S_SAT, S_HEAP, S_CAPS,
    S_ACTIVE, S_IN_FILLING, S_MULTI, S_OUT_K, S_OUT_RATE, S_BANDS, S_GIVEN, S_GIVEN_RATES, S_SEL_ID, S_SEL_RATE,
    S_SEL_START, S_SEL_END, S_CAND_STATE, S_CAND_START, S_CAND_END, S_SUSPECT, S_RANGES, S_RANKED, S_ROWS_LINK,
    S_ROWS_WEIGHT, S_TIMES, S_KEPT_IDS, S_KEPT_RATES, S_FORCED, N_SCRATCH
};
static struct {
    void *p;
    size_t size;
} scratch_pool[N_SCRATCH];

/* Slot `which` with room for `bytes` (its content kept when `keep`); NULL when out of memory. */
static void *scratch(int which, size_t bytes, int keep) {
    if (bytes > scratch_pool[which].size) {
        size_t size = bytes + bytes / 2 + 64;
        void *p = keep ? realloc(scratch_pool[which].p, size) : malloc(size);
        if (!p) return NULL;
        if (!keep) free(scratch_pool[which].p);
        scratch_pool[which].p = p;
        scratch_pool[which].size = size;
    }
    return scratch_pool[which].p;
}

/* Forget the scratch (it stays in the pool). */
static void fill_free(Fill *c) {
    c->flow_ptr = NULL;
    c->entry_link = NULL;
    c->entry_weight = NULL;
    c->touched_link = NULL;
    c->count = c->count0 = NULL;
    c->weight = c->weight0 = c->kept = c->residual = c->new_load = c->level_at = NULL;
    c->tight = c->active = NULL;
    c->link_ptr = c->fill = NULL;
    c->flows_by_link = c->sat = c->in_filling = c->multi = c->out_k = NULL;
    c->heap = NULL;
    c->caps = NULL;
    c->out_rate = NULL;
}

/* Scratch for c->n flows with nnz entries over at most n_links links; 0, or -1 (no memory). */
static int fill_alloc(Fill *c, Py_ssize_t nnz, Py_ssize_t n_links) {
    Py_ssize_t n = c->n;
    /* At most min(entries, links) distinct links are touched: the per-link arrays are sized
     * by that (a large re-solve would otherwise zero megabytes per update for nothing). */
    Py_ssize_t max_touched = (nnz < n_links ? nnz : n_links) + 1;
    c->flow_ptr = scratch(S_FLOW_PTR, (n + 1) * sizeof(int64_t), 0);
    c->entry_link = scratch(S_ENTRY_LINK, (nnz + 1) * sizeof(int32_t), 0);
    c->entry_weight = scratch(S_ENTRY_WEIGHT, (c->unit ? 1 : nnz + 1) * sizeof(double), 0); /* not used for unit weights */
    c->touched_link = scratch(S_TOUCHED_LINK, max_touched * sizeof(int32_t), 0);
    c->count = scratch(S_COUNT, max_touched * sizeof(int64_t), 0);
    c->count0 = scratch(S_COUNT0, max_touched * sizeof(int64_t), 0);
    c->weight = scratch(S_WEIGHT, max_touched * sizeof(double), 0);
    c->weight0 = scratch(S_WEIGHT0, max_touched * sizeof(double), 0);
    c->kept = scratch(S_KEPT, max_touched * sizeof(double), 0);
    c->tight = scratch(S_TIGHT, max_touched, 0);
    c->residual = scratch(S_RESIDUAL, max_touched * sizeof(double), 0);
    c->new_load = scratch(S_NEW_LOAD, max_touched * sizeof(double), 0);
    c->level_at = scratch(S_LEVEL_AT, max_touched * sizeof(double), 0);
    c->link_ptr = scratch(S_LINK_PTR, (max_touched + 1) * sizeof(int64_t), 0);
    c->fill = scratch(S_FILL, max_touched * sizeof(int64_t), 0);
    c->flows_by_link = scratch(S_FLOWS_BY_LINK, (nnz + 1) * sizeof(int32_t), 0);
    c->sat = scratch(S_SAT, max_touched * sizeof(int32_t), 0);
    c->heap = scratch(S_HEAP, max_touched * sizeof(HeapItem), 0);
    c->caps = scratch(S_CAPS, (n + 1) * sizeof(CapItem), 0);
    c->active = scratch(S_ACTIVE, n + 1, 0);
    c->in_filling = scratch(S_IN_FILLING, (n + 1) * sizeof(int32_t), 0);
    c->multi = scratch(S_MULTI, (n + 1) * sizeof(int32_t), 0);
    c->out_k = scratch(S_OUT_K, (n + 1) * sizeof(int32_t), 0);
    c->out_rate = scratch(S_OUT_RATE, (n + 1) * sizeof(double), 0);
    if (!c->flow_ptr || !c->entry_link || !c->entry_weight || !c->touched_link || !c->count || !c->count0 ||
        !c->weight || !c->weight0 || !c->kept || !c->tight || !c->residual || !c->new_load || !c->level_at ||
        !c->link_ptr || !c->fill || !c->flows_by_link || !c->sat || !c->heap || !c->caps || !c->active ||
        !c->in_filling || !c->multi || !c->out_k || !c->out_rate)
        return -1;
    return 0;
}

/* 1. Gather the re-solved flows' entries as touched-link indices (map, counts, weights, the
 * load they carried); build the caps queue. */
static void gather(Fill *c) {
    Py_ssize_t k_entry = 0;
    c->n_caps = 0;
    c->n_touched = 0;
    c->flow_ptr[0] = 0;
    for (Py_ssize_t k = 0; k < c->n; k++) {
        if (c->has_caps && k + PREFETCH_AHEAD < c->n) __builtin_prefetch(&c->cap[c->sel[k + PREFETCH_AHEAD]]);
        double r = c->old_rate[k];
        int carried = !c->full && isfinite(r);
        for (int64_t e = c->row_start[k]; e < c->row_end[k]; e++) {
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
                c->n_touched++;
            }
            if (carried) c->kept[t] -= w * r;
            c->count[t] += 1;
            c->weight[t] += w;
            if (!c->unit) c->entry_weight[k_entry] = w;
            c->entry_link[k_entry++] = t;
        }
        c->flow_ptr[k + 1] = k_entry;
        if (c->has_caps && isfinite(c->cap[c->sel[k]])) c->caps[c->n_caps++] = (CapItem){c->cap[c->sel[k]], (int32_t)k};
    }
    qsort(c->caps, c->n_caps, sizeof(CapItem), cap_compare);
    memcpy(c->count0, c->count, c->n_touched * sizeof(int64_t));
    memcpy(c->weight0, c->weight, c->n_touched * sizeof(double));
}

/* Forget the touched links (the scratch map back to all -1), e.g. before a fallback. */
static void untouch(Fill *c) {
    if (c->touched_link)
        for (Py_ssize_t t = 0; t < c->n_touched; t++) c->link_map[c->touched_link[t]] = -1;
    c->n_touched = 0;
}

/* 2. Progressive filling of the re-solved flows on the capacity the kept flows leave: a binary heap of
 * link fill levels (residual / unfrozen weight) with lazy re-keying, since levels only rise as
 * flows freeze below them; every link (and flow cap) within a relative `grow - 1` of the
 * lowest level saturates in the same event, like maxmin._sequential_events. With skip_slack,
 * a left-out link that would end over capacity (or under a flow left unconstrained) is put
 * back and the filling redone (counted in `retries`). */
static void progressive_fill(Fill *c) {
    /* Locals, not c->: the loops below store through these, and the compiler keeps them in
     * registers only when it can tell the stores do not move the pointers themselves. */
    const Py_ssize_t n = c->n, n_touched = c->n_touched;
    const int unit = c->unit;
    const int64_t *restrict flow_ptr = c->flow_ptr;
    const int32_t *restrict entry_link = c->entry_link;
    const double *restrict entry_weight = c->entry_weight;
    const int64_t *restrict count0 = c->count0;
    const double *restrict weight0 = c->weight0, *restrict kept = c->kept, *restrict capacity = c->capacity;
    const int32_t *restrict touched_link = c->touched_link;
    char *restrict tight = c->tight, *restrict active = c->active;
    double *restrict residual = c->residual, *restrict weight = c->weight, *restrict new_load = c->new_load;
    double *restrict level_at = c->level_at, *restrict out_rate = c->out_rate;
    int64_t *restrict count = c->count, *restrict link_ptr = c->link_ptr, *restrict fill = c->fill;
    int32_t *restrict flows_by_link = c->flows_by_link, *restrict sat = c->sat, *restrict in_filling = c->in_filling;
    int32_t *restrict multi = c->multi, *restrict out_k = c->out_k;
    HeapItem *heap = c->heap;
    const CapItem *caps = c->caps;
    for (;;) {
        /* Link -> re-solved flows index (counting sort) over the links in the filling. */
        link_ptr[0] = 0;
        for (Py_ssize_t t = 0; t < n_touched; t++) link_ptr[t + 1] = link_ptr[t] + (tight[t] ? count0[t] : 0);
        memcpy(fill, link_ptr, n_touched * sizeof(int64_t));
        for (Py_ssize_t k = 0; k < n; k++) {
            int32_t n_in = 0;
            for (int64_t e = flow_ptr[k]; e < flow_ptr[k + 1]; e++) {
                if (!tight[entry_link[e]]) continue;
                flows_by_link[fill[entry_link[e]]++] = (int32_t)k;
                n_in++;
            }
            in_filling[k] = n_in;
        }
        Py_ssize_t heap_size = 0;
        for (Py_ssize_t t = 0; t < n_touched; t++) {
            new_load[t] = 0.0;
            level_at[t] = INFINITY;
            if (!tight[t]) continue;
            count[t] = count0[t];
            weight[t] = weight0[t];
            double r = capacity[touched_link[t]] - kept[t];
            residual[t] = r > 0 ? r : 0.0;
            double level = level_of(residual, weight, count, t);
            if (isfinite(level)) heap_push(heap, &heap_size, level, (int32_t)t);
        }
        memset(active, 1, n);

        Py_ssize_t next_cap = 0, n_out = 0;
        c->events = 0;
        for (;;) {
            /* The lowest valid heap entry (entries whose level rose are re-keyed lazily). */
            while (heap_size) {
                HeapItem top = heap[0];
                double level = level_of(residual, weight, count, top.link);
                if (level == top.key) break;
                heap_pop(heap, &heap_size);
                if (isfinite(level)) heap_push(heap, &heap_size, level, top.link);
            }
            while (next_cap < c->n_caps && !active[caps[next_cap].flow]) next_cap++;
            double link_level = heap_size ? (heap[0].key > 0 ? heap[0].key : 0.0) : INFINITY;
            double cap_level = next_cap < c->n_caps ? caps[next_cap].cap : INFINITY;
            double current = link_level < cap_level ? link_level : cap_level;
            if (current == INFINITY) break;
            c->events++;
            double threshold = current * c->grow;
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
                level_at[t] = current;
                for (int64_t e = link_ptr[t]; e < link_ptr[t + 1]; e++) {
                    int32_t k = flows_by_link[e];
                    if (!active[k]) continue;
                    active[k] = 0;
                    out_k[n_out++] = k;
                    if (unit && in_filling[k] == 1)
                        alone++;
                    else
                        multi[n_multi++] = k;
                }
                /* Most flows cross one link that can fill: their share of t is accounted in
                 * one step, with no pass over their entries. */
                residual[t] -= alone * current;
                weight[t] -= alone;
                count[t] -= alone;
                new_load[t] += alone * current;
            }
            while (next_cap < c->n_caps && caps[next_cap].cap <= threshold) {
                int32_t k = caps[next_cap++].flow;
                if (!active[k]) continue;
                active[k] = 0;
                out_k[n_out++] = k;
                multi[n_multi++] = k;
            }
            for (Py_ssize_t o = first_new; o < n_out; o++) out_rate[o] = current;
            /* The others' load goes on every link of theirs in the filling (the current level
             * is <= every level on their path). */
            for (Py_ssize_t m = 0; m < n_multi; m++) {
                /* Frozen flows come in freeze order, scattered over the entry arrays: fetch a
                 * few flows ahead (their range, then their entries). */
                if (m + 2 * PREFETCH_STEP < n_multi) __builtin_prefetch(&flow_ptr[multi[m + 2 * PREFETCH_STEP]]);
                if (m + PREFETCH_STEP < n_multi) __builtin_prefetch(&entry_link[flow_ptr[multi[m + PREFETCH_STEP]]]);
                int32_t k = multi[m];
                for (int64_t e = flow_ptr[k]; e < flow_ptr[k + 1]; e++) {
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
        for (Py_ssize_t k = 0; k < n; k++) {
            if (!active[k]) continue;
            out_k[n_out] = (int32_t)k;
            out_rate[n_out++] = INFINITY;
        }
        if (!c->skip_slack) return;
        /* The left-out links' new load; one over capacity, or under an unconstrained flow,
         * goes into the filling and the filling is redone. */
        int redo = 0;
        for (Py_ssize_t o = 0; o < n; o++) {
            int32_t k = out_k[o];
            double r = out_rate[o];
            for (int64_t e = flow_ptr[k]; e < flow_ptr[k + 1]; e++) {
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
            if (!tight[t] && kept[t] + new_load[t] > capacity[touched_link[t]]) {
                tight[t] = 1;
                redo = 1;
            }
        }
        if (!redo) return;
        c->retries++;
    }
}


/* Rows of entries with weight > 0, appended one flow at a time. */
typedef struct {
    int32_t *link;
    double *weight; /* NULL for unit weights */
    Py_ssize_t n, room;
} Rows;

/* Append slot f's entries with weight > 0 to `rows` (checked: a corrupt packed row, an entry
 * range or link id out of range raise ValueError); 0, or -1 with a Python error set. */
static int rows_add(Rows *rows, const Slots *s, int64_t f) {
    const int32_t *row = NULL;
    int64_t first = 0, count;
    if (s->unit && s->packed[f * PACKED] >= 0) {
        count = s->packed[f * PACKED];
        row = &s->packed[f * PACKED + 1];
        if (count >= PACKED) {
            PyErr_Format(PyExc_ValueError, "_fill.resolve: packed row of slot %lld is corrupt", (long long)f);
            return -1;
        }
    } else {
        first = s->start[f];
        count = s->length[f];
        if (first < 0 || count < 0 || first + count > s->n_entries) {
            PyErr_Format(PyExc_ValueError, "_fill.resolve: flow slot %lld is out of range", (long long)f);
            return -1;
        }
    }
    if (rows->n + count > rows->room) {
        Py_ssize_t room = 2 * (rows->n + count) + 64;
        int32_t *link = scratch(S_ROWS_LINK, room * sizeof(int32_t), 1);
        if (link) rows->link = link;
        double *weight = s->unit ? NULL : scratch(S_ROWS_WEIGHT, room * sizeof(double), 1);
        if (weight) rows->weight = weight;
        if (!link || (!s->unit && !weight)) {
            PyErr_NoMemory();
            return -1;
        }
        rows->room = room;
    }
    for (int64_t j = 0; j < count; j++) {
        double w = row || s->unit ? 1.0 : s->weights[first + j];
        if (!(w > 0)) continue; /* neither loads nor constrains a link */
        int64_t l = row ? row[j] : s->links[first + j];
        if (l < 0 || l >= s->n_links) {
            PyErr_Format(PyExc_ValueError, "_fill.resolve: link id %lld out of range", (long long)l);
            return -1;
        }
        if (!s->unit) rows->weight[rows->n] = w;
        rows->link[rows->n++] = (int32_t)l;
    }
    return 0;
}

/* The flows to re-solve: slots, old rates (NaN: new) and where their entries are in the rows. */
typedef struct {
    int64_t *id;
    double *rate;
    int64_t *row_start, *row_end;
    Py_ssize_t n;
} Selection;

static inline void select_flow(Selection *sel, int64_t f, double rate, int64_t row_start, int64_t row_end) {
    sel->id[sel->n] = f;
    sel->rate[sel->n] = rate;
    sel->row_start[sel->n] = row_start;
    sel->row_end[sel->n++] = row_end;
}

/* Clear the "taken" mark of the given flows (sel's first n), where set: solved = 2 (all
 * candidates re-solved) or the rate NaN (the reach; sel->rate holds it). */
static void unmark(const Selection *sel, Py_ssize_t n, char *solved, double *rate) {
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t f = sel->id[k];
        if (solved[f] == 2) solved[f] = 1;
        if (isnan(rate[f]) && !isnan(sel->rate[k])) rate[f] = sel->rate[k];
    }
}

/* The candidates (FlowNetwork's rate order from the divergence level on: ids and the rates
 * they were sorted by, possibly with stale ids) as the reach sees them, read lazily. */
enum { CAND_UNSEEN, CAND_KEPT, CAND_TAKEN, CAND_DROPPED };
typedef struct {
    Py_ssize_t n;
    const int64_t *id;
    const double *rate;
    char *state;             /* CAND_*: a valid candidate left alone, taken, or a stale entry */
    int64_t *row_start, *row_end; /* its entries in the rows (once read) */
    Py_ssize_t scanned;
    Py_ssize_t first_removed, last_removed; /* the first and last index taken or dropped (n, -1: none) */
} Candidates;

/* Candidate i leaves its place in the rate order (taken or dropped). */
static inline void candidate_remove(Candidates *cand, Py_ssize_t i, char state) {
    cand->state[i] = state;
    if (i < cand->first_removed) cand->first_removed = i;
    if (i > cand->last_removed) cand->last_removed = i;
}

/* Read candidate i once: valid (live, solved, at the rate it is sorted by, not taken yet) or
 * dropped; its row is appended to `rows`. 0, or -1 with a Python error set. */
static int candidate_read(Candidates *cand, Py_ssize_t i, Rows *rows, const Slots *s, const char *alive,
                          const char *solved, const double *rate, Py_ssize_t slots) {
    if (cand->state[i] != CAND_UNSEEN) return 0;
    int64_t f = cand->id[i];
    if (f < 0 || f >= slots) {
        PyErr_Format(PyExc_ValueError, "_fill.resolve: flow slot %lld is out of range", (long long)f);
        return -1;
    }
    cand->scanned++;
    /* Rates are NaN exactly where a slot is not solved (dead, or new), and the reach sets a
     * taken flow's to NaN too: a rate equal to the sorted one means live, solved and not
     * taken yet (else a repeated entry). One random read per candidate. */
    (void)alive;
    (void)solved;
    if (!(rate[f] == cand->rate[i])) {
        candidate_remove(cand, i, CAND_DROPPED);
        return 0;
    }
    cand->row_start[i] = rows->n;
    if (rows_add(rows, s, f) < 0) return -1;
    cand->row_end[i] = rows->n;
    cand->state[i] = CAND_KEPT;
    return 0;
}

/* Start fetching what candidate_read(cand, i) will read (the sweeps read candidates in
 * order, but their slots are scattered). */
static inline void candidate_prefetch(const Candidates *cand, Py_ssize_t i, const Slots *s, const char *alive,
                                      const char *solved, const double *rate, Py_ssize_t slots) {
    if (i >= cand->n || cand->state[i] != CAND_UNSEEN) return;
    int64_t f = cand->id[i];
    if (f < 0 || f >= slots) return;
    (void)alive;
    (void)solved;
    __builtin_prefetch(&rate[f]);
    if (s->unit) __builtin_prefetch(&s->packed[f * PACKED]);
}

/* Start fetching candidates i .. i + PREFETCH_AHEAD - 1: where a sweep lands after a jump,
 * the one-ahead prefetch of candidate_prefetch has not run for them yet. */
static inline void candidate_prefetch_burst(const Candidates *cand, Py_ssize_t i, const Slots *s, const char *alive,
                                            const char *solved, const double *rate, Py_ssize_t slots) {
    for (Py_ssize_t j = i; j < i + PREFETCH_AHEAD && j < cand->n; j++)
        candidate_prefetch(cand, j, s, alive, solved, rate, slots);
}

/* The reach: which candidates a change can reach. Max-min rates propagate along the
 * bottleneck structure only: a changed link changes the flows *tight* on it (rate within
 * TIGHT_RTOL of its share, the largest rate on it), and a flow whose rate changes changes every
 * saturated link it crosses (share < inf; share 0 is unknown: every flow counts as tight).
 * The changed links start as those marked in `hot` (FlowNetwork's perturbed links, and every
 * link of a new flow) and grow in it.
 *
 * A flow tight on link l has a rate within TIGHT_RTOL of l's share, so only the candidates in
 * the rate bands of hot links are read: a sweep in rate order jumps from band to band (a heap
 * of bands by their lower end). A link turning hot with a band below the current rate sends
 * the sweep back over that band once it is past it. Reached candidates are taken (their
 * rate set to NaN, appended to `sel`). Returns how many, or -1 with a Python error set. */
static Py_ssize_t reach(Candidates *cand, Rows *rows, const Slots *s, const char *alive, char *solved,
                        double *rate, Py_ssize_t slots, const double *share, uint8_t *hot, Selection *sel) {
    Py_ssize_t n_links = s->n_links, n = cand->n, taken = 0;
    HeapItem *bands = scratch(S_BANDS, (n_links + 1) * sizeof(HeapItem), 0);
    if (!bands) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t n_bands = 0;
    for (Py_ssize_t l = 0; l < n_links; l++) {
        uint64_t word; /* few links are hot: skip them eight at a time */
        if ((l & 7) == 0 && l + 8 <= n_links && (memcpy(&word, &hot[l], 8), word == 0)) {
            l += 7;
            continue;
        }
        if (hot[l] && share[l] < INFINITY)
            heap_push(bands, &n_bands, share[l] > 0 ? share[l] * (1.0 - TIGHT_RTOL) : -INFINITY, (int32_t)l);
    }
    Py_ssize_t pos = 0, back = -1;
    double scan_to = -INFINITY, back_until = -INFINITY;
    for (;;) {
        if (back >= 0 && (pos >= n || cand->rate[pos] > back_until)) {
            pos = back;
            back = -1;
            candidate_prefetch_burst(cand, pos, s, alive, solved, rate, slots);
            continue;
        }
        if (pos >= n) break;
        /* Bands starting at or below the current rate: the sweep is inside them. */
        while (n_bands && bands[0].key <= cand->rate[pos]) {
            double band_share = share[bands[0].link];
            double top = band_share > 0 ? band_share * (1.0 + TIGHT_RTOL) : INFINITY;
            if (top > scan_to) scan_to = top;
            heap_pop(bands, &n_bands);
        }
        if (cand->rate[pos] > scan_to) { /* between bands: jump to the next one */
            if (back >= 0) {
                pos = back;
                back = -1;
                candidate_prefetch_burst(cand, pos, s, alive, solved, rate, slots);
                continue;
            }
            if (!n_bands) break;
            pos = lower_bound(cand->rate, pos, n, bands[0].key);
            candidate_prefetch_burst(cand, pos, s, alive, solved, rate, slots);
            continue;
        }
        candidate_prefetch(cand, pos + PREFETCH_AHEAD, s, alive, solved, rate, slots);
        if (candidate_read(cand, pos, rows, s, alive, solved, rate, slots) < 0) {
            return -1;
        }
        if (cand->state[pos] == CAND_KEPT) {
            double r = cand->rate[pos];
            int hit = 0;
            for (int64_t e = cand->row_start[pos]; e < cand->row_end[pos] && !hit; e++) {
                int32_t l = rows->link[e];
                hit = hot[l] && r >= share[l] * (1.0 - TIGHT_RTOL);
            }
            if (hit) {
                int64_t f = cand->id[pos];
                candidate_remove(cand, pos, CAND_TAKEN);
                select_flow(sel, f, r, cand->row_start[pos], cand->row_end[pos]);
                rate[f] = NAN; /* taken (unmark and the output write it back) */
                taken++;
                for (int64_t e = cand->row_start[pos]; e < cand->row_end[pos]; e++) {
                    int32_t l = rows->link[e];
                    if (hot[l] || !(share[l] < INFINITY)) continue;
                    hot[l] = 1;
                    double lowest = share[l] > 0 ? share[l] * (1.0 - TIGHT_RTOL) : -INFINITY;
                    if (lowest > r) {
                        heap_push(bands, &n_bands, lowest, l);
                        continue;
                    }
                    /* Its band reaches below here: earlier flows in it may be tight on l. */
                    Py_ssize_t from = lower_bound(cand->rate, 0, pos, lowest);
                    if (from < pos && (back < 0 || from < back)) back = from;
                    if (r * (1.0 + TIGHT_RTOL) > back_until) back_until = r * (1.0 + TIGHT_RTOL);
                    double top = share[l] > 0 ? share[l] * (1.0 + TIGHT_RTOL) : INFINITY;
                    if (top > scan_to) scan_to = top;
                }
            }
        }
        pos++;
    }
    return taken;
}

/* After a filling of the reached flows: may a kept candidate be faster than a bottleneck the
 * filling saturated (then it would have to slow down, and the reach does not hold)? On a link
 * that was hot, every candidate kept is below its old share (else it was tight, hence taken):
 * only a link whose new level is lower than that, or that was not saturated before, can have
 * one; the candidates in the union of those rate ranges are read and checked. 1: it holds; 0: it does not,
 * and the positions of the candidates that are too fast are appended to faster[*n_faster..];
 * -1: a Python error. */
typedef struct {
    double from, to;
} Range;

static int range_compare(const void *a, const void *b) {
    const Range *x = a, *y = b;
    return (x->from > y->from) - (x->from < y->from);
}

static int reach_holds(const Fill *c, Candidates *cand, Rows *rows, const Slots *s, const char *alive,
                       const char *solved, const double *rate, Py_ssize_t slots, const double *share,
                       double *suspect, Range *ranges, Py_ssize_t *faster, Py_ssize_t *n_faster) {
    Py_ssize_t n_ranges = 0;
    int holds = 1;
    for (Py_ssize_t t = 0; t < c->n_touched; t++) {
        suspect[t] = INFINITY;
        if (!c->tight[t] || c->level_at[t] == INFINITY) continue;
        double old = share[c->touched_link[t]];
        if (old == 0.0) continue; /* unknown: every candidate on it was taken */
        double from = c->level_at[t] * c->grow;
        double to = old < INFINITY ? old * (1.0 - TIGHT_RTOL) : INFINITY;
        if (!(from < to)) continue;
        suspect[t] = from;
        ranges[n_ranges++] = (Range){from, to};
    }
    /* The candidates in the union of the suspect links' ranges. */
    qsort(ranges, n_ranges, sizeof(Range), range_compare);
    for (Py_ssize_t j = 0; j < n_ranges;) {
        double from = ranges[j].from, to = ranges[j].to;
        for (j++; j < n_ranges && ranges[j].from <= to; j++)
            if (ranges[j].to > to) to = ranges[j].to;
        Py_ssize_t first = lower_bound(cand->rate, 0, cand->n, from);
        candidate_prefetch_burst(cand, first, s, alive, solved, rate, slots);
        for (Py_ssize_t i = first; i < cand->n && cand->rate[i] <= to; i++) {
            candidate_prefetch(cand, i + PREFETCH_AHEAD, s, alive, solved, rate, slots);
            if (candidate_read(cand, i, rows, s, alive, solved, rate, slots) < 0) return -1;
            if (cand->state[i] != CAND_KEPT) continue;
            double r = cand->rate[i];
            for (int64_t e = cand->row_start[i]; e < cand->row_end[i]; e++) {
                int32_t t = c->link_map[rows->link[e]];
                if (t >= 0 && r > suspect[t]) {
                    faster[(*n_faster)++] = i;
                    holds = 0;
                    break;
                }
            }
        }
    }
    return holds;
}

/* The unchanged ends of the rate-order suffix, 8-byte items in[0:from] and in[to:n], to
 * out[0:from] and out[tail_at:]. The output may be the input itself (FlowNetwork's case),
 * elsewhere, or overlap it: the block that moves toward the other one goes first (a prefix
 * moving right could run over the tail, a tail moving left over the prefix). */
static void move_ends(void *out, const void *in, Py_ssize_t from, Py_ssize_t to, Py_ssize_t n, Py_ssize_t tail_at) {
    char *o = out;
    const char *i = in;
    int prefix_first = (uintptr_t)o <= (uintptr_t)i;
    for (int pass = 0; pass < 2; pass++) {
        if ((pass == 0) == prefix_first) {
            if (o != i) memmove(o, i, from * 8);
        } else if (tail_at != to || o != i) {
            memmove(o + tail_at * 8, i + to * 8, (n - to) * 8);
        }
    }
}

/* One re-solve (see the wrapper below for the arguments' meaning): 0, or -1 with a Python error set. */
int fill_resolve(const Net *net, Resolve *r) {
    int status = -1;
    const Py_ssize_t n_given = r->n_given, n_links = net->s.n_links, slots = net->slots;
    const Py_ssize_t n_filter = r->n_filter < 0 ? 0 : r->n_filter > n_given ? n_given : r->n_filter;
    int full = r->full, skip_slack = r->skip_slack, use_reach = r->use_reach;
    Fill c;
    memset(&c, 0, sizeof c);
    Rows rows = {NULL, NULL, 0, 0};
    Candidates cand;
    memset(&cand, 0, sizeof cand);
    /* Read until the merge at the end, which may write over them (see there). */
    const int64_t *given = r->ids;
    const double *given_rates = r->id_rates;
    Selection sel = {NULL, NULL, NULL, NULL, 0}; /* the re-solved flows */
    double *suspect = NULL;
    Range *ranges = NULL;
    Py_ssize_t n_marked = 0; /* sel.id[:n_marked] holds every candidate marked taken (see unmark) */
    char *solved = NULL;                /* set before the first mark (the exit path reads it) */
    Ranked *ranked = NULL;
    Py_ssize_t n_changed = 0, fallbacks = 0, events = 0, retries = 0;
    /* Candidates (positions) an earlier filling found faster than a new bottleneck: taken
     * before the reach in every later round (see REACH_MAX_GROWS). */
    Py_ssize_t *faster = NULL, n_faster = 0, grows = 0;
    skip_slack = skip_slack && !full;
    use_reach = use_reach && !full && n_filter > 0;

    double *rate = net->rate, *load = net->load, *share = net->share;
    double *out_rates = r->out_rates, *out_changed_rates = r->out_changed_rates;
    solved = net->solved;
    const char *alive = net->alive;
    uint8_t *perturbed = net->perturbed;
    int64_t *out_ids = r->out_ids, *out_changed = r->out_changed;
    const Slots s = net->s;
    const int unit = s.unit;
    c.cap = net->cap;
    c.capacity = net->capacity;
    c.load = load;
    c.perturbed = perturbed;
    c.link_map = net->link_map;
    c.unit = unit;
    c.has_caps = net->has_caps;
    c.skip_slack = skip_slack;
    c.full = full;
    c.grow = r->grow;

    sel.id = scratch(S_SEL_ID, (n_given + 1) * sizeof(int64_t), 0);
    sel.rate = scratch(S_SEL_RATE, (n_given + 1) * sizeof(double), 0);
    sel.row_start = scratch(S_SEL_START, (n_given + 1) * sizeof(int64_t), 0);
    sel.row_end = scratch(S_SEL_END, (n_given + 1) * sizeof(int64_t), 0);
    if (!sel.id || !sel.rate || !sel.row_start || !sel.row_end) {
        PyErr_NoMemory();
        goto done;
    }
    if (fill_ids_in_range(given + n_filter, n_given - n_filter, slots, "_fill.resolve: flow slot") < 0) goto done;

    for (;;) {
        /* Select the flows to re-solve: the new ones, then the reached (or all live) candidates. */
        sel.n = n_marked = 0;
        rows.n = 0;
        for (Py_ssize_t i = n_filter; i < n_given; i++) {
            int64_t f = given[i], first = rows.n;
            if (rows_add(&rows, &s, f) < 0) goto done;
            select_flow(&sel, f, rate[f], first, rows.n);
            if (use_reach)
                for (int64_t e = first; e < rows.n; e++) perturbed[rows.link[e]] = 1;
        }
        if (use_reach) {
            cand.n = n_filter;
            cand.id = given;
            cand.rate = given_rates;
            cand.first_removed = n_filter;
            cand.last_removed = -1;
            cand.state = scratch(S_CAND_STATE, n_filter + 1, 0);
            if (cand.state) memset(cand.state, CAND_UNSEEN, n_filter + 1);
            cand.row_start = scratch(S_CAND_START, (n_filter + 1) * sizeof(int64_t), 0);
            cand.row_end = scratch(S_CAND_END, (n_filter + 1) * sizeof(int64_t), 0);
            if (!cand.state || !cand.row_start || !cand.row_end) {
                PyErr_NoMemory();
                goto done;
            }
            /* They change like new flows: their links are hot, and they are re-solved. */
            Py_ssize_t forced = 0;
            for (Py_ssize_t j = 0; j < n_faster; j++) {
                Py_ssize_t p = faster[j];
                if (candidate_read(&cand, p, &rows, &s, alive, solved, rate, slots) < 0) goto done;
                if (cand.state[p] != CAND_KEPT) continue;
                int64_t f = cand.id[p];
                candidate_remove(&cand, p, CAND_TAKEN);
                select_flow(&sel, f, cand.rate[p], cand.row_start[p], cand.row_end[p]);
                n_marked = sel.n;
                rate[f] = NAN; /* taken, as the reach marks it */
                forced++;
                for (int64_t e = cand.row_start[p]; e < cand.row_end[p]; e++) perturbed[rows.link[e]] = 1;
            }
            Py_ssize_t taken = reach(&cand, &rows, &s, alive, solved, rate, slots, share, perturbed, &sel);
            n_marked = sel.n;
            if (taken < 0) goto done;
            taken += forced;
            if (taken > REACH_MAX_FRACTION * n_filter) { /* little to gain: take them all */
                if (grows) fallbacks++; /* after a failed check: counted as falling back */
                unmark(&sel, n_marked, solved, rate);
                use_reach = 0;
                continue;
            }
        } else {
            for (Py_ssize_t i = 0; i < n_filter; i++) {
                if (i + PREFETCH_AHEAD < n_filter) {
                    int64_t ahead = given[i + PREFETCH_AHEAD];
                    if (ahead >= 0 && ahead < slots) {
                        __builtin_prefetch(&alive[ahead]);
                        __builtin_prefetch(&solved[ahead]);
                        __builtin_prefetch(&rate[ahead]);
                        if (unit) __builtin_prefetch(&s.packed[ahead * PACKED]);
                    }
                }
                int64_t f = given[i];
                if (f < 0 || f >= slots) {
                    PyErr_Format(PyExc_ValueError, "_fill.resolve: flow slot %lld is out of range", (long long)f);
                    goto done;
                }
                if (alive[f] != 1 || solved[f] != 1) continue;
                solved[f] = 2;
                int64_t first = rows.n;
                if (rows_add(&rows, &s, f) < 0) {
                    n_marked = sel.n;
                    solved[f] = 1;
                    goto done;
                }
                select_flow(&sel, f, rate[f], first, rows.n);
                n_marked = sel.n;
            }
        }

        /* Fill them. */
        c.n = sel.n;
        c.sel = sel.id;
        c.old_rate = sel.rate;
        c.row_start = sel.row_start;
        c.row_end = sel.row_end;
        c.row_link = rows.link;
        c.row_weight = rows.weight;
        Py_ssize_t nnz = 0;
        for (Py_ssize_t k = 0; k < sel.n; k++) nnz += sel.row_end[k] - sel.row_start[k];
        if (fill_alloc(&c, nnz, n_links) < 0) {
            PyErr_NoMemory();
            goto done;
        }
        gather(&c);
        progressive_fill(&c);
        events += c.events;
        retries += c.retries;
        if (!use_reach) break;
        suspect = scratch(S_SUSPECT, (c.n_touched + 1) * sizeof(double), 0);
        ranges = scratch(S_RANGES, (c.n_touched + 1) * sizeof(Range), 0);
        /* Each candidate is found too fast at most once (it is taken in every later round). */
        if (!faster) faster = scratch(S_FORCED, (n_filter + 1) * sizeof(Py_ssize_t), 0);
        if (!suspect || !ranges || !faster) {
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t n_before = n_faster;
        int holds = reach_holds(&c, &cand, &rows, &s, alive, solved, rate, slots, share, suspect, ranges, faster,
                                &n_faster);
        if (holds < 0) goto done;
        if (holds) break;
        /* A kept candidate is faster than a re-solved flow's bottleneck: fill again with it
         * (and what it reaches) re-solved too, or, after REACH_MAX_GROWS rounds, re-solve all. */
        untouch(&c);
        fill_free(&c);
        unmark(&sel, n_marked, solved, rate);
        if (++grows > REACH_MAX_GROWS || n_faster == n_before) {
            fallbacks++;
            use_reach = 0;
        }
    }

    /* 3. Rates, the flows whose rate changed, new load, link shares. */
    for (Py_ssize_t o = 0; o < sel.n; o++) {
        int32_t k = c.out_k[o];
        double r = c.out_rate[o];
        if (!(sel.rate[k] == r)) { /* NaN (new flow) never equals */
            out_changed_rates[n_changed] = r;
            out_changed[n_changed++] = sel.id[k];
        }
        rate[sel.id[k]] = r;
    }
    /* New flows (sel's first) become solved; so do the candidates marked solved = 2 when
     * all were re-solved (the reach's marks were their rates, written above). */
    for (Py_ssize_t k = 0; k < (use_reach ? n_given - n_filter : sel.n); k++) solved[sel.id[k]] = 1;
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
    for (Py_ssize_t o = 1; o < sel.n; o++) {
        if (c.out_rate[o] < c.out_rate[o - 1]) {
            ranked = scratch(S_RANKED, (sel.n + 1) * sizeof(Ranked), 0);
            if (!ranked) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t j = 0; j < sel.n; j++) ranked[j] = (Ranked){c.out_rate[j], c.out_k[j]};
            qsort(ranked, sel.n, sizeof(Ranked), ranked_compare);
            for (Py_ssize_t j = 0; j < sel.n; j++) {
                c.out_rate[j] = ranked[j].rate;
                c.out_k[j] = (int32_t)ranked[j].id;
            }
            break;
        }
    }
    /* The new suffix: the re-solved flows merged with the candidates kept (the reach only).
     * Only a region changes: from the first candidate taken or dropped (or the first
     * re-solved rate) to the last one taken or dropped (or past the last re-solved rate).
     * Before it nothing moves; after it the candidates move as one block. */
    Py_ssize_t n_out = 0;
    if (!use_reach) {
        for (Py_ssize_t o = 0; o < sel.n; o++) {
            out_ids[n_out] = sel.id[c.out_k[o]];
            out_rates[n_out++] = c.out_rate[o];
        }
    } else {
        Py_ssize_t from = cand.first_removed, to = cand.last_removed + 1;
        if (sel.n) {
            Py_ssize_t first_in = lower_bound(given_rates, 0, n_filter, c.out_rate[0]);
            Py_ssize_t last_in = lower_bound(given_rates, 0, n_filter, c.out_rate[sel.n - 1]);
            if (first_in < from) from = first_in;
            if (last_in > to) to = last_in;
        }
        if (to < from) to = from;
        /* The region's kept candidates, copied first: the output may run ahead of them. */
        int64_t *kept_ids = scratch(S_KEPT_IDS, (to - from + 1) * sizeof(int64_t), 0);
        double *kept_rates = scratch(S_KEPT_RATES, (to - from + 1) * sizeof(double), 0);
        if (!kept_ids || !kept_rates) {
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t n_kept = 0;
        for (Py_ssize_t i = from; i < to; i++) {
            if (cand.state[i] == CAND_TAKEN || cand.state[i] == CAND_DROPPED) continue;
            kept_ids[n_kept] = given[i];
            kept_rates[n_kept++] = given_rates[i];
        }
        /* The output may be the input itself (FlowNetwork's case), elsewhere, or overlap it:
         * the block that moves toward the other one goes first (a prefix moving right would
         * overwrite the tail it runs into, a tail moving left the prefix). */
        Py_ssize_t tail = n_filter - to, tail_at = from + n_kept + sel.n;
        move_ends(out_ids, given, from, to, n_filter, tail_at);
        move_ends(out_rates, given_rates, from, to, n_filter, tail_at);
        n_out = from;
        Py_ssize_t o = 0, i = 0;
        while (o < sel.n || i < n_kept) {
            if (o < sel.n && (i >= n_kept || c.out_rate[o] <= kept_rates[i])) {
                out_ids[n_out] = sel.id[c.out_k[o]];
                out_rates[n_out++] = c.out_rate[o++];
            } else {
                out_ids[n_out] = kept_ids[i];
                out_rates[n_out++] = kept_rates[i++];
            }
        }
        n_out += tail;
    }
    r->events = events;
    r->n_out = n_out;
    r->n_changed = n_changed;
    r->retries = retries;
    r->n_resolved = sel.n;
    r->fallbacks = fallbacks;
    r->grows = grows;
    r->read = cand.scanned;
    status = 0;

done:
    if (solved) unmark(&sel, n_marked, solved, rate);
    /* The scratch map goes back to all -1, after an error too. */
    untouch(&c);
    fill_free(&c);
    return status;
}

/* resolve(ids, id_rates, start, length, links, weights, packed, cap, rate, solved, alive, capacity, load,
 *         perturbed, share, link_map, out_ids, out_rates, out_changed, out_changed_rates, full, unit, has_caps,
 *         skip_slack, use_reach, grow, n_filter)
 *     -> (filling events, flows out, changed, slack retries, re-solved flows, reach fallbacks, candidates read,
 *         reach grows).
 *
 * The first `n_filter` ids are candidates: FlowNetwork's rate order from the divergence level
 * on, sorted by `id_rates` (float64, n_filter items), which may hold ids of since-removed
 * flows, of reused slots and repeats; only live, solved ones at the rate they are sorted by
 * count, each once. The other ids are new flows, taken as given. out_ids/out_rates may be the
 * memory ids/id_rates are read from (both are copied first).
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
 * int32 per link, all -1 on entry and on return (scratch).
 *
 * Output: out_ids/out_rates (len(ids) items): the new suffix of the rate order, its first
 * `flows out` items; out_changed: len(ids) items, its first `changed` are the flows whose rate
 * is new or differs, and out_changed_rates (float64, len(ids) items) their new rates. full: the
 * load in `load` is discarded and rebuilt. has_caps: false when every cap is inf (`cap` is
 * then not read).
 *
 * use_reach (partial re-solves): only the candidates the change can reach (see `reach`) and
 * the new flows are re-solved; the other candidates keep their rates, load and place in the
 * order (stale entries the sweep did not read stay too). That is exact when it holds up:
 * `reach_holds` checks that no kept candidate is faster than a bottleneck the filling
 * saturated (else it would have to slow down); when one is, every candidate is re-solved
 * instead (a fallback, counted). Without use_reach, every live candidate is re-solved and
 * the suffix is rewritten without stale entries.
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
    Py_buffer b_ids, b_id_rates, b_start, b_length, b_links, b_weights, b_packed, b_cap, b_rate, b_solved, b_alive,
        b_capacity, b_load, b_perturbed, b_share, b_map, b_out_ids, b_out_rates, b_out_changed, b_out_changed_rates;
    int full, unit, has_caps, skip_slack, use_reach;
    double grow;
    Py_ssize_t n_filter;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*w*w*y*y*w*w*w*w*w*w*w*w*pppppdn", &b_ids, &b_id_rates, &b_start,
                          &b_length, &b_links, &b_weights, &b_packed, &b_cap, &b_rate, &b_solved, &b_alive,
                          &b_capacity, &b_load, &b_perturbed, &b_share, &b_map, &b_out_ids, &b_out_rates,
                          &b_out_changed, &b_out_changed_rates, &full, &unit, &has_caps, &skip_slack, &use_reach,
                          &grow, &n_filter))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_given = b_ids.len / 8, n_links = b_capacity.len / 8, slots = b_start.len / 8;
    if (n_filter > n_given) n_filter = n_given;
    if (n_filter < 0) n_filter = 0;
    if (!check_buffer(&b_ids, 8, n_given, "ids") || !check_buffer(&b_id_rates, 8, n_filter, "id_rates") ||
        !check_buffer(&b_length, 8, slots, "length") ||
        !check_buffer(&b_packed, 4, unit ? slots * PACKED : 0, "packed") ||
        !check_buffer(&b_cap, 8, slots, "cap") || !check_buffer(&b_rate, 8, slots, "rate") ||
        !check_buffer(&b_solved, 1, slots, "solved") || !check_buffer(&b_alive, 1, slots, "alive") ||
        !check_buffer(&b_load, 8, n_links, "load") || !check_buffer(&b_perturbed, 1, n_links, "perturbed") ||
        !check_buffer(&b_share, 8, n_links, "share") ||
        !check_buffer(&b_map, 4, n_links, "link_map") || !check_buffer(&b_out_ids, 8, n_given, "out_ids") ||
        !check_buffer(&b_out_rates, 8, n_given, "out_rates") || !check_buffer(&b_out_changed, 8, n_given, "out_changed") ||
        !check_buffer(&b_out_changed_rates, 8, n_given, "out_changed_rates") ||
        !check_buffer(&b_links, 8, 0, "links") || !check_buffer(&b_weights, 8, b_links.len / 8, "weights"))
        goto done;
    {
        const Net net = {{b_start.buf, b_length.buf, b_links.buf, b_weights.buf, b_packed.buf, n_links,
                          b_links.len / 8, unit},
                         slots, b_cap.buf, b_rate.buf, b_solved.buf, b_alive.buf, b_capacity.buf, b_load.buf,
                         b_perturbed.buf, b_share.buf, b_map.buf, has_caps};
        Resolve r = {b_ids.buf, n_given, b_id_rates.buf, n_filter, b_out_ids.buf, b_out_rates.buf, b_out_changed.buf,
                     b_out_changed_rates.buf, full, skip_slack, use_reach, grow};
        if (fill_resolve(&net, &r) < 0) goto done;
        result = Py_BuildValue("nnnnnnnn", r.events, r.n_out, r.n_changed, r.retries, r.n_resolved, r.fallbacks,
                               r.read, r.grows);
    }
done:
    PyBuffer_Release(&b_ids);
    PyBuffer_Release(&b_id_rates);
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
int fill_remove(const Net *net, double *weight_sum, const int64_t *ids, Py_ssize_t n, double *lowest_out,
                Py_ssize_t *dead_out) {
    const Py_ssize_t slots = net->slots, n_links = net->s.n_links, n_entries = net->s.n_entries;
    const int64_t *start = net->s.start, *length = net->s.length, *links = net->s.links;
    const double *weights = net->s.weights;
    const int unit = net->s.unit;
    double *rate = net->rate, *load = net->load;
    char *solved = net->solved, *alive = (char *)net->alive;
    uint8_t *perturbed = net->perturbed;
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
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int64_t e = start[ids[i]]; e < start[ids[i]] + length[ids[i]]; e++) {
            if (links[e] < 0 || links[e] >= n_links) {
                PyErr_Format(PyExc_ValueError, "remove_flows: link id %lld out of range", (long long)links[e]);
                return -1;
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
    *lowest_out = lowest;
    *dead_out = dead;
    return 0;
}

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
    {
        const Net net = {{b_start.buf, b_length.buf, b_links.buf, b_weights.buf, NULL, n_links, n_entries, unit},
                         slots, NULL, b_rate.buf, b_solved.buf, b_alive.buf, NULL, b_load.buf, b_perturbed.buf,
                         NULL, NULL, 0};
        double lowest;
        Py_ssize_t dead;
        if (fill_remove(&net, b_weight_sum.buf, b_ids.buf, n, &lowest, &dead) == 0)
            result = Py_BuildValue("dn", lowest, dead);
    }
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


Py_ssize_t fill_progress(const int64_t *ids, const double *new_rates, Py_ssize_t n, double *record,
                         char *in_candidates, int64_t *near, double now, double horizon) {
    Py_ssize_t n_near = 0;
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
    return n_near;
}

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
    if (fill_ids_in_range(ids, n, slots, "_fill.progress: flow id") < 0) goto done;
    n_near = fill_progress(ids, new_rates, n, record, in_candidates, near, now, horizon);
    result = PyLong_FromSsize_t(n_near);
done:
    PyBuffer_Release(&b_ids);
    PyBuffer_Release(&b_new);
    PyBuffer_Release(&b_record);
    PyBuffer_Release(&b_in);
    PyBuffer_Release(&b_near);
    return result;
}

/* The k-th smallest (0-based) of values[0:n], which it reorders (quickselect). */
static double select_kth(double *values, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        double a = values[lo], b = values[lo + (hi - lo) / 2], c = values[hi];
        double pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b)); /* median of 3 */
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (values[i] < pivot) i++;
            while (values[j] > pivot) j--;
            if (i <= j) {
                double t = values[i];
                values[i++] = values[j];
                values[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return values[k];
    }
    return values[k];
}

Py_ssize_t fill_earliest(int64_t *cand, Py_ssize_t n, const double *record, char *in_candidates, double *horizon,
                         double *first_out) {
    Py_ssize_t kept = 0;
    double first = INFINITY, limit = *horizon;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t f = cand[i];
        double t = record[f * REC_WIDTH + REC_FINISH];
        if (t <= limit) {
            cand[kept++] = f;
            if (t < first) first = t;
        } else {
            in_candidates[f] = 0;
        }
    }
    if (kept > CANDIDATES_MAX) {
        /* Most flows are due by the horizon (finish times bunched below it): every event would
         * scan them all. Lower the horizon to the CANDIDATES-th earliest finish. */
        double *times = scratch(S_TIMES, kept * sizeof(double), 0);
        if (times) {
            for (Py_ssize_t i = 0; i < kept; i++) times[i] = record[cand[i] * REC_WIDTH + REC_FINISH];
            limit = select_kth(times, kept, CANDIDATES - 1);
            n = kept;
            kept = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                int64_t f = cand[i];
                if (record[f * REC_WIDTH + REC_FINISH] <= limit)
                    cand[kept++] = f;
                else
                    in_candidates[f] = 0;
            }
            *horizon = limit;
        } /* out of memory: keep them all (slower, not wrong) */
    }
    *first_out = first;
    return kept;
}

Py_ssize_t fill_rebuild(const double *record, Py_ssize_t rows, char *in_candidates, int64_t *cand, double *horizon,
                        double *first_out) {
    double *times = scratch(S_TIMES, (rows + 1) * sizeof(double), 0);
    if (!times) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t n_finite = 0;
    double largest = -INFINITY;
    for (Py_ssize_t f = 0; f < rows; f++) {
        double t = record[f * REC_WIDTH + REC_FINISH];
        if (isfinite(t)) {
            times[n_finite++] = t;
            if (t > largest) largest = t;
        }
    }
    *first_out = INFINITY;
    if (!n_finite) {
        *horizon = -INFINITY;
        return 0;
    }
    double limit = n_finite > CANDIDATES ? select_kth(times, n_finite, CANDIDATES - 1) : largest;
    Py_ssize_t n = 0;
    double first = INFINITY;
    for (Py_ssize_t f = 0; f < rows; f++) {
        double t = record[f * REC_WIDTH + REC_FINISH];
        if (t <= limit) {
            cand[n++] = f;
            in_candidates[f] = 1;
            if (t < first) first = t;
        }
    }
    *horizon = limit;
    *first_out = first;
    return n;
}

/* rebuild(record, in_candidates, out) -> (candidates, horizon, earliest finish).
 *
 * The event engine's new candidate set (see engine._FlowClass): the horizon is the
 * CANDIDATES-th earliest finish time of `record` (the largest when there are fewer; -inf
 * when none is finite), and every flow due by it is written to `out` (int64, >= the records'
 * rows, ascending) and marked in `in_candidates`. */
static PyObject *rebuild(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_record, b_in, b_out;
    if (!PyArg_ParseTuple(args, "y*w*w*", &b_record, &b_in, &b_out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = b_record.len / (8 * REC_WIDTH);
    if (!check_buffer(&b_record, 8, 0, "record") || !check_buffer(&b_in, 1, rows, "in_candidates") ||
        !check_buffer(&b_out, 8, rows, "out"))
        goto done;
    double horizon, first;
    Py_ssize_t n = fill_rebuild(b_record.buf, rows, b_in.buf, b_out.buf, &horizon, &first);
    if (n >= 0) result = Py_BuildValue("ndd", n, horizon, first);
done:
    PyBuffer_Release(&b_record);
    PyBuffer_Release(&b_in);
    PyBuffer_Release(&b_out);
    return result;
}

/* earliest(cand, record, in_candidates, horizon) -> (kept, earliest finish, horizon).
 *
 * The event engine's look at its candidate flows (int64 ids, see engine._FlowClass): those
 * whose finish time (column REC_FINISH of `record`) is past `horizon` are dropped and
 * unmarked in `in_candidates`; the others are compacted to the front of `cand` in order.
 * When more than CANDIDATES_MAX are left, the horizon is lowered to the CANDIDATES-th
 * earliest finish time and those past it are dropped too. Returns how many are kept, their
 * earliest finish time (inf when none) and the horizon. */
static PyObject *earliest(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_cand, b_record, b_in;
    double horizon;
    if (!PyArg_ParseTuple(args, "w*y*w*d", &b_cand, &b_record, &b_in, &horizon)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = b_cand.len / 8, slots = b_record.len / (8 * REC_WIDTH);
    if (!check_buffer(&b_in, 1, slots, "in_candidates")) goto done;
    int64_t *cand = b_cand.buf;
    if (fill_ids_in_range(cand, n, slots, "_fill.earliest: flow id") < 0) goto done;
    double first;
    Py_ssize_t kept = fill_earliest(cand, n, b_record.buf, b_in.buf, &horizon, &first);
    result = Py_BuildValue("ndd", kept, first, horizon);
done:
    PyBuffer_Release(&b_cand);
    PyBuffer_Release(&b_record);
    PyBuffer_Release(&b_in);
    return result;
}

int fill_ids_in_range(const int64_t *ids, Py_ssize_t n, Py_ssize_t limit, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "%s %lld is out of range", what, (long long)ids[i]);
            return -1;
        }
    }
    return 0;
}

Py_ssize_t fill_take(int64_t *cand, Py_ssize_t n, double *record, char *in_candidates, double threshold, int64_t *out,
                     Py_ssize_t *taken_out) {
    Py_ssize_t kept = 0, taken = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t f = cand[i];
        double *finish = &record[f * REC_WIDTH + REC_FINISH];
        if (*finish <= threshold) {
            out[taken++] = f;
            *finish = INFINITY;
            in_candidates[f] = 0;
        } else {
            cand[kept++] = f;
        }
    }
    *taken_out = taken;
    return kept;
}

/* take(cand, record, in_candidates, threshold, out) -> (kept, taken).
 *
 * The candidates finishing by `threshold` go to `out` (int64, len(cand) items, in order),
 * with their finish time set to inf and their mark in `in_candidates` cleared; the others
 * are compacted to the front of `cand` in order. */
static PyObject *take(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b_cand, b_record, b_in, b_out;
    double threshold;
    if (!PyArg_ParseTuple(args, "w*w*w*dw*", &b_cand, &b_record, &b_in, &threshold, &b_out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = b_cand.len / 8, slots = b_record.len / (8 * REC_WIDTH), taken;
    if (!check_buffer(&b_in, 1, slots, "in_candidates") || !check_buffer(&b_out, 8, n, "out")) goto done;
    if (fill_ids_in_range(b_cand.buf, n, slots, "_fill.take: flow id") < 0) goto done;
    Py_ssize_t kept = fill_take(b_cand.buf, n, b_record.buf, b_in.buf, threshold, b_out.buf, &taken);
    result = Py_BuildValue("nn", kept, taken);
done:
    PyBuffer_Release(&b_cand);
    PyBuffer_Release(&b_record);
    PyBuffer_Release(&b_in);
    PyBuffer_Release(&b_out);
    return result;
}

static PyMethodDef methods[] = {
    {"resolve", resolve, METH_VARARGS, "Progressive filling of FlowNetwork's re-solved flows (see the file header)."},
    {"remove", remove_flows, METH_VARARGS, "FlowNetwork.remove_flows' bookkeeping (see the function's comment)."},
    {"progress", progress, METH_VARARGS, "The event engine's finish times for flows whose rate changed."},
    {"earliest", earliest, METH_VARARGS, "The event engine's earliest candidate finish (see the function's comment)."},
    {"take", take, METH_VARARGS, "The event engine's finished candidates (see the function's comment)."},
    {"rebuild", rebuild, METH_VARARGS, "The event engine's new candidate set (see the function's comment)."},
    {"run_events", run_events, METH_VARARGS, "The event engine's compiled loop (see _events.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fill", "Compiled progressive filling for FlowNetwork.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fill(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "CANDIDATES", CANDIDATES) < 0 ||
              PyModule_AddIntConstant(m, "CANDIDATES_MAX", CANDIDATES_MAX) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
