"""C source of the native CPU codec kernels (built and loaded by `taco.kernels.native`).

Why C and not torch.compile: measured on 16M bf16 elements, torch.compile of the reference costs
~22 s of compile per process and is only ~2x faster, because the dense [G, G] Hadamard matmul
stays; a compiled butterfly formulation compiled for ~40 s and was slower still. One plain C pass
per group (load -> stats -> butterflies -> scales -> code -> store) is memory-bound, compiles in
about a second, and is cached on disk. The source lives in a Python string so that every install
(wheel or editable) carries it without package-data configuration.

Semantics follow `taco.codec.functional` operation by operation, in fp32, without FMA contraction
(built with -ffp-contract=off): the only differences from the reference are summation orders
(the butterflies vs the dense matmul, the sum of squares), i.e. fp32 ulps before the FP8/INT cast.
"""

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One codec configuration; mirrors `_Cfg` in native.py. */
typedef struct {
    int32_t kind;   /* 0 taco (dual scale), 1 fp8 (one scale), 2 int (one scale) */
    int32_t group;  /* G: 32..512, a power of two */
    int32_t rotate; /* apply the Walsh-Hadamard transform (taco: always) */
    int32_t fmt;    /* fp8 payload: 0 e4m3fn, 1 e5m2 */
    int32_t bits;   /* int payload: 8, or 4 (two's-complement nibbles, low nibble first) */
    float fmax;     /* fp8 clamp FMAX */
    float lam;      /* taco: lambda of the adaptive scale */
    float target;   /* taco: target range T of s_q */
    float qmax;     /* int: largest code magnitude */
} cfg_t;

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
#define MAXG 512
#define INLINE static inline __attribute__((always_inline))

/* ---- number formats ------------------------------------------------------------------------ */
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float half_to_float(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) { float v = (float)m * 5.9604644775390625e-08f; return s ? -v : v; } /* m * 2^-24 */
    if (e == 31) return u2f(s | 0x7F800000u | (m << 13));
    return u2f(s | ((e + 112) << 23) | (m << 13));
}

static inline uint16_t float_to_half(float f) { /* RNE, saturating at 65504 (finite_clamp) */
    uint32_t u = f2u(f), s = (u >> 16) & 0x8000, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000u) return (uint16_t)(s | 0x7E00);
    if (a >= 0x477FE000u) return (uint16_t)(s | 0x7BFF); /* >= 65504: clamp */
    if (a < 0x38800000u) {                               /* below 2^-14: subnormal grid 2^-24 */
        float v = nearbyintf(u2f(a) * 16777216.0f);
        return (uint16_t)(s | (uint32_t)v);
    }
    a += 0xFFFu + ((a >> 13) & 1u);
    return (uint16_t)(s | (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF));
}

