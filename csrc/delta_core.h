// Core of the delta codec's host path (no Python): the word checksum, change finding,
// positions decoding and the verified in-place apply, multithreaded. Formats: see
// glm_kernels/delta/_reference.py; Python bindings: delta_host.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace glm_delta {

constexpr uint32_t K1 = 0x9E3779B1u, K2 = 0x85EBCA77u, K3 = 0x165667B1u;
constexpr uint32_t M1 = 0x27D4EB2Fu, M2 = 0xC2B2AE3Du, M3 = 0x61C88647u;
constexpr uint32_t N1 = 0x7FEB352Du, N2 = 0x846CA68Bu, N3 = 0x2545F491u;
constexpr uint64_t GOLDEN64 = 0x9E3779B97F4A7C15ull;
constexpr int64_t ESCAPE = 65535;
constexpr int64_t TILE = 32768;   // elements per encode task: in-tile gaps stay below ESCAPE,
                                  // offsets fit uint16, a tile of both tensors stays in L2
constexpr int64_t CHUNK = 65536;  // changes per apply task, elements per checksum task

template <typename T>
inline T load(const void* p) {  // payload sections may sit at any address
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void store(void* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Hot loops get an AVX2 clone next to the baseline one, chosen at load time (GCC, Linux x86-64).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define GLM_HOT __attribute__((target_clones("avx2", "default")))
#else
#define GLM_HOT
#endif

// (w ^ k) * M mod 2^64, M = n * 2^32 + (m | 1): odd, so every single-word change shows.
// Written as a 32x32->64 and a 32x32->32 product (what SIMD units have), not a 64x64 one.
inline uint64_t mix(uint32_t w, uint32_t k, uint32_t m, uint32_t n) {
  const uint32_t x = w ^ k;
  return static_cast<uint64_t>(x) * (m | 1u) + (static_cast<uint64_t>(x * n) << 32);
}

inline uint64_t word_term(uint32_t w, uint64_t i) {
  const uint32_t lo = static_cast<uint32_t>(i), hi = static_cast<uint32_t>(i >> 32);
  return mix(w, lo * K1 + hi * K2 + K3, lo * M1 + hi * M2 + M3, lo * N1 + hi * N2 + N3);
}

template <typename U>
inline uint64_t element_term(U v, uint64_t e) {
  if constexpr (sizeof(U) == 8) {
    return word_term(static_cast<uint32_t>(v), 2 * e) +
           word_term(static_cast<uint32_t>(v >> 32), 2 * e + 1);
  } else {
    return word_term(static_cast<uint32_t>(v), e);
  }
}

inline uint64_t fmix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 33);
}

inline uint64_t finalize(uint64_t s, uint64_t n_words) { return fmix64(s ^ (n_words * GOLDEN64)); }

inline uint64_t le64(const std::string& b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[i]);
  return v;
}

template <typename U>
inline U zigzag(U x, U y) {
  const U d = static_cast<U>(x - y);
  const U sign = static_cast<U>(d >> (8 * sizeof(U) - 1));
  return static_cast<U>(static_cast<U>(d << 1) ^ static_cast<U>(U(0) - sign));
}

template <typename U>
inline U unzigzag_add(U zz, U old) {
  const U d = static_cast<U>((zz >> 1) ^ static_cast<U>(U(0) - (zz & U(1))));
  return static_cast<U>(old + d);
}

