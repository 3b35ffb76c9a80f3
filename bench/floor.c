// Copied unchanged from the project's first probe (floor.c): the bare-driver floor of one
// pool-IPC handoff, run by `poolipc bench --floor` beside our own round trip.
// CEO probe: the physical floor of one pool-IPC handoff round trip, in C on the driver API.
// Parent: pool (POSIX FD, release threshold max) -> alloc -> READY event -> send export blob.
// Child: import (or cached) -> wait READY -> memset in place -> DONE event -> free import -> ACK.
// Parent: recv ACK -> wait DONE to complete. Also: bare Unix-socket ping-pong.
// Build: nvcc -O2 -o floor floor.c -lcuda      Run: ./floor
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_; cuGetErrorName(r_, &n_); \
  fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, n_); exit(2); } } while (0)

static double now_us(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static void xsend(int s, const void *b, size_t n) { if (send(s, b, n, 0) != (ssize_t)n) { perror("send"); exit(3); } }
static void xrecv(int s, void *b, size_t n) { size_t g = 0; while (g < n) { ssize_t r = recv(s, (char *)b + g, n - g, 0); if (r <= 0) { perror("recv"); exit(3); } g += r; } }
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
static double median(double *v, int n) { qsort(v, n, sizeof *v, cmpd); return v[n / 2]; }

static void send_fd(int s, int fd) {
  char c = 'F'; struct iovec io = { &c, 1 }; char cbuf[CMSG_SPACE(sizeof(int))]; memset(cbuf, 0, sizeof cbuf);
  struct msghdr m = { 0 }; m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = cbuf; m.msg_controllen = sizeof cbuf;
  struct cmsghdr *h = CMSG_FIRSTHDR(&m); h->cmsg_level = SOL_SOCKET; h->cmsg_type = SCM_RIGHTS; h->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(h), &fd, sizeof fd); if (sendmsg(s, &m, 0) != 1) { perror("sendmsg"); exit(3); }
}
static int recv_fd(int s) {
  char c; struct iovec io = { &c, 1 }; char cbuf[CMSG_SPACE(sizeof(int))];
  struct msghdr m = { 0 }; m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = cbuf; m.msg_controllen = sizeof cbuf;
  if (recvmsg(s, &m, MSG_CMSG_CLOEXEC) != 1) { perror("recvmsg"); exit(3); }
  int fd; memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof fd); return fd;
}

typedef struct { CUmemPoolPtrExportData blob; size_t size; int op; } Req;
static const char *FREE_MODE = "async", *WAIT_MODE = "stream", *READY_MODE = "wait", *TARGET = "import";
typedef struct { double imp, total; } ChildT;  // op: 1 handoff, 2 ping, 0 quit
enum { N = 2000 };

