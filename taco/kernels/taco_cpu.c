/*
 * The native CPU codec kernels (built and loaded by taco/kernels/native.py; shipped as package data).
 *
 * Why C and not torch.compile: measured on 16M bf16 elements (2 cores), torch.compile of the
 * reference costs ~22 s of compile per process and is only ~2.3x faster, because the dense [G, G]
 * Hadamard matmul stays; a compiled butterfly formulation compiled for ~40 s and was slower still.
 * Here one pass per batch of 16 whole groups does load -> stats -> butterflies -> scales -> code ->
 * store with every step a loop over the 16 groups (one SIMD vector per step: the butterflies of all
 * strides, the reductions and the casts vectorise); ragged tails go group by group. It builds in
 * ~2 s once per machine (cached on disk) and runs ~10x faster than the eager reference.
 * Where the compiler targets AVX-512 (-march=native on such a CPU) the batch steps that gcc does
 * not vectorise well are written with intrinsics: the lane layout's loads, stores and payload bytes
 * through 16 x 16 register transposes, the FP8/INT dequantisation by table permutes, the
 * butterflies in register passes (strides 1-8 on 16 rows, fused into the dequantisation on decode;
 * then three strides at a time, with the scale products/divisions and the dsum accumulation fused
 * into the first/last pass), the absmax and the FP8/INT casts. They do the
 * same fp32 operations on the same operands, NaN-propagating operand order included, so the bytes
 * are those of the scalar loops (checked by tests/test_kernels_native_simd.py and
 * benchmarks/native_simd_check.py, which also times old against new: ~2x per element).
 *
 * Semantics follow `taco.codec.functional` operation by operation, in fp32, without FMA contraction
 * (built with -ffp-contract=off): the same butterflies in the same order (stride 1 first), the sum
 * of squares in index order, correctly rounded sqrt and divisions, so bytes and decoded values are
 * the reference's bit for bit (tests/test_kernels.py, tests/test_invariance.py). Groups near fp32's
 * max are rotated and decoded in scaled domains, as the reference does (see "finite in, finite out").
 * Integer codes of B = 2..8 bits are packed LSB first (8 codes in B bytes; formats.pack_bits); scale
 * formats fp32, bf16 and e8m0 (scales.py: rounded UP onto the format's grid before use, by the
 * same integer steps, NaN kept). Within this backend a
 * group's bytes depend on the group alone: the 16-group batches and the single-group path (ragged
 * tails, the rest of a thread's range) do the same operations in the same order, the sum of
 * squares included (index order), so neither the thread count nor a group's neighbours matter.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One codec configuration; mirrors `Cfg` in native.py. */
