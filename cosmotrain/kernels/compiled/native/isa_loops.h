/* The convolution loops for one instruction set: included by direct.c once per ISA, with
 * VL (floats per vector), FB (filters per register block), WV (vectors per output run)
 * and SUFFIX defined inside that ISA's "#pragma GCC target" region; every name the
 * bodies define per ISA is undefined again at the end, ready for the next. */
#include "direct_body.h"
#include "winograd_body.h"
#undef RUN
#undef VEC
#undef VL
#undef FB
#undef WV
#undef SUFFIX
