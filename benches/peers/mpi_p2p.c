/*
 * OpenMPI point-to-point between two ranks, for `sluice bench peers`: for each size, a
 * ping-pong round trip (p50, p99; the pattern of OSU's osu_latency) and windowed one-way
 * streaming bandwidth (osu_bw: a window of nonblocking sends, then a one-byte reply), each for
 * a time budget. Rank 0 prints one JSON object per result, in the record format of
 * `sluice bench --json` (suite "peer").
 *
 *   mpicc -O2 -o mpi_p2p mpi_p2p.c
 *   mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_p2p BUDGET_MS SIZE [SIZE...]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SAMPLES 200000
#define WINDOW_MAX 64

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Whether rank 0's clock says the budget is spent; every rank learns the same answer. */
static int spent(double start, double budget, long done, long at_least) {
    int stop = 0;
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) stop = done >= at_least && MPI_Wtime() - start >= budget;
    MPI_Bcast(&stop, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return stop;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world != 2 || argc < 3) {
        if (rank == 0) fprintf(stderr, "usage: mpirun -np 2 %s BUDGET_MS SIZE [SIZE...]\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    double budget = atof(argv[1]) / 1000.0;
    size_t largest = 1;
    for (int a = 2; a < argc; a++) {
        size_t n = strtoull(argv[a], NULL, 10);
        if (n > largest) largest = n;
    }
    char *buf = malloc(largest);
    double *samples = malloc(sizeof(double) * MAX_SAMPLES);
    if (!buf || !samples) MPI_Abort(MPI_COMM_WORLD, 3);
    memset(buf, 7, largest);
    int peer = 1 - rank;
    for (int a = 2; a < argc; a++) {
        size_t n = strtoull(argv[a], NULL, 10);
        /* Round trips, timed one by one, as Sluice's are: percentiles of single round trips on
           both sides (the clock's two reads are in every row alike). */
        long count = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        while (count < MAX_SAMPLES && !spent(start, budget, count, 5)) {
            double t0 = MPI_Wtime();
            if (rank == 0) {
                MPI_Send(buf, (int)n, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
                MPI_Recv(buf, (int)n, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, (int)n, MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, (int)n, MPI_BYTE, peer, 0, MPI_COMM_WORLD);
            }
            samples[count++] = MPI_Wtime() - t0;
        }
        /* The first round trip warms buffers and the shared-memory path; leave it out. */
        double *kept = count > 3 ? samples + 1 : samples;
        long kept_n = count > 3 ? count - 1 : count;
        qsort(kept, kept_n, sizeof(double), by_value);
        double p50 = kept[(long)((kept_n - 1) * 0.5 + 0.5)];
        double p99 = kept[(long)((kept_n - 1) * 0.99 + 0.5)];

        /* Streaming: a window of nonblocking sends, then a one-byte reply. */
        int window = n <= (1 << 20) ? WINDOW_MAX : 8;
        MPI_Request req[WINDOW_MAX];
        long sent = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        start = MPI_Wtime();
        while (!spent(start, budget, sent, 3)) {
            for (int k = 0; k < window; k++) {
                if (rank == 0)
                    MPI_Isend(buf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, &req[k]);
                else
                    MPI_Irecv(buf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, &req[k]);
            }
            MPI_Waitall(window, req, MPI_STATUSES_IGNORE);
            if (rank == 0)
                MPI_Recv(buf, 1, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            else
                MPI_Send(buf, 1, MPI_BYTE, peer, 2, MPI_COMM_WORLD);
            sent += window;
        }
        double elapsed = MPI_Wtime() - start;
        if (rank == 0) {
            printf("{\"suite\":\"peer\",\"backend\":\"openmpi\",\"metric\":\"rtt\",\"bytes\":%zu,"
                   "\"p50_ns\":%.1f,\"p99_ns\":%.1f,\"iterations\":%ld,\"baseline\":\"\"}\n",
                   n, p50 * 1e9, p99 * 1e9, kept_n);
            printf("{\"suite\":\"peer\",\"backend\":\"openmpi\",\"metric\":\"bw\",\"bytes\":%zu,"
                   "\"gbps\":%.4f,\"iterations\":%ld,\"baseline\":\"\"}\n",
                   n, (double)n * sent / elapsed / 1e9, sent);
            fflush(stdout);
        }
    }
    free(buf);
    free(samples);
    MPI_Finalize();
    return 0;
}
