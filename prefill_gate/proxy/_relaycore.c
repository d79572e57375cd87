/* The relay's per-read path, compiled (issue 27).

   Every upstream read of a stream under way runs the same few checks and one write: is the
   client's side ready for a body part, is the read nothing but whole content chunks, then
   frame it and write it. In Python that is half a dozen bytes-method calls and three
   frames a read, about 40% of the Python a read costs (bench/relay_read.py, the old docs/RESULTS.md, in git history
   3l). This module does the same in one call. It decides nothing of its own: every rule is the
   Python code's or the HTTP parser's, and tests/test_relaycore.py holds them equal.

     plain_events(data) -> int
         StreamObserver.take's test (prefill_gate/proxy/relay.py, plain_events): how many one-line
         content events ``data`` is exactly, or 0 where the read needs the general path.

     chunk_payloads(data) -> bytes | None
         where ``data`` is exactly whole chunks of a chunked HTTP body, none of them the
         last, their payloads joined; else None. A strict subset of what the parser
         (httptools' llhttp) reads from between two chunks, to the same bytes.

     DirectRelay(cycle, observer)(data) -> bool
         exactly ``ChunkWriter(cycle).write_through(observer.take, data)`` (prefill_gate/proxy/listener.py,
         prefill_gate/proxy/relay.py): False, with nothing taken, while the cycle's ``send`` has more to
         do than write a body part; else the read observed and written, and True. As
         ``take`` does: a plain read is counted as ``observer.counted(n)`` counts it (here,
         step for step), any other cut by the observer's splitter and filtered
         (``observer.filter(splitter.feed(data))``).

     DirectRelay.chunked(wire) -> None | True | bytes
         the same for a read of the upstream connection's wire where it is whole chunks
         (prefill_gate/proxy/fasthttp.py, FramedConnection): None, nothing done, where it is not; True
         taken; the payloads, untouched, where the client's side was not ready.

   DirectRelay tests bytes only; any other read (none comes from prefill_gate/proxy/fasthttp.py) goes to
   ``observer.take``, which treats it as Python would.

     Histogram(bounds)
         prefill_gate/proxy/metrics.py's histogram child (``_HistogramChild``): ``observe(value)``,
         ``observe_run(value, n)``, ``counts`` (per bucket, the last +Inf) and ``sum``, the
         same numbers from the same observations, its counts in C.

     GapTally(quiet, busy, upstream, more)(gap, n) -> None
         exactly ``GatedExchange._tokens`` (prefill_gate/proxy/exchange.py), the per-read token hook:
         ``n`` content chunks in one read, ``gap`` seconds after the previous, observed in
         ``busy`` while ``upstream.large_in_flight > 0``, else in ``quiet`` (two Histograms);
         then ``more(gap, n)`` unless ``more`` is None (the closed loop, the predictor).
         Where DirectRelay counts a read, it calls this without a Python frame.

     FramedReads
         the base of prefill_gate/proxy/fasthttp.py's FramedConnection: the fields its per-read step reads
         (at_boundary, sink_chunked, chunks, buffered, waiter, the read deadline's) as C
         members, and that step, ``data_received``: a read offered to ``sink_chunked`` where
         the reader is parked between two chunks with nothing queued (taken: the deadline
         moved; payloads handed back: queued, the reader woken); anything else to
         ``_parse_read``, the parser's path. Step for step the Python it replaced. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>

static PyObject *s_response_started, *s_chunked_encoding, *s_response_complete, *s_disconnected, *s_flow,
    *s_write_paused, *s_transport, *s_write, *s_first_at, *s_splitter, *s_held, *s_take, *s_feed, *s_filter,
    *s_clock, *s_tokens, *s_last_at, *s_on_tokens, *s_large_in_flight, *s_done, *s_time, *s_append, *s_sink_failed,
    *s_hand_over, *s_parse_read;

static const char EVENT_HEAD[] = "data: {";        /* how a plain content event starts */
static const char EVENT_JOIN[] = "\n\ndata: {";    /* the seam between two of them in one read */

/* The rule of prefill_gate/proxy/relay.py's plain_events, in one pass over the read: it starts with
   EVENT_HEAD and ends in exactly one blank line; no CR; no '"usage"', '"error"' or
   '"choices":[]'; and its LFs are two an event, all but the last two in an EVENT_JOIN
   (the count of LFs and of EVENT_JOINs decide it, as in Python). */
