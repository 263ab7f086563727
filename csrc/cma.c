/* Host-memory transfers between two processes of one machine in one system call each: Linux's
 * cross-memory attach (process_vm_writev, process_vm_readv), the same kernel copy that UCX's
 * "cma" transport makes, without the layers above it. A 4 KiB put through NIXL spends most of its
 * time in those layers; here the call from Python costs about what the kernel's copy costs.
 *
 * A transfer is prepared once (the peer's Process: its pid, a pidfd that says whether it still
 * lives and its gate, a shared page that says whether its memory is still open; the paired
 * (address, length) rows of both sides, merged where adjacent on their side) and run any number
 * of times.
 * Built at install time as transport._cma (pyproject.toml, optional); where it is missing the
 * library moves every byte through NIXL. transport/backends/cma.py decides when it is used. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* A run polls the pidfd unless a poll found the process alive less than this long ago. A pid
 * exited since is given to a new process only after the kernel's pid counter has gone once
 * around (at least 32,768 process creations), which no machine does within this time; the clock
 * runs on while this process is stopped, so a run after a freeze polls again. */
#define ALIVE_FOR_NS 1000000ULL

/* at most this many rows per system call (the kernel's limit on an iovec array) */
#define ROWS_PER_CALL 1024
/* from this many bytes on, a transfer lets go of the interpreter lock while it copies */
#define RELEASE_GIL_BYTES (64 * 1024)

/* A writer's count of its runs in progress in one gate: ``writer`` is its key (its pid in the high
 * 32 bits, a random number of its own in the low ones; 0: the slot is free). */
struct gate_slot {
    int64_t writer;
    int64_t active;
};

#define GATE_SLOTS 250

/* The page an agent shares with the writers of its machine (a memfd that each maps): its token,
 * whether its memory is open to transfers, and the runs in progress, counted per writer (a slot
 * each, claimed when it maps the gate; ``active`` counts the runs of writers that found every
 * slot taken). A run counts itself in, then reads ``open``; the owner clears ``open``, then waits
 * until no run is counted (all sequentially consistent): after that no run reaches the owner's
 * memory. A writer that died inside a run leaves its count behind; the owner knows it by its
 * pid and does not wait for it (a shared count alone made every close after such a death wait
 * its whole timeout). */
struct gate_page {
    unsigned char token[16];
    int64_t open;
    int64_t active;
    struct gate_slot slots[GATE_SLOTS];
};

#define GATE_BYTES 4096
_Static_assert(sizeof(struct gate_page) <= GATE_BYTES, "the gate fits its page");

/* this process's random half of its writer key (drawn once; a forked child differs by its pid) */
static int64_t writer_nonce;

