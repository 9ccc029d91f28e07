/* OpenMPI's MPI_Allreduce, a baseline of `sluice bench collective`: float32 sum of each size
 * given on the command line, the same call counts as Sluice's suite, each call timed on rank 0
 * (one by one, like Sluice's). Prints one JSON record per size in `sluice bench`'s format.
 *
 *   mpirun -np N mpi_allreduce QUICK SIZE...
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static long iterations(size_t size, int quick) {
    long n = (long)((256UL << 20) / (size ? size : 1));
    if (n < 5) n = 5;
    if (n > 200) n = 200;
    if (quick) n = n / 4 < 5 ? 5 : n / 4;
    return n;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc < 3) {
        if (rank == 0) fprintf(stderr, "usage: mpi_allreduce QUICK SIZE...\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int quick = atoi(argv[1]);
    for (int a = 2; a < argc; a++) {
        size_t size = strtoull(argv[a], NULL, 10);
        size_t n = size / 4;
        float *buf = malloc(n ? n * sizeof(float) : sizeof(float));
        long count = iterations(size, quick);
        double *samples = malloc(sizeof(double) * (size_t)count);
        if (!buf || !samples) MPI_Abort(MPI_COMM_WORLD, 3);
        for (size_t i = 0; i < n; i++) buf[i] = (float)(i % 7);
        for (int w = 0; w < 2; w++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (long i = 0; i < count; i++) {
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            samples[i] = MPI_Wtime() - t0;
        }
        if (rank == 0) {
            qsort(samples, (size_t)count, sizeof(double), by_value);
            double p50 = samples[(long)((count - 1) * 0.5 + 0.5)];
            double p99 = samples[(long)((count - 1) * 0.99 + 0.5)];
            printf("{\"suite\":\"peer\",\"backend\":\"openmpi-allreduce-f32-%dp\",\"metric\":\"rtt\","
                   "\"bytes\":%zu,\"p50_ns\":%.1f,\"p99_ns\":%.1f,\"iterations\":%ld,\"baseline\":\"\"}\n",
                   world, size, p50 * 1e9, p99 * 1e9, count);
            fflush(stdout);
        }
        free(buf);
        free(samples);
    }
    MPI_Finalize();
    return 0;
}
