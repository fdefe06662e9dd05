/* A pool of worker threads for CPU kernels, as a queue of jobs: kernels rendered with an `<name>_entry(void **args, long lo, long hi)` wrapper
   are submitted without waiting for them (see CPUProgram: the Python that builds and schedules the next kernels runs
   while these do) and split into chunks that worker threads and any thread waiting on the queue claim from a shared
   ticket (the current job's number and its next chunk). Jobs run one after another in submission order, each only
   once the one before has finished, so a kernel sees everything the kernels before it wrote. Workers spin for about
   10 us when there is nothing to claim (kernels of a step follow each other within microseconds), then yield the
   core a while and sleep: spinning longer would take the core from other processes (two test workers on two cores
   ran 2.5x slower with ~150 us of spinning). While jobs come in a burst (a realize loop: ~100-300 us of Python
   between kernels) they keep yielding for 500 us instead of 30: a sleeping worker takes ~50 us to wake, a yielding
   one gives its core to any other runnable thread at once. A thread waiting for a job claims its chunks too: a worker
   the OS doesn't run in time (another process's threads spinning on the other core) costs that chunk's time, not the
   scheduler's next tick (4 ms, measured after a numpy matmul: OpenBLAS's threads spin for ~0.1 s).
   A job submitted with a record array (PROFILE) gets, per chunk, the thread that ran it and when (fg_clock_ns): the
   chunk writes its own three slots, and the submitter reads them once the job has finished (fg_finished's release
   orders the writes before). Without one, a chunk costs one more test of a pointer. A timeline (fg_trace_start) records
   every chunk any thread runs, of any job, until it is full or stopped: (job number, chunk, lane, start ns, end ns). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
typedef void (*fg_entry)(void **, long, long);
#define FG_MAX_WORKERS 255
#define FG_QUEUE 64            /* jobs queued or running at once: a submit beyond waits for the oldest */
#define FG_SPIN 300            /* pauses (about 10 us), then yields to other runnable threads for */
#define FG_YIELD_NS 30000L     /* 30 us, or when jobs come in a burst (this one began within FG_HOT_GAP_NS of */
#define FG_HOT_YIELD_NS 500000L /* the end of the one before) 500 us, then sleep */
#define FG_HOT_GAP_NS 1000000L
/* help: whether threads waiting on the queue may run its chunks (not for chunks so long that the waiting thread, the
   caller's, should stay free to take a Ctrl-C: those are the workers' alone) */
/* rec: NULL, or 3 * n longs: chunk i writes (its thread's lane, start ns, end ns) at rec + 3 * i */
typedef struct { fg_entry fn; void **args; long size; long n; int help; long *rec; } fg_job;
static fg_job fg_q[FG_QUEUE];
static pthread_mutex_t fg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fg_cv = PTHREAD_COND_INITIALIZER;       /* sleeping workers wait here for a job to begin */
static pthread_cond_t fg_done_cv = PTHREAD_COND_INITIALIZER;  /* sleeping waiters wait here for a job to end */
/* jobs ever submitted and ever finished: jobs fg_finished .. fg_submitted - 1 are queued, the first one running */
atomic_ulong fg_submitted, fg_finished;
/* (running job's number << 32) | its next unclaimed chunk. Before the first job begins it names job 0 with no chunk
   left: a worker spinning then must not claim job 0's chunks as soon as its slot is written, before fg_begin resets
   the ticket and the chunk count (chunk 0 would run twice, and the job end before its last chunk has run) */