typedef struct {
    int32_t kind;   /* 0 taco (dual scale), 1 fp8 (one scale), 2 int (one scale) */
    int32_t group;  /* G: 32..512, a power of two */
    int32_t rotate; /* apply the Walsh-Hadamard transform (taco: always) */
    int32_t fmt;    /* fp8 payload: 0 e4m3fn, 1 e5m2 */
    int32_t bits;   /* int payload: B = 2..8 bits per two's-complement code, packed LSB first */
    float fmax;     /* fp8 clamp FMAX */
    float lam;      /* taco: lambda of the adaptive scale */
    float target;   /* taco: target range T of s_q */
    float qmax;     /* int: largest code magnitude */
    int32_t sfmt;   /* scale format: 0 fp32, 1 bf16, 2 e8m0 */
    int32_t signs;  /* int: 1 randomized Hadamard, x D before the rotation, D after; 2 "auto": per group the
                       plain or the randomized one, the choice in the scale's sign bit (last: older builds
                       read the prefix) */
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

/* Saturating round-to-nearest-even cast of t (clamped to +-fmax here) to FP8 bits; branchless so
   that loops over it vectorise. Bit-exact with torch's cast on clamped inputs; NaN -> 0x7F | sign. */
static inline uint32_t fp8_bits(float t, float fmax, fp8c_t k) {
    int shift = 23 - k.mb;
    t = t < -fmax ? -fmax : t;
    t = t > fmax ? fmax : t;
    uint32_t u = f2u(t), sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
    /* subnormal grid: rint(|t| / step) by the 1.5 * 2^23 trick (exact: |t| / step < 2^mb) */
    uint32_t sub = f2u(u2f(a) * k.subscale + 12582912.0f) - 0x4B400000u;
    uint32_t nrm = ((a + k.half + ((a >> shift) & 1u)) >> shift) - k.ebias;
    uint32_t code = a < k.minnorm ? sub : nrm;
    code = a > 0x7F800000u ? 0x7Fu : code;
    return sign | code;
}

/* INT code of t: round half to even (1.5 * 2^23 trick, |t| <= qmax), clamped, NaN -> 0. */
static inline uint32_t int_bits(float t, float qmax) {
    float r = (t + 12582912.0f) - 12582912.0f;
    r = r < -qmax ? -qmax : r;
    r = r > qmax ? qmax : r;
    return (uint32_t)(int32_t)(r == r ? r : 0.0f);
}

INLINE void quant_fp8(const float* v, float s, float fmax, int fmt, uint8_t* q, int G) {
    fp8c_t k = fp8_consts(fmt);
    uint32_t c[MAXG]; /* 32-bit codes first: the cast vectorises at full width */
    for (int i = 0; i < G; i++) c[i] = fp8_bits(v[i] / s, fmax, k);
    for (int i = 0; i < G; i++) q[i] = (uint8_t)c[i];
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

/* a + b with a as the first source where the target allows pinning it: when both are NaN, x86
   returns the first, so the order (free for the compiler to swap) decides a NaN sum's sign */
static inline float addf_first(float a, float b) {
#if defined(__x86_64__) && defined(__AVX__)
    float r;
    __asm__("vaddss %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
#else
    return a + b;
#endif
}

static inline float mulf_first(float a, float b) { /* a * b, a the first source (as addf_first) */
#if defined(__x86_64__) && defined(__AVX__)
    float r;
    __asm__("vmulss %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
#else
    return a * b;
#endif
}

/* Unnormalised Sylvester Walsh-Hadamard transform in place: v <- v @ H_G. ADD(a, b): a + b, where
   the order of two NaN operands decides the sum's sign: fwht leaves it to the compiler (encode),
   fwht_a_first pins a first (decode: the signs the first build's compiler chose there); with
   AVX-512 its strides >= 16 go 16 lanes at a time (ADD16, also a first). */
#if defined(__AVX512F__)
typedef float f16_t __attribute__((vector_size(64)));
#define HAVE_F16 1
static inline f16_t add16_first(f16_t a, f16_t b) {
    f16_t r;
    __asm__("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
}
#else
#define HAVE_F16 0
#endif
#define FWHT(name, ADD, WIDE)                                                                        \
    INLINE void name(float* v, int G) {                                                              \
        for (int i = 0; i < G; i += 4) { /* stages h = 1, 2 in registers */                          \
            float a = v[i], b = v[i + 1], c = v[i + 2], d = v[i + 3];                                \
            float s0 = ADD(a, b), d0 = a - b, s1 = ADD(c, d), d1 = c - d;                            \
            v[i] = ADD(s0, s1), v[i + 1] = ADD(d0, d1), v[i + 2] = s0 - s1, v[i + 3] = d0 - d1;      \
        }                                                                                            \
        for (int h = 4; h < G; h <<= 1)                                                              \
            for (int i = 0; i < G; i += 2 * h) {                                                     \
                int j = i;                                                                           \
                if (WIDE && h >= 16) FWHT16(v, j, i + h, h);                                         \
                for (; j < i + h; j++) {                                                             \
                    float a = v[j], b = v[j + h];                                                    \
                    v[j] = ADD(a, b), v[j + h] = a - b;                                              \
                }                                                                                    \
            }                                                                                        \
    }
#if HAVE_F16
#define FWHT16(v, j, end, h)                                                                         \
    for (; j < end; j += 16) {                                                                       \
        f16_t a, b, s;                                                                               \
        memcpy(&a, v + j, 64), memcpy(&b, v + j + h, 64);                                            \
        s = add16_first(a, b), b = a - b;                                                            \
        memcpy(v + j, &s, 64), memcpy(v + j + h, &b, 64);                                            \
    }
#else
#define FWHT16(v, j, end, h) (void)0
#endif
#define ADD_ANY(a, b) ((a) + (b))
FWHT(fwht, ADD_ANY, 0)
FWHT(fwht_a_first, addf_first, HAVE_F16)

/* sum of v[i]^2 in index order, ((v0^2 + v1^2) + v2^2) + ...: the order of encode_batch's
   lanes, so a group's s_a (and so its code) does not depend on which path encodes it. */
INLINE float sum_squares(const float* v, int G) {
    float acc = 0.0f;
    for (int i = 0; i < G; i++) acc += v[i] * v[i];
    return acc;
}

INLINE float abs_max(const float* v, int G) { /* NaN-propagating, like torch.amax */
    float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int nan = 0;
    for (int i = 0; i < G; i += 8)
        for (int l = 0; l < 8; l++) {
            float a = fabsf(v[i + l]);
            m[l] = a > m[l] ? a : m[l];
            nan |= a != a;
        }
    float r = 0.0f;
    for (int l = 0; l < 8; l++) r = m[l] > r ? m[l] : r;
    return nan ? NAN : r;
}

static inline float clampf(float v, float lo, float hi) { /* keeps NaN, like torch.clamp */
    if (v < lo) v = lo;
    if (v > hi) v = hi;
    return v;
}


/* ---- scale formats (taco.codec.scales): fp32; bf16 and e8m0, rounded UP onto their grid -------
   Pure integer steps on the fp32 bits, the reference's, so scales are byte-identical; a NaN scale
   (non-finite group) stays NaN in every format. Stored unaligned-safe, `scale_size` bytes each. */
enum { SF_F32 = 0, SF_BF16 = 1, SF_E8M0 = 2 };
#define BF16_MAX_BITS 0x7F7F0000u /* bf16's largest finite value, as fp32 bits */

static inline int scale_size(const cfg_t* c) { return c->sfmt == SF_BF16 ? 2 : c->sfmt == SF_E8M0 ? 1 : 4; }

static inline uint32_t e8m0_code(float s) { /* byte b of the smallest 2^(b - 127) >= s, <= 254; NaN 255 */
    uint32_t u = f2u(s), e = (u >> 23) & 0xFF, m = u & 0x7FFFFF;
    uint32_t b = e == 0 ? (uint32_t)(m > 0x400000) : e + (m != 0);
    b = b > 254 ? 254 : b;
    return s != s ? 255u : b;
}

static inline float e8m0_value(uint32_t b) { return b == 255 ? NAN : u2f(b == 0 ? 0x400000u : b << 23); }

/* s (> 0 or NaN) -> the smallest value of the scale format >= s (capped at its largest) */
static inline float round_scale(const cfg_t* c, float s) {
    if (c->sfmt == SF_BF16) {
        uint32_t r = (f2u(s) + 0xFFFFu) & ~0xFFFFu;
        return s != s ? s : u2f(r > BF16_MAX_BITS ? BF16_MAX_BITS : r);
    }
    return c->sfmt == SF_E8M0 ? e8m0_value(e8m0_code(s)) : s;
}

static inline void put_f32(uint8_t* p, float f) { memcpy(p, &f, 4); }
static inline float get_f32(const uint8_t* p) { float f; memcpy(&f, p, 4); return f; }

/* scale number i of a scale array (already on the format's grid) */
static inline void put_scale(const cfg_t* c, uint8_t* p, int64_t i, float s) {
    if (c->sfmt == SF_BF16) {
        uint16_t h = (uint16_t)(f2u(s) >> 16);
        memcpy(p + 2 * i, &h, 2);
    } else if (c->sfmt == SF_E8M0) {
        p[i] = (uint8_t)e8m0_code(s);
    } else {
        memcpy(p + 4 * i, &s, 4);
    }
}

static inline float get_scale(const cfg_t* c, const uint8_t* p, int64_t i) {
    if (c->sfmt == SF_BF16) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return u2f((uint32_t)h << 16);
    }
    if (c->sfmt == SF_E8M0) return e8m0_value(p[i]);
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
}

/* ---- bit-packed integer codes (formats.pack_bits): 8 codes of B bits in B bytes, LSB first ----
   B = 8 is the plain int8 bytes and B = 4 the nibble layout (low nibble first). */
/* codes c[i * cs], i < n (n a multiple of 8), two's complement -> the stream q */
INLINE void pack_codes(const uint32_t* c, int64_t cs, int n, int B, uint8_t* q) {
    if (B == 8) {
        for (int i = 0; i < n; i++) q[i] = (uint8_t)c[i * cs];
        return;
    }
    uint64_t m = (1u << B) - 1;
    for (int i = 0; i < n; i += 8, q += B) {
        uint64_t w = 0;
        for (int k = 0; k < 8; k++) w |= (c[(i + k) * cs] & m) << (k * B);
        for (int k = 0; k < B; k++) q[k] = (uint8_t)(w >> (8 * k));
    }
}

/* the stream q -> v[i * vs] = code i * s, i < n (n a multiple of 8); codes sign-extended */
INLINE void unpack_codes(const uint8_t* q, int n, int B, float s, float* v, int64_t vs) {
    if (B == 8) {
        for (int i = 0; i < n; i++) v[i * vs] = (float)(int8_t)q[i] * s;
        return;
    }
    for (int i = 0; i < n; i += 8, q += B) {
        uint64_t w = 0;
        for (int k = 0; k < B; k++) w |= (uint64_t)q[k] << (8 * k);
        for (int k = 0; k < 8; k++) { /* field k to the top of 32 bits, then back down, signed */
            int32_t code = (int32_t)((uint32_t)(w >> (k * B)) << (32 - B)) >> (32 - B);
            v[(i + k) * vs] = (float)code * s;
        }
    }
}

/* The quantization scale of a group from its absmax (taco: s_q; others: absmax_scale, whose
   subnormal scales are rounded up on the 2^-149 grid: never 0, no saturated codes), then rounded
   up onto the scale format (as adaptive_scale's s_a): the value every code is divided by. */
static inline float group_scale(const cfg_t* c, float amax) {
    float s;
    if (c->kind == 0) {
        s = clampf((amax < 1e-12f ? 1e-12f : amax) / c->target, 1e-12f, 1e6f);
    } else {
        float qm = c->kind == 1 ? c->fmax : c->qmax;
        s = amax / qm;
        if (s < 0x1p-126f) s = ceilf(amax / (qm * 0x1p-149f)) * 0x1p-149f; /* exact products */
        if (!(amax > 0.0f)) s = 1.0f;
    }
    return isfinite(amax) ? s : NAN;
}

static inline float adaptive_scale(const cfg_t* c, float sum_sq, int G) {
    return clampf((1.0f / sqrtf(sum_sq / (float)G + c->lam)) * c->fmax, 1e-3f, 1e3f);
}

/* Whether a codec needs the general group code (scale formats, B-bit packing): the codecs of the
   first kernels (fp32 scales, int8/int4 codes) keep their own copy of it, compiled as before, so
   that even the signs of their NaNs (which operand of a NaN + NaN the compiler puts first) stay
   those of that build (benchmarks/native_simd_check.py compares them byte for byte). */
static inline int lean(const cfg_t* c) {
    return c->sfmt != SF_F32 || (c->kind == 2 && c->bits != 4 && c->bits != 8) || c->signs;
}

/* The randomized Hadamard's diagonal (hadamard.py sign_flips): D_i = -1 where popcount(lo & hi) is
   odd, lo = i mod 2^m, hi = (i >> m) mod 2^m, m = floor(log2(G) / 2). A flip is exact (the sign bit). */
static inline int sign_flipped(int i, int G) {
    int m = (31 - __builtin_clz((unsigned)G)) >> 1;
    unsigned mask = (1u << m) - 1u;
    return __builtin_parity(((unsigned)i & mask) & (((unsigned)i >> m) & mask));
}

static void flip_signs(float* v, int G) { /* 0 - v: -v, but +0 for zeros (as the reference's sums) */
    for (int i = 0; i < G; i++)
        if (sign_flipped(i, G)) v[i] = 0.0f - v[i];
}

/* signs="auto" (functional.int_encode with flips): the randomized candidate (scale s2) is kept over the
   plain one (s1) where its scale, rounded onto the format, is smaller: the finer grid; ties and NaN:
   plain */
static inline int auto_pick(float s1, float s2) { return s2 < s1; }

/* ---- finite in, finite out (functional.prescale / wire_scale / decode_factor) ----------------
   A rotated group with some |x_i| >= 2^(127 - log2 G) could overflow in the butterflies (partial sums
   reach G * absmax): it is rotated as x * 2^-log2(G), exact, and its scale multiplied back by
   2^log2(G), saturating at the format's largest value. A scale >= 2^(111 - log2 G) is decoded in the
   scaled domain, s * 2^-(log2(G) + 16) (codes are < 2^16), the values multiplied back and saturated
   at fp32's largest. Power-of-two factors commute with every rounding in the normal range: groups of
   ordinary magnitude keep their bytes. The batches send such groups to the single-group path. */
#define FLT32_MAX 0x1.fffffep127f
static inline int log2i(int G) { return 31 - __builtin_clz((unsigned)G); }
static inline float pow2f(int e) { return u2f((uint32_t)(127 + e) << 23); } /* -126 <= e <= 127 */
static inline float max_scale(const cfg_t* c) {
    return c->sfmt == SF_BF16 ? u2f(BF16_MAX_BITS) : c->sfmt == SF_E8M0 ? 0x1p127f : FLT32_MAX;
}
static inline int big_group(const cfg_t* c, const float* v, int G) {
    if (c->kind == 0 || !c->rotate) return 0;
    const float t = pow2f(127 - log2i(G));
    int big = 0;
    for (int i = 0; i < G; i++) big |= fabsf(v[i]) >= t;
    return big;
}
static inline int big_scale(const cfg_t* c, float s, int G) {
    return c->kind != 0 && fabsf(s) >= pow2f(111 - log2i(G));
}
/* the scale written for a group pre-scaled by 2^-lg whose scale there is s: s * 2^lg, saturating */
static inline float wire_scale(const cfg_t* c, float s, int lg) {
    float w = s * pow2f(lg), m = max_scale(c);
    return w > m ? m : w; /* NaN stays NaN */
}

/* Encode one group held in v (fp32, modified): payload to q, scales to s0 (and s1). LEAN: the
   general code (a compile-time flag; see lean()). Scales are rounded onto their format before use. */
INLINE void encode_group_t(const cfg_t* c, float* v, uint8_t* q, uint8_t* s0, uint8_t* s1, int G, const int LEAN) {
    float rg = (float)sqrt((double)G), s, sa = 0.0f;
    if (c->kind == 0) { /* adaptive scale: s_a = clamp(FMAX / sqrt(mean(x^2) + lam), 1e-3, 1e3) */
        sa = adaptive_scale(c, sum_squares(v, G), G);
        if (LEAN) sa = round_scale(c, sa);
        for (int i = 0; i < G; i++) v[i] *= sa;
    }
    const int pick = LEAN && c->kind == 2 && c->rotate && c->signs == 2; /* signs="auto" */
    const int lg = big_group(c, v, G) ? log2i(G) : 0; /* pre-scale 2^-lg (finite in, finite out) */
    if (lg)
        for (int i = 0; i < G; i++) v[i] *= pow2f(-lg);
    float w[MAXG];
    if (pick) { /* the randomized candidate, as the plain one below */
        memcpy(w, v, (size_t)G * 4);
        flip_signs(w, G);
        fwht(w, G);
        for (int i = 0; i < G; i++) w[i] /= rg;
    }
    if (c->rotate) {
        if (LEAN && c->signs == 1) flip_signs(v, G);
        fwht(v, G);
        for (int i = 0; i < G; i++) v[i] /= rg;
    }
    s = group_scale(c, abs_max(v, G));
    if (LEAN) s = round_scale(c, s);
    float sw = s; /* the scale written: -s2 where the randomized candidate is kept */
    if (lg) sw = wire_scale(c, s, lg), s = sw * pow2f(-lg);
    if (pick) { /* the kept candidate is coded, its signed scale written */
        float s2 = round_scale(c, group_scale(c, abs_max(w, G))), w2 = s2;
        if (lg) w2 = wire_scale(c, s2, lg), s2 = w2 * pow2f(-lg);
        if (auto_pick(sw, w2)) memcpy(v, w, (size_t)G * 4), s = s2, sw = -w2;
    }
    if (c->kind == 2) {
        uint32_t t[MAXG];
        for (int i = 0; i < G; i++) t[i] = int_bits(v[i] / s, c->qmax);
        if (LEAN)
            pack_codes(t, 1, G, c->bits, q);
        else if (c->bits == 4)
            for (int i = 0; i < G; i += 2) q[i / 2] = (uint8_t)((t[i] & 0xF) | ((t[i + 1] & 0xF) << 4));
        else
            for (int i = 0; i < G; i++) q[i] = (uint8_t)t[i];
    } else {
        quant_fp8(v, s, c->fmax, c->fmt, q, G);
    }
    if (LEAN) {
        put_scale(c, s0, 0, sw);
        if (c->kind == 0) put_scale(c, s1, 0, sa);
    } else {
        put_f32(s0, sw);
        if (c->kind == 0) put_f32(s1, sa);
    }
}

/* Decode one group into v (fp32, G values). */
INLINE void decode_group_t(const cfg_t* c, const uint8_t* q, const uint8_t* s0, const uint8_t* s1, float* v,
                           int G, const int LEAN) {
    float s = LEAN ? get_scale(c, s0, 0) : get_f32(s0), rg = (float)sqrt((double)G);
    const int flip = LEAN && (c->signs == 1 || (c->signs == 2 && signbit(s))); /* auto: the sign bit */
    if (LEAN && c->signs == 2) s = fabsf(s);
    const int lg = big_scale(c, s, G) ? log2i(G) + 16 : 0; /* decode in the scaled domain */
    if (lg) s *= pow2f(-lg);
    if (LEAN && c->kind == 2) {
        unpack_codes(q, G, c->bits, s, v, 1);
    } else if (c->kind == 2) {
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
        for (int i = 0; i < G; i++) v[i] = mulf_first(lut[q[i]], s); /* NaN x NaN: the code's */
    }
    if (c->rotate) {
        fwht_a_first(v, G);
        for (int i = 0; i < G; i++) v[i] /= rg;
        if (flip) flip_signs(v, G);
    }
    if (lg) /* back by 2^lg (exact, or past fp32's range: then saturated at its largest) */
        for (int i = 0; i < G; i++) v[i] = clampf(v[i] * pow2f(lg), -FLT32_MAX, FLT32_MAX);
    if (c->kind == 0) {
        float sa = LEAN ? get_scale(c, s1, 0) : get_f32(s1);
        for (int i = 0; i < G; i++) v[i] /= sa;
    }
}

static __attribute__((noinline)) void encode_group_lean(const cfg_t* c, float* v, uint8_t* q, uint8_t* s0,
                                                        uint8_t* s1, int G) {
    encode_group_t(c, v, q, s0, s1, G, 1);
}

static __attribute__((noinline)) void decode_group_lean(const cfg_t* c, const uint8_t* q, const uint8_t* s0,
                                                        const uint8_t* s1, float* v, int G) {
    decode_group_t(c, q, s0, s1, v, G, 1);
}

INLINE void encode_group(const cfg_t* c, float* v, uint8_t* q, uint8_t* s0, uint8_t* s1, int G) {
    if (lean(c)) encode_group_lean(c, v, q, s0, s1, G);
    else encode_group_t(c, v, q, s0, s1, G, 0);
}

INLINE void decode_group(const cfg_t* c, const uint8_t* q, const uint8_t* s0, const uint8_t* s1, float* v,
                         int G) {
    if (lean(c)) decode_group_lean(c, q, s0, s1, v, G);
    else decode_group_t(c, q, s0, s1, v, G, 0);
}

/* ---- lane-parallel batches: L whole groups at once, t[i][l] = element i of group l ----------
   Every step is a loop over the L lanes (one SIMD vector), so the butterflies of every stride, the
   reductions and the casts vectorise; only the transposed loads/stores are strided. */
#define L 16
typedef float lanes_t[L];
#define ALIGN64 __attribute__((aligned(64)))

/* ---- AVX-512 transposes: the lane layout's loads and stores, 16 x 16 blocks in registers ------
   A batch step touches 16 consecutive elements of each of the 16 groups: 16 row vectors, one 16 x 16
   transpose (64 shuffles), 16 column vectors. Element values go through exactly the operations of
   the scalar code (the same conversions, the same products), so the bytes do not change; builds
   without AVX-512 (or G not a multiple of 16) take the scalar loops below. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define SIMD16 1

/* a + b with a as the first source: when both are NaN x86 returns the first, so the operand order
   (which a compiler may swap for a commutative intrinsic) decides a NaN's sign and payload; the
   scalar loops of the reference build put a first. */
INLINE __m512 add_first(__m512 a, __m512 b) {
    __m512 r;
    __asm__("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
}

INLINE __m512 mul_first(__m512 a, __m512 b) { /* a * b, a the first source (as add_first) */
    __m512 r;
    __asm__("vmulps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
}

INLINE void tr16(__m512* r) { /* in place: r[j] <- column j of the 16 rows r[0..15] */
    __m512 t[16], u[16];
    for (int k = 0; k < 16; k += 2) {
        t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {
        u[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44);
        u[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44);
        u[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int m = 0; m < 8; m++) {
        r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xDD);
    }
}

INLINE __m512i bf16_bits16(__m512 v) { /* float_to_bf16 of 16 values, in the low halves */
    __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    __m512i r = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    r = _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

/* t[i][l] <- element i of group g0 + l (fp32, bf16: exact widenings) */
static void load_batch16(const void* x, int dt, int64_t g0, int G, lanes_t* t) {
    for (int i0 = 0; i0 < G; i0 += 16) {
        __m512 r[16];
        for (int l = 0; l < 16; l++) {
            int64_t o = (g0 + l) * G + i0;
            if (dt == DT_F32) {
                r[l] = _mm512_loadu_ps((const float*)x + o);
            } else {
                __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + o));
                r[l] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
        }
        tr16(r);
        for (int k = 0; k < 16; k++) _mm512_storeu_ps(t[i0 + k], r[k]);
    }
}

static void store_batch16(lanes_t* t, int dt, int64_t g0, int G, void* y) {
    for (int i0 = 0; i0 < G; i0 += 16) {
        __m512 r[16];
        for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_ps(t[i0 + k]);
        tr16(r);
        for (int l = 0; l < 16; l++) {
            int64_t o = (g0 + l) * G + i0;
            if (dt == DT_F32)
                _mm512_storeu_ps((float*)y + o, r[l]);
            else
                _mm256_storeu_si256((__m256i*)((uint16_t*)y + o), _mm512_cvtepi32_epi16(bf16_bits16(r[l])));
        }
    }
}

/* fp8_bits of 16 values (the same integer steps; the one float product and sum unfused) */
INLINE __m512i fp8_bits16(__m512 t, float fmax, fp8c_t k) {
    const __m512 hi = _mm512_set1_ps(fmax), lo = _mm512_set1_ps(-fmax);
    t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(t, lo, _CMP_LT_OQ), lo);
    t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(t, hi, _CMP_GT_OQ), hi);
    __m512i u = _mm512_castps_si512(t), a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(k.subscale));
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(f, _mm512_set1_ps(12582912.0f))),
                                   _mm512_set1_epi32(0x4B400000));
    const __m128i sh = _mm_cvtsi32_si128(23 - k.mb);
    __m512i odd = _mm512_and_si512(_mm512_srl_epi32(a, sh), _mm512_set1_epi32(1));
    __m512i nrm = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((int)k.half)), odd);
    nrm = _mm512_sub_epi32(_mm512_srl_epi32(nrm, sh), _mm512_set1_epi32((int)k.ebias));
    __m512i code = _mm512_mask_mov_epi32(nrm, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)k.minnorm)), sub);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
                                 _mm512_set1_epi32(0x7F));
    return _mm512_or_si512(sign, code);
}

