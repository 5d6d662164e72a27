// y = x @ w^T (+ b) for bf16 x [M, K], w [N, K] (nn.Linear's layout, read as it is), b [N]; M small (decode steps).
// (fp32 x, w, b on AVX2 CPUs: linear_fp32, its own section below.)
//
// Why: PyTorch's CPU bf16 linear at one to a few rows streams the weights at a fraction of the memory bandwidth
// (measured on a 2-core Sapphire Rapids: ~4.5 GB/s in a 30-layer forward against ~16 GB/s read bandwidth), and a
// decode step is nothing but that. Here each output is a dot product over K: a weight row is widened bf16 -> fp32
// (exact: a shift), multiplied by the fp32 copy of each input row (exact), and summed in fp32, NB weight rows by MB
// input rows at a time so that a loaded weight vector serves MB rows and each input vector NB rows. Products are
// exact; only the fp32 summation order differs from oneDNN's, so results match stock F.linear to bf16 rounding of
// the same fp32 sums (the output is rounded to nearest even, like a bf16 cast).
//
// The weights are streamed once per call, so the loops ask for them ahead (software prefetch): a block's NB rows are
// short (a 576-wide row is 18 cache lines) and interleaved, which the hardware prefetchers follow poorly (a one-off
// A/B on SmolLM2-135M's 211 shapes, cold weights, 2 threads: ~25 % more bandwidth at one row, ~10 % at 16 rows on AMX;
// scripts/bench_cpu_kernel.py measures the whole forward).
//
// Where the CPU has AMX (Sapphire Rapids and later), 2..32 rows run on the tile unit instead: C^T = W X^T with W's
// rows loaded as A tiles straight from nn.Linear's layout (16 rows x 32 k) and X as one or two B tiles (16 rows
// each) in VNNI pairs (repacked per call: X is tiny), fp32 accumulation (TDPBF16PS), the same single rounding to
// bf16 at the end.
//
// CPUs with AVX-512-BF16 but no AMX (Cooper Lake; AMD Zen 4 and 5; Sapphire/Emerald Rapids guests whose hypervisor
// hides the tiles) run 2..32 rows with VDPBF16PS instead: it multiplies 32 bf16 pairs and adds them into 16 fp32
// lanes in one instruction, reading the weights and the inputs as they are (no widening, no repacking), so a weight
// vector loaded once serves up to 4 input rows at twice the FMA path's products per instruction. Products are exact
// in fp32 as above; the instruction flushes denormal inputs and sums to zero, as the AMX tile unit and oneDNN's own
// bf16 kernels do.
//
// CPUs without AVX-512 take the same blocks on AVX2 + FMA (8 lanes), which Python checks before building this. Each
// path is compiled for its own instruction set (function target attributes) and chosen at run time, so one build
// serves the machine it was built on. AMX also needs the kernel's permission, asked for once by amx_init().
// Threads: ATen's parallel_for over weight rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct Problem {
  const float* x;     // [M, K] fp32 copy of the input rows (FMA paths)
  int64_t M, K;
  const uint16_t* w;  // [N, K] bf16 bits
  const uint16_t* b;  // [N] bf16 bits, or nullptr
  uint16_t* y;        // [M, N] bf16 bits
  int64_t N;
  const uint16_t* xh = nullptr;  // [M, K] the input rows' own bf16 bits (AVX-512-BF16 path)
};

// rows[i] = the start of row first + i of a [*, K] matrix, for i < N; rows past count - 1 repeat the last one
template <typename T, int N>
inline void row_starts(const T* (&rows)[N], const T* base, int64_t first, int64_t count, int64_t K) {
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) rows[i] = base + (first + std::min<int64_t>(i, count - 1)) * K;
}

// The rows one register block reads and the outputs it writes: y[m .. m+mb, n .. n+nb] (nb <= NB, mb <= MB; missing
// rows repeat the last one and are not stored).
template <int NB, int MB>
struct Block {
  const float* x[MB];
  const uint16_t* w[NB];
  int64_t n, nb, m, mb;