static atomic_ulong fg_ticket = 0xffffffffUL;
static atomic_long fg_left;      /* chunks of the running job not finished yet */
static atomic_int fg_hot;        /* the running job began within FG_HOT_GAP_NS of the end of the one before */
static long fg_last_ns;          /* when the last job ended */
static int fg_workers, fg_sleepers, fg_waiters, fg_atfork;
static __thread long fg_lane;    /* a worker's number (1, 2, ...) in chunk records; 0 on any other thread */
static inline void fg_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}
static inline long fg_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}
/* the clock of chunk records, for Python to compare with its own */
long fg_clock_ns(void) { return fg_now_ns(); }
/* job j becomes the running one (fg_mu held) */
static void fg_begin(unsigned long j) {
  atomic_store_explicit(&fg_left, fg_q[j % FG_QUEUE].n, memory_order_relaxed);
  atomic_store_explicit(&fg_hot, fg_now_ns() - fg_last_ns < FG_HOT_GAP_NS, memory_order_relaxed);
  atomic_store_explicit(&fg_ticket, (j & 0xffffffffUL) << 32, memory_order_release);
  if (fg_sleepers) pthread_cond_broadcast(&fg_cv);
}
/* the running job's last chunk is done: the next queued one begins */
static void fg_finish(void) {
  pthread_mutex_lock(&fg_mu);
  unsigned long next = atomic_load(&fg_finished) + 1;
  atomic_store_explicit(&fg_finished, next, memory_order_release);
  fg_last_ns = fg_now_ns();
  if (atomic_load(&fg_submitted) > next) fg_begin(next);
  if (fg_waiters) pthread_cond_broadcast(&fg_done_cv);
  pthread_mutex_unlock(&fg_mu);
}
/* whether the running job has a chunk left to claim. (The slot may be refilled for a later job only after the ticket
   moved past it; a stale answer costs one more look) */
static inline int fg_claimable(void) {
  unsigned long t = atomic_load_explicit(&fg_ticket, memory_order_acquire);
  return (long)(t & 0xffffffffUL) < fg_q[(t >> 32) % FG_QUEUE].n;
}
/* the same for a waiting thread: a chunk of a job that takes help (or no worker exists to run it) */
static inline int fg_claimable_by_waiter(void) {
  unsigned long t = atomic_load_explicit(&fg_ticket, memory_order_acquire);
  fg_job *job = &fg_q[(t >> 32) % FG_QUEUE];
  return (long)(t & 0xffffffffUL) < job->n && (job->help || __atomic_load_n(&fg_workers, __ATOMIC_RELAXED) == 0);
}
/* claim and run chunks of the running job, and of the ones after it, until none is left to claim (with `only` >= 0:
   only chunks of job number `only`; with `until` > 0: no new claim once fg_now_ns() has passed it; a waiting thread,
   `waiter`, claims no chunk of a job that doesn't take help while a worker exists); returns how many this thread ran.
   A claim succeeds only while the ticket still names the job, and the job can't finish while a claimed chunk runs,
   so its function and arguments stay valid */
/* the timeline: NULL, or room for fg_trace_cap records of 5 longs; fg_trace_n counts the records claimed (those past
   the capacity are not written) */
static _Atomic(long *) fg_trace;
static long fg_trace_cap;
static atomic_long fg_trace_n;
/* record every chunk run from now on into `buf` (room for `cap` records), or stop (`buf` NULL); returns the records
   written since the last start */