INLINE __m512i int_bits16(__m512 t, float qmax) { /* int_bits of 16 values */
    const __m512 C = _mm512_set1_ps(12582912.0f), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    __m512 r = _mm512_sub_ps(_mm512_add_ps(t, C), C);
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(r, lo, _CMP_LT_OQ), lo);
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(r, hi, _CMP_GT_OQ), hi);
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), _mm512_setzero_ps());
    return _mm512_cvttps_epi32(r);
}

/* ---- B-bit codes (B = 2, 3, 5, 6, 7), 16 at a time: 16 codes are 2B bytes of the stream ----- */
typedef struct {
    int B;
    __m512i mask, lsh, bidx, bidx1; /* B-bit mask; unpack: 32 - B - bit offset, bytes of code k */
    __m128i rsh, compact;           /* unpack: 32 - B; pack: bytes 0..B-1, 8..8+B-1 -> 0..2B-1 */
} pack16_t;

static pack16_t pack16_consts(int B) {
    pack16_t k;
    int32_t ls[16], bi[16], bi1[16];
    int8_t cp[16];
    for (int i = 0; i < 16; i++) {
        ls[i] = 32 - B - (i * B & 7), bi[i] = i * B >> 3, bi1[i] = (i * B >> 3) + 1;
        cp[i] = (int8_t)(i < B ? i : i < 2 * B ? 8 + i - B : -1);
    }
    k.B = B;
    k.mask = _mm512_set1_epi32((1 << B) - 1);
    k.lsh = _mm512_loadu_si512(ls), k.bidx = _mm512_loadu_si512(bi), k.bidx1 = _mm512_loadu_si512(bi1);
    k.rsh = _mm_cvtsi32_si128(32 - B), k.compact = _mm_loadu_si128((const __m128i*)cp);
    return k;
}

