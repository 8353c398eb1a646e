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
//                  any writable buffer (a CPU tensor, a memory-mapped safetensors file);
//                  write=False runs the same checks and writes nothing (delta.verify)
//   gap16_pack / gap16_unpack / byte_group / byte_ungroup: the stream pieces on their own
// Errors raise ValueError (std::invalid_argument) before anything is written.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "delta_core.h"

namespace py = pybind11;

namespace {

using namespace glm_delta;

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
  std::vector<uint64_t> s_new_part(static_cast<size_t>(tiles));
  std::vector<uint64_t> s_old_part(static_cast<size_t>(tiles));
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
              const py::bytes& result_ck, const py::bytes& base_ck, int threads, bool write) {
  if (!(target.flags() & py::array::c_style) || (write && !target.writeable()))
    throw std::invalid_argument(write ? "target must be a writable C-contiguous buffer"
                                      : "target must be a C-contiguous buffer");
  const std::string result = result_ck, base = base_ck;
  if (result.size() != 8 || !(base.empty() || base.size() == 8))
    throw std::invalid_argument("checksums must be 8 bytes (base: 8 or empty)");
  py::buffer_info t = target.request(write);
  const int64_t size = t.itemsize, numel = static_cast<int64_t>(t.size);
  // Before any size arithmetic: 0 <= count <= numel keeps 8 * count far from overflow.
  if (count < 0 || count > numel)
    throw std::invalid_argument("corrupt delta packet: " + std::to_string(count) +
                                " changes for " + std::to_string(numel) + " elements");
  const py::buffer_info pi = contiguous(positions, "positions");
  const py::buffer_info ei = contiguous(escapes, "escapes");
  const py::buffer_info vi = contiguous(values, "values");
  const unsigned char* p = bytes_of(pi, gap16 ? 2 * count : 4 * count, "positions");
  const int64_t n_esc = static_cast<int64_t>(ei.size * ei.itemsize) / 8;
  // Each escaped gap skips at least ESCAPE elements and every change takes one: a stream with
  // more escapes than the target can hold is refused before anything is decoded.
  if (n_esc > (numel - count) / ESCAPE)
    throw std::invalid_argument("corrupt delta packet: " + std::to_string(n_esc) +
                                " escapes for " + std::to_string(count) + " changes in " +
                                std::to_string(numel) + " elements");
  const unsigned char* e = bytes_of(ei, 8 * n_esc, "escapes");
  const unsigned char* v = bytes_of(vi, size * count, "values");
  by_size(size, [&](auto tag) {
    using U = decltype(tag);
    py::gil_scoped_release nogil;
    apply_t<U>(static_cast<U*>(t.ptr), numel, gap16, diff, planar, p, e, n_esc, v, count, result,
               base, resolve_threads(threads), write);
  });
}

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

py::tuple py_gap16_pack(const Int64Array& pos) {
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

// Element-major bytes <-> byte planes: element k's byte b is at k * size + b in one layout and
// at b * count + k in the other.
py::array_t<uint8_t> transpose_bytes(const py::array& src_arr, int64_t size, bool to_planes,
                                     int threads) {
  const py::buffer_info info = contiguous(src_arr, to_planes ? "values" : "planes");
  const int64_t total = static_cast<int64_t>(info.size * info.itemsize);
  if (size < 1 || total % size)
    throw std::invalid_argument("byte count must be a multiple of the element size");
  const int64_t count = total / size;
  const auto* src = static_cast<const unsigned char*>(info.ptr);
  py::array_t<uint8_t> out(total);
  uint8_t* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    parallel_for(ceil_div(count, CHUNK), resolve_threads(threads), [&](int64_t t) {
      for (int64_t k = t * CHUNK, b = std::min(count, k + CHUNK); k < b; ++k)
        for (int64_t byte = 0; byte < size; ++byte) {
          const int64_t major = k * size + byte, planar = byte * count + k;
          dst[to_planes ? planar : major] = src[to_planes ? major : planar];
        }
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
        py::arg("threads") = 0, py::arg("write") = true,
        "Verify then apply streams to a writable buffer in place; ValueError before any write. "
        "write=False: verify only (the buffer is only read).");
  m.def("gap16_pack", &py_gap16_pack, py::arg("positions"));
  m.def("gap16_unpack", &py_gap16_unpack, py::arg("gaps"), py::arg("escapes"), py::arg("numel"),
        py::arg("threads") = 0);
  m.def("byte_group", [](const py::array& values, int threads) {
          return transpose_bytes(values, values.itemsize(), true, threads);
        }, py::arg("values"), py::arg("threads") = 0, "Values -> byte planes (uint8).");
  m.def("byte_ungroup", [](const py::array& planes, int64_t size, int threads) {
          return transpose_bytes(planes, size, false, threads);
        }, py::arg("planes"), py::arg("size"), py::arg("threads") = 0,
        "Byte planes -> element-major bytes (uint8; view them with the element dtype).");
}
