// glm_kernels._host: the delta codec's host (CPU) paths, multithreaded.
//
// The formats are defined in glm_kernels/delta/_reference.py (readable numpy); this file
// produces the same streams and checksums bit for bit:
//   checksum_sum   the linear word checksum S of a buffer (finalize() makes the 8 bytes)
//   encode         compare two buffers, count changes per tile, prefix, write positions or
//                  gap16 gaps (+ escapes) and values (raw or zigzag difference; element-major
//                  or byte planes), plus S of new (and of old for base-relative values)
//   apply          decode and validate positions, verify the base and result checksums from
//                  the target's S and the changed elements only, then scatter in place into
//                  any writable buffer (a CPU tensor, a memory-mapped safetensors file)
//   gap16_pack / gap16_unpack / byte_group / byte_ungroup: the stream pieces on their own
// Errors raise ValueError (std::invalid_argument) before anything is written.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

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

namespace {

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

uint64_t fmix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 33);
}

uint64_t finalize(uint64_t s, uint64_t n_words) { return fmix64(s ^ (n_words * GOLDEN64)); }

uint64_t le64(const std::string& b) {
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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
    const int64_t end = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(b - a), room)) + a;
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

// ---------------------------------------------------------------------------------- encode
// hash: checksum sums of new (and of old if diff); otherwise "s_delta", the sum of
// term(new) - term(old) over the changed elements (S(new) = S(old) + s_delta).
template <typename U>
py::dict encode_t(const U* nb, const U* ob, int64_t n, bool gap16, bool diff, bool planar,
                  bool hash, int threads) {
  if (!gap16 && n > (int64_t(1) << 31))
    throw std::invalid_argument("int32 positions cannot address more than 2^31 elements");
  // Pass 1, one read of new and old per tile: checksum sums and the tile's changed offsets
  // (uint16: TILE <= 65536; 2 bytes of scratch per change).
  const int64_t tiles = ceil_div(n, TILE);
  std::vector<std::vector<uint16_t>> changed(static_cast<size_t>(tiles));
  std::vector<uint64_t> s_new_part(static_cast<size_t>(tiles)), s_old_part(static_cast<size_t>(tiles));
  {
    py::gil_scoped_release nogil;
    parallel_for(tiles, threads, [&](int64_t t) {
      const int64_t a = t * TILE, b = std::min(n, a + TILE);
      if (hash) s_new_part[static_cast<size_t>(t)] = checksum_range(nb, a, b);
      if (hash && diff) s_old_part[static_cast<size_t>(t)] = checksum_range(ob, a, b);
      find_changes(nb, ob, a, b, changed[static_cast<size_t>(t)]);
    });
  }
  // Prefix over tiles: output offset, previous changed position, escapes in stream order.
  // A tile is shorter than ESCAPE, so only the first gap of a tile can need an escape.
  std::vector<int64_t> offset(static_cast<size_t>(tiles)), prev_last(static_cast<size_t>(tiles));
  std::vector<uint64_t> escapes;
  int64_t count = 0, last = -1;
  uint64_t s_new = 0, s_old = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const auto& c = changed[static_cast<size_t>(t)];
    offset[static_cast<size_t>(t)] = count;
    prev_last[static_cast<size_t>(t)] = last;
    if (!c.empty()) {
      const int64_t first = t * TILE + c.front();
      if (gap16 && first - last - 1 >= ESCAPE) escapes.push_back(first - last - 1);
      last = t * TILE + c.back();
      count += static_cast<int64_t>(c.size());
    }
    s_new += s_new_part[static_cast<size_t>(t)];
    s_old += s_old_part[static_cast<size_t>(t)];
  }
  const int64_t size = sizeof(U);
  auto alloc = [](py::dtype dt, int64_t k) {
    return py::array(dt, std::vector<py::ssize_t>{static_cast<py::ssize_t>(k)});
  };
  py::array positions = !gap16  ? alloc(py::dtype::of<int32_t>(), count)
                        : planar ? alloc(py::dtype::of<uint8_t>(), 2 * count)
                                 : alloc(py::dtype::of<uint16_t>(), count);
  py::array values = planar ? alloc(py::dtype::of<uint8_t>(), size * count)
                            : alloc(py::dtype::of<U>(), count);
  py::array_t<uint64_t> esc(static_cast<py::ssize_t>(escapes.size()));
  if (!escapes.empty())
    std::memcpy(esc.mutable_data(), escapes.data(), escapes.size() * sizeof(uint64_t));
  auto* pos_out = static_cast<unsigned char*>(positions.mutable_data());
  auto* val_out = static_cast<unsigned char*>(values.mutable_data());
  std::vector<uint64_t> delta(static_cast<size_t>(tiles), 0);
  {
    // Pass 2, count-sized: write positions or gaps and values at the tile's offset.
    py::gil_scoped_release nogil;
    parallel_for(tiles, threads, [&](int64_t t) {
      const auto& c = changed[static_cast<size_t>(t)];
      int64_t k = offset[static_cast<size_t>(t)], prev = prev_last[static_cast<size_t>(t)];
      for (const uint16_t local : c) {
        const int64_t i = t * TILE + local;
        const U x = load<U>(nb + i), y = load<U>(ob + i);
        if (!hash)
          delta[static_cast<size_t>(t)] += element_term(x, static_cast<uint64_t>(i)) -
                                           element_term(y, static_cast<uint64_t>(i));
        if (!gap16) {
          store<int32_t>(pos_out + 4 * k, static_cast<int32_t>(i));
        } else {
          const int64_t gap = i - prev - 1;
          const uint16_t g = static_cast<uint16_t>(gap >= ESCAPE ? ESCAPE : gap);
          if (planar) {
            pos_out[k] = static_cast<unsigned char>(g & 0xFF);
            pos_out[count + k] = static_cast<unsigned char>(g >> 8);
          } else {
            store<uint16_t>(pos_out + 2 * k, g);
          }
          prev = i;
        }
        const U v = diff ? zigzag(x, y) : x;
        if (planar) {
          for (int64_t byte = 0; byte < size; ++byte)
            val_out[byte * count + k] = static_cast<unsigned char>((v >> (8 * byte)) & 0xFF);
        } else {
          store<U>(val_out + size * k, v);
        }
        ++k;
      }
    });
  }
  py::dict out;
  out["count"] = count;
  out["positions"] = positions;
  out["escapes"] = esc;
  out["values"] = values;
  out["s_new"] = py::int_(s_new);
  out["s_old"] = py::int_(s_old);
  uint64_t s_delta = 0;
  for (uint64_t d : delta) s_delta += d;
  out["s_delta"] = py::int_(s_delta);
  return out;
}

