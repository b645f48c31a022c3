/* Python bindings of the kernels (moetier.kernels._ckernels).
 *
 * The Python layer (moetier.kernels.fast) validates dtypes and shapes; here every buffer
 * is checked against the byte length the kernel will touch, so a wrong call raises
 * instead of reading or writing out of bounds. Every kernel takes the index of an ISA
 * in isas() and refuses one this CPU does not support. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "mt.h"

/* The buffers one call holds: a few in place, more (a layer's experts) on the heap. */
typedef struct {
    Py_buffer small[16];
    Py_buffer *more;
    int n, cap;
} bufset;

static Py_buffer *bufset_next(bufset *bs) {
    if (bs->n < 16) return &bs->small[bs->n];
    if (bs->n - 16 >= bs->cap) {
        const int cap = bs->cap ? 2 * bs->cap : 64;
        Py_buffer *m = PyMem_Realloc(bs->more, (size_t)cap * sizeof(Py_buffer));
        if (!m) {
            PyErr_NoMemory();
            return NULL;
        }
        bs->more = m;
        bs->cap = cap;
    }
    return &bs->more[bs->n - 16];
}

static void bufset_release(bufset *bs) {
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(i < 16 ? &bs->small[i] : &bs->more[i - 16]);
    bs->n = 0;
    PyMem_Free(bs->more);
    bs->more = NULL;
    bs->cap = 0;
}

static void *get_buf(bufset *bs, PyObject *obj, int64_t need, int writable, const char *what) {
    if (obj == Py_None) {
        PyErr_Format(PyExc_ValueError, "%s is missing", what);
        return NULL;
    }
    Py_buffer *v = bufset_next(bs);
    if (!v) return NULL;
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return NULL;
    bs->n++;
    if (v->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, the kernel needs %lld", what, v->len,
                     (long long)need);
        return NULL;
    }
    return v->buf;
}

static int parse_qmat(bufset *bs, PyObject *spec, int64_t rows, int64_t cols, qmat *w, const char *what) {
    int dtype;
    long long g;
    PyObject *data, *scales;
    if (!PyArg_ParseTuple(spec, "iOOL", &dtype, &data, &scales, &g)) return -1;
    memset(w, 0, sizeof(*w));
    w->dtype = dtype;
    w->rows = rows;
    w->cols = cols;
    w->g = g;
    if (dtype == DT_F32 || dtype == DT_BF16) {
        w->row_bytes = cols * (dtype == DT_F32 ? 4 : 2);
    } else if (dtype == DT_INT8 || dtype == DT_INT4) {
        if (g <= 0 || (dtype == DT_INT4 && g % 2)) {
            PyErr_Format(PyExc_ValueError, "%s: invalid group size %lld", what, g);
            return -1;
        }
        w->ngroups = (cols + g - 1) / g;
        w->row_bytes = dtype == DT_INT8 ? w->ngroups * g : w->ngroups * g / 2;
        w->scales = get_buf(bs, scales, rows * w->ngroups * 2, 0, what);
        if (!w->scales) return -1;
    } else if (dtype == DT_MXFP4) {
        if (g != MT_MX_GROUP) {
            PyErr_Format(PyExc_ValueError, "%s: mxfp4 has group size %d, got %lld", what, MT_MX_GROUP, g);
            return -1;
        }
        w->ngroups = (cols + g - 1) / g;
        w->row_bytes = w->ngroups * g / 2;
        w->escales = get_buf(bs, scales, rows * w->ngroups, 0, what);
        if (!w->escales) return -1;
    } else {
        PyErr_Format(PyExc_ValueError, "%s: unknown dtype code %d", what, dtype);
        return -1;
    }
    w->data = get_buf(bs, data, rows * w->row_bytes, 0, what);
    return w->data ? 0 : -1;
}

static int n_isas(void) {
    int n = 0;
    while (mt_isas[n]) n++;
    return n;
}

/* The ISA with index i of isas(), or NULL with ValueError set. */
static const mt_isa *get_isa(int i) {
    if (i < 0 || i >= n_isas()) {
        PyErr_Format(PyExc_ValueError, "kernel path index %d outside isas() (0..%d)", i, n_isas() - 1);
        return NULL;
    }
    if (!mt_isas[i]->supported()) {
        PyErr_Format(PyExc_ValueError, "kernel path %s is not supported by this CPU", mt_isas[i]->name);
        return NULL;
    }
    return mt_isas[i];
}