static void child(int s) {
  CUdevice dev; CUcontext ctx; CUstream st; CUmemoryPool pool;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  int fd = recv_fd(s);
  CK(cuMemPoolImportFromShareableHandle(&pool, (void *)(long)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CUmemAccessDesc d = { { CU_MEM_LOCATION_TYPE_DEVICE, dev }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
  CK(cuMemPoolSetAccess(pool, &d, 1));
  CUipcEventHandle rh, dh; CUevent ready, done;
  xrecv(s, &rh, sizeof rh); CK(cuIpcOpenEventHandle(&ready, rh));
  CK(cuEventCreate(&done, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); CK(cuIpcGetEventHandle(&dh, done));
  xsend(s, &dh, sizeof dh);
  for (;;) {
    Req q; xrecv(s, &q, sizeof q);
    if (q.op == 0) break;
    if (q.op == 2) { xsend(s, &q.op, 1); continue; }
    CUdeviceptr p; double a = now_us();
    CK(cuMemPoolImportPointer(&p, pool, &q.blob));
    double b = now_us();
    if (!strcmp(READY_MODE, "wait")) CK(cuStreamWaitEvent(st, ready, 0));
    static CUdeviceptr own = 0; if (!own) CK(cuMemAlloc(&own, 4096));
    if (strcmp(TARGET, "skip")) CK(cuMemsetD32Async(strcmp(TARGET, "own") ? p : own, 0xABCDABCD, 1024, st));   // write (first 4 KiB)
    CK(cuEventRecord(done, st));
    if (!strcmp(FREE_MODE, "async")) CK(cuMemFreeAsync(p, st));       // UNIMPORT, stream-ordered
    else if (!strcmp(FREE_MODE, "sync")) { CK(cuStreamSynchronize(st)); CK(cuMemFree(p)); }
    ChildT ct = { b - a, now_us() - a }; xsend(s, &ct, sizeof ct);
  }
  exit(0);
}

int main(int argc, char **argv) {
  if (argc > 3) { FREE_MODE = argv[1]; WAIT_MODE = argv[2]; READY_MODE = argv[3]; }
  if (argc > 4) TARGET = argv[4];
  int sv[2]; if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
  pid_t pid = fork();
  if (pid == 0) { close(sv[0]); child(sv[1]); }
  close(sv[1]); int s = sv[0];
  CUdevice dev; CUcontext ctx; CUstream st; CUmemoryPool pool; CUmemPoolProps pp; memset(&pp, 0, sizeof pp);
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED; pp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE; pp.location.id = dev;
  CK(cuMemPoolCreate(&pool, &pp));
  cuuint64_t thr = ~0ULL; CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr));
  int fd; CK(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_fd(s, fd);
  CUevent ready, done; CUipcEventHandle rh, dh;
  CK(cuEventCreate(&ready, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); CK(cuIpcGetEventHandle(&rh, ready));
  xsend(s, &rh, sizeof rh); xrecv(s, &dh, sizeof dh); CK(cuIpcOpenEventHandle(&done, dh));
  static double t[N], ti[N], tc[N], tw[N], te[N];
  Req q; memset(&q, 0, sizeof q);
  q.op = 2;
  for (int i = 0; i < N; i++) { double a = now_us(); char c; xsend(s, &q, sizeof q); xrecv(s, &c, 1); t[i] = now_us() - a; }
  printf("{\"event\": \"uds_ping_pong\", \"bytes\": %zu, \"us_median\": %.2f}\n", sizeof q, median(t, N));
  size_t sizes[] = { 4096, 1 << 20, 64u << 20, 1ull << 30, 4ull << 30 };
  for (int k = 0; k < 5; k++) {
    size_t n = sizes[k]; int reps = n >= (1ull << 30) ? 200 : N;
    double first = 0;
    for (int i = 0; i < reps; i++) {
      CUdeviceptr p; CK(cuMemAllocFromPoolAsync(&p, n, pool, st));      // recycled after the first round
      CK(cuMemsetD32Async(p, 0x11111111, 1024, st));
      CK(cuEventRecord(ready, st));                                       // READY
      double a = now_us();
      q.op = 1; q.size = n; CK(cuMemPoolExportPointer(&q.blob, p));        // EXPORT
      te[i] = now_us() - a;
      xsend(s, &q, sizeof q); ChildT ct; xrecv(s, &ct, sizeof ct);       // ... ACK
      double b = now_us();
      if (!strcmp(WAIT_MODE, "stream")) { CK(cuStreamWaitEvent(st, done, 0)); CK(cuStreamSynchronize(st)); }
      else if (!strcmp(WAIT_MODE, "event")) CK(cuEventSynchronize(done));
      else CK(cuStreamSynchronize(st));
      t[i] = now_us() - a; if (i == 0) first = t[i];
      ti[i] = ct.imp; tc[i] = ct.total; tw[i] = now_us() - b;
      unsigned v; CK(cuMemcpyDtoH(&v, p, 4)); if (!strcmp(TARGET, "import") && v != 0xABCDABCD) { fprintf(stderr, "write not seen\n"); return 4; }
      CK(cuMemFreeAsync(p, st));                                          // RELEASE
    }
    printf("{\"event\": \"handoff_round_trip\", \"free\": \"%s\", \"wait\": \"%s\", \"ready\": \"%s\", \"bytes\": %zu, \"first_us\": %.1f, \"us_median\": %.2f, \"child_import_us\": %.2f, \"child_total_us\": %.2f, \"parent_gate_us\": %.2f, \"export_us\": %.2f, \"target\": \"%s\", \"reps\": %d}\n", FREE_MODE, WAIT_MODE, READY_MODE, n, first, median(t, reps), median(ti, reps), median(tc, reps), median(tw, reps), median(te, reps), TARGET, reps);
  }
  q.op = 0; xsend(s, &q, sizeof q);
  int st_; waitpid(pid, &st_, 0);
  return WIFEXITED(st_) && WEXITSTATUS(st_) == 0 ? 0 : 5;
}