static int64_t writer_key(void)
{
    while (writer_nonce == 0) {
        uint32_t r = 0;
        if (getrandom(&r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
            struct timespec t; /* no entropy to be had: the clock differs enough between two */
            clock_gettime(CLOCK_MONOTONIC, &t);
            r = (uint32_t)t.tv_nsec;
        }
        writer_nonce = (int64_t)r;
    }
    return ((int64_t)getpid() << 32) | writer_nonce;
}

/* Whether the process that holds ``pid`` is gone (a pid it exited from may be another's by now:
 * then it counts as alive, and its slot is waited for as before). */
static int pid_gone(int64_t key)
{
    pid_t pid = (pid_t)(key >> 32);
    return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

/* The count this process's runs keep in ``g``: its own slot (claimed: a free one, or one whose
 * writer is gone with no run counted), or the shared count when every slot is taken. */
static int64_t *claim_slot(struct gate_page *g)
{
    int64_t me = writer_key();
    for (int i = 0; i < GATE_SLOTS; i++)
        if (__atomic_load_n(&g->slots[i].writer, __ATOMIC_SEQ_CST) == me)
            return &g->slots[i].active;
    for (int i = 0; i < GATE_SLOTS; i++) {
        int64_t w = __atomic_load_n(&g->slots[i].writer, __ATOMIC_SEQ_CST);
        int free = w == 0 ||
                   (__atomic_load_n(&g->slots[i].active, __ATOMIC_SEQ_CST) == 0 && pid_gone(w));
        if (free && __atomic_compare_exchange_n(&g->slots[i].writer, &w, me, 0, __ATOMIC_SEQ_CST,
                                                __ATOMIC_SEQ_CST))
            return &g->slots[i].active;
    }
    return &g->active;
}

/* Whether a run is counted in ``g`` that may still reach its memory (a writer gone is not). */
static int gate_busy(struct gate_page *g)
{
    if (__atomic_load_n(&g->active, __ATOMIC_SEQ_CST) > 0)
        return 1;
    for (int i = 0; i < GATE_SLOTS; i++) {
        if (__atomic_load_n(&g->slots[i].active, __ATOMIC_SEQ_CST) <= 0)
            continue;
        if (!pid_gone(__atomic_load_n(&g->slots[i].writer, __ATOMIC_SEQ_CST)))
            return 1;
    }
    return 0;
}

/* A process of this machine, held by a pidfd: it owns the descriptor and closes it when the last
 * transfer prepared with it is gone, so that a descriptor number is never reused under one. */
typedef struct {
    PyObject_HEAD
    pid_t pid;
    int pidfd;
    uint64_t alive_at; /* CLOCK_MONOTONIC nanoseconds of the last poll that found it alive */
    struct gate_page *gate; /* its gate, mapped here by attach() (NULL: none) */
    int64_t *active;        /* where this process counts its runs in that gate (claim_slot) */
} Process;

typedef struct {
    PyObject_HEAD
    Process *process;
    PyObject *on_error; /* maps the OSError of a failed run to the exception raised, or NULL */
    pid_t pid;
    int pidfd;
    int write;
    Py_ssize_t rows;
    uint64_t nbytes;
    /* the rows merged where adjacent on their side, cut into calls (see merge_rows) */
    struct iovec *local;
    struct iovec *remote;
    struct call *calls;
    Py_ssize_t ncalls;
} Transfer;

/* Raise OSError for ``err``; with ``t``, the exception carries ``moved``: the bytes that went
 * before the kernel stopped. */
static PyObject *raise_errno(int err, const Transfer *t, uint64_t moved)
{
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    if (t == NULL)
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *m = PyLong_FromUnsignedLongLong(moved);
    if (value != NULL && m != NULL)
        PyObject_SetAttrString(value, "moved", m);
    Py_XDECREF(m);
    PyErr_Restore(type, value, tb);
    return NULL;
}

/* The error of a failed run: the OSError of ``err``, or what on_error makes of it. */
static PyObject *fail(const Transfer *t, int err, uint64_t moved)
{
    raise_errno(err, t, moved);
    if (t->on_error == NULL)
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *mapped = value != NULL ? PyObject_CallOneArg(t->on_error, value) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(tb);
    if (mapped == NULL) {
        Py_XDECREF(value);
        return NULL;
    }
    if (!PyExceptionInstance_Check(mapped)) {
        Py_DECREF(mapped);
        Py_DECREF(value);
        return PyErr_Format(PyExc_TypeError, "on_error must return an exception");
    }
    PyException_SetCause(mapped, value); /* steals value */
    PyErr_SetObject((PyObject *)Py_TYPE(mapped), mapped);
    Py_DECREF(mapped);
    return NULL;
}

/* One system call of a transfer: ``nlocal`` iovecs from ``local`` and ``nremote`` from ``remote``
 * (indices into the transfer's merged arrays), ``nbytes`` on each side. */
struct call {
    Py_ssize_t local, nlocal, remote, nremote;
    uint64_t nbytes;
};

/* Append row (base, len) to ``iov`` (``*n`` iovecs so far, ``first`` the call's first): merged
 * into the last iovec of the call when it continues it. Returns whether it took an iovec. */
static int append_row(struct iovec *iov, Py_ssize_t first, Py_ssize_t *n, struct iovec row)
{
    if (*n > first) {
        struct iovec *last = &iov[*n - 1];
        if ((char *)last->iov_base + last->iov_len == (char *)row.iov_base) {
            last->iov_len += row.iov_len;
            return 0;
        }
    }
    iov[(*n)++] = row;
    return 1;
}

/* Merge paired rows ``l`` and ``r`` (``n`` each, equal lengths pair by pair) into runs of
 * adjacent memory on each side independently: a transfer of many small tensors from separate
 * allocations into one flat region is then one remote iovec, which the kernel pins once instead
 * of once a row. The runs are cut into calls of at most ROWS_PER_CALL iovecs a side, at row
 * boundaries, so each call moves the same bytes on both sides. Writes the merged arrays over
 * ``l`` and ``r`` (never longer) and the calls into ``calls`` (at most ``n``); returns their
 * count. */
static Py_ssize_t merge_rows(struct iovec *l, struct iovec *r, Py_ssize_t n, struct call *calls)
{
    Py_ssize_t nl = 0, nr = 0, ncalls = 0;
    struct call *c = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        struct iovec lrow = l[i], rrow = r[i];
        if (c == NULL || c->nlocal == ROWS_PER_CALL || c->nremote == ROWS_PER_CALL) {
            c = &calls[ncalls++];
            c->local = nl;
            c->remote = nr;
            c->nlocal = c->nremote = 0;
            c->nbytes = 0;
        }
        c->nlocal += append_row(l, c->local, &nl, lrow);
        c->nremote += append_row(r, c->remote, &nr, rrow);
        c->nbytes += lrow.iov_len;
    }
    return ncalls;
}

/* rows: a buffer of unsigned 64-bit (address, length) pairs */
static int load_rows(PyObject *obj, struct iovec **out, Py_ssize_t *count, uint64_t *total)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view.len % 16 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "rows must be pairs of unsigned 64-bit words");
        return -1;
    }
    Py_ssize_t n = view.len / 16;
    struct iovec *iov = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(struct iovec));
    if (iov == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    const uint64_t *words = view.buf;
    uint64_t sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        iov[i].iov_base = (void *)(uintptr_t)words[2 * i];
        iov[i].iov_len = (size_t)words[2 * i + 1];
        if (words[2 * i + 1] > (uint64_t)SSIZE_MAX || sum + words[2 * i + 1] < sum) {
            PyMem_Free(iov);
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "a row's length is out of range");
            return -1;
        }
        sum += words[2 * i + 1];
    }
    PyBuffer_Release(&view);
    *out = iov;
    *count = n;
    *total = sum;
    return 0;
}

