/* numpy's data allocator with a planned arena for the large blocks of repeated steps.
 *
 * A training step allocates the same large arrays in the same order every time.  glibc's
 * heap (kept, device.reuse_freed_memory) reuses their pages, but places each block where
 * the first one that fits was: at W = 256 on a D2H2 rank a quarter of the heap was holes
 * at the step's peak (1205 MiB against 910 with glibc's defaults).  Here every block of at least `threshold` bytes allocated by the
 * phase's thread between begin() and end() is numbered; end() returns each block's size
 * and lifetime, the Python side (cosmotrain.device.step_memory) places the lifetimes in
 * one address range (an offline interval placement, peak = the bytes live at once), and
 * the next begin() of that phase hands block k its planned offset in the arena: a private
 * anonymous map reserved once (MAP_NORESERVE), whose pages stay resident between steps.
 *
 * A block the plan does not fit (another size at index k, a range still in use, past the
 * plan's end, no plan yet) is a miss.  The first miss abandons the plan for the rest of
 * the phase: the arena's pages no live block uses are handed back (MADV_DONTNEED) and
 * every later block gets a memory map of its own, unmapped when it is freed, so that a
 * step that runs unplanned (the first ones) leaves no pages behind and peaks at the bytes
 * it holds; Python then replans the phase from its log.
 * A block the plan leaves out (it outlived its phase when planned), every block outside a
 * phase and every block of other threads comes from malloc.  Frees find arena, mapped
 * and numbered blocks in a hash table keyed by address; anything else goes to free().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define PAGE 4096UL
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14 /* Linux's value; an unknown advice is refused, harmlessly */
#endif
#define TABLE_SIZE (1 << 14) /* slots for tracked large blocks (power of 2, half used at most) */
#define MAX_LOG 4096         /* numbered blocks of one phase (more are malloc's) */
#define MAX_ARENA_LIVE 4096

enum source { FROM_MALLOC, FROM_ARENA, FROM_MAP };
typedef struct { char *ptr; size_t size; long index; long generation; int source; } tracked;
typedef struct { size_t size; long t_alloc, t_free; } logged;
typedef struct { size_t offset, size; } extent;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t threshold = 1UL << 20;
static char *arena = NULL;
static size_t arena_bytes = 0, arena_touched = 0;
static extent arena_live[MAX_ARENA_LIVE];
static int n_arena_live = 0;
static tracked table[TABLE_SIZE];
static long n_tracked = 0;

/* the phase: its thread, plan and log */
static int in_phase = 0;
static pthread_t phase_thread;
static long generation = 0, next_index = 0, clock_tick = 0, misses = 0;
static size_t *plan_size = NULL, *plan_offset = NULL; /* offset SIZE_MAX: malloc */
static long plan_length = 0;
static logged *log_entries = NULL;
static long planned_total = 0, fallback_total = 0;

static size_t slot_of(const void *p) { return (((uintptr_t)p >> 12) * 2654435761u) & (TABLE_SIZE - 1); }

static int table_put(tracked entry) {
    if (n_tracked >= TABLE_SIZE / 2) return 0;
    size_t i = slot_of(entry.ptr);
    while (table[i].ptr) i = (i + 1) & (TABLE_SIZE - 1);
    table[i] = entry;
    n_tracked++;
    return 1;
}

/* remove and return the entry of p (ptr NULL when p is not tracked) */
static tracked table_take(const void *p) {
    tracked found = {NULL, 0, -1, -1, FROM_MALLOC};
    size_t i = slot_of(p);
    while (table[i].ptr && table[i].ptr != p) i = (i + 1) & (TABLE_SIZE - 1);
    if (!table[i].ptr) return found;
    found = table[i];
    table[i].ptr = NULL;
    n_tracked--;
    /* reinsert the rest of the probe run so lookups never stop at the new gap */
    for (size_t j = (i + 1) & (TABLE_SIZE - 1); table[j].ptr; j = (j + 1) & (TABLE_SIZE - 1)) {
        tracked moved = table[j];
        table[j].ptr = NULL;
        n_tracked--;
        table_put(moved);
    }
    return found;
}