static Py_ssize_t
count_plain(const char *p, Py_ssize_t n)
{
    const Py_ssize_t head = (Py_ssize_t)(sizeof(EVENT_HEAD) - 1), join = (Py_ssize_t)(sizeof(EVENT_JOIN) - 1);
    if (n < head || memcmp(p, EVENT_HEAD, (size_t)head) != 0)
        return 0;
    if (!(p[n - 1] == '\n' && p[n - 2] == '\n' && p[n - 3] != '\n'))
        return 0;
    Py_ssize_t lfs = 0, joins = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        switch (p[i]) {
        case '\r':
            return 0;
        case '\n':
            lfs++;
            if (i + join <= n && p[i + 1] == '\n' && memcmp(p + i, EVENT_JOIN, (size_t)join) == 0) {
                joins++;  /* (its second LF is counted on the next turn) */
            }
            break;
        case '"': {
            const char *q = p + i + 1;
            Py_ssize_t left = n - i - 1;
            if ((left >= 6 && memcmp(q, "usage\"", 6) == 0) || (left >= 6 && memcmp(q, "error\"", 6) == 0)
                || (left >= 11 && memcmp(q, "choices\":[]", 11) == 0))
                return 0;
            break;
        }
        default:
            break;
        }
    }
    Py_ssize_t events = lfs >> 1;
    if (lfs == 2)
        return 1;
    if (!(lfs & 1) && joins == events - 1)
        return events;
    return 0;
}

static PyObject *
plain_events(PyObject *module, PyObject *data)
{
    if (PyBytes_CheckExact(data))
        return PyLong_FromSsize_t(count_plain(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data)));
    Py_buffer view;  /* a bytearray, as Python's rule takes one too */
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = count_plain(view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

/* ------------------------------------------------------------- chunked frames */

static int
hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The most hex digits a chunk size may have here: its value stays far from size_t's limit. */
#define MAX_SIZE_DIGITS ((Py_ssize_t)(2 * sizeof(size_t) - 1))

/* The payloads of ``p[0:n]`` where it is exactly one or more whole chunks of a chunked body
   and none is the last: each ``<hex size>\r\n<size bytes>\r\n``, the size above 0 and
   without an extension or whitespace; the payloads joined, as a new bytes object. Anything
   else (a chunk cut by the read, the last chunk, an extension, a leading or trailing byte
   out of place) is Py_None, a new reference: the read goes to the HTTP parser whole. Every
   read this accepts, the parser (llhttp) accepts alike and leaves where it started, between
   two chunks (tests/test_relaycore.py). */
static PyObject *
payloads_of(const char *p, Py_ssize_t n)
{
    Py_ssize_t pos = 0, total = 0, frames = 0;
    while (pos < n) {
        size_t size = 0;
        Py_ssize_t digits = 0;
        int v;
        while (pos + digits < n && (v = hex_digit(p[pos + digits])) >= 0) {
            if (++digits > MAX_SIZE_DIGITS)
                Py_RETURN_NONE;
            size = size * 16 + (size_t)v;
        }
        if (digits == 0 || size == 0)
            Py_RETURN_NONE;
        pos += digits;
        if (n - pos < 2 || p[pos] != '\r' || p[pos + 1] != '\n')
            Py_RETURN_NONE;
        pos += 2;
        if ((size_t)(n - pos) < size + 2)
            Py_RETURN_NONE;
        pos += (Py_ssize_t)size;
        if (p[pos] != '\r' || p[pos + 1] != '\n')
            Py_RETURN_NONE;
        pos += 2;
        total += (Py_ssize_t)size;
        frames++;
    }
    if (frames == 0)
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    char *q = PyBytes_AS_STRING(out);
    for (pos = 0; pos < n;) {  /* the frames were checked above: sizes and CRLFs only */
        size_t size = 0;
        while (p[pos] != '\r')
            size = size * 16 + (size_t)hex_digit(p[pos++]);
        memcpy(q, p + pos + 2, size);
        q += size;
        pos += 2 + (Py_ssize_t)size + 2;
    }
    return out;
}

static PyObject *
chunk_payloads(PyObject *module, PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "chunk_payloads takes bytes, not %.100s", Py_TYPE(data)->tp_name);
        return NULL;
    }
    return payloads_of(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
}

/* -------------------------------------------------------------------- DirectRelay */

typedef struct {
    PyObject_HEAD
    PyObject *cycle;     /* the client's request (prefill_gate.proxy.http1.Cycle) */
    PyObject *observer;  /* the stream's StreamObserver */
    /* Read once: none changes in a cycle's or an observer's life (a cycle's flow and
       transport are set in its __init__; an observer keeps its splitter). */
    PyObject *flow;      /* cycle.flow */
    PyObject *write;     /* cycle.transport.write */
    PyObject *splitter;  /* observer.splitter */
    vectorcallfunc vectorcall;
} DirectRelay;