// Runs fn(task) for task in [0, n_tasks) on up to `threads` threads (dynamic scheduling);
// the first exception thrown by any task is rethrown here after every thread has stopped.
template <typename F>
void parallel_for(int64_t n_tasks, int threads, F&& fn) {
  if (n_tasks <= 0) return;
  const int64_t workers = std::min<int64_t>(std::max(threads, 1), n_tasks);
  if (workers == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&]() {
    try {
      for (int64_t t; (t = next.fetch_add(1)) < n_tasks;) fn(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next.store(n_tasks);
    }
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// S of elements x[a, b), element x[i] having index first_index + i. Along a contiguous range
// k, m and n advance by K1, M1 and N1 per word, so the loop has one multiply per word and
// vectorizes; the high half of the word index is refreshed where it changes (every 2^32 words).
template <typename U>
GLM_HOT uint64_t checksum_range(const U* x, int64_t a, int64_t b, uint64_t first_index = 0) {
  constexpr uint64_t WORDS = sizeof(U) == 8 ? 2 : 1;
  uint64_t s = 0;
  while (a < b) {
    const uint64_t word = (first_index + static_cast<uint64_t>(a)) * WORDS;
    const uint64_t room = ((uint64_t(1) << 32) - (word & 0xFFFFFFFFull)) / WORDS;
    const int64_t end =
        a + static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(b - a), room));
    const uint32_t lo = static_cast<uint32_t>(word), hi = static_cast<uint32_t>(word >> 32);
    uint32_t k = lo * K1 + hi * K2 + K3, m = lo * M1 + hi * M2 + M3, n = lo * N1 + hi * N2 + N3;
    for (int64_t i = a; i < end; ++i) {
      const U v = load<U>(x + i);
      if constexpr (sizeof(U) == 8) {
        s += mix(static_cast<uint32_t>(v), k, m, n);
        k += K1;
        m += M1;
        n += N1;
        s += mix(static_cast<uint32_t>(v >> 32), k, m, n);
      } else {
        s += mix(static_cast<uint32_t>(v), k, m, n);
      }
      k += K1;
      m += M1;
      n += N1;
    }
    a = end;
  }
  return s;
}

template <typename U>
uint64_t checksum_sum_t(const U* x, int64_t n, int threads, uint64_t first_index = 0) {
  const int64_t tasks = ceil_div(n, CHUNK);
  std::vector<uint64_t> part(static_cast<size_t>(tasks), 0);
  parallel_for(tasks, threads, [&](int64_t t) {
    part[static_cast<size_t>(t)] =
        checksum_range(x, t * CHUNK, std::min(n, (t + 1) * CHUNK), first_index);
  });
  uint64_t s = 0;
  for (uint64_t p : part) s += p;
  return s;
}

// Appends the tile-local offsets of the elements of [a, b) whose bits differ. Equal 32-byte
// blocks (most of them) are skipped with a few word compares.
template <typename U>
GLM_HOT void find_changes(const U* nb, const U* ob, int64_t a, int64_t b,
                          std::vector<uint16_t>& out) {
  constexpr int64_t STEP = 32 / sizeof(U);
  const auto* pn = reinterpret_cast<const unsigned char*>(nb);
  const auto* po = reinterpret_cast<const unsigned char*>(ob);
  int64_t i = a;
  for (; i + STEP <= b; i += STEP) {
    uint64_t d = 0;
    for (int q = 0; q < 4; ++q)
      d |= load<uint64_t>(pn + sizeof(U) * i + 8 * q) ^ load<uint64_t>(po + sizeof(U) * i + 8 * q);
    if (!d) continue;
    for (int64_t j = i; j < i + STEP; ++j)
      if (load<U>(nb + j) != load<U>(ob + j)) out.push_back(static_cast<uint16_t>(j - a));
  }
  for (; i < b; ++i)
    if (load<U>(nb + i) != load<U>(ob + i)) out.push_back(static_cast<uint16_t>(i - a));
}

// --------------------------------------------------------------------- positions decode
inline void decode_int32(const unsigned char* src, int64_t count, int64_t numel, int64_t* pos,
                  int threads) {
  parallel_for(ceil_div(count, CHUNK), threads, [&](int64_t t) {
    const int64_t a = t * CHUNK, b = std::min(count, a + CHUNK);
    int64_t prev = a ? load<int32_t>(src + 4 * (a - 1)) : -1;
    for (int64_t k = a; k < b; ++k) {
      const int64_t p = load<int32_t>(src + 4 * k);
      if (p < 0 || p >= numel)
        throw std::invalid_argument("corrupt delta packet: position " + std::to_string(p) +
                                    " out of range [0, " + std::to_string(numel) + ")");
      if (p <= prev)
        throw std::invalid_argument("corrupt delta packet: positions not strictly increasing");
      pos[k] = prev = p;
    }
  });
}

// gap16 (element-major u16, or two byte planes) + escapes -> positions, in two parallel
// passes over chunks of gaps with a serial prefix between them.
inline void decode_gap16(const unsigned char* gaps, bool planar, int64_t count,
                         const unsigned char* esc, int64_t n_esc, int64_t numel, int64_t* pos,
                         int threads) {
  auto gap_at = [&](int64_t k) -> int64_t {
    return planar ? int64_t(gaps[k]) | (int64_t(gaps[count + k]) << 8)
                  : int64_t(load<uint16_t>(gaps + 2 * k));
  };
  const int64_t chunks = ceil_div(count, CHUNK);
  std::vector<int64_t> span(static_cast<size_t>(chunks)), n_marks(static_cast<size_t>(chunks));
  parallel_for(chunks, threads, [&](int64_t t) {
    int64_t s = 0, e = 0;
    for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k) {
      const int64_t g = gap_at(k);
      if (g == ESCAPE) ++e; else s += g + 1;
    }
    span[static_cast<size_t>(t)] = s;
    n_marks[static_cast<size_t>(t)] = e;
  });
  std::vector<int64_t> base(static_cast<size_t>(chunks)), esc_at(static_cast<size_t>(chunks));
  int64_t position = -1, j = 0;
  for (int64_t t = 0; t < chunks; ++t) {
    base[static_cast<size_t>(t)] = position;
    esc_at[static_cast<size_t>(t)] = j;
    position += span[static_cast<size_t>(t)];
    for (int64_t m = 0; m < n_marks[static_cast<size_t>(t)]; ++m, ++j) {
      if (j >= n_esc) break;
      const uint64_t g = load<uint64_t>(esc + 8 * j);
      if (g < uint64_t(ESCAPE) || g >= uint64_t(std::max<int64_t>(numel, 1)))
        throw std::invalid_argument("corrupt gap16 stream: escape values must lie in [65535, " +
                                    std::to_string(numel) + ")");
      position += static_cast<int64_t>(g) + 1;
    }
    if (position >= numel)  // checked per chunk: the running sum cannot overflow
      throw std::invalid_argument("corrupt delta packet: position " + std::to_string(position) +
                                  " out of range [0, " + std::to_string(numel) + ")");
  }
  int64_t marks = 0;
  for (int64_t m : n_marks) marks += m;
  if (marks != n_esc)
    throw std::invalid_argument("corrupt gap16 stream: " + std::to_string(marks) +
                                " escape markers, " + std::to_string(n_esc) + " escape values");
  parallel_for(chunks, threads, [&](int64_t t) {
    int64_t p = base[static_cast<size_t>(t)], e = esc_at[static_cast<size_t>(t)];
    for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k) {
      int64_t g = gap_at(k);
      if (g == ESCAPE) g = static_cast<int64_t>(load<uint64_t>(esc + 8 * e++));
      pos[k] = p += g + 1;
    }
  });
}