static int arena_range_free(size_t offset, size_t size) {
    for (int i = 0; i < n_arena_live; i++)
        if (offset < arena_live[i].offset + arena_live[i].size &&
            arena_live[i].offset < offset + size)
            return 0;
    return 1;
}

static void arena_release(size_t offset) {
    for (int i = 0; i < n_arena_live; i++)
        if (arena_live[i].offset == offset) { arena_live[i] = arena_live[--n_arena_live]; return; }
}

/* the planned arena block of this allocation (index k of the phase), or NULL */
static char *planned(long k, size_t size) {
    if (k >= plan_length || plan_size[k] != size) return NULL;
    size_t offset = plan_offset[k];
    if (offset == SIZE_MAX || offset + size > arena_bytes || n_arena_live == MAX_ARENA_LIVE ||
        !arena_range_free(offset, size))
        return NULL;
    arena_live[n_arena_live].offset = offset;
    arena_live[n_arena_live++].size = size;
    if (offset + size > arena_touched) arena_touched = offset + size;
    return arena + offset;
}

/* whether the plan leaves array k to malloc (it outlived its phase when planned) */
static int left_to_malloc(long k, size_t size) {
    return k < plan_length && plan_size[k] == size && plan_offset[k] == SIZE_MAX;
}

static int hugepages = 0; /* numpy's own allocator asks for them: so do we */

/* what numpy's own allocator does for its arrays of 4 MiB and up */
static void advise_huge(char *p, size_t size) {
    if (!hugepages || size < (4UL << 20)) return;
    uintptr_t start = ((uintptr_t)p + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
    uintptr_t stop = ((uintptr_t)p + size) & ~(uintptr_t)(PAGE - 1);
    if (stop > start) madvise((void *)start, stop - start, MADV_HUGEPAGE);
}

static char *mapped(size_t size) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (hugepages) madvise(p, size, MADV_HUGEPAGE);
    return p;
}

static int by_offset(const void *a, const void *b) {
    size_t x = ((const extent *)a)->offset, y = ((const extent *)b)->offset;
    return (x > y) - (x < y);
}

/* Hand back the arena pages no live block uses: after a miss the rest of the phase runs
 * on memory maps, and the pages the plan had touched must not stay resident beside them. */
static void release_free_arena(void) {
    qsort(arena_live, n_arena_live, sizeof(extent), by_offset);
    size_t start = 0;
    for (int i = 0; i <= n_arena_live; i++) {
        size_t stop = i < n_arena_live ? arena_live[i].offset : arena_touched;
        if (stop > start) madvise(arena + start, stop - start, MADV_DONTNEED);
        if (i < n_arena_live && arena_live[i].offset + arena_live[i].size > start)
            start = arena_live[i].offset + arena_live[i].size;
    }
}

/* the block of a numbered allocation k: planned, left to malloc, or a miss (mapped); the
 * first miss of a phase abandons its plan */
static char *numbered(long k, size_t size, int *source) {
    char *p = misses ? NULL : planned(k, size);
    if (p) { *source = FROM_ARENA; planned_total++; return p; }
    *source = FROM_MALLOC;
    if (!misses && left_to_malloc(k, size)) return NULL;
    if (!misses && arena_touched) release_free_arena();
    misses++;
    fallback_total++;
    *source = FROM_MAP;
    return NULL;
}

static void *large(size_t request, int zeroed) {
    size_t size = (request + PAGE - 1) & ~(PAGE - 1);
    char *p = NULL;
    long k = -1;
    int source = FROM_MALLOC;
    pthread_mutex_lock(&lock);
    if (in_phase && pthread_equal(pthread_self(), phase_thread) && next_index < MAX_LOG) {
        k = next_index++;
        p = numbered(k, size, &source);
        log_entries[k].size = size;
        log_entries[k].t_alloc = clock_tick++;
        log_entries[k].t_free = -1;
    }
    pthread_mutex_unlock(&lock);
    if (source == FROM_ARENA) {
        if (zeroed) memset(p, 0, size);
    } else if (source == FROM_MAP) {
        p = mapped(size); /* fresh pages: zero already */
    }
    if (!p) {
        source = FROM_MALLOC;
        p = zeroed ? calloc(1, size) : malloc(size);
        if (!p) return NULL;
        advise_huge(p, size);
    }
    if (k < 0) return p; /* malloc's, untracked */
    tracked entry = {p, size, k, generation, source};
    pthread_mutex_lock(&lock);
    int kept = table_put(entry);
    if (!kept && source == FROM_ARENA) arena_release((size_t)(p - arena));
    pthread_mutex_unlock(&lock);
    if (!kept && source != FROM_MALLOC) { /* table full: serve this one from malloc */
        if (source == FROM_MAP) munmap(p, size);
        return zeroed ? calloc(1, size) : malloc(size);
    }
    return p;
}