/* n < 16 bytes at p: masked (no access beyond them) where AVX512BW/VL allow, else through a copy */
INLINE void store_bytes(uint8_t* p, __m128i v, int n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    _mm_mask_storeu_epi8(p, (__mmask16)((1u << n) - 1), v);
#else
    uint8_t b[16];
    _mm_storeu_si128((__m128i*)b, v);
    memcpy(p, b, (size_t)n);
#endif
}

INLINE __m128i load_bytes(const uint8_t* p, int n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p);
#else
    uint8_t b[16] = {0};
    memcpy(b, p, (size_t)n);
    return _mm_loadu_si128((const __m128i*)b);
#endif
}

/* 16 codes (int32 lanes, two's complement) -> 2B bytes at q: pairs merged in 64-bit lanes (2B
   bits), narrowed to 16 bits, pairs of those merged in 32-bit lanes (4B bits), then in 64-bit lanes
   (8 codes, B bytes each), the two B-byte runs made contiguous */
INLINE void pack_store16(__m512i cd, const pack16_t* k, uint8_t* q) {
    const int B = k->B;
    cd = _mm512_and_si512(cd, k->mask);
    __m128i w = _mm512_cvtepi64_epi16(_mm512_or_si512(cd, _mm512_srl_epi64(cd, _mm_cvtsi32_si128(32 - B))));
    w = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi32(0xFFFF)),
                     _mm_sll_epi32(_mm_srli_epi32(w, 16), _mm_cvtsi32_si128(2 * B)));
    w = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi64x(0xFFFFFFFF)),
                     _mm_sll_epi64(_mm_srli_epi64(w, 32), _mm_cvtsi32_si128(4 * B)));
    store_bytes(q, _mm_shuffle_epi8(w, k->compact), 2 * B);
}

/* 2B bytes at q -> 16 sign-extended codes: code k spans bytes bidx[k], bidx[k] + 1 (B <= 8), moved
   to the top of the lane, then arithmetically back down */
INLINE __m512i unpack16(const uint8_t* q, const pack16_t* k) {
    __m512i x = _mm512_cvtepu8_epi32(load_bytes(q, 2 * k->B)); /* lane j: byte j */
    __m512i w = _mm512_or_si512(_mm512_permutexvar_epi32(k->bidx, x),
                                _mm512_slli_epi32(_mm512_permutexvar_epi32(k->bidx1, x), 8));
    return _mm512_sra_epi32(_mm512_sllv_epi32(w, k->lsh), k->rsh);
}

/* encode_batch's last step: codes of t / s (s: the 16 lanes' scales; lanes l of bit l of `pick` take
   the rows of u, when u is given), 16 rows at a time in registers, transposed and narrowed into the
   payload bytes of lane l at q + l * pb */