long fg_trace_start(long *buf, long cap) {
  long n = atomic_load(&fg_trace_n), had = fg_trace_cap;
  atomic_store(&fg_trace, (long *)0);
  fg_trace_cap = cap;
  atomic_store(&fg_trace_n, 0);
  if (buf) atomic_store(&fg_trace, buf);
  return n < had ? n : had;
}
static int fg_claim_of(long only, long until, int waiter) {
  int ran = 0;
  for (;;) {
    if (until > 0 && fg_now_ns() >= until) return ran;
    unsigned long t = atomic_load_explicit(&fg_ticket, memory_order_acquire);
    unsigned long i = t & 0xffffffffUL;
    if (only >= 0 && (t >> 32) != ((unsigned long)only & 0xffffffffUL)) return ran;
    fg_job *job = &fg_q[(t >> 32) % FG_QUEUE];
    long n = job->n;
    if ((long)i >= n) return ran;
    if (waiter && !job->help && __atomic_load_n(&fg_workers, __ATOMIC_RELAXED) > 0) return ran;
    if (!atomic_compare_exchange_weak_explicit(&fg_ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
      continue;
    long *rec = job->rec, *tr = atomic_load_explicit(&fg_trace, memory_order_relaxed);
    long st = rec || tr ? fg_now_ns() : 0;
    job->fn(job->args, job->size * (long)i / n, job->size * (long)(i + 1) / n);
    if (rec) { rec[3 * i] = fg_lane; rec[3 * i + 1] = st; rec[3 * i + 2] = fg_now_ns(); }
    if (tr) {
      long k = atomic_fetch_add_explicit(&fg_trace_n, 1, memory_order_relaxed);
      if (k < fg_trace_cap) {
        long *r = tr + 5 * k;
        r[0] = (long)(t >> 32); r[1] = (long)i; r[2] = fg_lane; r[3] = st; r[4] = fg_now_ns();
      }
    }
    ran++;
    if (atomic_fetch_sub_explicit(&fg_left, 1, memory_order_acq_rel) == 1) fg_finish();
  }
}
static int fg_claim(void) { return fg_claim_of(-1, 0, 0); }
static void *fg_worker(void *arg) {
  fg_lane = (long)arg;
  for (;;) {
    long yield_until = 0;
    for (int spin = 0; !fg_claimable(); spin++) {
      if (spin < FG_SPIN) { fg_relax(); continue; }
      if (spin == FG_SPIN) yield_until = fg_now_ns() + (atomic_load(&fg_hot) ? FG_HOT_YIELD_NS : FG_YIELD_NS);
      if ((spin & 15) || fg_now_ns() < yield_until) { sched_yield(); continue; }
      pthread_mutex_lock(&fg_mu);
      fg_sleepers++;
      while (!fg_claimable()) pthread_cond_wait(&fg_cv, &fg_mu);
      fg_sleepers--;
      pthread_mutex_unlock(&fg_mu);
    }
    fg_claim();
  }
  return 0;
}
/* until `count` jobs have finished, claiming their chunks too; returns 1. With `ns` >= 0, returns 0 once about `ns`
   nanoseconds have passed (after the chunk this thread runs, if any), so the caller can look at signals and wait on */
int fg_pool_wait(unsigned long count, long ns) {
  struct timespec until = {0, 0};
  long deadline = 0;
  if (ns >= 0) {
    deadline = fg_now_ns() + ns;
    clock_gettime(CLOCK_REALTIME, &until);   /* (pthread_cond_timedwait's clock) */
    until.tv_sec += ns / 1000000000L;
    until.tv_nsec += ns % 1000000000L;
    if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
  }
  for (int spin = 0; atomic_load_explicit(&fg_finished, memory_order_acquire) < count; spin++) {
    if (ns >= 0 && fg_now_ns() >= deadline) return 0;
    if (fg_claim_of(-1, deadline, 1)) { spin = 0; continue; }
    if (spin < FG_SPIN) { fg_relax(); continue; }
    /* every chunk is claimed and the one running is long: sleep until a job ends (no core spent on waiting) */
    pthread_mutex_lock(&fg_mu);
    fg_waiters++;
    if (atomic_load(&fg_finished) < count && !fg_claimable_by_waiter()) {
      if (ns < 0) pthread_cond_wait(&fg_done_cv, &fg_mu);
      else pthread_cond_timedwait(&fg_done_cv, &fg_mu, &until);
    }
    fg_waiters--;
    pthread_mutex_unlock(&fg_mu);
  }
  return 1;
}
/* a forked child has none of the parent's threads: no workers, and locks and condition variables that no thread
   holds or waits on (the parent waits for its queue to drain before forking, so no job is left half done) */
static void fg_forget_workers(void) {
  fg_workers = fg_sleepers = fg_waiters = 0;
  pthread_mutex_init(&fg_mu, 0);
  pthread_cond_init(&fg_cv, 0);
  pthread_cond_init(&fg_done_cv, 0);
}
/* at least `workers` worker threads (fg_mu held) */
static void fg_spawn(int workers) {
  if (workers > FG_MAX_WORKERS) workers = FG_MAX_WORKERS;
  if (!fg_atfork) { pthread_atfork(0, 0, fg_forget_workers); fg_atfork = 1; }
  /* 8 MiB of stack whatever the process's stack limit: a kernel's packed blocks live on it (up to 512 KiB) */
  pthread_attr_t attr;
  int inited = pthread_attr_init(&attr) == 0;
  int sized = inited && pthread_attr_setstacksize(&attr, 8 << 20) == 0;
  while (fg_workers < workers) {
    pthread_t t;
    if (pthread_create(&t, sized ? &attr : 0, fg_worker, (void *)(long)(fg_workers + 1))) break;  /* fewer workers: waiting threads run the chunks */
    pthread_detach(t);
    __atomic_store_n(&fg_workers, fg_workers + 1, __ATOMIC_RELAXED);  /* (read by waiters without the lock) */
  }
  if (inited) pthread_attr_destroy(&attr);
}
static long fg_chunks(long n, long size) {
  if (n < 1) n = 1;
  return n > size ? (size > 0 ? size : 1) : n;
}
/* queue fn(args, lo, hi) over [0, size) in n chunks, with at least `workers` worker threads; returns the job count
   at which it has finished (for fg_pool_wait). With `join`, a job that runs at once (nothing queued ahead of it) gets
   chunks run by the caller too, until none is left to claim. `help`: whether waiting threads may run its chunks.
   `rec`: NULL, or room for each chunk's record (see fg_job) */
unsigned long fg_pool_submit(fg_entry fn, void **args, long size, long n, int workers, int join, int help,
                             long *rec) {
  n = fg_chunks(n, size);
  pthread_mutex_lock(&fg_mu);
  unsigned long j;
  while ((j = atomic_load(&fg_submitted)) - atomic_load(&fg_finished) >= FG_QUEUE) {
    pthread_mutex_unlock(&fg_mu);
    fg_pool_wait(j - FG_QUEUE + 1, -1);  /* the queue is full: help with its oldest job */
    pthread_mutex_lock(&fg_mu);
  }
  fg_spawn(workers);
  fg_q[j % FG_QUEUE] = (fg_job){fn, args, size, n, help, rec};
  atomic_store_explicit(&fg_submitted, j + 1, memory_order_release);
  int now = atomic_load(&fg_finished) == j;
  if (now) fg_begin(j);  /* nothing ahead of it: it runs now */
  pthread_mutex_unlock(&fg_mu);
  if (now && join && help) fg_claim_of((long)j, 0, 1);
  return j + 1;
}
/* queue `count` jobs under one lock (a TinyJit replay's kernels, without a return to Python between them): job k is
   fns[k](args + offsets[k], lo, hi) over [0, sizes[k]) in chunks[k] chunks, help[k] as for fg_pool_submit, none
   joined; returns the job count at which the last one has finished */
unsigned long fg_pool_submit_many(long count, const fg_entry *fns, void **args, const long *offsets, const long *sizes,
                                  const long *chunks, const int *help, int workers) {
  unsigned long end = atomic_load(&fg_submitted);
  for (long first = 0; first < count; first += FG_QUEUE) {
    long m = count - first < FG_QUEUE ? count - first : FG_QUEUE;
    pthread_mutex_lock(&fg_mu);
    unsigned long j;
    while ((j = atomic_load(&fg_submitted)) + m - atomic_load(&fg_finished) > FG_QUEUE) {
      pthread_mutex_unlock(&fg_mu);
      fg_pool_wait(j + m - FG_QUEUE, -1);  /* room for all of them: help with the oldest jobs */
      pthread_mutex_lock(&fg_mu);
    }
    fg_spawn(workers);
    for (long k = first; k < first + m; k++)
      fg_q[(j + k - first) % FG_QUEUE] = (fg_job){fns[k], args + offsets[k], sizes[k], fg_chunks(chunks[k], sizes[k]),
                                                  help[k], 0};
    end = j + m;
    atomic_store_explicit(&fg_submitted, end, memory_order_release);
    if (atomic_load(&fg_finished) == j) fg_begin(j);  /* nothing ahead of them: the first runs now */
    pthread_mutex_unlock(&fg_mu);
  }
  return end;
}
/* fg_pool_submit_many, then fg_pool_wait(end, ns): a caller that reads the results at once (a TinyJit replay whose
   outputs are copied out) claims the jobs' chunks as soon as they are queued, without a return to Python between.
   The caller sees whether they have finished in fg_finished (not after `ns` nanoseconds) */
unsigned long fg_pool_submit_many_wait(long count, const fg_entry *fns, void **args, const long *offsets,
                                       const long *sizes, const long *chunks, const int *help, int workers, long ns) {
  unsigned long end = fg_pool_submit_many(count, fns, args, offsets, sizes, chunks, help, workers);
  fg_pool_wait(end, ns);
  return end;
}
/* run `count` jobs (as for fg_pool_submit_many) on the calling thread, each whole, once the queue has drained */
void fg_run_many(long count, const fg_entry *fns, void **args, const long *offsets, const long *sizes) {
  unsigned long all = atomic_load(&fg_submitted);
  if (atomic_load_explicit(&fg_finished, memory_order_acquire) < all) fg_pool_wait(all, -1);
  for (long k = 0; k < count; k++) fns[k](args + offsets[k], 0, sizes[k]);
}