static void *h_malloc(void *ctx, size_t n) { return n >= threshold ? large(n, 0) : malloc(n); }

static void *h_calloc(void *ctx, size_t count, size_t each) {
    if (each && count > SIZE_MAX / each) return NULL;
    return count * each >= threshold ? large(count * each, 1) : calloc(count, each);
}

static void h_free(void *ctx, void *p, size_t n) {
    if (!p) return;
    pthread_mutex_lock(&lock);
    tracked entry = n_tracked ? table_take(p) : (tracked){NULL, 0, -1, -1, FROM_MALLOC};
    if (entry.ptr && in_phase && entry.generation == generation && entry.index >= 0)
        log_entries[entry.index].t_free = clock_tick++;
    if (entry.ptr && entry.source == FROM_ARENA) {
        arena_release((size_t)(entry.ptr - arena));
        /* once a phase has abandoned its plan nothing reuses the block this step: its
         * pages go back (under the lock: a later phase may plan the range at once) */
        if (in_phase && misses) madvise(entry.ptr, entry.size, MADV_DONTNEED);
    }
    pthread_mutex_unlock(&lock);
    if (!entry.ptr || entry.source == FROM_MALLOC) free(p);
    else if (entry.source == FROM_MAP) munmap(p, entry.size);
}

static void *h_realloc(void *ctx, void *p, size_t n) {
    if (!p) return h_malloc(ctx, n);
    pthread_mutex_lock(&lock);
    size_t old = 0;
    if (n_tracked) {
        size_t i = slot_of(p);
        while (table[i].ptr && table[i].ptr != p) i = (i + 1) & (TABLE_SIZE - 1);
        old = table[i].ptr ? table[i].size : 0;
    }
    pthread_mutex_unlock(&lock);
    if (!old && n < threshold) return realloc(p, n);
    if (!old) old = malloc_usable_size(p);
    void *q = h_malloc(ctx, n);
    if (!q) return NULL;
    memcpy(q, p, old < n ? old : n);
    h_free(ctx, p, old);
    return q;
}

static PyDataMem_Handler handler = {
    "cosmotrain_step_arena", 1, {NULL, h_malloc, h_calloc, h_realloc, h_free}};

#define HUGE_PAGE (2UL << 20)

/* install(threshold, arena_bytes, hugepages) -> the previous handler; reserves the arena
 * once, aligned to a huge page.  hugepages: madvise(MADV_HUGEPAGE) the arena and the
 * misses' maps, as numpy's allocator does for its large arrays (a transparent huge page
 * a 2 MiB TLB entry: without them a W = 128 step ran 4% slower than on numpy's heap). */