static void quant_store16(const cfg_t* c, lanes_t* t, const float* s, int G, uint8_t* q, int64_t pb,
                          lanes_t* u, uint32_t pick) {
    const __m512 vs = _mm512_loadu_ps(s);
    fp8c_t k = fp8_consts(c->fmt);
    int bits4 = c->kind == 2 && c->bits == 4, packed = c->kind == 2 && c->bits != 4 && c->bits != 8;
    const pack16_t pk = pack16_consts(packed ? c->bits : 2);
    for (int i0 = 0; i0 < G; i0 += 16) {
        __m512 r[16];
        for (int j = 0; j < 16; j++) {
            __m512 v = _mm512_load_ps(t[i0 + j]);
            if (u) v = _mm512_mask_blend_ps((__mmask16)pick, v, _mm512_load_ps(u[i0 + j]));
            v = _mm512_div_ps(v, vs);
            r[j] = _mm512_castsi512_ps(c->kind == 2 ? int_bits16(v, c->qmax) : fp8_bits16(v, c->fmax, k));
        }
        tr16(r);
        for (int l = 0; l < 16; l++) {
            __m512i cd = _mm512_castps_si512(r[l]);
            if (packed) {
                pack_store16(cd, &pk, q + l * pb + i0 * pk.B / 8);
            } else if (bits4) {
                cd = _mm512_and_si512(cd, _mm512_set1_epi32(0xF));
                cd = _mm512_or_si512(cd, _mm512_srli_epi64(cd, 28)); /* odd nibble above the even one */
                _mm_storel_epi64((__m128i*)(q + l * pb + i0 / 2), _mm512_cvtepi64_epi8(cd));
            } else {
                _mm_storeu_si128((__m128i*)(q + l * pb + i0), _mm512_cvtepi32_epi8(cd));
            }
        }
    }
}

/* per lane: the largest |t[i][l]| and whether any is NaN (encode_batch's reduction). On |x| the
   fp32 order is the unsigned order of the bits, NaNs above +inf: one integer max per row. */
static void absmax_batch16(lanes_t* t, int G, float* amax, int* nan) {
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m = _mm512_setzero_si512();
    for (int i = 0; i < G; i++) m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_load_si512(t[i]), absm));
    __mmask16 isnan = _mm512_cmpgt_epu32_mask(m, _mm512_set1_epi32(0x7F800000));
    _mm512_storeu_si512(amax, m); /* a NaN lane's value is not used */
    for (int l = 0; l < L; l++) nan[l] = (isnan >> l) & 1;
}

/* acc <- acc + t (acc the first source: where both are NaN, acc's NaN, as in the scalar sums) */
static void add_lanes16(lanes_t* acc, lanes_t* t, int G) {
    for (int i = 0; i < G; i++) _mm512_store_ps(acc[i], add_first(_mm512_load_ps(acc[i]), _mm512_load_ps(t[i])));
}

#define BFLY(x, y)                                                                                   \
    do {                                                                                             \
        __m512 a_ = x, b_ = y;                                                                       \
        x = add_first(a_, b_);                                                                       \
        y = _mm512_sub_ps(a_, b_);                                                                   \
    } while (0)

/* strides 1, 2, 4, 8 of the butterflies on 16 consecutive rows held in registers */
INLINE void bfly16(__m512* r) {
#pragma GCC unroll 4
    for (int h = 1; h < 16; h <<= 1)
#pragma GCC unroll 16
        for (int i = 0; i < 16; i += 2 * h)
#pragma GCC unroll 8
            for (int j = i; j < i + h; j++) BFLY(r[j], r[j + h]);
}

/* decode_batch's first step, t[i][l] = value of code i of lane l times its scale */
static void dequant_batch16(const cfg_t* c, const uint8_t* q, int64_t pb, const uint8_t* s0, int G,
                            lanes_t* t, int bfly) {
    __m512 T[8];
    for (int k = 0; k < 8; k++) T[k] = _mm512_loadu_ps(LUT[c->fmt & 1] + 16 * k);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const int packed = c->kind == 2 && c->bits != 4 && c->bits != 8;
    const pack16_t pk = pack16_consts(packed ? c->bits : 2);
    for (int i0 = 0; i0 < G; i0 += 16) {
        __m512 r[16];
        for (int l = 0; l < 16; l++) {
            const uint8_t* ql = q + l * pb;
            float sl = get_scale(c, s0, l);
            __m512 m, s = _mm512_set1_ps(c->signs == 2 ? fabsf(sl) : sl); /* auto: the sign is a flag */
            if (packed) {
                m = _mm512_cvtepi32_ps(unpack16(ql + i0 * pk.B / 8, &pk));
            } else if (c->kind == 2 && c->bits == 4) { /* byte k holds codes 2k (low nibble), 2k + 1 */
                __m128i b = _mm_loadl_epi64((const __m128i*)(ql + i0 / 2));
                __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
                v = _mm512_and_si512(_mm512_srlv_epi32(v, shifts), _mm512_set1_epi32(0xF));
                v = _mm512_sub_epi32(v, _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(8)), 1));
                m = _mm512_cvtepi32_ps(v);
            } else if (c->kind == 2) {
                m = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(ql + i0))));
            } else { /* LUT[b] = LUT[b & 0x7F] with the sign of b: four 32-entry permutes */
                __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(ql + i0)));
                __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
                __mmask16 b5 = _mm512_test_epi32_mask(a, _mm512_set1_epi32(32));
                __mmask16 b6 = _mm512_test_epi32_mask(a, _mm512_set1_epi32(64));
                __m512 lo = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(T[0], a, T[1]),
                                                 _mm512_permutex2var_ps(T[2], a, T[3]));
                __m512 hi = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(T[4], a, T[5]),
                                                 _mm512_permutex2var_ps(T[6], a, T[7]));
                __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
                m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mask_blend_ps(b6, lo, hi)), sign));
            }
            /* s * m with s the first source: where both are NaN, x86 returns the first one, and
               the scalar loops (and so the bytes of the reference build) return the scale's */
            r[l] = mul_first(s, m);
        }
        tr16(r);
        if (bfly) bfly16(r); /* fwht_batch16's first pass, on the rows while they are in registers */
        for (int k = 0; k < 16; k++) _mm512_storeu_ps(t[i0 + k], r[k]);
    }
}
#else
#define SIMD16 0
#endif

static void load_batch(const void* x, int dt, int64_t g0, int G, lanes_t* t) {
    if (SIMD16 && dt != DT_F16 && G % 16 == 0) {
#if SIMD16
        load_batch16(x, dt, g0, G, t);
#endif
        return;
    }
    for (int l = 0; l < L; l++) {
        int64_t base = (g0 + l) * G;
        if (dt == DT_F32) {
            const float* p = (const float*)x + base;
            for (int i = 0; i < G; i++) t[i][l] = p[i];
        } else if (dt == DT_BF16) {
            const uint16_t* p = (const uint16_t*)x + base;
            for (int i = 0; i < G; i++) t[i][l] = u2f((uint32_t)p[i] << 16);
        } else {
            const uint16_t* p = (const uint16_t*)x + base;
            for (int i = 0; i < G; i++) t[i][l] = half_to_float(p[i]);
        }
    }
}

static void store_batch(lanes_t* t, int dt, int64_t g0, int G, void* y) {
    if (SIMD16 && dt != DT_F16 && G % 16 == 0) {
#if SIMD16
        store_batch16(t, dt, g0, G, y);
#endif
        return;
    }
    for (int l = 0; l < L; l++) {
        int64_t base = (g0 + l) * G;
        if (dt == DT_F32) {
            float* p = (float*)y + base;
            for (int i = 0; i < G; i++) p[i] = t[i][l];
        } else if (dt == DT_BF16) {
            uint16_t* p = (uint16_t*)y + base;
            for (int i = 0; i < G; i++) p[i] = float_to_bf16(t[i][l]);
        } else {
            uint16_t* p = (uint16_t*)y + base;
            for (int i = 0; i < G; i++) p[i] = float_to_half(t[i][l]);
        }
    }
}

/* flip_signs for L groups: rows i of t with D_i = -1 (0 - t), in the lanes l of bit l of `lanes`;
   with src, t <- src D (t of those lanes: the rows of src, flipped or not). */
static void flip_lanes(lanes_t* t, int G, uint32_t lanes, lanes_t* src) {
    if (!src && !lanes) return;
    if (!src) src = t;
#if SIMD16
    for (int i = 0; i < G; i++) { /* a row is one vector: a masked 0 - t */
        __m512 r = _mm512_load_ps(src[i]);
        if (sign_flipped(i, G)) r = _mm512_mask_sub_ps(r, (__mmask16)lanes, _mm512_setzero_ps(), r);
        _mm512_store_ps(t[i], r);
    }
#else
    for (int i = 0; i < G; i++) {
        int f = sign_flipped(i, G);
        for (int l = 0; l < L; l++) t[i][l] = f && (lanes >> l & 1) ? 0.0f - src[i][l] : src[i][l];
    }
#endif
}

