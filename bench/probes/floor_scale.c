// The bare driver's jobs/s for a tensor lent again, one copy or several at once
// (whether 8 workers under MPS can give 6x one): a parent and a child, no poolipc, the same
// driver calls per job as `poolipc bench --workers` makes for a 4 KiB input whose export and
// import are cached:
//   parent: cuEventRecord(READY, stream) -> send 8 bytes
//   child:  recv -> cuStreamWaitEvent(READY) -> cuMemsetD8Async(input, 4 KiB) ->
//           cuEventRecord(DONE) -> send 8 bytes
//   parent: recv -> cuStreamWaitEvent(stream, DONE)   (no host synchronisation per job)
//   or, with `host`, the parent queries DONE on the host until it completed (as poolipc's
//   parent does for a DONE it gates on) and its stream waits for nothing.
// With `import` it makes the calls poolipc makes per job that the loop above makes once: the
// parent asks the driver for the input's range, pool and buffer id (cuPointerGetAttributes,
// as poolipc places every input), and the child imports the pointer before its wait and
// frees the import (cuMemFreeAsync) after its write, before DONE (no mapping of a worker's
// outlives its job).
// The input is allocated from a POSIX-FD pool and imported by the child once. Waits on the
// socket spin with sched_yield (as poolipc's spin-waits do) or block.
//
// Build: nvcc -O2 -o floor_scale floor_scale.c -lcuda
// Run:   ./floor_scale START_MS [spin|block] [WINDOW_MS] [stream|host] [once|import]
//   START_MS: CLOCK_REALTIME milliseconds at which to start counting (so that copies started
//   together count over the same window); 0: at once. Prints one JSON line.
#include <cuda.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_; cuGetErrorName(r_, &n_); \
  fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, n_); exit(2); } } while (0)

static int SPIN = 1, HOST_DONE = 0, IMPORT = 0;
static double now_s(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static void xsend(int s, const void *b, size_t n) { if (send(s, b, n, 0) != (ssize_t)n) { perror("send"); exit(3); } }
static void xrecv(int s, void *b, size_t n) {
  size_t g = 0;
  while (g < n) {
    ssize_t r = recv(s, (char *)b + g, n - g, SPIN ? MSG_DONTWAIT : 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) { sched_yield(); continue; }
    if (r <= 0) { perror("recv"); exit(3); }
    g += r;
  }
}
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

enum { BYTES = 4096 };

static void child(int s) {
  CUdevice dev; CUcontext ctx; CUstream st; CUmemoryPool pool;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  int fd = recv_fd(s);
  CK(cuMemPoolImportFromShareableHandle(&pool, (void *)(long)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CUmemAccessDesc d = { { CU_MEM_LOCATION_TYPE_DEVICE, dev }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
  CK(cuMemPoolSetAccess(pool, &d, 1));
  CUmemPoolPtrExportData blob; xrecv(s, &blob, sizeof blob);
  CUdeviceptr p = 0; if (!IMPORT) CK(cuMemPoolImportPointer(&p, pool, &blob));
  CUipcEventHandle rh, dh; CUevent ready, done;
  xrecv(s, &rh, sizeof rh); CK(cuIpcOpenEventHandle(&ready, rh));
  CK(cuEventCreate(&done, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); CK(cuIpcGetEventHandle(&dh, done));
  xsend(s, &dh, sizeof dh);
  for (;;) {
    unsigned long long q; xrecv(s, &q, sizeof q);
    if (q == 0) break;
    if (IMPORT) CK(cuMemPoolImportPointer(&p, pool, &blob));
    CK(cuStreamWaitEvent(st, ready, 0));
    CK(cuMemsetD8Async(p, (unsigned char)q, BYTES, st));
    if (IMPORT) CK(cuMemFreeAsync(p, st));
    CK(cuEventRecord(done, st));
    xsend(s, &q, sizeof q);
  }
  CK(cuStreamSynchronize(st));
  if (!IMPORT) CK(cuMemFree(p));
  exit(0);
}

int main(int argc, char **argv) {
  double start = argc > 1 ? atof(argv[1]) / 1e3 : 0;
  if (argc > 2) SPIN = strcmp(argv[2], "block") != 0;
  double window = (argc > 3 ? atof(argv[3]) : 2000) / 1e3;
  if (argc > 4) HOST_DONE = !strcmp(argv[4], "host");
  if (argc > 5) IMPORT = !strcmp(argv[5], "import");
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
  int fd; CK(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_fd(s, fd);
  CUdeviceptr p; CK(cuMemAllocFromPoolAsync(&p, BYTES, pool, st)); CK(cuStreamSynchronize(st));
  CUmemPoolPtrExportData blob; CK(cuMemPoolExportPointer(&blob, p)); xsend(s, &blob, sizeof blob);
  CUevent ready, done; CUipcEventHandle rh, dh;
  CK(cuEventCreate(&ready, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); CK(cuIpcGetEventHandle(&rh, ready));
  xsend(s, &rh, sizeof rh); xrecv(s, &dh, sizeof dh); CK(cuIpcOpenEventHandle(&done, dh));
  unsigned long long q = 0;
  // One job: READY on the parent's stream, the child's turn, DONE back on the parent's stream.
  // With `import`, the query poolipc makes as it places an input: its range, pool and buffer id.
  CUpointer_attribute attrs[4] = { CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                   CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, CU_POINTER_ATTRIBUTE_BUFFER_ID };
  CUdeviceptr base_; size_t size_; CUmemoryPool pool_; unsigned long long id_;
  void *vals[4] = { &base_, &size_, &pool_, &id_ };
#define JOB() do { q++; if (!(q & 0xff)) q++; \
  if (IMPORT) { CK(cuPointerGetAttributes(4, attrs, vals, p)); if (base_ != p || pool_ != pool) { fprintf(stderr, "wrong attributes\n"); exit(6); } } \
  CK(cuEventRecord(ready, st)); xsend(s, &q, sizeof q); \
  unsigned long long a_; xrecv(s, &a_, sizeof a_); \
  if (HOST_DONE) { CUresult q_; while ((q_ = cuEventQuery(done)) == CUDA_ERROR_NOT_READY) sched_yield(); CK(q_); } \
  else CK(cuStreamWaitEvent(st, done, 0)); } while (0)
  for (int i = 0; i < 500; i++) JOB();
  CK(cuStreamSynchronize(st));
  if (start > 0) while (now_s(CLOCK_REALTIME) < start) usleep(100);
  long jobs = 0; double t0 = now_s(CLOCK_MONOTONIC), t = t0;
  while (t - t0 < window) { JOB(); jobs++; if (!(jobs & 15)) t = now_s(CLOCK_MONOTONIC); }
  CK(cuStreamSynchronize(st));
  double secs = now_s(CLOCK_MONOTONIC) - t0;
  unsigned char v; CK(cuMemcpyDtoH(&v, p, 1));
  if (v != (unsigned char)q) { fprintf(stderr, "the child's last write not seen: %u, not %u\n", v, (unsigned char)q); return 4; }
  unsigned long long z = 0; xsend(s, &z, sizeof z);
  int st_; waitpid(pid, &st_, 0);
  printf("{\"event\": \"floor_scale\", \"done\": \"%s\", \"mode\": \"%s\", \"import\": \"%s\", \"jobs\": %ld, \"secs\": %.3f, \"jobs_per_s\": %.0f}\n",
         HOST_DONE ? "host" : "stream", SPIN ? "spin" : "block", IMPORT ? "per job" : "once", jobs, secs, jobs / secs);
  return WIFEXITED(st_) && WEXITSTATUS(st_) == 0 ? 0 : 5;
}