static PyObject *py_linear(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wspec, *bo, *yo;
    long long T, C, R;
    int isa_i, nthreads, q8 = 0;
    if (!PyArg_ParseTuple(args, "OLLLOOOii|p", &xo, &T, &C, &R, &wspec, &bo, &yo, &isa_i, &nthreads, &q8))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    bufset bs = {.n = 0};
    qmat w;
    const float *x, *bias = NULL;
    float *y;
    int rc;
    if (parse_qmat(&bs, wspec, R, C, &w, "w") < 0) goto fail;
    if (!(x = get_buf(&bs, xo, T * C * 4, 0, "x"))) goto fail;
    if (bo != Py_None && !(bias = get_buf(&bs, bo, R * 4, 0, "bias"))) goto fail;
    if (!(y = get_buf(&bs, yo, T * R * 4, 1, "out"))) goto fail;
    Py_BEGIN_ALLOW_THREADS
    rc = q8 ? mt_linear_q8(isa, nthreads, x, T, &w, bias, y) : mt_linear(isa, nthreads, x, T, &w, bias, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    bufset_release(&bs);
    return NULL;
}

/* The arguments of the per-head linears: H blocks of N rows of w [R, C], S rows apart from row
 * off; x[t, h, :nin] at x + t * xs_t + h * xs_h, out[t, h, :nout] likewise (strides in floats). */
typedef struct {
    PyObject *xo, *wspec, *yo;
    long long xs_t, xs_h, T, H, N, R, C, S, off, ys_t, ys_h;
} heads_args;

/* Checks a's shape and strides (x nin wide, out nout) and takes its buffers into bs; -1 with a
 * Python error set. */
static int heads_buffers(bufset *bs, const char *what, const heads_args *a, long long nin, long long nout, qmat *w,
                         const float **x, float **y) {
    if (a->T < 1 || a->H < 1 || a->N < 1 || a->C < 1 || a->S < a->N || a->off < 0 ||
        (a->H - 1) * a->S + a->off + a->N > a->R || a->xs_h < nin || a->xs_t < (a->H - 1) * a->xs_h + nin ||
        a->ys_h < nout || a->ys_t < (a->H - 1) * a->ys_h + nout) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shape or strides (T %lld, H %lld, N %lld, R %lld, C %lld, "
                     "S %lld, off %lld)", what, a->T, a->H, a->N, a->R, a->C, a->S, a->off);
        return -1;
    }
    if (parse_qmat(bs, a->wspec, a->R, a->C, w, "w") < 0) return -1;
    if (!(*x = get_buf(bs, a->xo, ((a->T - 1) * a->xs_t + (a->H - 1) * a->xs_h + nin) * 4, 0, "x"))) return -1;
    if (!(*y = get_buf(bs, a->yo, ((a->T - 1) * a->ys_t + (a->H - 1) * a->ys_h + nout) * 4, 1, "out"))) return -1;
    return 0;
}

/* linear_t(x, xs_t, xs_h, T, H, N, (dtype, data, scales, g), rows, C, S, off, out, ys_t, ys_h,
 * threads): per head, x's N inputs times N stored rows of W used transposed (mt_linear_t). */