static void fwht_batch(lanes_t* t, int G, float rg) {
    for (int h = 1; h < G; h <<= 1)
        for (int i = 0; i < G; i += 2 * h)
            for (int j = i; j < i + h; j++)
                for (int l = 0; l < L; l++) {
                    float a = t[j][l], b = t[j + h][l];
                    t[j][l] = a + b;
                    t[j + h][l] = a - b;
                }
    for (int i = 0; i < G; i++)
        for (int l = 0; l < L; l++) t[i][l] /= rg;
}

#if SIMD16
/* fwht_batch with its neighbours fused: t <- ((t * pre) @ H / rg) / post (pre, post: per-lane
   factors or NULL). The butterflies run in passes of strides held in registers: 1, 2, 4, 8 on 16
   rows (bfly16; on decode while dequant_batch16 holds the rows), then up to three strides on 8 rows
   (16, 32, 64, ...): the same sums and differences of the same operands as the stride-by-stride
   loops, with a third of their trips through memory (G = 128: two, or one after a dequant). */

/* the R live rows r0.. of fwht_pass16 divided (OP: _mm512_div_ps) or multiplied by v, in row order */
#define OP_ROWS(OP, v)                                                                               \
    do {                                                                                             \
        r0 = OP(r0, v), r1 = OP(r1, v);                                                              \
        if (R >= 4) r2 = OP(r2, v), r3 = OP(r3, v);                                                  \
        if (R == 8) {                                                                                \
            r4 = OP(r4, v), r5 = OP(r5, v);                                                          \
            r6 = OP(r6, v), r7 = OP(r7, v);                                                          \
        }                                                                                            \
    } while (0)

/* one pass of log2(R) butterfly strides h0, 2 h0, .. over rows j + m h0 (m < R) held in registers;
   the loops are spelled out (gcc keeps a looped r[] on the stack) */
INLINE void fwht_pass16(lanes_t* t, int G, int h0, const int R, int first, int last, __m512 vrg, int inv,
                        const float* pre, const float* post, lanes_t* acc) {
    const __m512 vpre = pre ? _mm512_loadu_ps(pre) : _mm512_setzero_ps();
    const __m512 vpost = post ? _mm512_loadu_ps(post) : _mm512_setzero_ps();
    for (int blk = 0; blk < G; blk += R * h0)
        for (int j = blk; j < blk + h0; j++) {
            __m512 r0, r1, r2, r3, r4, r5, r6, r7;
            r0 = _mm512_load_ps(t[j]);
            r1 = _mm512_load_ps(t[j + h0]);
            if (R >= 4) {
                r2 = _mm512_load_ps(t[j + 2 * h0]);
                r3 = _mm512_load_ps(t[j + 3 * h0]);
            }
            if (R == 8) {
                r4 = _mm512_load_ps(t[j + 4 * h0]);
                r5 = _mm512_load_ps(t[j + 5 * h0]);
                r6 = _mm512_load_ps(t[j + 6 * h0]);
                r7 = _mm512_load_ps(t[j + 7 * h0]);
            }
            if (first && pre) {
                r0 = mul_first(r0, vpre), r1 = mul_first(r1, vpre);
                if (R >= 4) r2 = mul_first(r2, vpre), r3 = mul_first(r3, vpre);
                if (R == 8) {
                    r4 = mul_first(r4, vpre), r5 = mul_first(r5, vpre);
                    r6 = mul_first(r6, vpre), r7 = mul_first(r7, vpre);
                }
            }
            BFLY(r0, r1);
            if (R >= 4) {
                BFLY(r2, r3);
                BFLY(r0, r2);
                BFLY(r1, r3);
            }
            if (R == 8) {
                BFLY(r4, r5);
                BFLY(r6, r7);
                BFLY(r4, r6);
                BFLY(r5, r7);
                BFLY(r0, r4);
                BFLY(r1, r5);
                BFLY(r2, r6);
                BFLY(r3, r7);
            }
            if (last) {
                if (inv)
                    OP_ROWS(_mm512_mul_ps, vrg);
                else
                    OP_ROWS(_mm512_div_ps, vrg);
                if (post) OP_ROWS(_mm512_div_ps, vpost);
            }
            lanes_t* o = t;
            if (last && acc) { /* dsum: acc + value, acc the first source (as the scalar sum) */
                o = acc;
                r0 = add_first(_mm512_load_ps(acc[j]), r0), r1 = add_first(_mm512_load_ps(acc[j + h0]), r1);
                if (R >= 4) {
                    r2 = add_first(_mm512_load_ps(acc[j + 2 * h0]), r2);
                    r3 = add_first(_mm512_load_ps(acc[j + 3 * h0]), r3);
                }
                if (R == 8) {
                    r4 = add_first(_mm512_load_ps(acc[j + 4 * h0]), r4);
                    r5 = add_first(_mm512_load_ps(acc[j + 5 * h0]), r5);
                    r6 = add_first(_mm512_load_ps(acc[j + 6 * h0]), r6);
                    r7 = add_first(_mm512_load_ps(acc[j + 7 * h0]), r7);
                }
            }
            _mm512_store_ps(o[j], r0);
            _mm512_store_ps(o[j + h0], r1);
            if (R >= 4) {
                _mm512_store_ps(o[j + 2 * h0], r2);
                _mm512_store_ps(o[j + 3 * h0], r3);
            }
            if (R == 8) {
                _mm512_store_ps(o[j + 4 * h0], r4);
                _mm512_store_ps(o[j + 5 * h0], r5);
                _mm512_store_ps(o[j + 6 * h0], r6);
                _mm512_store_ps(o[j + 7 * h0], r7);
            }
        }
}

/* G > 16: the first four strides as one pass of 16 rows in registers (t * pre first, if given);
   done0 = 4 when the caller already applied them (dequant_batch16 with bfly) */
static void fwht_batch16(lanes_t* t, int G, float rg, const float* pre, const float* post, lanes_t* acc,
                         int done0) {
    int lg = 0;
    while ((1 << lg) < G) lg++;
    /* rg a power of two (G = 16, 64, 256): x / rg is x * (1 / rg), both the correctly rounded x / rg
       (NaN, inf, zeros and subnormals alike), and a product is cheaper */
    const int inv = (f2u(rg) & 0x7FFFFFu) == 0;
    const __m512 vrg = _mm512_set1_ps(inv ? 1.0f / rg : rg);
    int done = done0;
    if (lg > 4 && done == 0) {
        const __m512 vpre = pre ? _mm512_loadu_ps(pre) : _mm512_setzero_ps();
        for (int blk = 0; blk < G; blk += 16) {
            __m512 r[16];
            for (int k = 0; k < 16; k++) r[k] = _mm512_load_ps(t[blk + k]);
            if (pre)
                for (int k = 0; k < 16; k++) r[k] = mul_first(r[k], vpre);
            bfly16(r);
            for (int k = 0; k < 16; k++) _mm512_store_ps(t[blk + k], r[k]);
        }
        done = 4;
    }
    while (done < lg) {
        int st = lg - done >= 3 ? 3 : lg - done, first = done == 0, last = done + st == lg;
        if (st == 3)
            fwht_pass16(t, G, 1 << done, 8, first, last, vrg, inv, pre, post, acc);
        else if (st == 2)
            fwht_pass16(t, G, 1 << done, 4, first, last, vrg, inv, pre, post, acc);
        else
            fwht_pass16(t, G, 1 << done, 2, first, last, vrg, inv, pre, post, acc);
        done += st;
    }
}
#endif

/* encode_batch's rotation: t <- (t * sa) @ H / sqrt(G) (sa: taco's per-lane s_a, else NULL) */
static void rotate_lanes(const cfg_t* c, lanes_t* t, int G, const float* sa) {
    if (SIMD16 && c->rotate && G % 16 == 0) {
#if SIMD16
        fwht_batch16(t, G, (float)sqrt((double)G), sa, NULL, NULL, 0);
#endif
    } else {
        if (sa)
            for (int i = 0; i < G; i++)
                for (int l = 0; l < L; l++) t[i][l] *= sa[l];
        if (c->rotate) fwht_batch(t, G, (float)sqrt((double)G));
    }
}