// --------------------------------------------------------------------- positions decode
void decode_int32(const unsigned char* src, int64_t count, int64_t numel, int64_t* pos,
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
void decode_gap16(const unsigned char* gaps, bool planar, int64_t count, const unsigned char* esc,
                  int64_t n_esc, int64_t numel, int64_t* pos, int threads) {
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
template <typename U>
void apply_t(U* target, int64_t numel, bool gap16, bool diff, bool planar,
             const unsigned char* positions, const unsigned char* esc, int64_t n_esc,
             const unsigned char* values, int64_t count, const std::string& result_ck,
             const std::string& base_ck, int threads) {
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
  parallel_for(chunks, threads, [&](int64_t t) {  // positions are distinct: no write races
    for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k) {
      const int64_t p = pos[static_cast<size_t>(k)];
      target[p] = value_at(k, target[p]);
    }
  });
}

// ----------------------------------------------------------------------- python glue
const unsigned char* bytes_of(const py::buffer_info& info, int64_t want, const char* name) {
  const int64_t have = static_cast<int64_t>(info.size * info.itemsize);
  if (have != want)
    throw std::invalid_argument(std::string(name) + ": " + std::to_string(have) +
                                " bytes, expected " + std::to_string(want));
  return static_cast<const unsigned char*>(info.ptr);
}

py::buffer_info contiguous(const py::array& a, const char* name) {
  if (!(a.flags() & py::array::c_style))
    throw std::invalid_argument(std::string(name) + " must be C-contiguous");
  return a.request();
}

template <typename F>
auto by_size(int64_t size, F&& fn) {
  switch (size) {
    case 1: return fn(uint8_t{});
    case 2: return fn(uint16_t{});
    case 4: return fn(uint32_t{});
    case 8: return fn(uint64_t{});
    default: throw std::invalid_argument("element size must be 1, 2, 4 or 8, got " +
                                         std::to_string(size));
  }
}

int resolve_threads(int threads) {
  if (threads >= 1) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

uint64_t py_checksum_sum(const py::array& x, int threads, uint64_t first_index) {
  const py::buffer_info info = contiguous(x, "x");
  return by_size(info.itemsize, [&](auto tag) {
    using U = decltype(tag);
    py::gil_scoped_release nogil;
    return checksum_sum_t(static_cast<const U*>(info.ptr), static_cast<int64_t>(info.size),
                          resolve_threads(threads), first_index);
  });
}

py::dict py_encode(const py::array& new_bits, const py::array& old_bits, bool gap16, bool diff,
                   bool planar, bool hash, int threads) {
  const py::buffer_info a = contiguous(new_bits, "new"), b = contiguous(old_bits, "old");
  if (a.itemsize != b.itemsize || a.size != b.size)
    throw std::invalid_argument("new and old must have the same element size and count");
  return by_size(a.itemsize, [&](auto tag) {
    using U = decltype(tag);
    return encode_t<U>(static_cast<const U*>(a.ptr), static_cast<const U*>(b.ptr),
                       static_cast<int64_t>(a.size), gap16, diff, planar, hash,
                       resolve_threads(threads));
  });
}

void py_apply(py::array target, bool gap16, bool diff, bool planar, const py::array& positions,
              const py::array& escapes, const py::array& values, int64_t count,
              const py::bytes& result_ck, const py::bytes& base_ck, int threads) {
  if (!(target.flags() & py::array::c_style) || !target.writeable())
    throw std::invalid_argument("target must be a writable C-contiguous buffer");
  const std::string result = result_ck, base = base_ck;
  if (result.size() != 8 || !(base.empty() || base.size() == 8))
    throw std::invalid_argument("checksums must be 8 bytes (base: 8 or empty)");
  py::buffer_info t = target.request(true);
  const int64_t size = t.itemsize, numel = static_cast<int64_t>(t.size);
  const py::buffer_info pi = contiguous(positions, "positions"), ei = contiguous(escapes, "escapes"),
                        vi = contiguous(values, "values");
  const unsigned char* p = bytes_of(pi, gap16 ? 2 * count : 4 * count, "positions");
  const int64_t n_esc = static_cast<int64_t>(ei.size * ei.itemsize) / 8;
  const unsigned char* e = bytes_of(ei, 8 * n_esc, "escapes");
  const unsigned char* v = bytes_of(vi, size * count, "values");
  if (count > numel) throw std::invalid_argument("corrupt delta packet: more changes than elements");
  by_size(size, [&](auto tag) {
    using U = decltype(tag);
    py::gil_scoped_release nogil;
    apply_t<U>(static_cast<U*>(t.ptr), numel, gap16, diff, planar, p, e, n_esc, v, count, result,
               base, resolve_threads(threads));
  });
}

py::tuple py_gap16_pack(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& pos) {
  const int64_t c = static_cast<int64_t>(pos.size());
  const int64_t* p = pos.data();
  py::array_t<uint16_t> gaps(c);
  uint16_t* g = gaps.mutable_data();
  std::vector<uint64_t> esc;
  int64_t prev = -1;
  for (int64_t k = 0; k < c; ++k) {
    if (p[k] <= prev) throw std::invalid_argument("positions must be >= 0 and strictly increasing");
    const int64_t gap = p[k] - prev - 1;
    g[k] = static_cast<uint16_t>(gap >= ESCAPE ? ESCAPE : gap);
    if (gap >= ESCAPE) esc.push_back(static_cast<uint64_t>(gap));
    prev = p[k];
  }
  py::array_t<uint64_t> escapes(static_cast<py::ssize_t>(esc.size()));
  if (!esc.empty()) std::memcpy(escapes.mutable_data(), esc.data(), esc.size() * 8);
  return py::make_tuple(gaps, escapes);
}

py::array_t<int64_t> py_gap16_unpack(const py::array& gaps, const py::array& escapes, int64_t numel,
                                     int threads) {
  const py::buffer_info gi = contiguous(gaps, "gaps"), ei = contiguous(escapes, "escapes");
  const int64_t count = static_cast<int64_t>(gi.size * gi.itemsize) / 2;
  const unsigned char* g = bytes_of(gi, 2 * count, "gaps");
  const int64_t n_esc = static_cast<int64_t>(ei.size * ei.itemsize) / 8;
  const unsigned char* e = bytes_of(ei, 8 * n_esc, "escapes");
  py::array_t<int64_t> pos(count);
  int64_t* out = pos.mutable_data();
  {
    py::gil_scoped_release nogil;
    decode_gap16(g, false, count, e, n_esc, numel, out, resolve_threads(threads));
  }
  return pos;
}

py::array_t<uint8_t> py_byte_group(const py::array& values, int threads) {
  const py::buffer_info vi = contiguous(values, "values");
  const int64_t size = vi.itemsize, count = static_cast<int64_t>(vi.size);
  const auto* src = static_cast<const unsigned char*>(vi.ptr);
  py::array_t<uint8_t> planes(size * count);
  uint8_t* dst = planes.mutable_data();
  {
    py::gil_scoped_release nogil;
    parallel_for(ceil_div(count, CHUNK), resolve_threads(threads), [&](int64_t t) {
      for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k)
        for (int64_t byte = 0; byte < size; ++byte) dst[byte * count + k] = src[k * size + byte];
    });
  }
  return planes;
}

py::array_t<uint8_t> py_byte_ungroup(const py::array& planes, int64_t size, int threads) {
  const py::buffer_info pi = contiguous(planes, "planes");
  const int64_t total = static_cast<int64_t>(pi.size * pi.itemsize);
  if (size < 1 || total % size)
    throw std::invalid_argument("planes length must be a multiple of size");
  const int64_t count = total / size;
  const auto* src = static_cast<const unsigned char*>(pi.ptr);
  py::array_t<uint8_t> out(total);
  uint8_t* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    parallel_for(ceil_div(count, CHUNK), resolve_threads(threads), [&](int64_t t) {
      for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k)
        for (int64_t byte = 0; byte < size; ++byte) dst[k * size + byte] = src[byte * count + k];
    });
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_host, m) {
  m.doc() = "glm_kernels host (CPU) delta codec paths; formats in glm_kernels/delta/_reference.py";
  m.def("checksum_sum", &py_checksum_sum, py::arg("x"), py::arg("threads") = 0,
        py::arg("first_index") = 0,
        "Word-checksum sum S (mod 2^64) of a contiguous 1/2/4/8-byte array whose first "
        "element has index first_index (a slice of a larger tensor).");
  m.def("finalize", [](uint64_t s, uint64_t n_words) {
          const uint64_t h = finalize(s, n_words);
          char b[8];
          for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((h >> (8 * i)) & 0xFF);
          return py::bytes(b, 8);
        }, py::arg("s"), py::arg("n_words"), "8-byte checksum from S and the word count.");
  m.def("encode", &py_encode, py::arg("new"), py::arg("old"), py::arg("gap16"), py::arg("diff"),
        py::arg("planar"), py::arg("hash") = true, py::arg("threads") = 0,
        "Streams turning old into new: dict(count, positions, escapes, values, s_new, s_old, "
        "s_delta); hash=False skips hashing the tensors (s_delta: the changes' term sum).");
  m.def("apply", &py_apply, py::arg("target"), py::arg("gap16"), py::arg("diff"),
        py::arg("planar"), py::arg("positions"), py::arg("escapes"), py::arg("values"),
        py::arg("count"), py::arg("result_checksum"), py::arg("base_checksum"),
        py::arg("threads") = 0,
        "Verify then apply streams to a writable buffer in place; ValueError before any write.");
  m.def("gap16_pack", &py_gap16_pack, py::arg("positions"));
  m.def("gap16_unpack", &py_gap16_unpack, py::arg("gaps"), py::arg("escapes"), py::arg("numel"),
        py::arg("threads") = 0);
  m.def("byte_group", &py_byte_group, py::arg("values"), py::arg("threads") = 0);
  m.def("byte_ungroup", &py_byte_ungroup, py::arg("planes"), py::arg("size"),
        py::arg("threads") = 0);
}