static PyObject *py_linear_t(PyObject *self, PyObject *args) {
    (void)self;
    heads_args a;
    int nthreads;
    if (!PyArg_ParseTuple(args, "OLLLLLOLLLLOLLi", &a.xo, &a.xs_t, &a.xs_h, &a.T, &a.H, &a.N, &a.wspec, &a.R, &a.C,
                          &a.S, &a.off, &a.yo, &a.ys_t, &a.ys_h, &nthreads))
        return NULL;
    bufset bs = {.n = 0};
    qmat w;
    const float *x;
    float *y;
    if (heads_buffers(&bs, "linear_t", &a, a.N, a.C, &w, &x, &y) < 0) {
        bufset_release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mt_linear_t(nthreads, x, a.xs_t, a.xs_h, a.T, a.H, a.N, &w, a.S, a.off, y, a.ys_t, a.ys_h);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

/* head_linears(x, xs_t, xs_h, T, H, N, w, R, C, S, off, out, ys_t, ys_h, isa, threads): per head, linear
 * on the head's N rows of w (mt_head_linears). */
static PyObject *py_head_linears(PyObject *self, PyObject *args) {
    (void)self;
    heads_args a;
    int isa_i, nthreads;
    if (!PyArg_ParseTuple(args, "OLLLLLOLLLLOLLii", &a.xo, &a.xs_t, &a.xs_h, &a.T, &a.H, &a.N, &a.wspec, &a.R, &a.C,
                          &a.S, &a.off, &a.yo, &a.ys_t, &a.ys_h, &isa_i, &nthreads))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    bufset bs = {.n = 0};
    qmat w;
    const float *x;
    float *y;
    if (heads_buffers(&bs, "head_linears", &a, a.C, a.N, &w, &x, &y) < 0) {
        bufset_release(&bs);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mt_head_linears(isa, nthreads, x, a.xs_t, a.xs_h, a.T, a.H, &w, a.S, a.off, a.N, y, a.ys_t, a.ys_h);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* linears(x, T, C, [(R, (dtype, data, scales, g), bias or None, out)], isa, threads, q8): several
 * linears of one x in one job (mt_linears). */
static PyObject *py_linears(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *specs;
    long long T, C;
    int isa_i, nthreads, q8 = 0;
    if (!PyArg_ParseTuple(args, "OLLO!ii|p", &xo, &T, &C, &PyList_Type, &specs, &isa_i, &nthreads, &q8)) return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(specs);
    if (n < 1 || n > 64) {
        PyErr_Format(PyExc_ValueError, "linears: %zd weights (1 to 64)", n);
        return NULL;
    }
    bufset bs = {.n = 0};
    qmat w[64];
    const float *bias[64];
    float *y[64];
    const float *x;
    int rc;
    if (!(x = get_buf(&bs, xo, T * C * 4, 0, "x"))) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long R;
        PyObject *wspec, *bo, *yo;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(specs, i), "LOOO", &R, &wspec, &bo, &yo)) goto fail;
        if (parse_qmat(&bs, wspec, R, C, &w[i], "w") < 0) goto fail;
        bias[i] = NULL;
        if (bo != Py_None && !(bias[i] = get_buf(&bs, bo, R * 4, 0, "bias"))) goto fail;
        if (!(y[i] = get_buf(&bs, yo, T * R * 4, 1, "out"))) goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = mt_linears(isa, nthreads, x, T, (int)n, w, bias, y, q8);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    bufset_release(&bs);
    return NULL;
}

static PyObject *py_ffn(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *gs, *us, *ds, *yo;
    long long T, D, I;
    int isa_i, nthreads, q8 = 0;
    if (!PyArg_ParseTuple(args, "OLLLOOOOii|p", &xo, &T, &D, &I, &gs, &us, &ds, &yo, &isa_i, &nthreads, &q8))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    bufset bs = {.n = 0};
    qmat g, u, d;
    const float *x;
    float *y;
    int rc;
    if (parse_qmat(&bs, gs, I, D, &g, "gate") < 0 || parse_qmat(&bs, us, I, D, &u, "up") < 0 ||
        parse_qmat(&bs, ds, D, I, &d, "down") < 0)
        goto fail;
    if (!(x = get_buf(&bs, xo, T * D * 4, 0, "x"))) goto fail;
    if (!(y = get_buf(&bs, yo, T * D * 4, 1, "out"))) goto fail;
    Py_BEGIN_ALLOW_THREADS
    rc = q8 ? mt_ffn_q8(isa, nthreads, x, T, &g, &u, &d, y) : mt_ffn(isa, nthreads, x, T, &g, &u, &d, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    bufset_release(&bs);
    return NULL;
}

/* out[t, k] = FFN_e(x[t]) for every (t, k) with ids[t, k] = e of a listed expert e (other
 * slots untouched): each expert's rows gathered in (t, k) order, all experts computed by one
 * mt_ffn_many (int8 activations too), the rows scattered back. */
static PyObject *py_experts(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *io, *yo, *specs, *wo = Py_None, *co = Py_None;
    long long T, D, K;
    int isa_i, nthreads, q8 = 0;
    if (!PyArg_ParseTuple(args, "OLLOLOO!ii|pOO", &xo, &T, &D, &io, &K, &yo, &PyList_Type, &specs, &isa_i,
                          &nthreads, &q8, &wo, &co))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(specs);
    bufset bs = {.n = 0};
    qmat *w = PyMem_Calloc((size_t)(3 * n + 1), sizeof(qmat));
    int64_t *eid = PyMem_Calloc((size_t)(n + 1), sizeof(int64_t));
    const float *x, *cw = NULL;
    const int64_t *ids;
    float *y, *combined = NULL;
    PyObject *ret = NULL;
    int rc = 0;
    if (!w || !eid) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!(x = get_buf(&bs, xo, T * D * 4, 0, "x")) || !(ids = get_buf(&bs, io, T * K * 8, 0, "ids")) ||
        !(y = get_buf(&bs, yo, T * K * D * 4, 1, "out")))
        goto fail;
    if ((wo == Py_None) != (co == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "experts: the combine needs both its weights and its output");
        goto fail;
    }
    if (wo != Py_None && (!(cw = get_buf(&bs, wo, T * K * 4, 0, "weights")) ||
                          !(combined = get_buf(&bs, co, T * D * 4, 1, "combined"))))
        goto fail;
    for (Py_ssize_t e = 0; e < n; e++) {
        long long I, id;
        PyObject *gs, *us, *ds;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(specs, e), "LLOOO", &id, &I, &gs, &us, &ds)) goto fail;
        eid[e] = id;
        if (parse_qmat(&bs, gs, I, D, &w[3 * e], "gate") < 0 || parse_qmat(&bs, us, I, D, &w[3 * e + 1], "up") < 0 ||
            parse_qmat(&bs, ds, D, I, &w[3 * e + 2], "down") < 0)
            goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = mt_experts_run(isa, nthreads, x, T, D, ids, K, n, eid, w, q8, y, cw, combined);
    Py_END_ALLOW_THREADS
    if (rc < 0) PyErr_NoMemory();
    else {
        Py_INCREF(Py_None);
        ret = Py_None;
    }
fail:
    bufset_release(&bs);
    PyMem_Free(w);
    PyMem_Free(eid);
    return ret;
}

/* A layer's experts held for moe_block (expert_table): their parsed weights, the buffers they
 * lie in held (exported) until the table is dropped. */
typedef struct {
    int64_t E, D;
    qmat *w;
    unsigned char *have;
    bufset bs;
} xtable;

#define XTABLE "moetier.expert_table"

static void xtable_free(PyObject *cap) {
    xtable *t = PyCapsule_GetPointer(cap, XTABLE);
    if (!t) return;
    bufset_release(&t->bs);
    PyMem_Free(t->w);
    PyMem_Free(t->have);
    PyMem_Free(t);
}

static PyObject *py_expert_table(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *specs;
    long long D;
    if (!PyArg_ParseTuple(args, "LO!", &D, &PyList_Type, &specs)) return NULL;
    const Py_ssize_t E = PyList_GET_SIZE(specs);
    xtable *t = PyMem_Calloc(1, sizeof(xtable));
    if (!t) return PyErr_NoMemory();
    t->E = E;
    t->D = D;
    t->w = PyMem_Calloc((size_t)(3 * E + 1), sizeof(qmat));
    t->have = PyMem_Calloc((size_t)(E + 1), 1);
    PyObject *cap = NULL;
    if (!t->w || !t->have) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t e = 0; e < E; e++) {
        PyObject *spec = PyList_GET_ITEM(specs, e);
        if (spec == Py_None) continue;
        long long I;
        PyObject *gs, *us, *ds;
        if (!PyArg_ParseTuple(spec, "LOOO", &I, &gs, &us, &ds)) goto fail;
        if (parse_qmat(&t->bs, gs, I, D, &t->w[3 * e], "gate") < 0 ||
            parse_qmat(&t->bs, us, I, D, &t->w[3 * e + 1], "up") < 0 ||
            parse_qmat(&t->bs, ds, D, I, &t->w[3 * e + 2], "down") < 0)
            goto fail;
        t->have[e] = 1;
    }
    cap = PyCapsule_New(t, XTABLE, xtable_free);
    if (cap) return cap;
fail:
    bufset_release(&t->bs);
    PyMem_Free(t->w);
    PyMem_Free(t->have);
    PyMem_Free(t);
    return NULL;
}