  Block(const Problem& p, int64_t n_, int64_t nb_, int64_t m_, int64_t mb_) : n(n_), nb(nb_), m(m_), mb(mb_) {
    row_starts(w, p.w, n, nb, p.K);
    row_starts(x, p.x, m, mb, p.K);
  }

  // sums cover k < k_done; a tail the vector loop left (k_done <= k < K) is summed here, then bias, then bf16
  void store(const Problem& p, const float (&sums)[NB][MB], int64_t k_done) const {
    for (int64_t i = 0; i < nb; ++i) {
      const float bias = p.b ? bf16_to_float(p.b[n + i]) : 0.0f;
      for (int64_t j = 0; j < mb; ++j) {
        float s = sums[i][j];
        for (int64_t k = k_done; k < p.K; ++k) s += bf16_to_float(w[i][k]) * x[j][k];
        p.y[(m + j) * p.N + n + i] = float_to_bf16(s + bias);
      }
    }
  }
};

#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

template <int NB, int MB>
DS_AVX512 void block_avx512(const Problem& p, int64_t n, int64_t nb, int64_t m, int64_t mb) {
  const Block<NB, MB> blk(p, n, nb, m, mb);
  __m512 acc[NB][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; k += 16) {  // masked loads cover the tail: nothing left for store()
    const __mmask16 mask = p.K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (p.K - k)) - 1);
    __m512 xv[MB];
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) xv[j] = _mm512_maskz_loadu_ps(mask, blk.x[j] + k);
    if ((k & 31) == 0) {  // each new cache line: the same line of the next block's rows (prefetch, see the top)
#pragma GCC unroll 16
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(blk.w[i] + k + NB * p.K), _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, blk.w[i] + k);
      const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  float sums[NB][MB];  // reduced with constant indices so that the accumulators stay in registers
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  blk.store(p, sums, p.K);
}

// ---- AVX-512-BF16: VDPBF16PS on the bf16 rows as they are ------------------------------------------------------

#define DS_BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// The lane sums of four accumulators at once (13 instructions instead of 4 full reductions of ~8 each): pairs
// interleaved and added, then the four per-128-bit-lane partial sums, then the four 128-bit lanes.
DS_BF16DP inline void reduce4(const __m512 (&a)[4], float (&out)[4]) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // ab per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 (the same for cd): pick [a, b] halves of each and add
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  // abcd per 128-bit lane: a, b, c, d partial sums; add the four lanes
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  _mm_storeu_ps(out, quarter);
}

template <int NB, int MB>
DS_BF16DP void block_bf16dp(const Problem& p, int64_t n, int64_t nb, int64_t m, int64_t mb) {
  const uint16_t* w[NB];
  const uint16_t* x[MB];
  row_starts(w, p.w, n, nb, p.K);
  row_starts(x, p.xh, m, mb, p.K);
  __m512 acc[NB][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; k += 32) {  // 32 bf16 = one cache line; masked loads zero the tail's pairs
    const __mmask32 mask = p.K - k >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (p.K - k)) - 1);
    __m512i xv[MB];
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) xv[j] = _mm512_maskz_loadu_epi16(mask, x[j] + k);
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + k + NB * p.K), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w[i] + k);
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)xv[j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i) {
    if (i >= nb) break;
    const float bias = p.b ? bf16_to_float(p.b[n + i]) : 0.0f;
    float sums[MB];
    if constexpr (MB == 4) {
      reduce4(acc[i], sums);
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) sums[j] = _mm512_reduce_add_ps(acc[i][j]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) p.y[(m + j) * p.N + n + i] = float_to_bf16(sums[j] + bias);
  }
}

// block_bf16dp<NB, mb> for a run-time mb <= MB: each row count its own registers, no repeated rows
template <int NB, int MB>
DS_BF16DP void block_bf16dp_rows(const Problem& p, int64_t n, int64_t nb, int64_t m, int64_t mb) {
  if constexpr (MB > 1) {
    if (mb < MB) return block_bf16dp_rows<NB, MB - 1>(p, n, nb, m, mb);
  }
  block_bf16dp<NB, MB>(p, n, nb, m, mb);
}

