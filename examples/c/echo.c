/*
 * Sluice from C: an echo server and a client in two processes.
 *
 * The process forks (before its first call into the library, which starts threads). The child
 * listens, tells the parent its address through a pipe(2), and echoes every message back: the
 * same metadata and payloads, and the received tensors themselves, lent to the reply without a
 * copy until it has been sent. The parent connects, sends a message with a float tensor of
 * 1 << 20 elements and a payload, receives the echo and checks every byte, several rounds, then
 * prints the round-trip times and "ok".
 *
 * Build and run: scripts/c-example.sh. Exits 0 on success, nonzero (with sluice_last_error())
 * on any failure.
 */
#define _POSIX_C_SOURCE 200809L

#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sluice.h"

#define ELEMENTS (1 << 20)
#define ROUNDS 10
#define PAYLOAD "a small payload beside the tensor"

static int failed(const char *who, const char *what, int rc) {
  fprintf(stderr, "%s: %s failed: %s: %s\n", who, what, sluice_status_name(rc), sluice_last_error());
  return 1;
}

/* ---- server ----------------------------------------------------------------------------- */

/* A received message kept alive while the echo borrows its tensors: freed by the last release. */
struct held {
  sluice_received *received;
  atomic_int refs;
};

static void release_held(void *user) {
  struct held *h = user;
  if (atomic_fetch_sub(&h->refs, 1) == 1) {
    sluice_received_free(h->received);
    free(h);
  }
}

/* The reply to `r`: its metadata, payloads and tensors (borrowed from `r`). Takes `r`. */
static int echo_of(sluice_received *r, sluice_message **out) {
  const uint8_t *data;
  size_t len;
  sluice_message *m;
  struct held *h = malloc(sizeof *h);
  int rc;
  if (h == NULL) {
    sluice_received_free(r);
    return SLUICE_IO;
  }
  h->received = r;
  atomic_init(&h->refs, 1); /* our own reference, dropped at the end */
  rc = sluice_message_new(&m);
  if (rc == SLUICE_OK) rc = sluice_received_metadata(r, &data, &len);
  if (rc == SLUICE_OK) rc = sluice_message_set_metadata(m, data, len);
  for (size_t i = 0; rc == SLUICE_OK && i < sluice_received_payload_count(r); i++) {
    rc = sluice_received_payload(r, i, &data, &len);
    if (rc == SLUICE_OK) rc = sluice_message_add_payload(m, data, len);
  }
  for (size_t i = 0; rc == SLUICE_OK && i < sluice_received_tensor_count(r); i++) {
    DLTensor t;
    rc = sluice_received_tensor(r, i, &t);
    if (rc != SLUICE_OK) break;
    atomic_fetch_add(&h->refs, 1);
    rc = sluice_message_add_tensor(m, &t, release_held, h);
    if (rc != SLUICE_OK) atomic_fetch_sub(&h->refs, 1); /* not taken: no release will come */
  }
  if (rc != SLUICE_OK) {
    sluice_message_free(m); /* NULL-safe */
    m = NULL;
  }
  release_held(h);
  *out = m;
  return rc;
}

static int serve(int report_fd) {
  sluice_context *ctx = NULL;
  sluice_listener *listener = NULL;
  sluice_pipe *pipe = NULL;
  int rc, result = 1;
  size_t echoed = 0;

  if ((rc = sluice_context_new(NULL, NULL, &ctx)) != SLUICE_OK) return failed("server", "context", rc);
  if ((rc = sluice_listen(ctx, "127.0.0.1:0", &listener)) != SLUICE_OK) {
    failed("server", "listen", rc);
    goto out;
  }
  const char *address = sluice_listener_address(listener);
  size_t n = strlen(address) + 1;
  if (write(report_fd, address, n) != (ssize_t)n) {
    perror("server: reporting the address");
    goto out;
  }
  close(report_fd);
  if ((rc = sluice_listener_accept(listener, &pipe)) != SLUICE_OK) {
    failed("server", "accept", rc);
    goto out;
  }
  for (;;) {
    sluice_received *r;
    sluice_message *reply;
    rc = sluice_pipe_read(pipe, &r);
    if (rc == SLUICE_PEER_LOST) break; /* the client is done */
    if (rc != SLUICE_OK) {
      failed("server", "read", rc);
      goto out;
    }
    if ((rc = echo_of(r, &reply)) != SLUICE_OK) {
      failed("server", "building the echo", rc);
      goto out;
    }
    if ((rc = sluice_pipe_write_sync(pipe, reply)) != SLUICE_OK) {
      failed("server", "write", rc);
      goto out;
    }
    echoed++;
  }
  result = echoed == ROUNDS ? 0 : 1;
  if (result) fprintf(stderr, "server: echoed %zu messages, expected %d\n", echoed, ROUNDS);
out:
  sluice_pipe_free(pipe);
  sluice_listener_free(listener);
  sluice_context_free(ctx);
  return result;
}