/* per lane: the quantization scale of the rotated group, rounded onto the scale format */
static void lane_scales(const cfg_t* c, lanes_t* t, int G, float* s) {
    float amax[L];
    int nan[L];
    if (SIMD16 && G % 16 == 0) {
#if SIMD16
        absmax_batch16(t, G, amax, nan);
#endif
    } else {
        for (int l = 0; l < L; l++) amax[l] = 0.0f, nan[l] = 0;
        for (int i = 0; i < G; i++)
            for (int l = 0; l < L; l++) {
                float a = fabsf(t[i][l]);
                amax[l] = a > amax[l] ? a : amax[l];
                nan[l] |= a != a;
            }
    }
    for (int l = 0; l < L; l++) s[l] = round_scale(c, group_scale(c, nan[l] ? NAN : amax[l]));
}

/* t <- u in the lanes l of bit l of `lanes` */
static void select_lanes(lanes_t* t, lanes_t* u, int G, uint32_t lanes) {
#if SIMD16
    for (int i = 0; i < G; i++) {
        __m512 a = _mm512_load_ps(t[i]), b = _mm512_load_ps(u[i]);
        _mm512_store_ps(t[i], _mm512_mask_blend_ps((__mmask16)lanes, a, b));
    }
#else
    for (int i = 0; i < G; i++)
        for (int l = 0; l < L; l++) t[i][l] = lanes >> l & 1 ? u[i][l] : t[i][l];
#endif
}

/* codes of t / s, packed: lane l's payload at q + l * pb; with u, lanes l of bit l of `pick` take the
   rows of u first */
static void quant_lanes(const cfg_t* c, lanes_t* t, const float* s, int G, uint8_t* q, int64_t pb, lanes_t* u,
                        uint32_t pick) {
    if (SIMD16 && G % 16 == 0) {
#if SIMD16
        quant_store16(c, t, s, G, q, pb, u, pick);
#endif
        return;
    }
    if (u) select_lanes(t, u, G, pick);
    uint32_t code[MAXG][L] ALIGN64;
    if (c->kind == 2) {
        for (int i = 0; i < G; i++)
            for (int l = 0; l < L; l++) code[i][l] = int_bits(t[i][l] / s[l], c->qmax);
    } else {
        fp8c_t k = fp8_consts(c->fmt);
        for (int i = 0; i < G; i++)
            for (int l = 0; l < L; l++) code[i][l] = fp8_bits(t[i][l] / s[l], c->fmax, k);
    }
    for (int l = 0; l < L; l++) pack_codes(&code[0][l], L, G, c->kind == 2 ? c->bits : 8, q + l * pb);
}

/* signs="auto" of L groups (int, rotated): both candidates rotated and scaled, each lane keeps the one
   with the smaller scale (auto_pick), its scale written negative when the randomized one is kept */
static void encode_batch_auto(const cfg_t* c, lanes_t* t, int G, uint8_t* q, int64_t pb, uint8_t* s0) {
    lanes_t u[MAXG] ALIGN64;
    float s[L], s2[L], sel[L];
    flip_lanes(u, G, 0xFFFF, t); /* u = t D */
    rotate_lanes(c, t, G, NULL);
    rotate_lanes(c, u, G, NULL);
    lane_scales(c, t, G, s);
    lane_scales(c, u, G, s2);
    uint32_t pick = 0;
    for (int l = 0; l < L; l++) {
        int p = auto_pick(s[l], s2[l]);
        pick |= (uint32_t)p << l;
        sel[l] = p ? s2[l] : s[l];
    }
    quant_lanes(c, t, sel, G, q, pb, u, pick);
    for (int l = 0; l < L; l++) put_scale(c, s0, l, pick >> l & 1 ? -s2[l] : s[l]);
}

/* encode_group for L groups: payload of lane l at q + l * pb, its scales number l of s0/s1. */
static void encode_batch(const cfg_t* c, lanes_t* t, int G, uint8_t* q, int64_t pb, uint8_t* s0,
                         uint8_t* s1) {
    if (c->kind == 2 && c->rotate && c->signs == 2) {
        encode_batch_auto(c, t, G, q, pb, s0);
        return;
    }
    float sa[L], s[L];
    if (c->kind == 0) {
        float acc[L] = {0};
        for (int i = 0; i < G; i++)
            for (int l = 0; l < L; l++) acc[l] += t[i][l] * t[i][l];
        for (int l = 0; l < L; l++) sa[l] = round_scale(c, adaptive_scale(c, acc[l], G));
    }
    if (c->rotate && c->signs == 1) flip_lanes(t, G, 0xFFFF, NULL);
    rotate_lanes(c, t, G, c->kind == 0 ? sa : NULL);
    lane_scales(c, t, G, s);
    quant_lanes(c, t, s, G, q, pb, NULL, 0);
    for (int l = 0; l < L; l++) {
        put_scale(c, s0, l, s[l]);
        if (c->kind == 0) put_scale(c, s1, l, sa[l]);
    }
}

/* acc <- acc + t, lane-parallel (the running sums of decode_sum_encode) */
static void add_lanes(lanes_t* acc, lanes_t* t, int G) {
#if SIMD16
    add_lanes16(acc, t, G);
#else
    for (int i = 0; i < G; i++)
        for (int l = 0; l < L; l++) acc[i][l] = acc[i][l] + t[i][l];
#endif
}

/* decode_group for L groups into t; with acc != NULL, acc[i][l] += the decoded values instead (t: scratch) */
static void decode_batch(const cfg_t* c, const uint8_t* q, int64_t pb, const uint8_t* s0, const uint8_t* s1,
                         int G, lanes_t* t, lanes_t* acc) {
#if SIMD16
    const int pre4 = c->rotate && G % 16 == 0 && G > 16; /* dequant applies the first four strides */
    if (G % 16 == 0) dequant_batch16(c, q, pb, s0, G, t, pre4);
    else
#endif
    for (int l = 0; l < L; l++) {
        const uint8_t* ql = q + l * pb;
        float s = get_scale(c, s0, l);
        if (c->signs == 2) s = fabsf(s); /* auto: the sign is a flag */
        if (c->kind == 2) {
            unpack_codes(ql, G, c->bits, s, &t[0][l], L);
        } else {
            const float* lut = LUT[c->fmt];
            for (int i = 0; i < G; i++) t[i][l] = lut[ql[i]] * s;
        }
    }
    float sa[L] = {0}; /* read by kind 0 only */
    if (c->kind == 0)
        for (int l = 0; l < L; l++) sa[l] = get_scale(c, s1, l);
    if (SIMD16 && c->rotate && G % 16 == 0 && !c->signs) {
#if SIMD16
        fwht_batch16(t, G, (float)sqrt((double)G), NULL, c->kind == 0 ? sa : NULL, acc, pre4 ? 4 : 0);
#endif
        return;
    }
    if (SIMD16 && c->rotate && G % 16 == 0) { /* signs (int: no s_a): flip after, then accumulate */
#if SIMD16
        fwht_batch16(t, G, (float)sqrt((double)G), NULL, NULL, NULL, pre4 ? 4 : 0);
#endif
    } else if (c->rotate) {
        fwht_batch(t, G, (float)sqrt((double)G));
    }
    if (c->rotate && c->signs) { /* auto: D in the lanes whose scale is negative */
        uint32_t neg = 0;
        for (int l = 0; l < L; l++) neg |= c->signs == 1 ? 1u << l : (f2u(get_scale(c, s0, l)) >> 31) << l;
        flip_lanes(t, G, neg, NULL);
    }
    if (c->kind == 0)
        for (int i = 0; i < G; i++)
            for (int l = 0; l < L; l++) t[i][l] /= sa[l];
    if (acc) add_lanes(acc, t, G);
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
    void* y; void* sum; int sum_dt; /* dsum: optional sums, in dtype sum_dt */
    const void* own; int own_dt; int own_index; /* dsum: raw local term at this position */
} job_t;

/* the lanes of a batch holding a big group (big_group), bit l for lane l: the single-group path
   encodes them again (the batch path's other lanes keep their bytes, NaN signs included) */
static uint32_t big_lanes(const cfg_t* c, lanes_t* t, int G) {
    if (c->kind == 0 || !c->rotate) return 0;
    const float th = pow2f(127 - log2i(G));
    int big[L] = {0};
    for (int i = 0; i < G; i++)
        for (int l = 0; l < L; l++) big[l] |= fabsf(t[i][l]) >= th;
    uint32_t m = 0;
    for (int l = 0; l < L; l++) m |= (uint32_t)big[l] << l;
    return m;
}