/* The truth of getattr(obj, name): 1, 0, or -1 with an exception set. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* ChunkWriter.write_through's readiness, in its order: 1 ready, 0 not, -1 error. */
static int
cycle_ready(PyObject *c, PyObject *flow)
{
    int t = attr_true(c, s_response_started);
    if (t <= 0)
        return t;
    PyObject *chunked = PyObject_GetAttr(c, s_chunked_encoding);
    if (chunked == NULL)
        return -1;
    int is_true = chunked == Py_True;
    Py_DECREF(chunked);
    if (!is_true)
        return 0;
    if ((t = attr_true(c, s_response_complete)) != 0 || (t = attr_true(c, s_disconnected)) != 0)
        return t < 0 ? -1 : 0;
    t = attr_true(flow, s_write_paused);
    return t < 0 ? -1 : !t;
}

/* StreamObserver.take's precondition for its fast path: under way, nothing held over.
   1, 0, or -1 with an exception set. */
static int
observer_under_way(PyObject *observer, PyObject *splitter)
{
    PyObject *first_at = PyObject_GetAttr(observer, s_first_at);
    if (first_at == NULL)
        return -1;
    int under_way = first_at != Py_None;
    Py_DECREF(first_at);
    if (!under_way)
        return 0;
    int held = attr_true(splitter, s_held);
    return held < 0 ? -1 : !held;
}

/* StreamObserver.counted(n), step for step: the clock read once, ``tokens`` raised by n,
   ``on_tokens(now - last_at, n)``, ``last_at`` moved to now. 0, or -1 with an exception set. */
static int
counted(PyObject *observer, Py_ssize_t n)
{
    int rc = -1;
    PyObject *clock = NULL, *now = NULL, *count = NULL, *tokens = NULL, *total = NULL, *last_at = NULL,
             *gap = NULL, *on_tokens = NULL, *r = NULL;
    if ((clock = PyObject_GetAttr(observer, s_clock)) == NULL || (now = PyObject_CallNoArgs(clock)) == NULL
        || (count = PyLong_FromSsize_t(n)) == NULL || (tokens = PyObject_GetAttr(observer, s_tokens)) == NULL
        || (total = PyNumber_InPlaceAdd(tokens, count)) == NULL || PyObject_SetAttr(observer, s_tokens, total) < 0
        || (on_tokens = PyObject_GetAttr(observer, s_on_tokens)) == NULL
        || (last_at = PyObject_GetAttr(observer, s_last_at)) == NULL
        || (gap = PyNumber_Subtract(now, last_at)) == NULL)
        goto done;
    PyObject *args[2] = {gap, count};
    if ((r = PyObject_Vectorcall(on_tokens, args, 2, NULL)) == NULL || PyObject_SetAttr(observer, s_last_at, now) < 0)
        goto done;
    rc = 0;
done:
    Py_XDECREF(clock);
    Py_XDECREF(now);
    Py_XDECREF(count);
    Py_XDECREF(tokens);
    Py_XDECREF(total);
    Py_XDECREF(last_at);
    Py_XDECREF(gap);
    Py_XDECREF(on_tokens);
    Py_XDECREF(r);
    return rc;
}