// ---- AVX2 + FMA (CPUs without AVX-512): the same blocks in 8 lanes; store() sums the K % 8 tail ---------------------

#define DS_AVX2 __attribute__((target("avx2,fma")))

DS_AVX2 inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 8 weights as fp32 lanes: bf16 widened (exact: a shift), or fp32 as they are
DS_AVX2 inline __m256 load8(const uint16_t* w) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

DS_AVX2 inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }

// acc[i][j] = 8-lane partial sums of w[i][k] * x[j][k] over k < K / 8 * 8 (the AVX2 paths' one inner loop, bf16 or
// fp32 weights). With `prefetch`, each new cache line of a weight row asks for the same line of the next block's
// rows (NB rows further on; see the top).
template <typename W, int NB, int MB>
DS_AVX2 void dot8(const W* const (&w)[NB], const float* const (&x)[MB], int64_t K, bool prefetch,
                  __m256 (&acc)[NB][MB]) {
  constexpr int64_t line = 64 / sizeof(W);  // weights a cache line holds
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k_done = K / 8 * 8;
  for (int64_t k = 0; k < k_done; k += 8) {
    __m256 xv[MB];
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) xv[j] = _mm256_loadu_ps(x[j] + k);
    if (prefetch && k % line == 0) {
#pragma GCC unroll 16
      for (int i = 0; i < NB; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + k + NB * K), _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NB; ++i) {
      const __m256 wv = load8(w[i] + k);
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
}

template <int NB, int MB>
DS_AVX2 void block_avx2(const Problem& p, int64_t n, int64_t nb, int64_t m, int64_t mb) {
  const Block<NB, MB> blk(p, n, nb, m, mb);
  __m256 acc[NB][MB];
  dot8<uint16_t, NB, MB>(blk.w, blk.x, p.K, true, acc);
  const int64_t k_done = p.K / 8 * 8;
  float sums[NB][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) sums[i][j] = hsum256(acc[i][j]);
  blk.store(p, sums, k_done);
}

// Weight rows [n0, n1) in blocks of NB, input rows in blocks of MB, through one ISA's block kernel.
template <int NB, int MB, void (*kernel)(const Problem&, int64_t, int64_t, int64_t, int64_t)>
void rows(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NB)
    for (int64_t m = 0; m < p.M; m += MB)
      kernel(p, n, std::min<int64_t>(NB, n1 - n), m, std::min<int64_t>(MB, p.M - m));
}

// ---- AMX: 2..32 rows -------------------------------------------------------------------------------------------

#define DS_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

struct alignas(64) TileConfig {  // palette 1 layout (Intel SDM, LDTILECFG)
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_init() {  // Linux: ask for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); false if refused
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// y[m, n .. n+16] = bf16(c[.., m] + bias[n ..]) for m < M: c is a stored [16 n][16 m] fp32 tile
DS_AMX void tile_epilogue(const float* c, const uint16_t* b, uint16_t* y, int64_t M, int64_t N, int64_t n) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  const __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + n))), 16))
                        : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + m, 4), bias);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + n), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// One or two blocks of 16 weight rows from `blk` against one or two B tiles of 16 input rows each (XT: rows 0-15,