/* ---- client ----------------------------------------------------------------------------- */

static void count_release(void *user) { atomic_fetch_add((atomic_int *)user, 1); }

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Checks the echo of round `round`: every byte of metadata, payload and tensor. */
static int check_echo(sluice_received *r, int round, const float *sent) {
  char expected[32];
  const uint8_t *data;
  size_t len;
  DLTensor t;
  int rc;
  snprintf(expected, sizeof expected, "round %d", round);
  if ((rc = sluice_received_metadata(r, &data, &len)) != SLUICE_OK) return failed("client", "metadata", rc);
  if (len != strlen(expected) || memcmp(data, expected, len) != 0) {
    fprintf(stderr, "client: round %d: wrong metadata\n", round);
    return 1;
  }
  if (sluice_received_payload_count(r) != 1 || sluice_received_tensor_count(r) != 1) {
    fprintf(stderr, "client: round %d: %zu payloads and %zu tensors, expected 1 and 1\n", round,
            sluice_received_payload_count(r), sluice_received_tensor_count(r));
    return 1;
  }
  if ((rc = sluice_received_payload(r, 0, &data, &len)) != SLUICE_OK) return failed("client", "payload", rc);
  if (len != sizeof PAYLOAD || memcmp(data, PAYLOAD, len) != 0) {
    fprintf(stderr, "client: round %d: wrong payload\n", round);
    return 1;
  }
  if ((rc = sluice_received_tensor(r, 0, &t)) != SLUICE_OK) return failed("client", "tensor", rc);
  if (t.device.device_type != kDLCPU || t.ndim != 1 || t.shape[0] != ELEMENTS || t.strides[0] != 1 ||
      t.dtype.code != kDLFloat || t.dtype.bits != 32 || t.dtype.lanes != 1) {
    fprintf(stderr, "client: round %d: wrong tensor description\n", round);
    return 1;
  }
  const uint8_t *got = (const uint8_t *)t.data + t.byte_offset;
  const uint8_t *want = (const uint8_t *)sent;
  for (size_t i = 0; i < (size_t)ELEMENTS * sizeof(float); i++) {
    if (got[i] != want[i]) {
      fprintf(stderr, "client: round %d: tensor byte %zu is %u, expected %u\n", round, i, got[i], want[i]);
      return 1;
    }
  }
  return 0;
}

