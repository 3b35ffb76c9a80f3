// The arena copy's round trip on the bare driver, by how the parent copies: where an
// isolated worker's 4 KiB job loses its time against the pool pointer lent again.
//
// The parent owns a VMM allocation (the arena chunk, POSIX FD) that a forked child maps,
// and a source buffer of its own. Each job: the parent copies the source into the chunk
// (or not: `none`, the pool pointer's case), records READY, sends a frame; the child waits
// READY on its stream, writes the block (`touch`) or not (`noop`), records DONE, answers;
// the parent waits for DONE on the host and, for a writable job, copies the block back into
// the source on its stream and synchronizes that stream. The copy's ways:
//
//   none         no copy; READY on the aside stream (the pool pointer lent again)
//   dtod         cuMemcpyDtoDAsync on the job's stream; READY there
//   dtod-wait    the same, then cuStreamQuery until the copy completed; READY aside
//   aside        cuMemcpyDtoDAsync on the aside stream; READY there
//   batch        cuMemcpyBatchAsync, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (a copy
//                engine, where the driver can), on the job's stream; READY there
//   batch-aside  the same on the aside stream; READY there
//   host         through pinned host memory (cuMemcpyDtoHAsync then cuMemcpyHtoDAsync, a
//                copy engine each), on the job's stream; READY there
//   host-aside   the same on the aside stream; READY there
//   2d           cuMemcpy2DAsync device to device (rows of 4 KiB), on the job's stream
//   peer         cuMemcpyPeerAsync, the context to itself, on the job's stream
//   host-split   through pinned host memory in 4 pieces, device to host on the job's stream
//                and host to device on a second stream (the two directions overlap)
//
// The ways that copy aside use a second primed stream of their own, so that `none`, whose
// READY goes on the first, tells whether what they leave behind is the stream's or the GPU's.
//
// The aside stream's last work is a 1 MiB copy through pageable memory (poolipc's
// `warm::aside_stream`: its records run on a copy engine). The copy-back uses the same way
// as the copy in (`batch*`: batch; otherwise cuMemcpyDtoDAsync), on the job's stream.
//
// Build: nvcc -O2 -o arena_copy bench/probes/arena_copy.c -lcuda
// Run:   ./arena_copy            (one JSON line per way, child mode, access and size)
#include <cuda.h>
#include <stdint.h>
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

enum { CHUNK = 64 << 20, N = 1000 };
// op: 1 job (touch: the child writes `bytes`), 0 quit.
typedef struct { int op, touch; size_t bytes; } Req;