// 16-31). Tiles: 0-3 accumulators (block b, B tile t: 2b + t), 4-5 weight rows, 6-7 the input. Each accumulator is
// stored through `c` and its epilogue. Tile numbers are immediates, hence the compile-time counts.
template <int Blocks, int XT>
DS_AMX void amx_run(const Problem& p, const uint16_t* xb, int64_t blk, float* c) {
  const int64_t stride = p.K * 2;  // bytes between weight rows
  const uint16_t* w0 = p.w + blk * 16 * p.K;
  const uint16_t* w1 = w0 + 16 * p.K;
  const uint16_t* xb1 = xb + p.K * 16;  // the second B tile's rows
  _tile_zero(0);
  if constexpr (XT == 2) _tile_zero(1);
  if constexpr (Blocks == 2) _tile_zero(2);
  if constexpr (Blocks == 2 && XT == 2) _tile_zero(3);
  for (int64_t k = 0; k < p.K; k += 32) {
    // prefetch 8 lines (256 columns) ahead in these rows, or past their end the next run's rows
    const uint16_t* ahead = k + 256 < p.K ? w0 + k + 256 : w0 + Blocks * 16 * p.K + k + 256 - p.K;
#pragma GCC unroll 32
    for (int r = 0; r < Blocks * 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * p.K), _MM_HINT_T0);
    _tile_loadd(6, xb + k * 16, 64);
    if constexpr (XT == 2) _tile_loadd(7, xb1 + k * 16, 64);
    _tile_loadd(4, w0 + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (XT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (Blocks == 2) {
      _tile_loadd(5, w1 + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (XT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t m1 = std::min<int64_t>(p.M, 16);  // rows in the first B tile; the rest in the second
  _tile_stored(0, c, 64);
  tile_epilogue(c, p.b, p.y, m1, p.N, blk * 16);
  if constexpr (XT == 2) {
    _tile_stored(1, c, 64);
    tile_epilogue(c, p.b, p.y + 16 * p.N, p.M - 16, p.N, blk * 16);
  }
  if constexpr (Blocks == 2) {
    _tile_stored(2, c, 64);
    tile_epilogue(c, p.b, p.y, m1, p.N, (blk + 1) * 16);
  }
  if constexpr (Blocks == 2 && XT == 2) {
    _tile_stored(3, c, 64);
    tile_epilogue(c, p.b, p.y + 16 * p.N, p.M - 16, p.N, (blk + 1) * 16);
  }
}

// Weight row blocks [blk0, blk1) of 16 rows each, two at a time, against XT B tiles of input rows.
template <int XT>
DS_AMX void amx_blocks(const Problem& p, const uint16_t* xb, int64_t blk0, int64_t blk1) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[16 * 16];
  int64_t blk = blk0;
  for (; blk + 1 < blk1; blk += 2) amx_run<2, XT>(p, xb, blk, c);
  if (blk < blk1) amx_run<1, XT>(p, xb, blk, c);
  _tile_release();
}

// ---- entry ------------------------------------------------------------------------------------------------------

bool amx_applies(int64_t M, int64_t K, int64_t N, bool use_amx) {
  return use_amx && M >= 2 && M <= 32 && K % 32 == 0 && N >= 16;
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

bool has_avx512_bf16() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// What linear_bf16 and linear_fp32 take and give alike: x [..., K] and w [N, K] (contiguous) of `dtype` on the CPU,
// b [N] of `dtype` or none -> x read as a contiguous [M, K], b contiguous (undefined if none), y [..., N] to write.
struct Operands {
  torch::Tensor x, b, y;
  int64_t M, K, N;
};

Operands operands(const char* fn, at::ScalarType dtype, const torch::Tensor& x, const torch::Tensor& w,
                  const c10::optional<torch::Tensor>& b) {
  const char* type = dtype == at::kFloat ? "fp32" : "bf16";
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), fn, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, fn, ": ", type, " only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), fn, ": weight must be a contiguous [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, fn, ": input's last dimension must be ", K);
  TORCH_CHECK(K > 0, fn, ": the weight has no columns");
  Operands o;
  if (b.has_value()) {
    o.b = b->contiguous();
    TORCH_CHECK(o.b.scalar_type() == dtype && o.b.numel() == N, fn, ": bias must be ", type, " [N]");
  }
  o.x = x.is_contiguous() ? x : x.contiguous();
  o.M = o.x.numel() / K;
  o.K = K;
  o.N = N;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  o.y = torch::empty(shape, x.options());  // written as [M, N]
  return o;
}

// Whether a routed call runs on the kernel: no grad mode, x of `dtype` on the CPU with 1..max_rows rows, w and b as
// `operands` takes them (else the caller runs F.linear). One C++ call instead of the checks in Python: a decode step
// makes hundreds of these calls.
bool routable(at::ScalarType dtype, const torch::Tensor& x, const torch::Tensor& w,
              const c10::optional<torch::Tensor>& b, int64_t max_rows) {
  if (at::GradMode::is_enabled() || !x.device().is_cpu() || x.scalar_type() != dtype || x.dim() < 1) return false;
  const int64_t numel = x.numel(), K = x.size(-1);
  if (numel == 0 || numel > max_rows * K || !w.device().is_cpu() || w.scalar_type() != dtype || w.dim() != 2 ||
      !w.is_contiguous() || w.size(1) != K) {
    return false;
  }
  return !b.has_value() || (b->device().is_cpu() && b->scalar_type() == dtype && b->numel() == w.size(0));
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b,
                          bool use_amx, bool use_avx512, bool use_dp) {
  static const bool cpu_avx512 = has_avx512();
  static const bool cpu_dp = has_avx512_bf16();
  const bool avx512 = use_avx512 && cpu_avx512;
  const bool dp = use_dp && avx512 && cpu_dp;
  const Operands o = operands("linear_bf16", at::kBFloat16, x, w, b);
  const int64_t M = o.M, K = o.K, N = o.N;
  const torch::Tensor& y = o.y;
  const uint16_t* bp = o.b.defined() ? reinterpret_cast<const uint16_t*>(o.b.data_ptr()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(o.x.data_ptr());
  if (M == 0) return y;

  int64_t fma_from = 0;  // weight rows [fma_from, N) run on the vector path (AVX-512 or AVX2)
  if (amx_applies(M, K, N, use_amx)) {
    // X as one or two B tiles of 16 rows: xb[m / 16][k / 2][m % 16][k % 2] = x[m][k], zero for m >= M
    const int xt = M > 16 ? 2 : 1;
    thread_local std::vector<uint16_t> xb;  // per calling thread, reused: no allocation per call
    xb.assign(size_t(K) * 16 * xt, 0);
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* tile = xb.data() + (m / 16) * K * 16;
      for (int64_t k = 0; k < K; k += 2) {
        tile[(k / 2 * 16 + m % 16) * 2] = xp[m * K + k];
        tile[(k / 2 * 16 + m % 16) * 2 + 1] = xp[m * K + k + 1];
      }
    }
    const Problem p{nullptr, M, K, wp, bp, yp, N};
    const uint16_t* xbp = xb.data();  // taken here: inside the lambda `xb` would name a worker thread's own buffer
    at::parallel_for(0, N / 16, 2, [&](int64_t s, int64_t e) {
      if (xt == 1) amx_blocks<1>(p, xbp, s, e);
      else amx_blocks<2>(p, xbp, s, e);
    });
    fma_from = N / 16 * 16;
    if (fma_from == N) return y;
  }
  constexpr int64_t kChunk = 24;  // weight rows per parallel task: a multiple of every NB below
  if (dp && M >= 2) {  // one row stays on the FMA path below (measured: as fast, and it needs no dot-pair tail)
    Problem p{nullptr, M, K, wp, bp, yp, N};
    p.xh = xp;
    at::parallel_for(0, (N - fma_from + kChunk - 1) / kChunk, 4, [&](int64_t s, int64_t e) {
      const int64_t n0 = fma_from + s * kChunk, n1 = std::min(fma_from + e * kChunk, N);
      for (int64_t n = n0; n < n1; n += 6)  // 6 weight rows x 4 input rows: 24 accumulators + 4 inputs + 1 weight
        for (int64_t m = 0; m < M; m += 4)
          block_bf16dp_rows<6, 4>(p, n, std::min<int64_t>(6, n1 - n), m, std::min<int64_t>(4, M - m));
    });
    return y;
  }
  thread_local std::vector<float> xf;  // x widened to fp32 (exact), per calling thread, reused
  xf.resize(size_t(M * K));
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xp[i]);
  const Problem p{xf.data(), M, K, wp, bp, yp, N};
  at::parallel_for(0, (N - fma_from + kChunk - 1) / kChunk, 4, [&](int64_t s, int64_t e) {
    const int64_t n0 = fma_from + s * kChunk, n1 = std::min(fma_from + e * kChunk, N);
    if (!avx512) {  // 16 ymm registers: NB x MB accumulators + MB inputs + 1 weight vector
      if (M == 1) rows<8, 1, block_avx2<8, 1>>(p, n0, n1);
      else rows<4, 3, block_avx2<4, 3>>(p, n0, n1);
    } else if (M == 1) rows<8, 1, block_avx512<8, 1>>(p, n0, n1);  // 32 zmm registers
    else if (M == 2) rows<8, 2, block_avx512<8, 2>>(p, n0, n1);
    else if (M == 3) rows<6, 3, block_avx512<6, 3>>(p, n0, n1);
    else rows<4, 6, block_avx512<4, 6>>(p, n0, n1);
  });
  return y;
}

// ---- fp32 (AVX2 + FMA): y = x @ w^T (+ b) for fp32 x [M, K], w [N, K], 1..32 rows ---------------------------------
//
// Why: on AVX2 CPUs stock fp32 F.linear at 2 to a few rows leaves the BLAS's matrix-vector path and costs up to
// twice its one-row call, and at 9-17 rows it runs at about half the FMA rate the core has (host E, a 2-core Zen 3
// EPYC whose two threads share one core's FMA units: ~20 GFMA/s one thread, ~25 both). The blocks below reach
// 17-21 GFMA/s at 9-17 rows and stream the weights at ~14 GB/s at one row (scripts/bench_cpu_kernel.py measures the
// whole forward). Each output is a dot product over K in 8 lanes, NB weight rows by MB input rows at a time (4 x 3:
// 12 accumulators + 3 inputs + 1 weight vector in 16 ymm registers); a block's weight rows stay in L1 while every
// block of input rows passes over them. The sums of 4 (or 8) weight rows for one input row are reduced together
// (horizontal adds) into one vector store, since they are neighbours in y. Only the summation order differs from
// stock fp32, as it does between a one-row and a K-row forward.

struct ProblemF32 {
  const float* x;  // [M, K]
  int64_t M, K;
  const float* w;  // [N, K]
  const float* b;  // [N] or nullptr
  float* y;        // [M, N]
  int64_t N;
};

// y[m .. m+mb, n .. n+nb] from weight rows n.. (nb <= NB) and input rows m.. (mb == MB: block_fp32_rows picks MB)
template <int NB, int MB>
DS_AVX2 void block_fp32(const ProblemF32& p, int64_t n, int64_t nb, int64_t m, bool prefetch) {
  const float* w[NB];
  const float* x[MB];
  row_starts(w, p.w, n, nb, p.K);
  row_starts(x, p.x, m, MB, p.K);  // all MB rows exist (block_fp32_rows)
  __m256 acc[NB][MB];
  dot8<float, NB, MB>(w, x, p.K, prefetch, acc);  // prefetch: the first block of input rows only
  const int64_t k_done = p.K / 8 * 8;
  if (nb == NB && k_done == p.K && (NB == 4 || NB == 8)) {  // whole block, no tail: vector reduction and store
    if constexpr (NB == 4) {
      const __m128 bias = p.b ? _mm_loadu_ps(p.b + n) : _mm_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {  // lane i of the result: the sum of acc[i][j]
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][j], acc[1][j]), _mm256_hadd_ps(acc[2][j], acc[3][j]));
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(p.y + (m + j) * p.N + n, _mm_add_ps(s, bias));
      }
      return;
    } else if constexpr (NB == 8) {
      const __m256 bias = p.b ? _mm256_loadu_ps(p.b + n) : _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {
        const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][j], acc[1][j]), _mm256_hadd_ps(acc[2][j], acc[3][j]));
        const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(acc[4][j], acc[5][j]), _mm256_hadd_ps(acc[6][j], acc[7][j]));
        const __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
        _mm256_storeu_ps(p.y + (m + j) * p.N + n, _mm256_add_ps(s, bias));
      }
      return;
    }
  }
  float sums[NB][MB];  // a partial block (the last nb < NB weight rows) or a K % 8 tail: scalar finish