// ------------------------------------------------------------------------------- apply
// Verify the streams against target (positions, base checksum, result checksum); then, only
// if write is true, scatter the new values. write=false is delta.verify: the same checks,
// target only read.
template <typename U>
void apply_t(U* target, int64_t numel, bool gap16, bool diff, bool planar,
             const unsigned char* positions, const unsigned char* esc, int64_t n_esc,
             const unsigned char* values, int64_t count, const std::string& result_ck,
             const std::string& base_ck, int threads, bool write = true) {
  const int64_t size = sizeof(U);
  std::vector<int64_t> pos(static_cast<size_t>(count));
  if (gap16)
    decode_gap16(positions, planar, count, esc, n_esc, numel, pos.data(), threads);
  else
    decode_int32(positions, count, numel, pos.data(), threads);
  auto value_at = [&](int64_t k, U old) -> U {
    U v = 0;
    if (planar) {
      for (int64_t byte = 0; byte < size; ++byte)
        v = static_cast<U>(v | (static_cast<U>(values[byte * count + k]) << (8 * byte)));
    } else {
      v = load<U>(values + size * k);
    }
    return diff ? unzigzag_add(v, old) : v;
  };
  // S(result) = S(target) + sum over changed elements of term(new) - term(old): the result is
  // verified before the first write, with no copy of the target.
  const int64_t chunks = ceil_div(count, CHUNK);
  std::vector<uint64_t> delta(static_cast<size_t>(chunks), 0);
  parallel_for(chunks, threads, [&](int64_t t) {
    uint64_t d = 0;
    for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k) {
      const uint64_t p = static_cast<uint64_t>(pos[static_cast<size_t>(k)]);
      const U old = target[p];
      d += element_term(value_at(k, old), p) - element_term(old, p);
    }
    delta[static_cast<size_t>(t)] = d;
  });
  const uint64_t n_words = static_cast<uint64_t>(numel) * (size == 8 ? 2 : 1);
  uint64_t s = checksum_sum_t(target, numel, threads);
  if (!base_ck.empty() && finalize(s, n_words) != le64(base_ck))
    throw std::invalid_argument(
        "target is not the packet's base: base checksum mismatch (the packet codes values "
        "relative to one exact base version)");
  for (uint64_t d : delta) s += d;
  if (finalize(s, n_words) != le64(result_ck))
    throw std::invalid_argument(
        "delta result checksum mismatch: the target differs from the packet's base at "
        "unchanged elements, or the packet is corrupt");
  if (!write) return;
  parallel_for(chunks, threads, [&](int64_t t) {  // positions are distinct: no write races
    for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k) {
      const int64_t p = pos[static_cast<size_t>(k)];
      target[p] = value_at(k, target[p]);
    }
  });
}

}  // namespace glm_delta