/* the lanes of L consecutive groups whose scale is big (big_scale), bit l for lane l */
static uint32_t big_scales(const cfg_t* c, const uint8_t* s0, int G) {
    uint32_t m = 0;
    for (int l = 0; l < L; l++) m |= (uint32_t)big_scale(c, get_scale(c, s0, l), G) << l;
    return m;
}

static int64_t payload_bytes(const cfg_t* c) { return (int64_t)c->group * (c->kind == 2 ? c->bits : 8) / 8; }

static void encode_range(const void* p, int64_t g0, int64_t g1) {
    const job_t* j = (const job_t*)p;
    int G = j->c->group;
    int64_t pb = payload_bytes(j->c), sb = scale_size(j->c), g = g0, full = j->n / G; /* full: unpadded */
    lanes_t t[MAXG] ALIGN64;
    float v[MAXG];
    for (; g + L <= g1 && g + L <= full; g += L) {
        load_batch(j->x, j->dt, g, G, t);
        uint32_t big = big_lanes(j->c, t, G);
        encode_batch(j->c, t, G, j->q + g * pb, pb, j->s0 + sb * g, j->s1 ? j->s1 + sb * g : NULL);
        for (int l = 0; l < L; l++)
            if (big >> l & 1) { /* finite in, finite out: the single-group path pre-scales it */
                load_group(j->x, j->dt, (g + l) * G, j->n, G, v);
                encode_group(j->c, v, j->q + (g + l) * pb, j->s0 + sb * (g + l), j->s1 ? j->s1 + sb * (g + l) : NULL, G);
            }
    }
    for (; g < g1; g++) {
        load_group(j->x, j->dt, g * G, j->n, G, v);
        encode_group(j->c, v, j->q + g * pb, j->s0 + sb * g, j->s1 ? j->s1 + sb * g : NULL, G);
    }
}

static void decode_range(const void* p, int64_t g0, int64_t g1) {
    const job_t* j = (const job_t*)p;
    int G = j->c->group;
    int64_t pb = payload_bytes(j->c), sb = scale_size(j->c), g = g0, full = j->n / G;
    lanes_t t[MAXG] ALIGN64;
    for (; g + L <= g1 && g + L <= full; g += L) {
        decode_batch(j->c, j->iq + g * pb, pb, j->is0 + sb * g, j->is1 ? j->is1 + sb * g : NULL, G, t, NULL);
        store_batch(t, j->dt, g, G, j->y);
        uint32_t big = big_scales(j->c, j->is0 + sb * g, G);
        for (int l = 0; l < L; l++) /* finite in, finite out: the single-group path, in a scaled domain */
            if (big >> l & 1) decode_range(p, g + l, g + l + 1);
    }
    float v[MAXG];
    for (; g < g1; g++) {
        decode_group(j->c, j->iq + g * pb, j->is0 + sb * g, j->is1 ? j->is1 + sb * g : NULL, v, G);
        if (j->dt == DT_BF16 && big_scale(j->c, get_scale(j->c, j->is0 + sb * g, 0), G))
            for (int i = 0; i < G; i++) /* saturate at bf16's largest (finite_clamp; fp16: in the cast) */
                v[i] = clampf(v[i], -u2f(BF16_MAX_BITS), u2f(BF16_MAX_BITS));
        store_group(v, j->dt, g * G, j->n, G, j->y);
    }
}

static void dsum_groups(const job_t* j, int64_t g, int64_t g1);

static void dsum_range(const void* p, int64_t g0, int64_t g1) {
    const job_t* j = (const job_t*)p;
    int G = j->c->group;
    int64_t pb = payload_bytes(j->c), sb = scale_size(j->c), g = g0, full = j->n / G;
    int nterms = j->nchunks + (j->own != NULL);
    lanes_t at[MAXG] ALIGN64, t[MAXG] ALIGN64;
    for (; g + L <= g1 && g + L <= full; g += L) { /* whole groups: lane-parallel batches */
        uint32_t big = 0, bigsum; /* lanes redone by dsum_groups; lanes whose sum is encoded again */
        for (int k = 0; k < j->nchunks; k++) big |= big_scales(j->c, j->is0 + k * j->stride + sb * g, G);
        for (int tt = 0, k = 0; tt < nterms; tt++) { /* s = y_0 + y_1 + ...: y_0 lands in at as is */
            if (j->own != NULL && tt == j->own_index) {
                load_batch(j->own, j->own_dt, g, G, tt == 0 ? at : t);
                if (tt > 0) add_lanes(at, t, G);
            } else {
                int64_t o = (k++) * j->stride;
                const uint8_t* s1 = j->is1 ? j->is1 + o + sb * g : NULL;
                decode_batch(j->c, j->iq + o + g * pb, pb, j->is0 + o + sb * g, s1, G, tt == 0 ? at : t,
                             tt == 0 ? NULL : at);
            }
        }
        if (j->sum) store_batch(at, j->sum_dt, g, G, j->sum);
        bigsum = j->q ? big_lanes(j->c, at, G) & ~big : 0;
        float v[L][MAXG]; /* finite in, finite out: big sums encoded again by the single-group path */
        for (int l = 0; l < L; l++)
            if (bigsum >> l & 1)
                for (int i = 0; i < G; i++) v[l][i] = at[i][l];
        if (j->q) encode_batch(j->c, at, G, j->q + g * pb, pb, j->s0 + sb * g, j->s1 ? j->s1 + sb * g : NULL);
        for (int l = 0; l < L; l++) {
            if (bigsum >> l & 1)
                encode_group(j->c, v[l], j->q + (g + l) * pb, j->s0 + sb * (g + l), j->s1 ? j->s1 + sb * (g + l) : NULL, G);
            if (big >> l & 1) dsum_groups(j, g + l, g + l + 1); /* big scales: decoded in a scaled domain */
        }
    }
    dsum_groups(j, g, g1);
}

/* dsum_range's single groups (ragged tails, the rest of a range) */
static __attribute__((noinline)) void dsum_groups(const job_t* j, int64_t g, int64_t g1) {
    int G = j->c->group;
    int64_t pb = payload_bytes(j->c), sb = scale_size(j->c);
    int nterms = j->nchunks + (j->own != NULL);
    float acc[MAXG], v[MAXG];
    for (; g < g1; g++) {
        int64_t valid = j->n - g * G;
        for (int t = 0, k = 0; t < nterms; t++) {
            if (j->own != NULL && t == j->own_index) {
                load_group(j->own, j->own_dt, g * G, j->n, G, v);
            } else {
                int64_t o = (k++) * j->stride;
                decode_group(j->c, j->iq + o + g * pb, j->is0 + o + sb * g, j->is1 ? j->is1 + o + sb * g : NULL,
                             v, G);
            }
            if (t == 0) /* s = y_0 + y_1 + ...: the first term is taken as is (keeps -0) */
                for (int i = 0; i < G; i++) acc[i] = i < valid ? v[i] : 0.0f;
            else
                for (int i = 0; i < G; i++) acc[i] += i < valid ? v[i] : 0.0f;
        }
        if (j->sum) store_group(acc, j->sum_dt, g * G, j->n, G, j->sum);
        if (j->q) encode_group(j->c, acc, j->q + g * pb, j->s0 + sb * g, j->s1 ? j->s1 + sb * g : NULL, G);
    }
}

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
   number own_index; optionally store the n sums (dtype sum_dt) and re-encode them (oq != NULL). */
void taco_decode_sum_encode(const cfg_t* c, int nchunks, int64_t stride, const uint8_t* q,
                            const uint8_t* s0, const uint8_t* s1, int64_t n, const void* own,
                            int own_dt, int own_index, uint8_t* oq, uint8_t* os0, uint8_t* os1,
                            void* sum, int sum_dt, int nt) {
    job_t j = {0};
    j.c = c; j.nchunks = nchunks; j.stride = stride; j.iq = q; j.is0 = s0; j.is1 = s1; j.n = n;
    j.own = own; j.own_dt = own_dt; j.own_index = own_index;
    j.q = oq; j.s0 = os0; j.s1 = os1; j.sum = sum; j.sum_dt = sum_dt;
    parallel_for(dsum_range, &j, groups(c, n), nt);
}