#pragma GCC unroll 16
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) sums[i][j] = hsum256(acc[i][j]);
  for (int64_t i = 0; i < nb; ++i) {
    for (int j = 0; j < MB; ++j) {
      float s = sums[i][j];
      for (int64_t k = k_done; k < p.K; ++k) s += w[i][k] * x[j][k];
      p.y[(m + j) * p.N + n + i] = s + (p.b ? p.b[n + i] : 0.0f);
    }
  }
}

// block_fp32<NB, mb> for a run-time mb <= MB: each remainder its own registers, no repeated rows
template <int NB, int MB>
DS_AVX2 void block_fp32_rows(const ProblemF32& p, int64_t n, int64_t nb, int64_t m, int64_t mb, bool prefetch) {
  if constexpr (MB > 1) {
    if (mb < MB) return block_fp32_rows<NB, MB - 1>(p, n, nb, m, mb, prefetch);
  }
  block_fp32<NB, MB>(p, n, nb, m, prefetch);
}

// Weight rows [n0, n1) in blocks of NB; for each, every block of MB input rows (its weight rows stay in L1)
template <int NB, int MB>
void rows_fp32(const ProblemF32& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NB)
    for (int64_t m = 0; m < p.M; m += MB)
      block_fp32_rows<NB, MB>(p, n, std::min<int64_t>(NB, n1 - n), m, std::min<int64_t>(MB, p.M - m), m == 0);
}