/* b"%x\r\n%s\r\n" % (len(body), body), for any bytes-like body. */
static PyObject *
framed(PyObject *body)
{
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    char size[2 * sizeof(size_t)];  /* the length in lowercase hex, no leading zeros ("%zx") */
    int digits = 0;
    size_t left = (size_t)view.len;
    do {
        size[sizeof(size) - 1 - digits++] = "0123456789abcdef"[left & 15];
        left >>= 4;
    } while (left != 0);
    PyObject *out = PyBytes_FromStringAndSize(NULL, digits + 2 + view.len + 2);
    if (out != NULL) {
        char *p = PyBytes_AS_STRING(out);
        memcpy(p, size + sizeof(size) - digits, (size_t)digits);
        memcpy(p + digits, "\r\n", 2);
        memcpy(p + digits + 2, view.buf, (size_t)view.len);
        memcpy(p + digits + 2 + view.len, "\r\n", 2);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *
relay_call(DirectRelay *self, PyObject *data)
{
    int ready = cycle_ready(self->cycle, self->flow);
    if (ready <= 0)
        return ready < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *body;
    if (!PyBytes_CheckExact(data)) {
        body = PyObject_CallMethodOneArg(self->observer, s_take, data);
    } else {
        /* StreamObserver.take, its two ways: a plain read counted, any other cut and filtered. */
        int under_way = observer_under_way(self->observer, self->splitter);
        if (under_way < 0)
            return NULL;
        Py_ssize_t n = under_way ? count_plain(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data)) : 0;
        if (n > 0) {
            if (counted(self->observer, n) < 0)
                return NULL;
            body = Py_NewRef(data);
        } else {
            PyObject *events = PyObject_CallMethodOneArg(self->splitter, s_feed, data);
            body = events == NULL ? NULL : PyObject_CallMethodOneArg(self->observer, s_filter, events);
            Py_XDECREF(events);
        }
    }
    if (body == NULL)
        return NULL;
    int nonempty = PyObject_IsTrue(body);
    if (nonempty > 0) {
        PyObject *out = framed(body);
        PyObject *r = out == NULL ? NULL : PyObject_CallOneArg(self->write, out);
        Py_XDECREF(out);
        if (r == NULL)
            nonempty = -1;
        Py_XDECREF(r);
    }
    Py_DECREF(body);
    return nonempty < 0 ? NULL : Py_NewRef(Py_True);
}

static PyObject *
relay_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "DirectRelay takes one positional argument (a read's bytes)");
        return NULL;
    }
    return relay_call((DirectRelay *)self, args[0]);
}

static PyObject *
relay_chunked(DirectRelay *self, PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "chunked takes bytes, not %.100s", Py_TYPE(data)->tp_name);
        return NULL;
    }
    PyObject *body = payloads_of(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
    if (body == NULL || body == Py_None)
        return body;
    PyObject *taken = relay_call(self, body);
    if (taken != Py_False) {  /* taken (True), or an error (NULL) */
        Py_DECREF(body);
        return taken;
    }
    Py_DECREF(taken);
    return body;
}

static PyMethodDef relay_methods[] = {
    {"chunked", (PyCFunction)relay_chunked, METH_O,
     "chunked(data: bytes) -> None | True | bytes: where ``data`` is whole chunks of a chunked body "
     "(chunk_payloads), their payloads relayed as self(payloads) would: True taken, else the "
     "payloads, left for the caller to queue; None: not whole chunks, nothing done."},
    {NULL, NULL, 0, NULL},
};

static int
relay_init(DirectRelay *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"cycle", "observer", NULL};
    PyObject *cycle, *observer;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:DirectRelay", names, &cycle, &observer))
        return -1;
    PyObject *flow = PyObject_GetAttr(cycle, s_flow);
    PyObject *transport = flow == NULL ? NULL : PyObject_GetAttr(cycle, s_transport);
    PyObject *write = transport == NULL ? NULL : PyObject_GetAttr(transport, s_write);
    PyObject *splitter = write == NULL ? NULL : PyObject_GetAttr(observer, s_splitter);
    Py_XDECREF(transport);
    if (splitter == NULL) {
        Py_XDECREF(flow);
        Py_XDECREF(write);
        return -1;
    }
    Py_XSETREF(self->cycle, Py_NewRef(cycle));
    Py_XSETREF(self->observer, Py_NewRef(observer));
    Py_XSETREF(self->flow, flow);
    Py_XSETREF(self->write, write);
    Py_XSETREF(self->splitter, splitter);
    return 0;
}

static PyObject *
relay_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    DirectRelay *self = (DirectRelay *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->vectorcall = relay_vectorcall;
    return (PyObject *)self;
}

static int
relay_traverse(DirectRelay *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cycle);
    Py_VISIT(self->observer);
    Py_VISIT(self->flow);
    Py_VISIT(self->write);
    Py_VISIT(self->splitter);
    return 0;
}

static int
relay_clear(DirectRelay *self)
{
    Py_CLEAR(self->cycle);
    Py_CLEAR(self->observer);
    Py_CLEAR(self->flow);
    Py_CLEAR(self->write);
    Py_CLEAR(self->splitter);
    return 0;
}

