/* Fused kernels of the block codecs: int8, and the 4-bit int4 and fp4 (wire format: p2p/codecs.py),
 * and of the sums the part owners' aggregators take (p2p/aggregate.py; at the end of the file).
 *
 * p2p/native.py builds this file with the system C compiler and calls it through
 * ctypes, which releases the GIL. The torch code in p2p/codecs.py is the
 * reference: the tests check that both give the same bytes for the same input and
 * the same values (or the same error) for the same bytes. Each value is computed
 * with the same IEEE fp32 operations as there, one divide to scale and one
 * multiply to decode (built with -ffp-contract=off, so no fused multiply-add), so
 * the results agree bit for bit.
 *
 * Each block (1 KB of fp32 by default) is worked on while it is in cache, instead
 * of a dozen whole-array torch passes and their temporaries: on two shared cores
 * those temporaries fell out of cache and the codec dominated the all-reduce's
 * CPU time. The encoders fill "decoded" by unpacking their own output with the
 * decoder's code, so what they report is what every receiver decodes.
 */
#include <stdint.h>
#include <string.h>

enum { KIND_INT4 = 0, KIND_FP4 = 1 };
enum { OK = 0, NON_FINITE_INPUT, NON_FINITE_SCALE, NEGATIVE_SCALE, SCALE_OVERFLOW, BAD_CODE, BAD_PADDING };