static PyObject *py_moe_block(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *no, *rspec, *bo, *tab, *oo, *io, *wo;
    long long T, D, K;
    float eps, scale;
    int renorm, isa_i, nthreads, q8;
    if (!PyArg_ParseTuple(args, "OLLOfOOLpfOOOOiip", &xo, &T, &D, &no, &eps, &rspec, &bo, &K, &renorm, &scale, &tab,
                          &oo, &io, &wo, &isa_i, &nthreads, &q8))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    xtable *t = PyCapsule_GetPointer(tab, XTABLE);
    if (!t) return NULL;
    if (T < 1 || K < 1 || K > t->E || D != t->D) {
        PyErr_Format(PyExc_ValueError, "moe_block: %lld of %lld experts for %lld rows of width %lld (the table's: %lld)",
                     K, (long long)t->E, T, D, (long long)t->D);
        return NULL;
    }
    bufset bs = {.n = 0};
    qmat router;
    mt_moe a = {.T = T, .D = D, .eps = eps, .router = &router, .K = K, .renorm = renorm, .scale = scale,
                .E = t->E, .w = t->w, .have = t->have, .q8 = q8};
    if (parse_qmat(&bs, rspec, t->E, D, &router, "router") < 0 || !(a.x = get_buf(&bs, xo, T * D * 4, 0, "x")) ||
        !(a.norm = get_buf(&bs, no, D * 4, 0, "norm")) ||
        (bo != Py_None && !(a.bias = get_buf(&bs, bo, t->E * 4, 0, "bias"))) ||
        !(a.out = get_buf(&bs, oo, T * D * 4, 1, "out")) || !(a.ids = get_buf(&bs, io, T * K * 4, 1, "ids")) ||
        !(a.weights = get_buf(&bs, wo, T * K * 4, 1, "weights"))) {
        bufset_release(&bs);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mt_moe_block(isa, nthreads, &a);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc == -2) {
        PyErr_SetString(PyExc_ValueError, "moe_block: a routed expert is not in the table");
        return NULL;
    }
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *yo;
    long long T, C;
    float eps;
    int isa_i;
    if (!PyArg_ParseTuple(args, "OLLOfOi", &xo, &T, &C, &wo, &eps, &yo, &isa_i)) return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    bufset bs = {.n = 0};
    const float *x, *wt;
    float *y;
    if (!(x = get_buf(&bs, xo, T * C * 4, 0, "x")) || !(wt = get_buf(&bs, wo, C * 4, 0, "weight")) ||
        !(y = get_buf(&bs, yo, T * C * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mt_rmsnorm(isa, x, T, C, wt, eps, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_softmax(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    long long T, N;
    int isa_i;
    if (!PyArg_ParseTuple(args, "OLLOi", &xo, &T, &N, &yo, &isa_i)) return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    bufset bs = {.n = 0};
    const float *x;
    float *y;
    if (!(x = get_buf(&bs, xo, T * N * 4, 0, "x")) || !(y = get_buf(&bs, yo, T * N * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t t = 0; t < T; t++) mt_softmax_row(isa, x + t * N, N, y + t * N);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_attention(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qo, *ko, *vo, *po, *yo, *so = Py_None;
    long long T, H, S, Hkv, dq, dv, window = 0;
    float scale;
    int isa_i, nthreads;
    if (!PyArg_ParseTuple(args, "OOOOLLLLLLfOii|OL", &qo, &ko, &vo, &po, &T, &H, &S, &Hkv, &dq, &dv, &scale,
                          &yo, &isa_i, &nthreads, &so, &window))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    if (window < 0) {
        PyErr_Format(PyExc_ValueError, "sliding window %lld must be >= 0", window);
        return NULL;
    }
    bufset bs = {.n = 0};
    const float *q, *k, *v, *sinks = NULL;
    const int64_t *qpos;
    float *y;
    int rc;
    if (Hkv <= 0 || H % Hkv) {
        PyErr_Format(PyExc_ValueError, "H=%lld is not a multiple of Hkv=%lld", H, Hkv);
        return NULL;
    }
    if (!(q = get_buf(&bs, qo, T * H * dq * 4, 0, "q")) || !(k = get_buf(&bs, ko, S * Hkv * dq * 4, 0, "k")) ||
        !(v = get_buf(&bs, vo, S * Hkv * dv * 4, 0, "v")) || !(qpos = get_buf(&bs, po, T * 8, 0, "q_pos")) ||
        !(y = get_buf(&bs, yo, T * H * dv * 4, 1, "out")) ||
        (so != Py_None && !(sinks = get_buf(&bs, so, H * 4, 0, "sinks")))) {
        bufset_release(&bs);
        return NULL;
    }
    for (int64_t t = 0; t < T; t++) {
        if (qpos[t] < 0 || qpos[t] >= S) {
            bufset_release(&bs);
            PyErr_Format(PyExc_ValueError, "q_pos[%lld]=%lld outside the %lld cached positions", (long long)t,
                         (long long)qpos[t], S);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rc = mt_attention(isa, nthreads, q, k, v, qpos, T, H, S, Hkv, dq, dv, scale, sinks, window, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* One (R, (dtype, data, scales, g), bias or None) of gqa_block: its matrix [R, C] and bias. */
static int parse_proj(bufset *bs, PyObject *t, long long R, long long C, qmat *w, const float **bias,
                      const char *what) {
    long long r;
    PyObject *spec, *bo;
    if (!PyArg_ParseTuple(t, "LOO", &r, &spec, &bo)) return -1;
    if (r != R) {
        PyErr_Format(PyExc_ValueError, "gqa_block: %s has %lld rows, the layer needs %lld", what, r, R);
        return -1;
    }
    if (parse_qmat(bs, spec, R, C, w, what) < 0) return -1;
    *bias = NULL;
    if (bo != Py_None && !(*bias = get_buf(bs, bo, R * 4, 0, what))) return -1;
    return 0;
}

/* gqa_block(x, T, D, norm, eps, q, k, v, o, qn, kn, qk_mode, clip, clip_to, H, Hkv, hd, cos, sin, P, interleave,
 * kc, vc, S, qpos, scale, sinks, window, out, isa, threads, q8): one GQA attention layer of one sequence's T rows
 * (mt_gqa_block); q, k, v, o: (rows, weight spec, bias or None). */
static PyObject *py_gqa_block(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *no, *pq, *pk, *pv, *po, *qno, *kno, *co, *so, *kco, *vco, *qpo, *sko, *oo;
    long long T, D, H, Hkv, hd, P, S, window;
    float eps, scale, clip_to;
    int qk_mode, clip, interleave, isa_i, nthreads, q8;
    if (!PyArg_ParseTuple(args, "OLLOfOOOOOOipfLLLOOLpOOLOfOLOiip", &xo, &T, &D, &no, &eps, &pq, &pk, &pv, &po, &qno,
                          &kno, &qk_mode, &clip, &clip_to, &H, &Hkv, &hd, &co, &so, &P, &interleave, &kco, &vco, &S,
                          &qpo, &scale, &sko, &window, &oo, &isa_i, &nthreads, &q8))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    if (T < 1 || D < 1 || H < 1 || Hkv < 1 || H % Hkv || hd < 1 || P < 0 || 2 * P > hd || S < T || window < 0 ||
        qk_mode < 0 || qk_mode > 2) {
        PyErr_Format(PyExc_ValueError, "gqa_block: inconsistent shape (T %lld, D %lld, H %lld, Hkv %lld, hd %lld, "
                     "P %lld, S %lld, window %lld, qk_mode %d)", T, D, H, Hkv, hd, P, S, window, qk_mode);
        return NULL;
    }
    const long long nq = H * hd, nk = Hkv * hd;
    bufset bs = {.n = 0};
    qmat wq, wk, wv, wo;
    mt_gqa a = {.T = T, .D = D, .eps = eps, .wq = &wq, .wk = &wk, .wv = &wv, .wo = &wo, .qk_mode = qk_mode,
                .clip = clip, .clip_to = clip_to, .H = H, .Hkv = Hkv, .hd = hd, .P = P, .interleave = interleave, .S = S, .scale = scale,
                .window = window, .q8 = q8};
    float *kc, *vc, *out;
    const long long qkn = qk_mode == 1 ? nq : hd, kkn = qk_mode == 1 ? nk : hd;
    if (!(a.x = get_buf(&bs, xo, T * D * 4, 0, "x")) || !(a.norm = get_buf(&bs, no, D * 4, 0, "norm")) ||
        parse_proj(&bs, pq, nq, D, &wq, &a.bq, "q") < 0 || parse_proj(&bs, pk, nk, D, &wk, &a.bk, "k") < 0 ||
        parse_proj(&bs, pv, nk, D, &wv, &a.bv, "v") < 0 || parse_proj(&bs, po, D, nq, &wo, &a.bo, "o") < 0 ||
        (qk_mode && (!(a.qn = get_buf(&bs, qno, qkn * 4, 0, "q_norm")) ||
                     !(a.kn = get_buf(&bs, kno, kkn * 4, 0, "k_norm")))) ||
        !(a.cos = get_buf(&bs, co, T * P * 4, 0, "cos")) || !(a.sin = get_buf(&bs, so, T * P * 4, 0, "sin")) ||
        !(kc = get_buf(&bs, kco, S * nk * 4, 1, "k cache")) || !(vc = get_buf(&bs, vco, S * nk * 4, 1, "v cache")) ||
        !(a.qpos = get_buf(&bs, qpo, T * 8, 0, "q_pos")) ||
        (sko != Py_None && !(a.sinks = get_buf(&bs, sko, H * 4, 0, "sinks"))) ||
        !(out = get_buf(&bs, oo, T * D * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    for (int64_t t = 0; t < T; t++) {
        if (a.qpos[t] < 0 || a.qpos[t] >= S) {
            bufset_release(&bs);
            PyErr_Format(PyExc_ValueError, "gqa_block: q_pos[%lld]=%lld outside the %lld cached positions",
                         (long long)t, (long long)a.qpos[t], S);
            return NULL;
        }
    }
    a.kc = kc, a.vc = vc, a.out = out;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mt_gqa_block(isa, nthreads, &a);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* route_softmax(h, T, C, E, (dtype, data, scales, g), bias, K, ids, chosen, isa, threads, q8): the softmax
 * router's K best experts of each row and their scores (mt_route_softmax). */
static PyObject *py_route_softmax(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ho, *wspec, *bo, *io, *co;
    long long T, C, E, K;
    int isa_i, nthreads, q8;
    if (!PyArg_ParseTuple(args, "OLLLOOLOOiip", &ho, &T, &C, &E, &wspec, &bo, &K, &io, &co, &isa_i, &nthreads, &q8))
        return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    if (T < 1 || K < 1 || K > E) {
        PyErr_Format(PyExc_ValueError, "route_softmax: %lld of %lld experts for %lld rows", K, E, T);
        return NULL;
    }
    bufset bs = {.n = 0};
    qmat w;
    const float *h, *bias = NULL;
    int32_t *ids;
    float *chosen;
    if (parse_qmat(&bs, wspec, E, C, &w, "router") < 0 || !(h = get_buf(&bs, ho, T * C * 4, 0, "h")) ||
        (bo != Py_None && !(bias = get_buf(&bs, bo, E * 4, 0, "bias"))) ||
        !(ids = get_buf(&bs, io, T * K * 4, 1, "ids")) || !(chosen = get_buf(&bs, co, T * K * 4, 1, "chosen"))) {
        bufset_release(&bs);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mt_route_softmax(isa, nthreads, h, T, &w, bias, K, q8, ids, chosen);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_np_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ao;
    long long n;
    if (!PyArg_ParseTuple(args, "OL", &ao, &n)) return NULL;
    bufset bs = {.n = 0};
    const float *a = get_buf(&bs, ao, n * 4, 0, "a");
    if (!a) {
        bufset_release(&bs);
        return NULL;
    }
    const float s = mt_np_sum(a, n);
    bufset_release(&bs);
    return PyFloat_FromDouble(s);
}

static PyObject *py_glu_clamped(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *go, *uo;
    long long n;
    float alpha, limit;
    if (!PyArg_ParseTuple(args, "OOLff", &go, &uo, &n, &alpha, &limit)) return NULL;
    bufset bs = {.n = 0};
    float *g;
    const float *u;
    if (!(g = get_buf(&bs, go, n * 4, 1, "gate")) || !(u = get_buf(&bs, uo, n * 4, 0, "up"))) {
        bufset_release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mt_glu_clamped(g, u, n, alpha, limit);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_exp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    long long N;
    int isa_i;
    if (!PyArg_ParseTuple(args, "OLOi", &xo, &N, &yo, &isa_i)) return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    bufset bs = {.n = 0};
    const float *x;
    float *y;
    if (!(x = get_buf(&bs, xo, N * 4, 0, "x")) || !(y = get_buf(&bs, yo, N * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    isa->exp_shift(x, 0.0f, N, y);
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_combine(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *yo, *wo, *oo;
    long long T, K, D;
    if (!PyArg_ParseTuple(args, "OOLLLO", &yo, &wo, &T, &K, &D, &oo)) return NULL;
    bufset bs = {.n = 0};
    const float *ys, *w;
    float *out;
    if (!(ys = get_buf(&bs, yo, T * K * D * 4, 0, "ys")) || !(w = get_buf(&bs, wo, T * K * 4, 0, "weights")) ||
        !(out = get_buf(&bs, oo, T * D * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mt_combine(ys, w, T, K, D, out);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *co, *so, *oo;
    long long T, H, d, P;
    int interleave;
    if (!PyArg_ParseTuple(args, "OOOLLLLpO", &xo, &co, &so, &T, &H, &d, &P, &interleave, &oo)) return NULL;
    if (P < 0 || 2 * P > d) {
        PyErr_Format(PyExc_ValueError, "rope: %lld pairs do not fit head dim %lld", P, d);
        return NULL;
    }
    bufset bs = {.n = 0};
    const float *x, *c, *s;
    float *out;
    if (!(x = get_buf(&bs, xo, T * H * d * 4, 0, "x")) || !(c = get_buf(&bs, co, T * P * 4, 0, "cos")) ||
        !(s = get_buf(&bs, so, T * P * 4, 0, "sin")) || !(out = get_buf(&bs, oo, T * H * d * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mt_rope(x, c, s, T, H, d, P, interleave, out);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_fma_probe(PyObject *self, PyObject *args) {
    (void)self;
    int isa_i, nthreads;
    long long rounds;
    if (!PyArg_ParseTuple(args, "iiL", &isa_i, &nthreads, &rounds)) return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    double flops;
    Py_BEGIN_ALLOW_THREADS
    flops = mt_fma_probe(isa, nthreads, rounds);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(flops);
}

static PyObject *py_read_probe(PyObject *self, PyObject *args) {
    (void)self;
    int isa_i, nthreads;
    PyObject *bo;
    if (!PyArg_ParseTuple(args, "Oii", &bo, &isa_i, &nthreads)) return NULL;
    const mt_isa *isa = get_isa(isa_i);
    if (!isa) return NULL;
    Py_buffer v;
    if (PyObject_GetBuffer(bo, &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    sum = mt_read_probe(isa, nthreads, v.buf, (int64_t)v.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(sum);
}

static PyObject *py_isas(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    const int n = n_isas();
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("(sO)", mt_isas[i]->name, mt_isas[i]->supported() ? Py_True : Py_False);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *py_pool_spin(PyObject *self, PyObject *args) {
    (void)self;
    long long ns = -1;
    if (!PyArg_ParseTuple(args, "|L", &ns)) return NULL;
    const int64_t old = mt_pool_spin();
    if (ns >= 0) mt_pool_set_spin(ns);
    return PyLong_FromLongLong(old);
}

static PyObject *py_pool_park(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    mt_pool_park();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS,
     "linear(x, T, C, R, (dtype, data, scales, g), bias, out, isa, threads, int8_activations=False)"},
    {"linear_t", py_linear_t, METH_VARARGS,
     "linear_t(x, xs_t, xs_h, T, H, N, w, R, C, S, off, out, ys_t, ys_h, threads): per-head transposed linears"},
    {"head_linears", py_head_linears, METH_VARARGS,
     "head_linears(x, xs_t, xs_h, T, H, N, w, R, C, S, off, out, ys_t, ys_h, isa, threads): per head, linear on "
     "its N rows of w"},
    {"linears", py_linears, METH_VARARGS,
     "linears(x, T, C, [(R, (dtype, data, scales, g), bias, out)], isa, threads, int8_activations=False): "
     "several linears of one x in one job"},
    {"ffn", py_ffn, METH_VARARGS, "ffn(x, T, D, I, gate, up, down, out, isa, threads, int8_activations=False)"},
    {"experts", py_experts, METH_VARARGS,
     "experts(x, T, D, ids, K, out, [(e, I, gate, up, down)], isa, threads, int8_activations=False, weights=None, "
     "combined=None): out[t, k] = FFN_e(x[t]) where ids[t, k] = e, for the listed experts; with weights [T, K], "
     "also combined[t] = sum_k weights[t, k] * out[t, k] in k order (combine)"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, T, C, weight, eps, out, isa)"},
    {"softmax", py_softmax, METH_VARARGS, "softmax(x, T, N, out, isa)"},
    {"attention", py_attention, METH_VARARGS,
     "attention(q, k, v, q_pos, T, H, S, Hkv, dq, dv, scale, out, isa, threads, sinks=None, window=0)"},
    {"gqa_block", py_gqa_block, METH_VARARGS,
     "gqa_block(x, T, D, norm, eps, q, k, v, o, q_norm, k_norm, qk_mode, clip, clip_to, H, Hkv, hd, cos, sin, P, interleave, "
     "k_cache, v_cache, S, q_pos, scale, sinks, window, out, isa, threads, int8_activations): one GQA attention "
     "layer of one sequence's T rows, residual in and out; q, k, v, o: (rows, (dtype, data, scales, g), bias)"},
    {"route_softmax", py_route_softmax, METH_VARARGS,
     "route_softmax(h, T, C, E, (dtype, data, scales, g), bias, K, ids, chosen, isa, threads, int8_activations): "
     "the softmax router's K best experts of each row (best first, the lower on ties) and their scores"},
    {"expert_table", py_expert_table, METH_VARARGS,
     "expert_table(D, [(I, gate, up, down) or None for each expert]) -> a layer's experts for moe_block (their "
     "buffers held until it is dropped)"},
    {"moe_block", py_moe_block, METH_VARARGS,
     "moe_block(x, T, D, norm, eps, (dtype, data, scales, g), bias, K, renorm, scale, table, out, ids, weights, isa, "
     "threads, int8_activations): a MoE layer of the table's experts with a softmax router, residual in and out"},
    {"np_sum", py_np_sum, METH_VARARGS, "np_sum(a, N) -> numpy's float32 sum of a's N numbers (moe_block's row sum)"},
    {"glu_clamped", py_glu_clamped, METH_VARARGS,
     "glu_clamped(gate, up, N, alpha, limit): gpt-oss's clamped SwiGLU into gate, elementwise"},
    {"exp", py_exp, METH_VARARGS, "exp(x, N, out, isa): the contract's exponential, elementwise"},
    {"combine", py_combine, METH_VARARGS,
     "combine(ys, weights, T, K, D, out): out[t] = sum_k weights[t, k] * ys[t, k], in k order"},
    {"rope", py_rope, METH_VARARGS,
     "rope(x, cos, sin, T, H, d, P, interleave, out): the rotary embedding of Rope.apply"},
    {"fma_probe", py_fma_probe, METH_VARARGS,
     "fma_probe(isa, threads, rounds) -> flops: twelve independent fma chains per thread chunk (the FMA peak)"},
    {"read_probe", py_read_probe, METH_VARARGS,
     "read_probe(buffer, isa, threads) -> checksum: every byte read once, split between threads"},
    {"pool_spin", py_pool_spin, METH_VARARGS,
     "pool_spin(ns=-1) -> the previous setting: how long idle pool helpers poll for work before sleeping "
     "(ns >= 0 sets it)"},
    {"pool_park", py_pool_park, METH_NOARGS,
     "pool_park(): polling pool helpers sleep now rather than poll until the next call (a hint; the next call "
     "wakes them)"},
    {"isas", py_isas, METH_NOARGS,
     "[(name, supported by this CPU)] of every kernel path in this build, best first; an ISA argument is an index "
     "into it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_ckernels",
                                    "moetier C kernels (see moetier/kernels/fast.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ckernels(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (m && PyModule_AddIntConstant(m, "VERSION", MT_KERNELS_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