static int client(const char *address) {
  sluice_context *ctx = NULL;
  sluice_pipe *pipe = NULL;
  atomic_int released;
  double rtt[ROUNDS];
  int rc, result = 1, round = 0;
  float *values = malloc((size_t)ELEMENTS * sizeof(float));
  int64_t shape[1] = {ELEMENTS};
  DLTensor tensor = {
      .data = values,
      .device = {.device_type = kDLCPU, .device_id = 0},
      .ndim = 1,
      .dtype = {.code = kDLFloat, .bits = 32, .lanes = 1},
      .shape = shape,
      .strides = NULL,
      .byte_offset = 0,
  };

  atomic_init(&released, 0);
  if (values == NULL) return 1;
  for (int i = 0; i < ELEMENTS; i++) values[i] = (float)i * 0.25f - 1000.0f;
  if ((rc = sluice_context_new(NULL, NULL, &ctx)) != SLUICE_OK) {
    failed("client", "context", rc);
    goto out;
  }
  if ((rc = sluice_connect(ctx, address, &pipe)) != SLUICE_OK) {
    failed("client", "connect", rc);
    goto out;
  }
  printf("connected to %s over %s, CPU tensors by %s\n", address, sluice_pipe_transport(pipe),
         sluice_pipe_channel(pipe));

  for (round = 0; round < ROUNDS; round++) {
    char metadata[32];
    sluice_message *m = NULL;
    sluice_op *op = NULL;
    sluice_received *r = NULL;
    int len = snprintf(metadata, sizeof metadata, "round %d", round);
    double start = now_us();
    rc = sluice_message_new(&m);
    if (rc == SLUICE_OK) rc = sluice_message_set_metadata(m, (const uint8_t *)metadata, (size_t)len);
    if (rc == SLUICE_OK) rc = sluice_message_add_payload(m, (const uint8_t *)PAYLOAD, sizeof PAYLOAD);
    if (rc == SLUICE_OK) rc = sluice_message_add_tensor(m, &tensor, count_release, &released);
    if (rc != SLUICE_OK) {
      sluice_message_free(m);
      failed("client", "building the message", rc);
      goto out;
    }
    /* The write completes once the server has the bytes; read the echo meanwhile. */
    if ((rc = sluice_pipe_write_start(pipe, m, &op)) != SLUICE_OK) {
      failed("client", "write", rc);
      goto out;
    }
    rc = sluice_pipe_read(pipe, &r);
    if (rc != SLUICE_OK) {
      sluice_op_free(op);
      failed("client", "read", rc);
      goto out;
    }
    /* The write's eventfd is readable by now (as it would be in an epoll loop). */
    struct pollfd pfd = {.fd = sluice_op_fd(op), .events = POLLIN};
    if (pfd.fd < 0 || poll(&pfd, 1, 10000) != 1) {
      fprintf(stderr, "client: the write's eventfd did not become readable: %s\n", sluice_last_error());
      sluice_op_free(op);
      sluice_received_free(r);
      goto out;
    }
    rc = sluice_op_test(op);
    sluice_op_free(op);
    rtt[round] = now_us() - start;
    if (rc != SLUICE_OK) {
      sluice_received_free(r);
      failed("client", "the write", rc);
      goto out;
    }
    int bad = check_echo(r, round, values);
    sluice_received_free(r);
    if (bad) goto out;
  }
  result = 0;
out:
  sluice_pipe_free(pipe);
  sluice_context_free(ctx);
  if (result == 0 && atomic_load(&released) != ROUNDS) {
    fprintf(stderr, "client: %d tensors released, expected %d\n", atomic_load(&released), ROUNDS);
    result = 1;
  }
  if (result == 0) {
    double best = rtt[0], sum = 0;
    for (int i = 0; i < ROUNDS; i++) {
      if (rtt[i] < best) best = rtt[i];
      sum += rtt[i];
    }
    printf("round trip of %d MiB + payload: first %.0f us, best %.0f us, mean %.0f us over %d rounds\n",
           (int)(ELEMENTS * sizeof(float) >> 20), rtt[0], best, sum / ROUNDS, ROUNDS);
  }
  free(values);
  return result;
}

/* ---- main ------------------------------------------------------------------------------- */

int main(void) {
  int fds[2], status = -1;
  char address[256];
  size_t got = 0;

  alarm(60); /* a watchdog: a hang is a failure */
  if (pipe(fds) != 0) {
    perror("pipe");
    return 1;
  }
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return 1;
  }
  if (pid == 0) {
    close(fds[0]);
    _exit(serve(fds[1]));
  }
  close(fds[1]);
  for (;;) {
    ssize_t n = read(fds[0], address + got, sizeof address - 1 - got);
    if (n <= 0) break;
    got += (size_t)n;
  }
  close(fds[0]);
  address[got] = '\0';
  int result;
  if (got == 0 || address[got - 1] != '\0') {
    fprintf(stderr, "client: the server did not report its address\n");
    result = 1;
  } else {
    result = client(address);
  }
  if (result != 0) kill(pid, SIGTERM);
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "server: did not exit cleanly (status %d)\n", status);
    result = 1;
  }
  if (result == 0) printf("ok\n");
  return result;
}