#define SCALE_LIMIT 0x1p120f /* p2p.codecs.SCALE_LIMIT */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* One build for any x86-64 host: the AVX2 version is picked at load time where the CPU has it. */
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline uint32_t bits_of(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float float_of(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

/* The unscaled value of a code (1..15), as p2p.codecs.Int4Codec/FP4Codec.values16 give it. */
static inline float int4_value(uint32_t code) { return (float)((int32_t)code - 8); }

static inline float fp4_value(uint32_t code) {
    /* level q = code - 8 = +-e: +-2^(e-7) for e in 1..7, +0 for e = 0 (branch-free, so it vectorizes) */
    int32_t q = (int32_t)code - 8, sign = q >> 31, e = (q ^ sign) - sign;
    uint32_t pattern = ((uint32_t)sign & 0x80000000u) | ((uint32_t)(e + 120) << 23);
    return float_of(pattern & (uint32_t)-(e != 0));
}

/* The code of a scaled fp4 value: sign, exponent and first mantissa bit of its fp32 pattern
 * (the derivation is FP4Codec.code_table's). */
static inline uint32_t fp4_code(float v) {
    uint32_t u = bits_of(v), exponent = (u >> 23) & 0xFF, bit = (u >> 22) & 1;
    int32_t level = (int32_t)(exponent + bit) - 120;
    level = level < 0 ? 0 : (level > 7 ? 7 : level);
    if (exponent >= 120 && level < 1)
        level = 1;
    return (u >> 31) ? 8 - (uint32_t)level : 8 + (uint32_t)level;
}

/* The fp32 pattern of the largest |x[i]|: for non-negative floats the patterns order as the
 * values do, and any NaN or Inf gives a pattern from 0x7F800000 up. */
MULTIVERSION
static uint32_t absmax_bits(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* A block's scale from the pattern of its (finite) absmax, as BlockCodec.encode computes it. */
static inline float scale_of(uint32_t m, float qmax) {
    float scale = float_of(m) / qmax;
    return scale > SCALE_LIMIT ? SCALE_LIMIT : scale;
}

/* OK, or the first of NON_FINITE_SCALE, NEGATIVE_SCALE, SCALE_OVERFLOW that any of a payload's
 * nblocks scales fails: BlockCodec._split's order. */
static int check_scales(const uint8_t *data, int64_t nblocks) {
    int non_finite = 0, negative = 0, overflow = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        float s;
        memcpy(&s, data + 4 * b, 4); /* the payload need not be aligned */
        non_finite |= !__builtin_isfinite(s);
        negative |= s < 0;
        overflow |= s > SCALE_LIMIT;
    }
    return non_finite ? NON_FINITE_SCALE : negative ? NEGATIVE_SCALE : overflow ? SCALE_OVERFLOW : OK;
}

static inline uint32_t int4_code(float v) {
    float q = __builtin_nearbyintf(v); /* round half to even, as torch.round */
    q = q < -7.0f ? -7.0f : (q > 7.0f ? 7.0f : q);
    return (uint32_t)((int32_t)q + 8);
}

/* A kind's code of a scaled value, and the unscaled value of a code. */
static inline uint32_t code_of(int kind, float v) { return kind == KIND_INT4 ? int4_code(v) : fp4_code(v); }
static inline float value_of(int kind, uint32_t code) { return kind == KIND_INT4 ? int4_value(code) : fp4_value(code); }

/* One block of n values divided by divisor, packed: value j in the low nibble of byte j, value
 * j + h in its high nibble, h = ceil(n / 2); an odd block ends with the pad code 8. */
static inline __attribute__((always_inline)) void pack(int kind, const float *x, int64_t n, float divisor,
                                                       uint8_t *out) {
    int64_t h = (n + 1) / 2, full = n - h;
    for (int64_t j = 0; j < full; j++)
        out[j] = (uint8_t)(code_of(kind, x[j] / divisor) | code_of(kind, x[j + h] / divisor) << 4);
    if (full < h)
        out[h - 1] = (uint8_t)(code_of(kind, x[h - 1] / divisor) | 8u << 4);
}

/* pack() for each kind: kind a constant in each, so its loop vectorizes (one with a run-time
 * kind did not, and ran 3-5x slower). */
MULTIVERSION
static void pack_int4(const float *x, int64_t n, float divisor, uint8_t *out) { pack(KIND_INT4, x, n, divisor, out); }
MULTIVERSION
static void pack_fp4(const float *x, int64_t n, float divisor, uint8_t *out) { pack(KIND_FP4, x, n, divisor, out); }

/* The values of one block's packed codes times scale; nonzero if a code is 0 (invalid). */
MULTIVERSION
static int unpack(int kind, const uint8_t *in, int64_t n, float scale, float *out) {
    int64_t h = (n + 1) / 2;
    uint32_t zero = 0;
    for (int64_t j = 0; j < h; j++) {
        uint32_t c = in[j] & 15;
        zero |= c == 0;
        out[j] = value_of(kind, c) * scale;
    }
    for (int64_t j = 0; j < n - h; j++) {
        uint32_t c = in[j] >> 4;
        zero |= c == 0;
        out[h + j] = value_of(kind, c) * scale;
    }
    return zero != 0;
}

/* Encode numel values: nblocks fp32 scales, then the packed codes, into out (wire_bytes(numel));
 * into decoded, if not NULL, what decoding out gives (by decoding it: the same code path).
 * kind: KIND_INT4 (scale = absmax / 7) or KIND_FP4 (scale = absmax). Returns OK or
 * NON_FINITE_INPUT (out and decoded then hold garbage). */
int gonka_nibble_encode(int kind, const float *x, int64_t numel, int64_t block, uint8_t *out, float *decoded) {
    if (block < 2 || block % 2 || numel < 0)
        return -1;
    int64_t nblocks = (numel + block - 1) / block;
    uint8_t *codes = out + 4 * nblocks;
    float qmax = kind == KIND_INT4 ? 7.0f : 1.0f;
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t start = b * block, n = numel - start < block ? numel - start : block;
        uint32_t m = absmax_bits(x + start, n);
        if (m >= 0x7F800000u)
            return NON_FINITE_INPUT;
        float scale = scale_of(m, qmax);
        memcpy(out + 4 * b, &scale, 4);
        float divisor = scale > 0 ? scale : 1.0f; /* an all-zero block: codes of 0 */
        uint8_t *packed = codes + b * (block / 2);
        (kind == KIND_INT4 ? pack_int4 : pack_fp4)(x + start, n, divisor, packed);
        if (decoded)
            unpack(kind, packed, n, scale, decoded + start);
    }
    return OK;
}

/* Decode an untrusted payload of exactly wire_bytes(numel) bytes (the caller checks the size)
 * into out. Returns OK or, in the order the torch code checks them, NON_FINITE_SCALE,
 * NEGATIVE_SCALE, SCALE_OVERFLOW (any scale), then BAD_CODE (a code 0 in a full block),
 * then for a short last block BAD_PADDING before BAD_CODE. out then holds garbage. */
int gonka_nibble_decode(int kind, const uint8_t *data, int64_t numel, int64_t block, float *out) {
    if (block < 2 || block % 2 || numel < 0)
        return -1;
    int64_t nblocks = (numel + block - 1) / block, full = numel / block;
    int error = check_scales(data, nblocks);
    if (error)
        return error;
    const uint8_t *codes = data + 4 * nblocks;
    int zero = 0;
    for (int64_t b = 0; b < full; b++) {
        float s;
        memcpy(&s, data + 4 * b, 4);
        zero |= unpack(kind, codes + b * (block / 2), block, s, out + b * block);
    }
    if (zero)
        return BAD_CODE;
    if (full < nblocks) {
        int64_t n = numel - full * block, h = (n + 1) / 2;
        const uint8_t *in = codes + full * (block / 2);
        if (n % 2 && in[h - 1] >> 4 != 8)
            return BAD_PADDING;
        float s;
        memcpy(&s, data + 4 * full, 4);
        if (unpack(kind, in, n, s, out + full * block))
            return BAD_CODE;
    }
    return OK;
}

/* int8: one code per value, clamp(round(v), -127, 127) as in Int8Codec._quantize; -128 is invalid. */
MULTIVERSION
static void pack_int8(const float *x, int64_t n, float divisor, uint8_t *out) {
    for (int64_t j = 0; j < n; j++) {
        float q = __builtin_nearbyintf(x[j] / divisor); /* round half to even, as torch.round */
        q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
        out[j] = (uint8_t)(int8_t)(int32_t)q;
    }
}

/* The values of one block's int8 codes times scale; nonzero if a code is -128 (invalid). */
MULTIVERSION
static int unpack_int8(const uint8_t *in, int64_t n, float scale, float *out) {
    uint32_t bad = 0;
    for (int64_t j = 0; j < n; j++) {
        bad |= in[j] == 0x80;
        out[j] = (float)(int8_t)in[j] * scale;
    }
    return bad != 0;
}

/* Encode numel values in the int8 format: nblocks fp32 scales (absmax / 127), then numel codes,
 * into out; into decoded, if not NULL, what decoding out gives. Returns OK or NON_FINITE_INPUT
 * (out and decoded then hold garbage). */
int gonka_int8_encode(const float *x, int64_t numel, int64_t block, uint8_t *out, float *decoded) {
    if (block < 2 || block % 2 || numel < 0)
        return -1;
    int64_t nblocks = (numel + block - 1) / block;
    uint8_t *codes = out + 4 * nblocks;
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t start = b * block, n = numel - start < block ? numel - start : block;
        uint32_t m = absmax_bits(x + start, n);
        if (m >= 0x7F800000u)
            return NON_FINITE_INPUT;
        float scale = scale_of(m, 127.0f);
        memcpy(out + 4 * b, &scale, 4);
        pack_int8(x + start, n, scale > 0 ? scale : 1.0f, codes + start); /* an all-zero block: codes of 0 */
        if (decoded)
            unpack_int8(codes + start, n, scale, decoded + start);
    }
    return OK;
}