static void transfer_dealloc(Transfer *self)
{
    PyMem_Free(self->local);
    PyMem_Free(self->remote);
    PyMem_Free(self->calls);
    Py_XDECREF(self->process);
    Py_XDECREF(self->on_error);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ProcessType;

/* Transfer(process, write, local_rows, remote_rows, on_error=None): the i-th local row pairs
 * with the i-th remote row, of the same length. on_error(oserror) returns the exception that a
 * failed run raises instead of the OSError (which becomes its cause). */
static int transfer_init(Transfer *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"process", "write", "local", "remote", "on_error", NULL};
    Process *process;
    int write;
    PyObject *local, *remote, *on_error = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!pOO|O", names, &ProcessType, &process, &write,
                                     &local, &remote, &on_error))
        return -1;
    struct iovec *l = NULL, *r = NULL;
    Py_ssize_t nl, nr;
    uint64_t tl, tr;
    if (load_rows(local, &l, &nl, &tl) < 0)
        return -1;
    if (load_rows(remote, &r, &nr, &tr) < 0) {
        PyMem_Free(l);
        return -1;
    }
    for (Py_ssize_t i = 0; nl == nr && i < nl; i++) {
        if (l[i].iov_len != r[i].iov_len) {
            nr = -1;
            break;
        }
    }
    if (nl != nr) {
        PyMem_Free(l);
        PyMem_Free(r);
        PyErr_SetString(PyExc_ValueError, "local and remote rows must pair up, length for length");
        return -1;
    }
    struct call *calls = PyMem_Calloc(nl > 0 ? (size_t)nl : 1, sizeof(struct call));
    if (calls == NULL) {
        PyMem_Free(l);
        PyMem_Free(r);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t ncalls = merge_rows(l, r, nl, calls);
    PyMem_Free(self->local);
    PyMem_Free(self->remote);
    PyMem_Free(self->calls);
    self->calls = calls;
    self->ncalls = ncalls;
    Py_INCREF(process);
    Py_XSETREF(self->process, process);
    Py_XSETREF(self->on_error, on_error == Py_None ? NULL : Py_NewRef(on_error));
    self->pid = process->pid;
    self->pidfd = process->pidfd;
    self->write = write;
    self->rows = nl;
    self->nbytes = tl;
    self->local = l;
    self->remote = r;
    return 0;
}