static void
relay_dealloc(DirectRelay *self)
{
    PyObject_GC_UnTrack(self);
    relay_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject DirectRelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefill_gate.proxy._relaycore.DirectRelay",
    .tp_doc = "DirectRelay(cycle, observer)(data): ChunkWriter(cycle).write_through(observer.take, data), compiled.",
    .tp_basicsize = sizeof(DirectRelay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(DirectRelay, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = relay_new,
    .tp_init = (initproc)relay_init,
    .tp_traverse = (traverseproc)relay_traverse,
    .tp_clear = (inquiry)relay_clear,
    .tp_dealloc = (destructor)relay_dealloc,
    .tp_methods = relay_methods,
};

/* ------------------------------------------------------------------ Histogram */

typedef struct {
    PyObject_HEAD
    Py_ssize_t nbounds;
    double *bounds;              /* ascending, as prefill_gate/proxy/metrics.py gives them */
    unsigned long long *counts;  /* nbounds + 1: per bucket, not cumulative; the last is +Inf */
    Py_ssize_t zero_at;          /* the bucket of 0.0 */
    double sum;
} Histogram;

/* bisect.bisect_left(bounds, value): the first bound not below value (NaN: 0, as in Python,
   where every ``bound < nan`` is false). */
static Py_ssize_t
bucket_of(const Histogram *h, double value)
{
    Py_ssize_t lo = 0, hi = h->nbounds;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (h->bounds[mid] < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void
histogram_run(Histogram *h, double value, Py_ssize_t n)
{
    h->counts[bucket_of(h, value)] += 1;
    if (n > 1)
        h->counts[h->zero_at] += (unsigned long long)(n - 1);
    h->sum += value;
}

static int
histogram_init(Histogram *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"bounds", NULL};
    PyObject *given;
    if (self->bounds != NULL) {
        PyErr_SetString(PyExc_TypeError, "a Histogram is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Histogram", names, &given))
        return -1;
    PyObject *seq = PySequence_Fast(given, "bounds must be a sequence of numbers");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    self->bounds = PyMem_Calloc((size_t)n + 1, sizeof(double));
    self->counts = PyMem_Calloc((size_t)n + 1, sizeof(unsigned long long));
    if (self->bounds == NULL || self->counts == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double b = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (b == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (i > 0 && !(self->bounds[i - 1] < b)) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "bounds must be strictly ascending");
            return -1;
        }
        self->bounds[i] = b;
    }
    Py_DECREF(seq);
    self->nbounds = n;
    self->zero_at = bucket_of(self, 0.0);
    return 0;
}

static void
histogram_dealloc(Histogram *self)
{
    PyMem_Free(self->bounds);
    PyMem_Free(self->counts);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
histogram_ready(Histogram *self)
{
    if (self->counts == NULL) {
        PyErr_SetString(PyExc_TypeError, "Histogram.__init__ was not called");
        return -1;
    }
    return 0;
}

static PyObject *
histogram_observe(Histogram *self, PyObject *value)
{
    double v = PyFloat_AsDouble(value);
    if ((v == -1.0 && PyErr_Occurred()) || histogram_ready(self) < 0)
        return NULL;
    histogram_run(self, v, 1);
    Py_RETURN_NONE;
}

static PyObject *
histogram_observe_run(Histogram *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "observe_run(value, n) takes two arguments");
        return NULL;
    }
    double v = PyFloat_AsDouble(args[0]);
    if (v == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if ((n == -1 && PyErr_Occurred()) || histogram_ready(self) < 0)
        return NULL;
    histogram_run(self, v, n);
    Py_RETURN_NONE;
}

static PyObject *
histogram_counts(Histogram *self, void *closure)
{
    if (histogram_ready(self) < 0)
        return NULL;
    PyObject *out = PyList_New(self->nbounds + 1);
    for (Py_ssize_t i = 0; out != NULL && i <= self->nbounds; i++) {
        PyObject *count = PyLong_FromUnsignedLongLong(self->counts[i]);
        if (count == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, count);
    }
    return out;
}

static PyObject *
histogram_sum(Histogram *self, void *closure)
{
    return PyFloat_FromDouble(self->sum);
}

static PyMethodDef histogram_methods[] = {
    {"observe", (PyCFunction)histogram_observe, METH_O, "observe(value): one observation."},
    {"observe_run", (PyCFunction)(void (*)(void))histogram_observe_run, METH_FASTCALL,
     "observe_run(value, n): ``value``, then ``n - 1`` zeros (one read's chunks)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef histogram_getset[] = {
    {"counts", (getter)histogram_counts, NULL, "per bucket, not cumulative; the last is +Inf (a new list)", NULL},
    {"sum", (getter)histogram_sum, NULL, "the sum of the observations", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HistogramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefill_gate.proxy._relaycore.Histogram",
    .tp_doc = "Histogram(bounds): prefill_gate/proxy/metrics.py's histogram child, its counts in C.",
    .tp_basicsize = sizeof(Histogram),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)histogram_init,
    .tp_dealloc = (destructor)histogram_dealloc,
    .tp_methods = histogram_methods,
    .tp_getset = histogram_getset,
};

/* ------------------------------------------------------------------ GapTally */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Histogram *quiet, *busy;  /* no large prefill in flight on the upstream / one or more */
    PyObject *upstream;       /* its .large_in_flight, read at each call */
    PyObject *more;           /* None, or callable(gap, n) */
} GapTally;

static PyObject *zero;  /* 0 */

static PyObject *
tally_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    GapTally *self = (GapTally *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "GapTally takes two positional arguments (gap, n)");
        return NULL;
    }
    if (self->quiet == NULL) {
        PyErr_SetString(PyExc_TypeError, "GapTally.__init__ was not called");
        return NULL;
    }
    double gap = PyFloat_AsDouble(args[0]);
    if (gap == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *large = PyObject_GetAttr(self->upstream, s_large_in_flight);
    if (large == NULL)
        return NULL;
    int busy = PyObject_RichCompareBool(large, zero, Py_GT);
    Py_DECREF(large);
    if (busy < 0)
        return NULL;
    histogram_run(busy ? self->busy : self->quiet, gap, n);
    if (self->more == Py_None)
        Py_RETURN_NONE;
    return PyObject_Vectorcall(self->more, args, 2, NULL);
}

static int
tally_init(GapTally *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"quiet", "busy", "upstream", "more", NULL};
    PyObject *quiet, *busy, *upstream, *more;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OO:GapTally", names, &HistogramType, &quiet,
                                     &HistogramType, &busy, &upstream, &more))
        return -1;
    if (histogram_ready((Histogram *)quiet) < 0 || histogram_ready((Histogram *)busy) < 0)
        return -1;
    if (more != Py_None && !PyCallable_Check(more)) {
        PyErr_SetString(PyExc_TypeError, "more must be None or callable");
        return -1;
    }
    Py_XSETREF(self->quiet, (Histogram *)Py_NewRef(quiet));
    Py_XSETREF(self->busy, (Histogram *)Py_NewRef(busy));
    Py_XSETREF(self->upstream, Py_NewRef(upstream));
    Py_XSETREF(self->more, Py_NewRef(more));
    return 0;
}