static inline uint16_t float_to_bf16(float f) { /* RNE; NaN stays NaN */
    uint32_t u = f2u(f);
    if ((u & 0x7FFFFFFF) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* FP8 constants of one format: mantissa bits, bias. */
typedef struct { int mb; uint32_t minnorm, half, ebias; float subscale; } fp8c_t;

static fp8c_t fp8_consts(int fmt) {
    fp8c_t k;
    int bias = fmt ? 15 : 7;
    k.mb = fmt ? 2 : 3;
    k.minnorm = (uint32_t)(128 - bias) << 23;                  /* smallest normal, as fp32 bits */
    k.half = (1u << (22 - k.mb)) - 1u;                         /* RNE bias below the kept bits */
    k.ebias = (uint32_t)(127 - bias) << k.mb;                  /* fp32 -> fp8 exponent rebias */
    k.subscale = u2f((uint32_t)(127 + bias - 1 + k.mb) << 23); /* 1 / subnormal step */
    return k;
}

/* Saturating round-to-nearest-even casts v[i] / s, clamped to +-fmax, to FP8 bits (branchless,
   vectorisable). Bit-exact with torch's cast on clamped inputs; NaN -> 0x7F | sign. */
INLINE void quant_fp8(const float* v, float s, float fmax, int fmt, uint8_t* q, int G) {
    fp8c_t k = fp8_consts(fmt);
    int shift = 23 - k.mb;
    for (int i = 0; i < G; i++) {
        float t = v[i] / s;
        t = t < -fmax ? -fmax : t;
        t = t > fmax ? fmax : t;
        uint32_t u = f2u(t), sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
        /* subnormal grid: rint(|t| / step) by the 1.5 * 2^23 trick (exact: |t| / step < 8) */
        uint32_t sub = f2u(u2f(a) * k.subscale + 12582912.0f) - 0x4B400000u;
        uint32_t nrm = ((a + k.half + ((a >> shift) & 1u)) >> shift) - k.ebias;
        uint32_t code = a < k.minnorm ? sub : nrm;
        code = a > 0x7F800000u ? 0x7Fu : code;
        q[i] = (uint8_t)(sign | code);
    }
}

/* FP8 bits -> fp32 (exact, branchless). */
INLINE void dequant_fp8(const uint8_t* q, float s, int fmt, float* v, int G) {
    fp8c_t k = fp8_consts(fmt);
    float step = 1.0f / k.subscale;
    uint32_t nanmag = fmt ? 0x7Cu : 0x7Eu; /* above: NaN (e5m2: 0x7C is inf) */
    for (int i = 0; i < G; i++) {
        uint32_t b = q[i], a = b & 0x7F;
        float sub = (float)a * step;
        float nrm = u2f((a << (23 - k.mb)) + (k.ebias << (23 - k.mb)));
        float m = a < (1u << k.mb) ? sub : nrm;
        m = a > nanmag ? NAN : (fmt && a == 0x7Cu ? INFINITY : m);
        v[i] = ((b & 0x80) ? -m : m) * s;
    }
}

static float LUT[2][256];

static void build_lut(void) {
    uint8_t codes[256];
    for (int b = 0; b < 256; b++) codes[b] = (uint8_t)b;
    dequant_fp8(codes, 1.0f, 0, LUT[0], 256);
    dequant_fp8(codes, 1.0f, 1, LUT[1], 256);
}

/* ---- group primitives ---------------------------------------------------------------------- */
INLINE void load_group(const void* x, int dt, int64_t base, int64_t n, int G, float* v) {
    int64_t m = n - base; /* valid elements of this group; the tail is zero-padded */
    if (m > G) m = G;
    if (m < 0) m = 0;
    if (dt == DT_F32) {
        memcpy(v, (const float*)x + base, (size_t)m * 4);
    } else if (dt == DT_BF16) {
        const uint16_t* p = (const uint16_t*)x + base;
        if (m == G) { /* the common full group: a constant trip count */
            for (int i = 0; i < G; i++) v[i] = u2f((uint32_t)p[i] << 16);
            return;
        }
        for (int i = 0; i < m; i++) v[i] = u2f((uint32_t)p[i] << 16);
    } else {
        const uint16_t* p = (const uint16_t*)x + base;
        for (int i = 0; i < m; i++) v[i] = half_to_float(p[i]);
    }
    for (int i = (int)m; i < G; i++) v[i] = 0.0f;
}

INLINE void store_group(const float* v, int dt, int64_t base, int64_t n, int G, void* y) {
    int64_t m = n - base;
    if (m > G) m = G;
    if (dt == DT_F32) {
        memcpy((float*)y + base, v, (size_t)m * 4);
    } else if (dt == DT_BF16) {
        uint16_t* p = (uint16_t*)y + base;
        if (m == G) {
            for (int i = 0; i < G; i++) p[i] = float_to_bf16(v[i]);
            return;
        }
        for (int i = 0; i < m; i++) p[i] = float_to_bf16(v[i]);
    } else {
        uint16_t* p = (uint16_t*)y + base;
        for (int i = 0; i < m; i++) p[i] = float_to_half(v[i]);
    }
}

/* Unnormalised Sylvester Walsh-Hadamard transform in place: v <- v @ H_G. */
INLINE void fwht(float* v, int G) {
    for (int i = 0; i < G; i += 4) { /* stages h = 1, 2 in registers */
        float a = v[i], b = v[i + 1], c = v[i + 2], d = v[i + 3];
        float s0 = a + b, d0 = a - b, s1 = c + d, d1 = c - d;
        v[i] = s0 + s1; v[i + 1] = d0 + d1; v[i + 2] = s0 - s1; v[i + 3] = d0 - d1;
    }
    for (int h = 4; h < G; h <<= 1)
        for (int i = 0; i < G; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}

INLINE float sum_squares(const float* v, int G) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < G; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += v[i + l] * v[i + l];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

INLINE float abs_max(const float* v, int G) { /* NaN-propagating, like torch.amax */
    float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < G; i += 8)
        for (int l = 0; l < 8; l++) {
            float a = fabsf(v[i + l]);
            m[l] = (a > m[l] || a != a) ? a : m[l];
        }
    float r = 0.0f;
    for (int l = 0; l < 8; l++) r = (m[l] > r || m[l] != m[l]) ? m[l] : r;
    return r;
}

static inline float clampf(float v, float lo, float hi) { /* keeps NaN, like torch.clamp */
    if (v < lo) v = lo;
    if (v > hi) v = hi;
    return v;
}

static inline void put_f32(uint8_t* p, float f) { memcpy(p, &f, 4); }
static inline float get_f32(const uint8_t* p) { float f; memcpy(&f, p, 4); return f; }

/* Encode one group held in v (fp32, modified): payload to q, scales to s0[4] (and s1[4]). */
INLINE void encode_group(const cfg_t* c, float* v, uint8_t* q, uint8_t* s0, uint8_t* s1, int G) {
    float rg = (float)sqrt((double)G), s, sa = 0.0f;
    if (c->kind == 0) { /* adaptive scale: s_a = clamp(FMAX / sqrt(mean(x^2) + lam), 1e-3, 1e3) */
        float ms = sum_squares(v, G) / (float)G;
        sa = clampf((1.0f / sqrtf(ms + c->lam)) * c->fmax, 1e-3f, 1e3f);
        for (int i = 0; i < G; i++) v[i] *= sa;
    }
    if (c->rotate) {
        fwht(v, G);
        for (int i = 0; i < G; i++) v[i] /= rg;
    }
    float amax = abs_max(v, G);
    if (c->kind == 0) {
        s = clampf((amax < 1e-12f ? 1e-12f : amax) / c->target, 1e-12f, 1e6f);
    } else {
        s = amax / (c->kind == 1 ? c->fmax : c->qmax);
        if (!(amax > 0.0f)) s = 1.0f;
    }
    if (!isfinite(amax)) s = NAN;
    if (c->kind == 2) {
        int8_t t[MAXG];
        for (int i = 0; i < G; i++) {
            float r = (v[i] / s + 12582912.0f) - 12582912.0f; /* round half even, |v/s| < 2^22 */
            r = clampf(r, -c->qmax, c->qmax);
            t[i] = (int8_t)(r == r ? r : 0.0f);
        }
        if (c->bits == 4)
            for (int i = 0; i < G; i += 2) q[i / 2] = (uint8_t)((t[i] & 0xF) | ((t[i + 1] & 0xF) << 4));
        else
            memcpy(q, t, (size_t)G);
    } else {
        quant_fp8(v, s, c->fmax, c->fmt, q, G);
    }
    put_f32(s0, s);
    if (c->kind == 0) put_f32(s1, sa);
}

/* Decode one group into v (fp32, G values). */
INLINE void decode_group(const cfg_t* c, const uint8_t* q, const uint8_t* s0, const uint8_t* s1, float* v,
                         int G) {
    float s = get_f32(s0), rg = (float)sqrt((double)G);
    if (c->kind == 2) {
        if (c->bits == 4)
            for (int i = 0; i < G; i += 2) {
                int lo = q[i / 2] & 0xF, hi = q[i / 2] >> 4;
                v[i] = (float)(lo - ((lo & 8) << 1)) * s;
                v[i + 1] = (float)(hi - ((hi & 8) << 1)) * s;
            }
        else
            for (int i = 0; i < G; i++) v[i] = (float)(int8_t)q[i] * s;
    } else {
        const float* lut = LUT[c->fmt]; /* a table gather beats the branchless decode here */
        for (int i = 0; i < G; i++) v[i] = lut[q[i]] * s;
    }
    if (c->rotate) {
        fwht(v, G);
        for (int i = 0; i < G; i++) v[i] /= rg;
    }
    if (c->kind == 0) {
        float sa = get_f32(s1);
        for (int i = 0; i < G; i++) v[i] /= sa;
    }
}

/* ---- threading: contiguous group ranges on short-lived pthreads (fork-safe, no OpenMP) ----- */
typedef void (*range_fn)(const void* ctx, int64_t g0, int64_t g1);
typedef struct { range_fn fn; const void* ctx; int64_t g0, g1; } task_t;

static void* run_task(void* p) {
    task_t* t = (task_t*)p;
    t->fn(t->ctx, t->g0, t->g1);
    return NULL;
}

static void parallel_for(range_fn fn, const void* ctx, int64_t ng, int nt) {
    if (nt > 64) nt = 64;
    if (nt > ng / 256) nt = (int)(ng / 256); /* >= 256 groups per thread, else not worth it */
    if (nt <= 1) { fn(ctx, 0, ng); return; }
    task_t tk[64];
    pthread_t th[64];
    int started[64] = {0};
    for (int i = 0; i < nt; i++) {
        tk[i].fn = fn; tk[i].ctx = ctx;
        tk[i].g0 = ng * i / nt; tk[i].g1 = ng * (i + 1) / nt;
    }
    for (int i = 1; i < nt; i++) started[i] = pthread_create(&th[i], NULL, run_task, &tk[i]) == 0;
    run_task(&tk[0]);
    for (int i = 1; i < nt; i++) {
        if (started[i]) pthread_join(th[i], NULL);
        else run_task(&tk[i]); /* could not start a thread: do its share here */
    }
}

/* ---- entry points ---------------------------------------------------------------------------- */
typedef struct {
    const cfg_t* c; const void* x; int dt; int64_t n;
    uint8_t *q, *s0, *s1; /* outputs (encode) */
    const uint8_t *iq, *is0, *is1; int64_t stride; int nchunks; /* inputs (decode, dsum) */
    void* y; float* sum;
    const void* own; int own_dt; int own_index; /* dsum: raw local term at this position */
} job_t;

/* `name_range` calls `name_body` with G as a compile-time constant, so that every per-group loop
   is unrolled and vectorised for the common group sizes. */
#define CONST_G_RANGE(name)                                                   \
    static void name##_range(const void* p, int64_t g0, int64_t g1) {         \
        const job_t* j = (const job_t*)p;                                     \
        switch (j->c->group) {                                                \
        case 32: name##_body(j, g0, g1, 32); break;                           \
        case 64: name##_body(j, g0, g1, 64); break;                           \
        case 128: name##_body(j, g0, g1, 128); break;                         \
        case 256: name##_body(j, g0, g1, 256); break;                         \
        default: name##_body(j, g0, g1, j->c->group);                         \
        }                                                                     \
    }

static int64_t payload_bytes(const cfg_t* c) { return (int64_t)c->group * (c->kind == 2 ? c->bits : 8) / 8; }

INLINE void encode_body(const job_t* j, int64_t g0, int64_t g1, int G) {
    int64_t pb = payload_bytes(j->c);
    float v[MAXG];
    for (int64_t g = g0; g < g1; g++) {
        load_group(j->x, j->dt, g * G, j->n, G, v);
        encode_group(j->c, v, j->q + g * pb, j->s0 + 4 * g, j->s1 ? j->s1 + 4 * g : NULL, G);
    }
}

CONST_G_RANGE(encode)

INLINE void decode_body(const job_t* j, int64_t g0, int64_t g1, int G) {
    int64_t pb = payload_bytes(j->c);
    float v[MAXG];
    for (int64_t g = g0; g < g1; g++) {
        decode_group(j->c, j->iq + g * pb, j->is0 + 4 * g, j->is1 ? j->is1 + 4 * g : NULL, v, G);
        store_group(v, j->dt, g * G, j->n, G, j->y);
    }
}

CONST_G_RANGE(decode)

INLINE void dsum_body(const job_t* j, int64_t g0, int64_t g1, int G) {
    int64_t pb = payload_bytes(j->c);
    float acc[MAXG], v[MAXG];
    for (int64_t g = g0; g < g1; g++) {
        int64_t valid = j->n - g * G;
        int nterms = j->nchunks + (j->own != NULL);
        for (int t = 0, k = 0; t < nterms; t++) {
            if (j->own != NULL && t == j->own_index) {
                load_group(j->own, j->own_dt, g * G, j->n, G, v);
            } else {
                int64_t o = (k++) * j->stride;
                decode_group(j->c, j->iq + o + g * pb, j->is0 + o + 4 * g, j->is1 ? j->is1 + o + 4 * g : NULL,
                             v, G);
            }
            if (t == 0) /* s = y_0 + y_1 + ...: the first term is taken as is (keeps -0) */
                for (int i = 0; i < G; i++) acc[i] = i < valid ? v[i] : 0.0f;
            else
                for (int i = 0; i < G; i++) acc[i] += i < valid ? v[i] : 0.0f;
        }
        if (j->sum) store_group(acc, DT_F32, g * G, j->n, G, j->sum);
        encode_group(j->c, acc, j->q + g * pb, j->s0 + 4 * g, j->s1 ? j->s1 + 4 * g : NULL, G);
    }
}

CONST_G_RANGE(dsum)

static int64_t groups(const cfg_t* c, int64_t n) { return (n + c->group - 1) / c->group; }

void taco_init(void) { build_lut(); }

float taco_lut(int fmt, int code) { return LUT[fmt & 1][code & 0xFF]; }

/* x: n elements of dtype dt -> payload q and scales s0 (s1: taco's s_a), zero-padded groups. */
void taco_encode(const cfg_t* c, const void* x, int dt, int64_t n,
                 uint8_t* q, uint8_t* s0, uint8_t* s1, int nt) {
    job_t j = {0};
    j.c = c; j.x = x; j.dt = dt; j.n = n; j.q = q; j.s0 = s0; j.s1 = s1;
    parallel_for(encode_range, &j, groups(c, n), nt);
}

/* payload + scales -> the first n elements, in dtype dt. */
void taco_decode(const cfg_t* c, const uint8_t* q, const uint8_t* s0, const uint8_t* s1,
                 int64_t n, void* y, int dt, int nt) {
    job_t j = {0};
    j.c = c; j.iq = q; j.is0 = s0; j.is1 = s1; j.n = n; j.y = y; j.dt = dt;
    parallel_for(decode_range, &j, groups(c, n), nt);
}

/* nchunks encoded chunks of n elements, chunk k's pointers offset by k*stride bytes: decode each
   in fp32 and sum in order, with the raw local values `own` (dtype own_dt, may be NULL) as term
   number own_index; optionally store the n sums; re-encode the sum. */
void taco_decode_sum_encode(const cfg_t* c, int nchunks, int64_t stride, const uint8_t* q,
                            const uint8_t* s0, const uint8_t* s1, int64_t n, const void* own,
                            int own_dt, int own_index, uint8_t* oq, uint8_t* os0, uint8_t* os1,
                            float* sum, int nt) {
    job_t j = {0};
    j.c = c; j.nchunks = nchunks; j.stride = stride; j.iq = q; j.is0 = s0; j.is1 = s1; j.n = n;
    j.own = own; j.own_dt = own_dt; j.own_index = own_index;
    j.q = oq; j.s0 = os0; j.s1 = os1; j.sum = sum;
    parallel_for(dsum_range, &j, groups(c, n), nt);
}
"""