/* One transfer of every row. Returns None; raises OSError (errno ESRCH: the process is gone;
 * EFAULT: an address of either side is not mapped; EPERM: not allowed) with ``moved``, the bytes
 * that went before it stopped, or what on_error made of it. */
static PyObject *transfer_run(Transfer *self, PyObject *Py_UNUSED(ignored))
{
    if (self->local == NULL)
        return PyErr_Format(PyExc_RuntimeError, "the transfer was not initialised");
    /* a pidfd turns readable when its process has exited: its pid may then be another's */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    uint64_t now_ns = (uint64_t)now.tv_sec * 1000000000ULL + (uint64_t)now.tv_nsec;
    Process *p = self->process;
    if (now_ns - p->alive_at >= ALIVE_FOR_NS) {
        struct pollfd alive = {self->pidfd, POLLIN, 0};
        if (poll(&alive, 1, 0) != 0)
            return fail(self, ESRCH, 0);
        p->alive_at = now_ns;
    }
    struct gate_page *gate = p->gate;
    if (gate == NULL)
        return PyErr_Format(PyExc_RuntimeError, "the process has no gate attached");
    int64_t *active = p->active;
    __atomic_add_fetch(active, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&gate->open, __ATOMIC_SEQ_CST) != 1) {
        __atomic_sub_fetch(active, 1, __ATOMIC_SEQ_CST);
        return fail(self, ECONNRESET, 0); /* its owner closed its memory */
    }
    int err = 0;
    uint64_t moved = 0;
    PyThreadState *ts = NULL;
    if (self->nbytes >= RELEASE_GIL_BYTES)
        ts = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < self->ncalls && !err; i++) {
        const struct call *c = &self->calls[i];
        struct iovec *l = self->local + c->local, *r = self->remote + c->remote;
        unsigned long nl = (unsigned long)c->nlocal, nr = (unsigned long)c->nremote;
        ssize_t got;
        do {
            got = self->write ? process_vm_writev(self->pid, l, nl, r, nr, 0)
                              : process_vm_readv(self->pid, l, nl, r, nr, 0);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            err = errno;
        } else {
            moved += (uint64_t)got;
            if ((uint64_t)got != c->nbytes)
                err = EFAULT; /* the kernel stops at the first row it cannot reach */
        }
    }
    __atomic_sub_fetch(active, 1, __ATOMIC_SEQ_CST);
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    if (err)
        return fail(self, err, moved);
    Py_RETURN_NONE;
}

static PyObject *transfer_nbytes(Transfer *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->nbytes);
}

static PyObject *transfer_rows(Transfer *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->rows);
}

static PyObject *transfer_calls(Transfer *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->ncalls);
}

static PyObject *transfer_iovecs(Transfer *self, void *Py_UNUSED(closure))
{
    Py_ssize_t l = 0, r = 0;
    for (Py_ssize_t i = 0; i < self->ncalls; i++) {
        l += self->calls[i].nlocal;
        r += self->calls[i].nremote;
    }
    return Py_BuildValue("(nn)", l, r);
}