/* Decode an untrusted int8 payload of exactly wire_bytes(numel) bytes into out. Returns OK or,
 * in the order the torch code checks them, NON_FINITE_SCALE, NEGATIVE_SCALE, SCALE_OVERFLOW
 * (any scale), then BAD_CODE (any code -128). out then holds garbage. */
int gonka_int8_decode(const uint8_t *data, int64_t numel, int64_t block, float *out) {
    if (block < 2 || block % 2 || numel < 0)
        return -1;
    int64_t nblocks = (numel + block - 1) / block;
    int error = check_scales(data, nblocks);
    if (error)
        return error;
    const uint8_t *codes = data + 4 * nblocks;
    int bad = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t start = b * block, n = numel - start < block ? numel - start : block;
        float s;
        memcpy(&s, data + 4 * b, 4);
        bad |= unpack_int8(codes + start, n, s, out + start);
    }
    return bad ? BAD_CODE : OK;
}

/* ---- the aggregators' exact sums (p2p/aggregate.py) ----
 *
 * The torch code in p2p/aggregate.py is their reference, as for the codecs: the same IEEE fp32
 * operations (one rounding per product and per sum), or integer sums that are exact in any order.
 * Each pass reads its inputs once, where the torch code made four to six passes over a piece with
 * temporaries of fp32, int32 and fp64. */

/* The fp32 pattern of the largest |x[i]| (p2p.aggregate.max_abs of finite values). */
uint32_t gonka_absmax(const float *x, int64_t n) { return absmax_bits(x, n); }

/* The sum of q_i * q_i, q_i = x_i * scale truncated towards zero (p2p.aggregate.norm). scale is
 * a power of two chosen by the caller so that every |q_i| < 2^26 and the sum stays below 2^53:
 * x_i * scale is exact in double, and in fp32 too wherever |q_i| >= 1, so q_i is the torch
 * code's; the sum is of integers, the same in any order. */
MULTIVERSION
int64_t gonka_sum_sq_truncated(const float *x, int64_t n, double scale) {
    int64_t acc = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t q = (int32_t)((double)x[i] * scale);
        acc += (int64_t)q * q;
    }
    return acc;
}

/* out[j] = c[0] x_0[j] + c[1] x_1[j] + ... + c[m-1] x_{m-1}[j], added in member order, each product
 * rounded to fp32 before it is added (p2p.aggregate._combine; the coefficients are fp32 numbers).
 * Worked in runs that stay in cache while every member's values are added. out must not
 * overlap an input. */
MULTIVERSION
void gonka_weighted_sum(const float *const *xs, const float *c, int64_t m, int64_t n, float *out) {
    enum { RUN = 2048 };
    for (int64_t start = 0; start < n; start += RUN) {
        int64_t len = n - start < RUN ? n - start : RUN;
        float *o = out + start;
        const float *x0 = xs[0] + start;
        float c0 = c[0];
        for (int64_t j = 0; j < len; j++)
            o[j] = c0 * x0[j];
        for (int64_t i = 1; i < m; i++) {
            const float *xi = xs[i] + start;
            float ci = c[i];
            for (int64_t j = 0; j < len; j++)
                o[j] = o[j] + ci * xi[j];
        }
    }
}