static CUdeviceptr map_chunk(CUmemGenericAllocationHandle h, CUdevice dev) {
  CUdeviceptr p; CK(cuMemAddressReserve(&p, CHUNK, 0, 0, 0)); CK(cuMemMap(p, CHUNK, 0, h, 0));
  CUmemAccessDesc d = { { CU_MEM_LOCATION_TYPE_DEVICE, dev }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
  CK(cuMemSetAccess(p, CHUNK, &d, 1)); return p;
}

static void child(int s) {
  CUdevice dev; CUcontext ctx; CUstream st;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  int fd = recv_fd(s);
  CUmemGenericAllocationHandle h;
  CK(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  CUdeviceptr chunk = map_chunk(h, dev);
  CUipcEventHandle rh, dh; CUevent ready, done;
  xrecv(s, &rh, sizeof rh); CK(cuIpcOpenEventHandle(&ready, rh));
  CK(cuEventCreate(&done, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); CK(cuIpcGetEventHandle(&dh, done));
  xsend(s, &dh, sizeof dh);
  for (;;) {
    Req q; xrecv(s, &q, sizeof q);
    if (q.op == 0) break;
    CK(cuStreamWaitEvent(st, ready, 0));
    if (q.touch) CK(cuMemsetD32Async(chunk, 0xABCDABCD, 1024, st));   // its first 4 KiB
    CK(cuEventRecord(done, st));
    xsend(s, &q.op, sizeof q.op);
  }
  exit(0);
}

typedef CUresult (*BatchV1)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *, size_t, size_t *, CUstream);
static BatchV1 batch_fn;

static void *bounce;  // pinned, 1 MiB

static CUcontext g_ctx;
static CUstream g_second;
static CUevent g_piece[4], g_back;

static void copy(const char *way, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream st) {
  if (!strcmp(way, "host-split")) {
    size_t k = n >= 65536 ? 4 : 1, part = n / k;
    for (size_t i = 0; i < k; i++) {
      size_t len = i + 1 == k ? n - part * i : part;
      CK(cuMemcpyDtoHAsync((char *)bounce + part * i, src + part * i, len, st));
      CK(cuEventRecord(g_piece[i], st));
      CK(cuStreamWaitEvent(g_second, g_piece[i], 0));
      CK(cuMemcpyHtoDAsync(dst + part * i, (char *)bounce + part * i, len, g_second));
    }
    CK(cuEventRecord(g_back, g_second));
    CK(cuStreamWaitEvent(st, g_back, 0));
  } else if (!strcmp(way, "2d")) {
    size_t w = n < 4096 ? n : 4096;
    CUDA_MEMCPY2D c; memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE; c.srcDevice = src; c.srcPitch = w;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE; c.dstDevice = dst; c.dstPitch = w;
    c.WidthInBytes = w; c.Height = n / w;
    CK(cuMemcpy2DAsync(&c, st));
  } else if (!strcmp(way, "peer")) {
    CK(cuMemcpyPeerAsync(dst, g_ctx, src, g_ctx, n, st));
  } else if (!strncmp(way, "host", 4)) {
    CK(cuMemcpyDtoHAsync(bounce, src, n, st));
    CK(cuMemcpyHtoDAsync(dst, bounce, n, st));
  } else if (!strncmp(way, "batch", 5)) {
    CUmemcpyAttributes a; memset(&a, 0, sizeof a);
    a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    a.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
    size_t idx = 0, fail = 0;
    CK(batch_fn(&dst, &src, &n, 1, &a, &idx, 1, &fail, st));
  } else {
    CK(cuMemcpyDtoDAsync(dst, src, n, st));
  }
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : N;
  if (reps < 1 || reps > N) reps = N;
  int sv[2]; if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
  pid_t pid = fork();
  if (pid == 0) { close(sv[0]); child(sv[1]); }
  close(sv[1]); int s = sv[0];
  CUdevice dev; CUcontext ctx; CUstream st, aside, aside2;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  int drv = 0; CK(cuDriverGetVersion(&drv));
  CUdriverProcAddressQueryResult qr;
  // The 12.8 entry point (a count of failures at the end), which drivers of 12.8 and later keep.
  if (cuGetProcAddress("cuMemcpyBatchAsync", (void **)&batch_fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &qr) != CUDA_SUCCESS || !batch_fn)
    batch_fn = NULL;
  CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&aside, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&aside2, CU_STREAM_NON_BLOCKING));
  for (int k = 0; k < 2; k++) {  // each aside stream's last work: a 1 MiB copy through pageable memory
    CUstream a = k ? aside2 : aside;
    CUdeviceptr w; CK(cuMemAlloc(&w, 1 << 20)); char *host = malloc(1 << 20); memset(host, 0x5a, 1 << 20);
    CK(cuMemcpyDtoHAsync(host, w, 1 << 20, a)); CK(cuMemcpyHtoDAsync(w, host, 1 << 20, a));
    CK(cuStreamSynchronize(a)); CK(cuMemFree(w)); free(host);
  }
  CK(cuMemHostAlloc(&bounce, 1 << 20, 0));
  g_ctx = ctx;
  CK(cuStreamCreate(&g_second, CU_STREAM_NON_BLOCKING));
  for (int i = 0; i < 4; i++) CK(cuEventCreate(&g_piece[i], CU_EVENT_DISABLE_TIMING));
  CK(cuEventCreate(&g_back, CU_EVENT_DISABLE_TIMING));
  CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, CHUNK, &prop, 0));
  int fd; CK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_fd(s, fd); close(fd);
  CUdeviceptr chunk = map_chunk(h, dev);
  CUdeviceptr src; CK(cuMemAlloc(&src, 1 << 20)); CK(cuMemsetD32(src, 0x11111111, (1 << 20) / 4));
  CUevent ready, done; CUipcEventHandle rh, dh;
  CK(cuEventCreate(&ready, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); CK(cuIpcGetEventHandle(&rh, ready));
  xsend(s, &rh, sizeof rh); xrecv(s, &dh, sizeof dh); CK(cuIpcOpenEventHandle(&done, dh));
  printf("{\"event\": \"arena_copy_start\", \"driver\": %d, \"batch\": %s}\n", drv, batch_fn ? "true" : "false");
  fflush(stdout);
  const char *ways[] = { "none", "host", "host-split", "2d", "peer", "none", "dtod" };
  size_t sizes[] = { 4096, 1 << 20 };
  static double t[N], tc[N];
  for (int pass = 0; pass < 1; pass++)
  for (int touch = 0; touch < 2; touch++)
  for (int rw = 0; rw < 2; rw++)
  for (int k = 0; k < 2; k++)
  for (unsigned w = 0; w < sizeof ways / sizeof *ways; w++) {
    const char *way = ways[w]; size_t n = sizes[k];
    if (!strncmp(way, "batch", 5) && !batch_fn) continue;
    if (!strcmp(way, "none") && rw) continue;  // nothing to copy back
    for (int i = 0; i < reps; i++) {
      double a = now_us();
      CUstream on = st;
      if (!strcmp(way, "none")) on = aside;
      else if (strstr(way, "aside")) { copy(way, chunk, src, n, aside2); on = aside2; }
      else {
        copy(way, chunk, src, n, st);
        if (!strcmp(way, "dtod-wait")) { while (cuStreamQuery(st) == CUDA_ERROR_NOT_READY) {} on = aside; }
      }
      CK(cuEventRecord(ready, on));
      Req q = { 1, touch, n }; xsend(s, &q, sizeof q); int ack; xrecv(s, &ack, sizeof ack);
      CUresult r; while ((r = cuEventQuery(done)) == CUDA_ERROR_NOT_READY) {}
      CK(r);
      double b = now_us();
      if (rw) { copy(way, src, chunk, n, st); CK(cuStreamSynchronize(st)); }
      t[i] = now_us() - a; tc[i] = now_us() - b;
    }
    if (touch && rw) {  // the child's write came back into the source
      unsigned v; CK(cuMemcpyDtoH(&v, src, 4));
      if (v != 0xABCDABCD) { fprintf(stderr, "%s: the write did not come back (%08x)\n", way, v); return 4; }
      CK(cuMemsetD32(src, 0x11111111, (1 << 20) / 4));
    }
    printf("{\"event\": \"arena_copy\", \"pass\": %d, \"way\": \"%s\", \"child\": \"%s\", \"access\": \"%s\", \"bytes\": %zu, \"us_median\": %.1f, \"copy_back_us\": %.1f, \"reps\": %d}\n",
           pass, way, touch ? "touch" : "noop", rw ? "rw" : "ro", n, median(t, reps), median(tc, reps), reps);
    fflush(stdout);
  }
  Req q = { 0, 0, 0 }; xsend(s, &q, sizeof q);
  int st_; waitpid(pid, &st_, 0);
  return WIFEXITED(st_) && WEXITSTATUS(st_) == 0 ? 0 : 5;
}