torch::Tensor linear_fp32(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  const Operands o = operands("linear_fp32", at::kFloat, x, w, b);
  const int64_t M = o.M, N = o.N;
  if (M == 0) return o.y;
  const ProblemF32 p{o.x.data_ptr<float>(), M, o.K, w.data_ptr<float>(),
                     o.b.defined() ? o.b.data_ptr<float>() : nullptr, o.y.data_ptr<float>(), N};
  constexpr int64_t kChunk = 24;  // weight rows per parallel task: a multiple of every NB below
  at::parallel_for(0, (N + kChunk - 1) / kChunk, 4, [&](int64_t s, int64_t e) {
    const int64_t n0 = s * kChunk, n1 = std::min(e * kChunk, N);
    if (M == 1) rows_fp32<8, 1>(p, n0, n1);
    else rows_fp32<4, 3>(p, n0, n1);
  });
  return o.y;
}

// The routed call of an fp32 nn.Linear in a decode step: linear_fp32 where it applies (`routable`), else None for
// the caller's F.linear.
c10::optional<torch::Tensor> linear_fp32_routed(const torch::Tensor& x, const torch::Tensor& w,
                                                const c10::optional<torch::Tensor>& b, int64_t max_rows) {
  if (!routable(at::kFloat, x, w, b, max_rows)) return c10::nullopt;
  return linear_fp32(x, w, b);
}

