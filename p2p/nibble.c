/* Fused kernels of the block codecs: int8, and the 4-bit int4 and fp4 (wire format: p2p/codecs.py),
 * of the sparse codec (p2p/sparsecodec.py), and of the sums the part owners' aggregators take
 * (p2p/aggregate.py; at the end of the file).
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
#include <stdlib.h>
#include <string.h>

enum { KIND_INT4 = 0, KIND_FP4 = 1 };
enum { OK = 0, NON_FINITE_INPUT, NON_FINITE_SCALE, NEGATIVE_SCALE, SCALE_OVERFLOW, BAD_CODE, BAD_PADDING, BAD_INDEX };
enum { BAD_ARGUMENT = -1, NO_MEMORY = -2 };

#define SCALE_LIMIT 0x1p120f /* p2p.codec.SCALE_LIMIT */

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

/* ---- the sparse codec (p2p/sparsecodec.py) ----
 *
 * Per chunk of L values (the last may be shorter) the kept(L) values of largest magnitude, ties
 * to the lower index: the torch code ranks them by a unique key, (fp32 bits of |v|) << 16 |
 * (65535 - index), whose order is the magnitude's, then the lower index's. Here the kept(L)-th
 * largest key, the threshold, is found without ranking the whole chunk: the chunk is cut into
 * groups of 16 values, and kept(L) groups hold a value at least as large as the kept(L)-th largest
 * group maximum, so no value below it is kept. Rounded down to its bin in a histogram of the
 * maxima (1/8 of an octave wide), that bar lets ~1.5 kept(L) values of a Gaussian chunk through
 * (keep 64 of 4096), and whole groups are skipped by their maximum alone. A quickselect on those
 * few gives the threshold; a bitmap of the kept gives their indices in ascending order. lo, step,
 * levels and values are the torch code's fp32 operations one by one. */

enum { GROUP = 16 }; /* values per group */

/* Values kept of a chunk of length values: SparseCodec.kept. */
static inline int64_t sparse_kept(int64_t length, int64_t chunk, int64_t keep) {
    int64_t k = (keep * length + chunk - 1) / chunk;
    return k < length ? k : length;
}

static inline uint64_t sparse_key(const float *x, int64_t i) {
    return (uint64_t)(bits_of(x[i]) & 0x7FFFFFFFu) << 16 | (uint64_t)(65535 - i);
}