static PyObject *
tally_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    GapTally *self = (GapTally *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->vectorcall = tally_vectorcall;
    return (PyObject *)self;
}

static int
tally_traverse(GapTally *self, visitproc visit, void *arg)
{
    Py_VISIT(self->quiet);
    Py_VISIT(self->busy);
    Py_VISIT(self->upstream);
    Py_VISIT(self->more);
    return 0;
}

static int
tally_clear(GapTally *self)
{
    Py_CLEAR(self->quiet);
    Py_CLEAR(self->busy);
    Py_CLEAR(self->upstream);
    Py_CLEAR(self->more);
    return 0;
}

static void
tally_dealloc(GapTally *self)
{
    PyObject_GC_UnTrack(self);
    tally_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject GapTallyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefill_gate.proxy._relaycore.GapTally",
    .tp_doc = "GapTally(quiet, busy, upstream, more)(gap, n): GatedExchange._tokens, compiled.",
    .tp_basicsize = sizeof(GapTally),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(GapTally, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = tally_new,
    .tp_init = (initproc)tally_init,
    .tp_traverse = (traverseproc)tally_traverse,
    .tp_clear = (inquiry)tally_clear,
    .tp_dealloc = (destructor)tally_dealloc,
};

/* ---------------------------------------------------------------- FramedReads */

/* The base of prefill_gate/proxy/fasthttp.py's FramedConnection: the state its per-read step reads, kept
   here (the Python code reads and sets it as attributes, as on any connection), and that
   step, ``data_received``. Where the connection is between two chunks of a chunked body,
   its reader parked with nothing queued, a read goes to the sink's ``chunked`` first;
   anything that does not take goes to ``_parse_read`` (the HTTP parser's path, Python). */
typedef struct {
    PyObject_HEAD
    char at_boundary;        /* between two chunks, past the head, the answer not complete */
    PyObject *sink_chunked;  /* None, or callable(read) -> None | True | bytes */
    PyObject *chunks;        /* the body bytes queued for the reader (a deque) */
    Py_ssize_t buffered;     /* their length */
    PyObject *waiter;        /* None, or the parked reader's future */
    PyObject *timer;         /* None, or the read deadline's check (a TimerHandle) */
    double deadline;         /* of the current wait (loop time) */
    PyObject *loop;          /* None until the first wait */
    PyObject *wait_timeout;  /* the current wait's timeout (seconds) or None */
} FramedReads;

/* Is ``obj`` set (neither NULL, where never set or deleted, nor None)? */
static inline int
is_set(PyObject *obj)
{
    return obj != NULL && obj != Py_None;
}

/* The reader is parked on ``waiter`` (a future not yet done): 1, 0, or -1 with an exception set. */
static int
parked(PyObject *waiter)
{
    if (!is_set(waiter))
        return 0;
    PyObject *done = PyObject_CallMethodNoArgs(waiter, s_done);
    if (done == NULL)
        return -1;
    int is_done = PyObject_IsTrue(done);
    Py_DECREF(done);
    return is_done < 0 ? -1 : !is_done;
}

/* ``self.<name>()`` for its effect: 0, or -1 with an exception set. */
static int
call_method(PyObject *self, PyObject *name, PyObject *arg)
{
    PyObject *r = arg == NULL ? PyObject_CallMethodNoArgs(self, name) : PyObject_CallMethodOneArg(self, name, arg);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* The sink raised (an Exception; anything else goes on up): ``self._sink_failed(exc)``, then
   ``self._hand_over()``, as the Python path's ``except Exception`` does. */
static PyObject *
sink_raised(FramedReads *self)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return NULL;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL)
        PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
#endif
    int rc = call_method((PyObject *)self, s_sink_failed, exc);
    Py_DECREF(exc);
    if (rc < 0 || call_method((PyObject *)self, s_hand_over, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Bytes came: the read deadline moves, ``self._deadline = self._loop.time() + self._wait_timeout``,
   while a deadline's check is armed. 0, or -1 with an exception set. */
static int
deadline_moved(FramedReads *self)
{
    if (!is_set(self->timer))
        return 0;
    if (self->loop == NULL || self->wait_timeout == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a read deadline is armed without its loop and timeout");
        return -1;
    }
    PyObject *now = PyObject_CallMethodNoArgs(self->loop, s_time);
    if (now == NULL)
        return -1;
    PyObject *deadline = PyNumber_Add(now, self->wait_timeout);
    Py_DECREF(now);
    if (deadline == NULL)
        return -1;
    double d = PyFloat_AsDouble(deadline);
    Py_DECREF(deadline);
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    self->deadline = d;
    return 0;
}

static PyObject *
framed_data_received(FramedReads *self, PyObject *data)
{
    if (self->at_boundary && is_set(self->sink_chunked) && self->chunks != NULL) {
        /* Strong references for the calls below: the sink's callbacks may drop the
           connection's own (a relay that ends, a connection reset), and a borrowed one would
           free the sink, or the queue, in the middle of its use. */
        PyObject *sink = Py_NewRef(self->sink_chunked);
        PyObject *chunks = Py_NewRef(self->chunks);
        PyObject *waiter = Py_XNewRef(self->waiter);
        Py_ssize_t queued = PyObject_Size(chunks);
        int waiting = queued < 0 ? -1 : queued == 0 ? parked(waiter) : 0;
        Py_XDECREF(waiter);
        PyObject *taken = waiting > 0 ? PyObject_CallOneArg(sink, data) : NULL;
        Py_DECREF(sink);
        if (waiting < 0) {
            Py_DECREF(chunks);
            return NULL;
        }
        if (waiting) {  /* the reader was parked, nothing queued: whole chunks went to the sink, unparsed */
            if (taken == NULL) {
                Py_DECREF(chunks);
                return sink_raised(self);
            }
            if (taken == Py_True) {
                Py_DECREF(taken);
                Py_DECREF(chunks);
                if (deadline_moved(self) < 0)
                    return NULL;
                Py_RETURN_NONE;
            }
            if (taken != Py_None) {  /* whole chunks, their payloads left for the reader */
                Py_ssize_t size = PyObject_Size(taken);
                int rc = size < 0 ? -1 : call_method(chunks, s_append, taken);
                Py_DECREF(taken);
                Py_DECREF(chunks);
                if (rc < 0)
                    return NULL;
                self->buffered += size;
                if (call_method((PyObject *)self, s_hand_over, NULL) < 0)
                    return NULL;
                Py_RETURN_NONE;
            }
            Py_DECREF(taken);
        }
        Py_DECREF(chunks);
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_parse_read, data);
}

static PyMethodDef framed_methods[] = {
    {"data_received", (PyCFunction)framed_data_received, METH_O,
     "asyncio.Protocol.data_received: whole chunks to the sink's ``chunked`` where the reader is parked "
     "between two chunks, else ``self._parse_read(data)``."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef framed_members[] = {
    {"at_boundary", T_BOOL, offsetof(FramedReads, at_boundary), 0, NULL},
    {"sink_chunked", T_OBJECT, offsetof(FramedReads, sink_chunked), 0, NULL},
    {"chunks", T_OBJECT, offsetof(FramedReads, chunks), 0, NULL},
    {"buffered", T_PYSSIZET, offsetof(FramedReads, buffered), 0, NULL},
    {"waiter", T_OBJECT, offsetof(FramedReads, waiter), 0, NULL},
    {"_timer", T_OBJECT, offsetof(FramedReads, timer), 0, NULL},
    {"_deadline", T_DOUBLE, offsetof(FramedReads, deadline), 0, NULL},
    {"_loop", T_OBJECT, offsetof(FramedReads, loop), 0, NULL},
    {"_wait_timeout", T_OBJECT, offsetof(FramedReads, wait_timeout), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int
framed_traverse(FramedReads *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sink_chunked);
    Py_VISIT(self->chunks);
    Py_VISIT(self->waiter);
    Py_VISIT(self->timer);
    Py_VISIT(self->loop);
    Py_VISIT(self->wait_timeout);
    return 0;
}

static int
framed_clear(FramedReads *self)
{
    Py_CLEAR(self->sink_chunked);
    Py_CLEAR(self->chunks);
    Py_CLEAR(self->waiter);
    Py_CLEAR(self->timer);
    Py_CLEAR(self->loop);
    Py_CLEAR(self->wait_timeout);
    return 0;
}

static void
framed_dealloc(FramedReads *self)
{
    PyObject_GC_UnTrack(self);
    framed_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FramedReadsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefill_gate.proxy._relaycore.FramedReads",
    .tp_doc = "The base of prefill_gate.proxy.fasthttp.FramedConnection: its per-read state and data_received, compiled.",
    .tp_basicsize = sizeof(FramedReads),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)framed_traverse,
    .tp_clear = (inquiry)framed_clear,
    .tp_dealloc = (destructor)framed_dealloc,
    .tp_methods = framed_methods,
    .tp_members = framed_members,
};

static PyMethodDef module_methods[] = {
    {"plain_events", plain_events, METH_O,
     "plain_events(data: bytes) -> int: how many one-line content events the read is exactly, or 0."},
    {"chunk_payloads", chunk_payloads, METH_O,
     "chunk_payloads(data: bytes) -> bytes | None: the payloads where data is exactly whole chunks of a "
     "chunked body, none the last; else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "prefill_gate.proxy._relaycore", "The relay's per-read path, compiled (see prefill_gate/proxy/_relaycore.c).",
    -1, module_methods,
};

static int
intern_names(void)
{
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_response_started, "response_started"}, {&s_chunked_encoding, "chunked_encoding"},
        {&s_response_complete, "response_complete"}, {&s_disconnected, "disconnected"}, {&s_flow, "flow"},
        {&s_write_paused, "write_paused"}, {&s_transport, "transport"}, {&s_write, "write"},
        {&s_first_at, "first_at"}, {&s_splitter, "splitter"}, {&s_held, "held"}, {&s_take, "take"},
        {&s_feed, "feed"}, {&s_filter, "filter"}, {&s_clock, "clock"}, {&s_tokens, "tokens"},
        {&s_last_at, "last_at"}, {&s_on_tokens, "on_tokens"}, {&s_large_in_flight, "large_in_flight"},
        {&s_done, "done"}, {&s_time, "time"}, {&s_append, "append"}, {&s_sink_failed, "_sink_failed"},
        {&s_hand_over, "_hand_over"}, {&s_parse_read, "_parse_read"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].name)) == NULL)
            return -1;
    return 0;
}

PyMODINIT_FUNC
PyInit__relaycore(void)
{
    if (intern_names() < 0 || PyType_Ready(&DirectRelayType) < 0 || PyType_Ready(&HistogramType) < 0
        || PyType_Ready(&GapTallyType) < 0 || PyType_Ready(&FramedReadsType) < 0
        || (zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "DirectRelay", (PyObject *)&DirectRelayType) < 0
        || PyModule_AddObjectRef(module, "Histogram", (PyObject *)&HistogramType) < 0
        || PyModule_AddObjectRef(module, "GapTally", (PyObject *)&GapTallyType) < 0
        || PyModule_AddObjectRef(module, "FramedReads", (PyObject *)&FramedReadsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