static PyMethodDef transfer_methods[] = {
    {"run", (PyCFunction)transfer_run, METH_NOARGS,
     "Move every row once; raises OSError (with .moved) when the kernel refuses."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef transfer_getset[] = {
    {"nbytes", (getter)transfer_nbytes, NULL, "bytes moved by one run", NULL},
    {"rows", (getter)transfer_rows, NULL, "paired rows", NULL},
    {"calls", (getter)transfer_calls, NULL, "system calls per run", NULL},
    {"iovecs", (getter)transfer_iovecs, NULL, "(local, remote) iovecs once adjacent rows merged",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TransferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transport._cma.Transfer",
    .tp_basicsize = sizeof(Transfer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A prepared cross-memory transfer with one process, run any number of times.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)transfer_init,
    .tp_dealloc = (destructor)transfer_dealloc,
    .tp_methods = transfer_methods,
    .tp_getset = transfer_getset,
};

/* Process(pid): opens a pidfd on pid (OSError where the process does not exist or the kernel
 * has no pidfds) */
static int process_init(Process *self, PyObject *args, PyObject *kwds)
{
    int pid;
    if (!PyArg_ParseTuple(args, "i", &pid))
        return -1;
    if (pid <= 0) {
        PyErr_SetString(PyExc_ValueError, "pid must be positive");
        return -1;
    }
    if (self->pidfd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "a Process is initialised once");
        return -1;
    }
    long fd = syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->pid = (pid_t)pid;
    self->pidfd = (int)fd;
    return 0;
}

static PyObject *process_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Process *self = (Process *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->pidfd = -1;
    return (PyObject *)self;
}

static void process_dealloc(Process *self)
{
    if (self->gate != NULL)
        munmap(self->gate, GATE_BYTES);
    if (self->pidfd >= 0)
        close(self->pidfd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *process_alive(Process *self, PyObject *Py_UNUSED(ignored))
{
    struct pollfd p = {self->pidfd, POLLIN, 0};
    return PyBool_FromLong(self->pidfd >= 0 && poll(&p, 1, 0) == 0);
}

/* read(address, nbytes) -> bytes: nbytes of the process's memory (the identity probe) */
static PyObject *process_read(Process *self, PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &addr, &n))
        return NULL;
    if (self->pidfd < 0 || n < 0 || n > 4096)
        return PyErr_Format(PyExc_ValueError, "read takes 0 to 4096 bytes of an opened process");
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL)
        return NULL;
    struct iovec l = {PyBytes_AS_STRING(out), (size_t)n};
    struct iovec r = {(void *)(uintptr_t)addr, (size_t)n};
    ssize_t got = process_vm_readv(self->pid, &l, 1, &r, 1, 0);
    if (got < 0 || got != n) {
        int err = got < 0 ? errno : EFAULT;
        Py_DECREF(out);
        return raise_errno(err, NULL, 0);
    }
    return out;
}

/* attach(fd): map the process's gate from ``fd`` (its memfd, opened through /proc); once */
static PyObject *process_attach(Process *self, PyObject *arg)
{
    int fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (self->gate != NULL)
        return PyErr_Format(PyExc_RuntimeError, "a gate is attached once");
    void *page = mmap(NULL, GATE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (page == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    self->gate = page;
    self->active = claim_slot(self->gate);
    Py_RETURN_NONE;
}

/* token() -> the 16 bytes at the head of the attached gate */
static PyObject *process_token(Process *self, PyObject *Py_UNUSED(ignored))
{
    if (self->gate == NULL)
        return PyErr_Format(PyExc_RuntimeError, "no gate attached");
    return PyBytes_FromStringAndSize((const char *)self->gate->token, sizeof(self->gate->token));
}

static PyObject *process_pid(Process *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->pid);
}

static PyMethodDef process_methods[] = {
    {"alive", (PyCFunction)process_alive, METH_NOARGS, "Whether the process has not exited."},
    {"read", (PyCFunction)process_read, METH_VARARGS, "read(address, nbytes) -> its bytes"},
    {"attach", (PyCFunction)process_attach, METH_O, "attach(fd): map its gate from fd"},
    {"token", (PyCFunction)process_token, METH_NOARGS, "the token at the head of its gate"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef process_getset[] = {
    {"pid", (getter)process_pid, NULL, "the process id", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ProcessType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transport._cma.Process",
    .tp_basicsize = sizeof(Process),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A process of this machine, held by a pidfd (closed with the last reference).",
    .tp_new = process_new,
    .tp_init = (initproc)process_init,
    .tp_dealloc = (destructor)process_dealloc,
    .tp_methods = process_methods,
    .tp_getset = process_getset,
};

/* Gate(token): this process's gate (see struct gate_page), in a new memfd, open. */
typedef struct {
    PyObject_HEAD
    int fd;
    struct gate_page *page;
} Gate;

static PyObject *gate_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Gate *self = (Gate *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->fd = -1;
    return (PyObject *)self;
}

static int gate_init(Gate *self, PyObject *args, PyObject *kwds)
{
    Py_buffer token;
    if (!PyArg_ParseTuple(args, "y*", &token))
        return -1;
    if (self->page != NULL || token.len != (Py_ssize_t)sizeof(self->page->token)) {
        PyBuffer_Release(&token);
        PyErr_SetString(PyExc_ValueError, "a Gate is made once, from a 16-byte token");
        return -1;
    }
    int fd = memfd_create("transport-gate", MFD_CLOEXEC);
    void *page = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, GATE_BYTES) == 0)
        page = mmap(NULL, GATE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (page == MAP_FAILED) {
        PyBuffer_Release(&token);
        PyErr_SetFromErrno(PyExc_OSError);
        if (fd >= 0)
            close(fd);
        return -1;
    }
    self->fd = fd;
    self->page = page;
    memcpy(self->page->token, token.buf, sizeof(self->page->token));
    PyBuffer_Release(&token);
    __atomic_store_n(&self->page->open, 1, __ATOMIC_SEQ_CST);
    return 0;
}

static void gate_dealloc(Gate *self)
{
    if (self->page != NULL)
        munmap(self->page, GATE_BYTES);
    if (self->fd >= 0)
        close(self->fd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* shut(timeout) -> bool: no run starts any more; waits (at most timeout seconds, without the
 * interpreter lock) until none is in progress. False: some still were at the deadline. */
static PyObject *gate_shut(Gate *self, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->page == NULL)
        Py_RETURN_TRUE;
    __atomic_store_n(&self->page->open, 0, __ATOMIC_SEQ_CST);
    int busy;
    Py_BEGIN_ALLOW_THREADS
    struct timespec step = {0, 100000}, now; /* polls every 0.1 ms */
    clock_gettime(CLOCK_MONOTONIC, &now);
    double end = (double)now.tv_sec + (double)now.tv_nsec * 1e-9 + timeout;
    while ((busy = gate_busy(self->page))) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)now.tv_sec + (double)now.tv_nsec * 1e-9 >= end)
            break;
        nanosleep(&step, NULL);
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(!busy);
}

static PyObject *gate_fd(Gate *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->fd);
}

static PyObject *gate_address(Gate *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong((uint64_t)(uintptr_t)self->page);
}

static PyMethodDef gate_methods[] = {
    {"shut", (PyCFunction)gate_shut, METH_O, "shut(timeout) -> whether no run was left"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gate_getset[] = {
    {"fd", (getter)gate_fd, NULL, "its memfd (writers open it through /proc)", NULL},
    {"address", (getter)gate_address, NULL, "where its page (the token first) is mapped", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transport._cma.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "This process's gate: a shared page that says whether its memory is open.",
    .tp_new = gate_new,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
};

static PyMethodDef module_methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transport._cma",
    "Cross-memory transfers between processes of one machine (csrc/cma.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__cma(void)
{
    if (PyType_Ready(&TransferType) < 0 || PyType_Ready(&ProcessType) < 0 ||
        PyType_Ready(&GateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Transfer", (PyObject *)&TransferType) < 0 ||
        PyModule_AddObjectRef(m, "Process", (PyObject *)&ProcessType) < 0 ||
        PyModule_AddObjectRef(m, "Gate", (PyObject *)&GateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
