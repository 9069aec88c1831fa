/* The transformed kernels of Winograd F(m,3) along W, packed as the register blocks of
 * winograd_body.h read them: out[i][block][c][a][b][f] = sum_e G[i][e] w[block FB + f]
 * [c][a][b][e], in double, rounded to float; 0 for the filters past the last.
 *
 * Why in C: numpy's form (winograd.transformed_weights: a float64 tensordot, padding and
 * a transposing copy) took 16 ms for MLPerf conv5's 512 x 256 x 27 weights at F(2,3) and
 * 32 ms at F(4,3), per call, on one core: half the convolution itself.  This reads each
 * weight once and writes each output once.  Plain C for any x86-64 (bound by memory). */

#pragma GCC optimize("O3")

static const double G2[4][3] = {{1.0, 0.0, 0.0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5},
                                {0.0, 0.0, 1.0}};
static const double G4[6][3] = {{1.0 / 4, 0.0, 0.0}, {-1.0 / 6, -1.0 / 6, -1.0 / 6},
                                {-1.0 / 6, 1.0 / 6, -1.0 / 6}, {1.0 / 24, 1.0 / 12, 1.0 / 6},
                                {1.0 / 24, -1.0 / 12, 1.0 / 6}, {0.0, 0.0, 1.0}};

/* w: (filters, taps, 3) contiguous, taps = c_in kd kh; out: (m + 2, blocks, taps, fb);
 * m is 2 or 4 (the caller checks). */
void cosmotrain_winograd_weights(const float *w, int filters, long taps, int fb, int m,
                                 float *out) {
    const double (*g)[3] = m == 2 ? G2 : G4;
    const int parts = m + 2, blocks = (filters + fb - 1) / fb;
    const long component = (long)blocks * taps * fb;
    for (int block = 0; block < blocks; block++)
    for (long t = 0; t < taps; t++)
    for (int f = 0; f < fb; f++) {
        const int filter = block * fb + f;
        float *o = out + ((long)block * taps + t) * fb + f;
        if (filter >= filters) {
            for (int i = 0; i < parts; i++) o[i * component] = 0.0f;
            continue;
        }
        const float *x = w + ((long)filter * taps + t) * 3;
        const double x0 = x[0], x1 = x[1], x2 = x[2];
        for (int i = 0; i < parts; i++)
            o[i * component] = (float)(g[i][0] * x0 + g[i][1] * x1 + g[i][2] * x2);
    }
}