static PyObject *install(PyObject *self, PyObject *args) {
    Py_ssize_t min_bytes, reserve;
    int huge;
    if (!PyArg_ParseTuple(args, "nnp", &min_bytes, &reserve, &huge)) return NULL;
    hugepages = huge;
    if (!arena) {
        size_t span = ((size_t)reserve & ~(HUGE_PAGE - 1)) + HUGE_PAGE;
        char *p = mmap(NULL, span, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
        log_entries = malloc(sizeof(logged) * MAX_LOG);
        if (!log_entries) { munmap(p, span); return PyErr_NoMemory(); }
        arena = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        arena_bytes = span - HUGE_PAGE;
        if (hugepages) madvise(arena, arena_bytes, MADV_HUGEPAGE);
    }
    threshold = (size_t)min_bytes;
    PyObject *capsule = PyCapsule_New(&handler, "mem_handler", NULL);
    if (!capsule) return NULL;
    PyObject *previous = PyDataMem_SetHandler(capsule);
    Py_DECREF(capsule);
    return previous;
}

/* begin(sizes, offsets): start a phase on this thread with a plan (two uint64 buffers) */
static PyObject *begin(PyObject *self, PyObject *args) {
    Py_buffer sizes, offsets;
    if (!PyArg_ParseTuple(args, "y*y*", &sizes, &offsets)) return NULL;
    long n = (long)(sizes.len / sizeof(uint64_t));
    size_t *new_size = malloc(sizeof(size_t) * (n ? n : 1));
    size_t *new_offset = malloc(sizeof(size_t) * (n ? n : 1));
    if (!new_size || !new_offset || offsets.len != sizes.len) {
        free(new_size); free(new_offset);
        PyBuffer_Release(&sizes); PyBuffer_Release(&offsets);
        return new_size && new_offset ? (PyErr_SetString(PyExc_ValueError, "sizes and offsets differ"), NULL)
                                      : PyErr_NoMemory();
    }
    for (long k = 0; k < n; k++) {
        new_size[k] = ((const uint64_t *)sizes.buf)[k];
        new_offset[k] = ((const uint64_t *)offsets.buf)[k];
    }
    PyBuffer_Release(&sizes); PyBuffer_Release(&offsets);
    pthread_mutex_lock(&lock);
    free(plan_size); free(plan_offset);
    plan_size = new_size; plan_offset = new_offset; plan_length = n;
    phase_thread = pthread_self();
    generation++;
    next_index = clock_tick = misses = 0;
    in_phase = 1;
    pthread_mutex_unlock(&lock);
    Py_RETURN_NONE;
}

/* end() -> (sizes, allocation ticks, free ticks (-1: alive at the end), misses) */
static PyObject *end(PyObject *self, PyObject *args) {
    pthread_mutex_lock(&lock);
    in_phase = 0;
    long n = next_index, missed = misses + (n < plan_length);
    PyObject *sizes = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *allocs = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *frees = PyBytes_FromStringAndSize(NULL, n * 8);
    if (sizes && allocs && frees)
        for (long k = 0; k < n; k++) {
            ((int64_t *)PyBytes_AS_STRING(sizes))[k] = (int64_t)log_entries[k].size;
            ((int64_t *)PyBytes_AS_STRING(allocs))[k] = log_entries[k].t_alloc;
            ((int64_t *)PyBytes_AS_STRING(frees))[k] = log_entries[k].t_free;
        }
    pthread_mutex_unlock(&lock);
    if (!sizes || !allocs || !frees) {
        Py_XDECREF(sizes); Py_XDECREF(allocs); Py_XDECREF(frees);
        return NULL;
    }
    return Py_BuildValue("(NNNl)", sizes, allocs, frees, missed);
}

static PyObject *trim(PyObject *self, PyObject *args) {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    Py_RETURN_NONE;
}

static PyObject *statistics(PyObject *self, PyObject *args) {
    pthread_mutex_lock(&lock);
    size_t live = 0;
    for (int i = 0; i < n_arena_live; i++) live += arena_live[i].size;
    PyObject *out = Py_BuildValue("{s:n,s:n,s:n,s:l,s:l,s:n}", "arena_reserved", (Py_ssize_t)arena_bytes,
                                  "arena_touched", (Py_ssize_t)arena_touched, "arena_live", (Py_ssize_t)live,
                                  "planned", planned_total, "fallbacks", fallback_total,
                                  "threshold", (Py_ssize_t)threshold);
    pthread_mutex_unlock(&lock);
    return out;
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS, "Reserve the arena and make this numpy's allocator."},
    {"begin", begin, METH_VARARGS, "Start a phase with a plan."},
    {"end", end, METH_NOARGS, "End the phase; its allocation log."},
    {"trim", trim, METH_NOARGS, "Give malloc's free pages back (glibc)."},
    {"statistics", statistics, METH_NOARGS, "The arena's counters."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_step_arena", NULL, -1, methods};

PyMODINIT_FUNC PyInit__step_arena(void) {
    import_array();
    return PyModule_Create(&module);
}