// The routed call of a bf16 nn.Linear in a decode step: linear_bf16 (AVX-512 where the CPU has it) where it applies
// (`routable`), else None for the caller's F.linear.
c10::optional<torch::Tensor> linear_bf16_routed(const torch::Tensor& x, const torch::Tensor& w,
                                                const c10::optional<torch::Tensor>& b, int64_t max_rows,
                                                bool use_amx, bool use_dp) {
  if (!routable(at::kBFloat16, x, w, b, max_rows)) return c10::nullopt;
  return linear_bf16(x, w, b, use_amx, true, use_dp);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16,
        "y = x @ w^T (+ b), bf16, for a few rows of x; AMX for 2..32 rows if use_amx, else AVX-512-BF16 dot products "
        "for 2.. rows if use_dp; AVX2 unless use_avx512");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs the AVX-512-BF16 path");
  m.def("linear_bf16_routed", &linear_bf16_routed,
        "linear_bf16 (AVX-512 where the CPU has it) if grad mode is off and x is 1..max_rows bf16 CPU rows, else None");
  m.def("linear_fp32", &linear_fp32, "y = x @ w^T (+ b), fp32, AVX2 + FMA, for a few rows of x");
  m.def("linear_fp32_routed", &linear_fp32_routed,
        "linear_fp32 if grad mode is off and x is 1..max_rows fp32 CPU rows, else None");
  m.def("amx_init", &amx_init, "ask Linux for the AMX tile state once per process; false if refused");
}