static int compare_keys(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The nth smallest of n distinct keys (n >= 1, 0 <= nth < n); a is reordered, the nth smallest
 * then at a[nth], larger keys after it. Quickselect with a median-of-three pivot, and a sort of
 * what is left where the pivots keep falling badly. */
static uint64_t select_key(uint64_t *a, int64_t n, int64_t nth) {
    int64_t lo = 0, hi = n - 1, budget = 64;
    while (hi > lo) {
        if (--budget < 0) {
            qsort(a + lo, (size_t)(hi - lo + 1), sizeof *a, compare_keys);
            break;
        }
        int64_t mid = lo + (hi - lo) / 2;
        uint64_t t;
        if (a[mid] < a[lo]) t = a[mid], a[mid] = a[lo], a[lo] = t;
        if (a[hi] < a[lo]) t = a[hi], a[hi] = a[lo], a[lo] = t;
        if (a[hi] < a[mid]) t = a[hi], a[hi] = a[mid], a[mid] = t;
        uint64_t pivot = a[mid];
        int64_t i = lo, j = hi;
        while (i <= j) { /* Hoare's partition: a[lo..j] <= pivot <= a[i..hi] */
            while (a[i] < pivot)
                i++;
            while (a[j] > pivot)
                j--;
            if (i <= j) {
                t = a[i], a[i] = a[j], a[j] = t;
                i++, j--;
            }
        }
        if (nth <= j)
            hi = j;
        else if (nth >= i)
            lo = i;
        else
            break; /* j < nth < i: a[nth] is the pivot */
    }
    return a[nth];
}

/* The fp32 pattern of the largest |v| of each group of a chunk (the last group may be shorter). */
MULTIVERSION
static void group_maxima(const float *v, int64_t length, uint32_t *maxima) {
    int64_t full = length / GROUP;
    for (int64_t g = 0; g < full; g++) {
        uint32_t m = 0;
        for (int64_t j = 0; j < GROUP; j++) {
            uint32_t a = bits_of(v[g * GROUP + j]) & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
        maxima[g] = m;
    }
    if (length > full * GROUP)
        maxima[full] = absmax_bits(v + full * GROUP, length - full * GROUP);
}

/* Scratch memory of one encode: the group maxima of a chunk, a histogram of their top bits
 * (all zero between chunks), the candidates for the kept values, and a bitmap of the kept. */
enum { BIN_SHIFT = 20 }; /* a bin: 1/8 of an octave of magnitudes (exponent and 3 mantissa bits) */
typedef struct {
    uint32_t *maxima;
    uint16_t *bins;
    uint64_t *keys, *kept;
    int64_t capacity; /* keys held before the least are dropped */
} sparse_scratch;

static int scratch_alloc(sparse_scratch *s, int64_t chunk, int64_t keep) {
    s->capacity = 4 * keep;
    s->maxima = malloc((size_t)(chunk + GROUP - 1) / GROUP * sizeof *s->maxima);
    s->bins = calloc((size_t)1 << (31 - BIN_SHIFT), sizeof *s->bins);
    s->keys = malloc((size_t)s->capacity * sizeof *s->keys);
    s->kept = malloc((size_t)(chunk + 63) / 64 * sizeof *s->kept);
    return s->maxima && s->bins && s->keys && s->kept;
}

static void scratch_free(sparse_scratch *s) { free(s->maxima), free(s->bins), free(s->keys), free(s->kept); }

/* The kept-th largest key of a chunk (0 < kept < length) whose group maxima are in s; the kept keys
 * are then the first kept of s->keys. */
static uint64_t threshold_key(const float *v, int64_t length, int64_t kept, sparse_scratch *s) {
    int64_t groups = (length + GROUP - 1) / GROUP, n = 0;
    uint64_t bar = 0; /* no key below it is kept */
    if (kept <= groups) {
        /* Down from the top bin of the group maxima to the one where kept of them are reached:
         * kept groups hold a value from its lower edge up. */
        uint32_t top = 0;
        for (int64_t g = 0; g < groups; g++) {
            uint32_t bin = s->maxima[g] >> BIN_SHIFT;
            s->bins[bin]++;
            top = bin > top ? bin : top;
        }
        uint32_t bin = top;
        for (int64_t reached = s->bins[bin]; reached < kept;)
            reached += s->bins[--bin];
        bar = (uint64_t)bin << BIN_SHIFT << 16;
        for (int64_t g = 0; g < groups; g++)
            s->bins[s->maxima[g] >> BIN_SHIFT] = 0;
    }
    /* The keys from the bar up; where they fill the buffer, the top kept stay and the bar rises
     * to them (the keys are distinct: a key must beat the least of them). */
    for (int64_t g = 0; g < groups; g++) {
        if (s->maxima[g] < bar >> 16)
            continue;
        int64_t end = (g + 1) * GROUP < length ? (g + 1) * GROUP : length;
        for (int64_t i = g * GROUP; i < end; i++) {
            uint64_t key = sparse_key(v, i);
            s->keys[n] = key; /* without a branch: few keys pass, at random */
            n += key >= bar;
            if (n == s->capacity) {
                bar = select_key(s->keys, n, n - kept) + 1;
                memmove(s->keys, s->keys + n - kept, (size_t)kept * sizeof *s->keys);
                n = kept;
            }
        }
    }
    uint64_t threshold = select_key(s->keys, n, n - kept); /* n >= kept: every key of the top kept passed */
    memmove(s->keys, s->keys + n - kept, (size_t)kept * sizeof *s->keys); /* the kept keys, first */
    return threshold;
}

/* Appends width-bit entries to a stream, least significant bit first (sparsecodec._pack). */
typedef struct { uint8_t *at; uint64_t acc; int n; } bit_writer;

static inline void put_bits(bit_writer *w, uint32_t value, int width) {
    w->acc |= (uint64_t)value << w->n;
    for (w->n += width; w->n >= 8; w->n -= 8, w->acc >>= 8)
        *w->at++ = (uint8_t)w->acc;
}

static inline void flush_bits(bit_writer *w) { /* the last byte, zero-padded */
    if (w->n > 0)
        *w->at++ = (uint8_t)w->acc;
    w->acc = 0, w->n = 0;
}

typedef struct { const uint8_t *at; uint64_t acc; int n; } bit_reader;

static inline uint32_t get_bits(bit_reader *r, int width) {
    for (; r->n < width; r->n += 8)
        r->acc |= (uint64_t)*r->at++ << r->n;
    uint32_t value = (uint32_t)(r->acc & ((1u << width) - 1));
    r->acc >>= width, r->n -= width;
    return value;
}

/* ±(lo + level * step), one fp32 multiply and one add (SparseCodec._values). */
static inline float sparse_value(float lo, float step, uint32_t level, int negative) {
    float magnitude = (float)level * step;
    magnitude = magnitude + lo;
    return negative ? -magnitude : magnitude;
}

/* Chunks and kept values in all of numel values (SparseCodec._layout). */
static void sparse_layout(int64_t numel, int64_t chunk, int64_t keep, int64_t *chunks, int64_t *count) {
    int64_t full = numel / chunk, rest = numel % chunk;
    *chunks = full + (rest > 0);
    *count = full * keep + (rest > 0 ? sparse_kept(rest, chunk, keep) : 0);
}

static int sparse_arguments_bad(int64_t numel, int64_t chunk, int64_t keep, int bits) {
    return numel < 0 || chunk < 2 || chunk > 65536 || (chunk & (chunk - 1)) || keep < 1 || keep > chunk ||
           bits < 2 || bits > 8;
}

/* Encode numel values in the sparse format of (chunk, keep, bits) into out (wire_bytes(numel));
 * into decoded, if not NULL, what decoding out gives: 0 but at the kept values. Returns OK,
 * NON_FINITE_INPUT (out and decoded then hold garbage), BAD_ARGUMENT or NO_MEMORY. */
MULTIVERSION
int gonka_sparse_encode(const float *x, int64_t numel, int64_t chunk, int64_t keep, int bits, uint8_t *out,
                        float *decoded) {
    if (sparse_arguments_bad(numel, chunk, keep, bits))
        return BAD_ARGUMENT;
    int64_t chunks, count;
    sparse_layout(numel, chunk, keep, &chunks, &count);
    int width = __builtin_ctzll((unsigned long long)chunk), levels = (1 << (bits - 1)) - 1;
    sparse_scratch s;
    if (!scratch_alloc(&s, chunk, keep)) {
        scratch_free(&s);
        return NO_MEMORY;
    }
    bit_writer index = {out + 8 * chunks, 0, 0};
    bit_writer code = {out + 8 * chunks + (count * width + 7) / 8, 0, 0};
    int error = OK;
    for (int64_t c = 0; c < chunks; c++) {
        const float *v = x + c * chunk;
        int64_t length = numel - c * chunk < chunk ? numel - c * chunk : chunk, kept = sparse_kept(length, chunk, keep);
        int64_t groups = (length + GROUP - 1) / GROUP, words = (length + 63) / 64;
        group_maxima(v, length, s.maxima);
        uint32_t absmax = 0;
        for (int64_t g = 0; g < groups; g++)
            absmax = s.maxima[g] > absmax ? s.maxima[g] : absmax;
        if (absmax >= 0x7F800000u) {
            error = NON_FINITE_INPUT;
            break;
        }
        /* lo and lo + M step: the smallest kept magnitude and the largest; the kept, as a bitmap. */
        float lo = float_of(absmax), hi = float_of(absmax);
        if (kept < length) {
            lo = float_of((uint32_t)(threshold_key(v, length, kept, &s) >> 16));
            memset(s.kept, 0, (size_t)words * sizeof *s.kept);
            for (int64_t j = 0; j < kept; j++) {
                int64_t i = 65535 - (int64_t)(s.keys[j] & 0xFFFF);
                s.kept[i / 64] |= 1ull << (i % 64);
            }
        } else {
            for (int64_t i = 0; i < length; i++)
                lo = __builtin_fabsf(v[i]) < lo ? __builtin_fabsf(v[i]) : lo;
            memset(s.kept, 0xFF, (size_t)words * sizeof *s.kept);
            if (length % 64)
                s.kept[words - 1] = (1ull << (length % 64)) - 1;
        }
        /* Magnitudes above the format's limit are taken as the limit (SparseCodec._encode_rows). */
        lo = lo > SCALE_LIMIT ? SCALE_LIMIT : lo;
        hi = hi > SCALE_LIMIT ? SCALE_LIMIT : hi;
        float step = (hi - lo) / (float)levels;
        memcpy(out + 8 * c, &lo, 4);
        memcpy(out + 8 * c + 4, &step, 4);
        if (decoded)
            memset(decoded + c * chunk, 0, (size_t)length * sizeof *decoded);
        for (int64_t w = 0; w < words; w++)
            for (uint64_t set = s.kept[w]; set; set &= set - 1) { /* the kept indices, ascending */
                int64_t i = 64 * w + __builtin_ctzll(set);
                float level = 0.0f; /* step 0: every kept magnitude is lo */
                if (step > 0) { /* rounded half to even, as torch.round */
                    float a = __builtin_fabsf(v[i]);
                    a = a > SCALE_LIMIT ? SCALE_LIMIT : a;
                    level = __builtin_nearbyintf((a - lo) / step);
                    level = level > (float)levels ? (float)levels : level;
                }
                int negative = v[i] < 0;
                put_bits(&index, (uint32_t)i, width);
                put_bits(&code, (uint32_t)level | (uint32_t)negative << (bits - 1), bits);
                if (decoded)
                    decoded[c * chunk + i] = sparse_value(lo, step, (uint32_t)level, negative);
            }
    }
    flush_bits(&index);
    flush_bits(&code);
    scratch_free(&s);
    return error;
}

/* Check an untrusted sparse payload of exactly wire_bytes(numel) bytes (the caller checks the size)
 * and, where not NULL, decode it into out and mark its kept values in mask (one byte per value,
 * 1 where kept). Returns OK or, in the order SparseCodec._parse checks them, NON_FINITE_SCALE,
 * NEGATIVE_SCALE, SCALE_OVERFLOW (any lo or step), BAD_PADDING (the index stream's, then the
 * code stream's), BAD_INDEX (any chunk's); out and mask then hold garbage. Or BAD_ARGUMENT. */
int gonka_sparse_decode(const uint8_t *data, int64_t numel, int64_t chunk, int64_t keep, int bits, float *out,
                        uint8_t *mask) {
    if (sparse_arguments_bad(numel, chunk, keep, bits))
        return BAD_ARGUMENT;
    int64_t chunks, count;
    sparse_layout(numel, chunk, keep, &chunks, &count);
    int width = __builtin_ctzll((unsigned long long)chunk), levels = (1 << (bits - 1)) - 1;
    int error = check_scales(data, 2 * chunks);
    if (error)
        return error;
    const uint8_t *indices = data + 8 * chunks, *codes = indices + (count * width + 7) / 8;
    /* Padding: the bits of each stream's last byte above its last entry. */
    if ((count * width) % 8 && codes[-1] >> (count * width) % 8)
        return BAD_PADDING;
    if ((count * bits) % 8 && codes[(count * bits + 7) / 8 - 1] >> (count * bits) % 8)
        return BAD_PADDING;
    bit_reader index = {indices, 0, 0}, code = {codes, 0, 0};
    for (int64_t c = 0; c < chunks; c++) {
        int64_t length = numel - c * chunk < chunk ? numel - c * chunk : chunk, kept = sparse_kept(length, chunk, keep);
        float scales[2];
        memcpy(scales, data + 8 * c, 8);
        if (out)
            memset(out + c * chunk, 0, (size_t)length * sizeof *out);
        if (mask)
            memset(mask + c * chunk, 0, (size_t)length);
        int64_t previous = -1;
        for (int64_t j = 0; j < kept; j++) {
            int64_t i = get_bits(&index, width);
            uint32_t q = get_bits(&code, bits);
            if (i <= previous || i >= length)
                return BAD_INDEX; /* the last check: nothing after it decides the reason */
            previous = i;
            if (out)
                out[c * chunk + i] = sparse_value(scales[0], scales[1], q & (uint32_t)levels, (int)(q >> (bits - 1)));
            if (mask)
                mask[c * chunk + i] = 1;
        }
    }
    return OK;
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
