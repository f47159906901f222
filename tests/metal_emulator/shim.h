// Metal shim for the CPU emulator of MLX Metal kernels.
//
// A kernel source generated exactly as MLX generates it (see mod.rs) is
// compiled as C++20 after this header. The header provides:
//   1. the runtime (namespace metal_emu): a pool of real threads that runs one
//      threadgroup at a time, threadgroup and simdgroup barriers with deadlock
//      detection, and the driver's main();
//   2. the subset of the Metal language and of MLX's utils.h that kernels use
//      (namespace metal, pulled in with `using namespace metal` as utils.h does);
//   3. the address-space qualifiers, defined last so that 1 and 2 can use the
//      standard library freely.
// Threadgroup memory: runner.rs rewrites `threadgroup T name[...];` declarations
// to `static`, which the threads of one threadgroup share; threadgroups run one
// after another, so each sees the memory alone.
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <source_location>
#include <string>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------------------------
// Scalar and vector types (needed by the runtime for the attribute values).
// ---------------------------------------------------------------------------

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;  // 64 bits on LP64, as in Metal
typedef _Float16 half;

namespace metal {

// bfloat: storage and rounding of bfloat16, arithmetic through float.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  static constexpr uint16_t round(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
  }
  constexpr bfloat(float f) : bits(round(f)) {}
  constexpr bfloat(double f) : bits(round(float(f))) {}
  constexpr bfloat(half f) : bits(round(float(f))) {}
  template <typename I>
    requires std::is_integral_v<I>
  constexpr bfloat(I i) : bits(round(float(i))) {}
  constexpr operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};

template <typename T>
inline constexpr bool is_float_like_v =
    std::is_floating_point_v<T> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>;
template <typename T>
inline constexpr bool is_scalar_v = std::is_arithmetic_v<T> || is_float_like_v<T>;

#define EMU_BF_BINOP(op)                                                              \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); } \
  template <typename S>                                                               \
    requires std::is_arithmetic_v<S>                                                  \
  inline auto operator op(bfloat a, S b) { return float(a) op b; }                    \
  template <typename S>                                                               \
    requires std::is_arithmetic_v<S>                                                  \
  inline auto operator op(S a, bfloat b) { return a op float(b); }                    \
  inline bfloat& operator op##=(bfloat& a, bfloat b) { return a = a op b; }           \
  template <typename S>                                                               \
    requires std::is_arithmetic_v<S>                                                  \
  inline bfloat& operator op##=(bfloat& a, S b) { return a = bfloat(float(a) op b); }
EMU_BF_BINOP(+)
EMU_BF_BINOP(-)
EMU_BF_BINOP(*)
EMU_BF_BINOP(/)
#undef EMU_BF_BINOP
#define EMU_BF_CMP(op)                                                                 \
  inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }         \
  template <typename S>                                                                \
    requires std::is_arithmetic_v<S>                                                   \
  inline bool operator op(bfloat a, S b) { return float(a) op b; }                     \
  template <typename S>                                                                \
    requires std::is_arithmetic_v<S>                                                   \
  inline bool operator op(S a, bfloat b) { return a op float(b); }
EMU_BF_CMP(<)
EMU_BF_CMP(>)
EMU_BF_CMP(<=)
EMU_BF_CMP(>=)
EMU_BF_CMP(==)
EMU_BF_CMP(!=)
#undef EMU_BF_CMP
inline bfloat operator-(bfloat a) { return bfloat(-float(a)); }

template <typename T, int N>
struct vec;

template <typename T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  constexpr vec(T s) : x(s), y(s) {}
  constexpr vec(T a, T b) : x(a), y(b) {}
  template <typename U>
  explicit constexpr vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  constexpr T& operator[](int i) { return i == 0 ? x : y; }
  constexpr const T& operator[](int i) const { return i == 0 ? x : y; }
};

template <typename T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  constexpr vec(T s) : x(s), y(s), z(s) {}
  constexpr vec(T a, T b, T c) : x(a), y(b), z(c) {}
  constexpr vec(vec<T, 2> a, T c) : x(a.x), y(a.y), z(c) {}
  constexpr vec(T a, vec<T, 2> b) : x(a), y(b.x), z(b.y) {}
  template <typename U>
  explicit constexpr vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  constexpr T& operator[](int i) { return i == 0 ? x : i == 1 ? y : z; }
  constexpr const T& operator[](int i) const { return i == 0 ? x : i == 1 ? y : z; }
};

template <typename T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  constexpr vec(T s) : x(s), y(s), z(s), w(s) {}
  constexpr vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  constexpr vec(vec<T, 2> a, vec<T, 2> b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
  constexpr vec(vec<T, 3> a, T d) : x(a.x), y(a.y), z(a.z), w(d) {}
  constexpr vec(vec<T, 2> a, T c, T d) : x(a.x), y(a.y), z(c), w(d) {}
  template <typename U>
  explicit constexpr vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  constexpr T& operator[](int i) { return i == 0 ? x : i == 1 ? y : i == 2 ? z : w; }
  constexpr const T& operator[](int i) const { return i == 0 ? x : i == 1 ? y : i == 2 ? z : w; }
};

#define EMU_VEC_BINOP(op)                                                        \
  template <typename T, int N>                                                   \
  constexpr vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {      \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                          \
    return r;                                                                    \
  }                                                                              \
  template <typename T, int N, typename S>                                       \
    requires is_scalar_v<S>                                                      \
  constexpr vec<T, N> operator op(const vec<T, N>& a, S b) {                     \
    return a op vec<T, N>(T(b));                                                 \
  }                                                                              \
  template <typename T, int N, typename S>                                       \
    requires is_scalar_v<S>                                                      \
  constexpr vec<T, N> operator op(S a, const vec<T, N>& b) {                     \
    return vec<T, N>(T(a)) op b;                                                 \
  }                                                                              \
  template <typename T, int N, typename S>                                       \
  constexpr vec<T, N>& operator op##=(vec<T, N>& a, const S& b) {                \
    return a = a op b;                                                           \
  }
EMU_VEC_BINOP(+)
EMU_VEC_BINOP(-)
EMU_VEC_BINOP(*)
EMU_VEC_BINOP(/)
EMU_VEC_BINOP(%)
EMU_VEC_BINOP(&)
EMU_VEC_BINOP(|)
EMU_VEC_BINOP(^)
EMU_VEC_BINOP(<<)
EMU_VEC_BINOP(>>)
#undef EMU_VEC_BINOP
#define EMU_VEC_CMP(op)                                                          \
  template <typename T, int N>                                                   \
  constexpr vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {   \
    vec<bool, N> r;                                                              \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                             \
    return r;                                                                    \
  }
EMU_VEC_CMP(<)
EMU_VEC_CMP(>)
EMU_VEC_CMP(<=)
EMU_VEC_CMP(>=)
EMU_VEC_CMP(==)
EMU_VEC_CMP(!=)
#undef EMU_VEC_CMP
template <typename T, int N>
constexpr vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = -a[i];
  return r;
}
template <int N>
constexpr bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
constexpr bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
constexpr bool all(bool v) { return v; }
constexpr bool any(bool v) { return v; }

}  // namespace metal

#define EMU_VEC_TYPES(T)          \
  typedef metal::vec<T, 2> T##2;  \
  typedef metal::vec<T, 3> T##3;  \
  typedef metal::vec<T, 4> T##4;
EMU_VEC_TYPES(bool)
EMU_VEC_TYPES(char)
EMU_VEC_TYPES(uchar)
EMU_VEC_TYPES(short)
EMU_VEC_TYPES(ushort)
EMU_VEC_TYPES(int)
EMU_VEC_TYPES(uint)
EMU_VEC_TYPES(long)
EMU_VEC_TYPES(ulong)
EMU_VEC_TYPES(half)
EMU_VEC_TYPES(float)
#undef EMU_VEC_TYPES
typedef metal::bfloat bfloat;
typedef metal::vec<bfloat, 2> bfloat2;
typedef metal::vec<bfloat, 3> bfloat3;
typedef metal::vec<bfloat, 4> bfloat4;
typedef half float16_t;        // MLX utils.h
typedef bfloat bfloat16_t;     // MLX bf16.h

// ---------------------------------------------------------------------------
// Runtime.
// ---------------------------------------------------------------------------

namespace metal_emu {

constexpr unsigned kSimdWidth = 32;
constexpr unsigned kSlotBytes = 64;  // largest value a simd function exchanges

[[noreturn]] inline void fail(const char* fmt, ...) {
  static std::atomic<bool> failed{false};
  if (failed.exchange(true)) {
    for (;;) pause();  // the first failing thread reports and ends the process
  }
  va_list ap;
  va_start(ap, fmt);
  std::fputs("metal emulator: ", stderr);
  std::vfprintf(stderr, fmt, ap);
  std::fputc('\n', stderr);
  va_end(ap);
  std::fflush(stderr);
  _exit(70);
}

struct Launch {
  uint3 grid;           // threads, as MLX's dispatchThreads
  uint3 tg;             // dispatched threadgroup size, min(threadgroup, grid)
  uint3 groups;         // threadgroups per grid
  unsigned tg_threads;  // tg.x * tg.y * tg.z
  int timeout_ms;
};

// State of a simdgroup for one threadgroup: exchange slots for the simd_*
// functions, double-buffered so that one rendezvous per call suffices.
struct SimdGroup {
  std::mutex m;
  std::condition_variable cv;
  unsigned active = 0;     // lanes that exist and have not returned
  uint64_t mask = 0;       // the same, as a bit per lane
  unsigned arrived = 0;
  uint64_t round = 0;
  const char* op = nullptr;
  uint64_t round_mask[2] = {0, 0};
  alignas(16) unsigned char slot[2][kSimdWidth][kSlotBytes];
};

struct Group {
  uint3 pos;        // threadgroup_position_in_grid
  uint3 size;       // actual size: the last threadgroup of a dimension may be partial
  unsigned count;   // threads in this threadgroup
  std::mutex m;
  std::condition_variable cv;
  unsigned arrived = 0, exited = 0;
  uint64_t round = 0;
  unsigned site_line = 0, site_column = 0;  // the barrier call of the current round
  SimdGroup simd[1024 / kSimdWidth];
};

struct Thread {
  unsigned index;  // thread_index_in_threadgroup
  unsigned lane;
  SimdGroup* sg;
};

inline Launch g_launch;
inline Group* g_group;
inline thread_local Thread* t_self;

inline std::chrono::steady_clock::time_point deadline() {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(g_launch.timeout_ms);
}

inline void threadgroup_barrier_wait(const std::source_location& site) {
  Group& g = *g_group;
  std::unique_lock<std::mutex> lk(g.m);
  const uint64_t r = g.round;
  if (g.arrived == 0) {
    g.site_line = site.line();
    g.site_column = site.column();
  } else if (g.site_line != site.line() || g.site_column != site.column()) {
    fail("threads of threadgroup (%u,%u,%u) are at different barriers, line %u and line %u of %s "
         "(barriers inside a branch that only some threads take?)",
         g.pos.x, g.pos.y, g.pos.z, g.site_line, unsigned(site.line()), site.file_name());
  }
  ++g.arrived;
  if (g.exited > 0 && g.arrived + g.exited == g.count) {
    fail("threadgroup_barrier in threadgroup (%u,%u,%u): %u of %u threads reached it and %u "
         "had returned from the kernel; every thread of a threadgroup must reach every barrier",
         g.pos.x, g.pos.y, g.pos.z, g.arrived, g.count, g.exited);
  }
  if (g.arrived == g.count) {
    g.arrived = 0;
    ++g.round;
    g.cv.notify_all();
    return;
  }
  if (!g.cv.wait_until(lk, deadline(), [&] { return g.round != r; })) {
    fail("deadlock at threadgroup_barrier in threadgroup (%u,%u,%u): after %d ms %u of %u "
         "threads had reached it and %u had returned; the others are at a different barrier "
         "(a barrier inside a branch that only some threads take?) or still running",
         g.pos.x, g.pos.y, g.pos.z, g_launch.timeout_ms, g.arrived, g.count, g.exited);
  }
}

inline void complete_simd_round(SimdGroup& s) {
  s.round_mask[s.round & 1] = s.mask;
  s.arrived = 0;
  ++s.round;
  s.cv.notify_all();
}

inline void thread_exit() {
  Thread& t = *t_self;
  {
    Group& g = *g_group;
    std::lock_guard<std::mutex> lk(g.m);
    ++g.exited;
    if (g.arrived > 0 && g.arrived + g.exited == g.count) {
      fail("threadgroup_barrier in threadgroup (%u,%u,%u): %u of %u threads reached it and %u "
           "had returned from the kernel; every thread of a threadgroup must reach every barrier",
           g.pos.x, g.pos.y, g.pos.z, g.arrived, g.count, g.exited);
    }
  }
  SimdGroup& s = *t.sg;
  std::lock_guard<std::mutex> lk(s.m);
  s.mask &= ~(uint64_t(1) << t.lane);
  --s.active;
  if (s.arrived > 0 && s.arrived == s.active) complete_simd_round(s);
}

// One rendezvous of the active lanes of the caller's simdgroup: each lane
// deposits `v`, and `read(slots, mask)` computes the caller's result from the
// values of the lanes in `mask`. Lanes that returned from the kernel are
// inactive, as on the GPU; lanes that are elsewhere make this time out.
template <typename T, typename R>
inline auto simd_exchange(const char* op, const T& v, R&& read) {
  static_assert(sizeof(T) <= kSlotBytes, "simd value too large for the emulator");
  Thread& t = *t_self;
  SimdGroup& s = *t.sg;
  std::unique_lock<std::mutex> lk(s.m);
  const uint64_t r = s.round;
  const int p = int(r & 1);
  if (s.arrived == 0) {
    s.op = op;
  } else if (std::strcmp(s.op, op) != 0) {
    fail("divergent simd functions in simdgroup %u of threadgroup (%u,%u,%u): lane %u called %s "
         "while other lanes are in %s",
         t.index / kSimdWidth, g_group->pos.x, g_group->pos.y, g_group->pos.z, t.lane, op, s.op);
  }
  std::memcpy(s.slot[p][t.lane], &v, sizeof(T));
  if (++s.arrived == s.active) {
    complete_simd_round(s);
  } else if (!s.cv.wait_until(lk, deadline(), [&] { return s.round != r; })) {
    fail("deadlock in %s, simdgroup %u of threadgroup (%u,%u,%u): after %d ms %u of %u active "
         "lanes had called it (a simd function or simdgroup_barrier inside a branch that only "
         "some lanes take?)",
         op, t.index / kSimdWidth, g_group->pos.x, g_group->pos.y, g_group->pos.z,
         g_launch.timeout_ms, s.arrived, s.active);
  }
  auto lane_value = [&](unsigned lane) {
    T out;
    std::memcpy(&out, s.slot[p][lane], sizeof(T));
    return out;
  };
  return read(lane_value, s.round_mask[p], t.lane);
}

using LaunchFn = void (*)(void* const* buffers, const Thread& t, uint3 local, uint3 global);

struct Pool {
  std::mutex m;
  std::condition_variable start, done;
  uint64_t generation = 0;
  unsigned remaining = 0;
  bool stop = false;
  LaunchFn fn = nullptr;
  void* const* buffers = nullptr;
};
inline Pool g_pool;

inline void run_thread(unsigned w) {
  Group& g = *g_group;
  const uint3 local(w % g.size.x, (w / g.size.x) % g.size.y, w / (g.size.x * g.size.y));
  const uint3 global(g.pos.x * g_launch.tg.x + local.x, g.pos.y * g_launch.tg.y + local.y,
                     g.pos.z * g_launch.tg.z + local.z);
  Thread t{w, w % kSimdWidth, &g.simd[w / kSimdWidth]};
  t_self = &t;
  g_pool.fn(g_pool.buffers, t, local, global);
  thread_exit();
  t_self = nullptr;
}

inline void* worker(void* arg) {
  const unsigned w = unsigned(uintptr_t(arg));
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(g_pool.m);
      g_pool.start.wait(lk, [&] { return g_pool.stop || g_pool.generation != seen; });
      if (g_pool.stop) return nullptr;
      seen = g_pool.generation;
    }
    if (w < g_group->count) run_thread(w);
    std::lock_guard<std::mutex> lk(g_pool.m);
    if (--g_pool.remaining == 0) g_pool.done.notify_one();
  }
}

// Runs every threadgroup of the launch, one after another, each with
// tg_threads real threads.
inline void dispatch(LaunchFn fn, void* const* buffers) {
  const Launch& L = g_launch;
  if (L.grid.x == 0 || L.grid.y == 0 || L.grid.z == 0) return;
  g_pool.fn = fn;
  g_pool.buffers = buffers;
  std::vector<pthread_t> threads(L.tg_threads);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 20);
  for (unsigned w = 0; w < L.tg_threads; ++w) {
    if (pthread_create(&threads[w], &attr, worker, (void*)uintptr_t(w)) != 0) {
      fail("cannot start thread %u of %u", w, L.tg_threads);
    }
  }
  pthread_attr_destroy(&attr);
  auto* group = new Group;
  g_group = group;
  for (unsigned gz = 0; gz < L.groups.z; ++gz)
    for (unsigned gy = 0; gy < L.groups.y; ++gy)
      for (unsigned gx = 0; gx < L.groups.x; ++gx) {
        Group& g = *group;
        g.pos = uint3(gx, gy, gz);
        g.size = uint3(std::min(L.tg.x, L.grid.x - gx * L.tg.x), std::min(L.tg.y, L.grid.y - gy * L.tg.y),
                       std::min(L.tg.z, L.grid.z - gz * L.tg.z));
        g.count = g.size.x * g.size.y * g.size.z;
        g.arrived = g.exited = 0;
        for (unsigned s = 0; s * kSimdWidth < g.count; ++s) {
          SimdGroup& sg = g.simd[s];
          sg.active = std::min(kSimdWidth, g.count - s * kSimdWidth);
          sg.mask = sg.active == 64 ? ~uint64_t(0) : (uint64_t(1) << sg.active) - 1;
          sg.arrived = 0;
        }
        std::unique_lock<std::mutex> lk(g_pool.m);
        g_pool.remaining = L.tg_threads;
        ++g_pool.generation;
        g_pool.start.notify_all();
        g_pool.done.wait(lk, [] { return g_pool.remaining == 0; });
      }
  {
    std::lock_guard<std::mutex> lk(g_pool.m);
    g_pool.stop = true;
    g_pool.start.notify_all();
  }
  for (auto& t : threads) pthread_join(t, nullptr);
  delete group;
}

// Attribute values of the calling thread, by name, as the driver passes them.
struct Attrs {
  const Thread& t;
  uint3 local, global;
  uint3 dispatch_threads_per_threadgroup() const { return g_launch.tg; }
  uint3 grid_origin() const { return uint3(0u); }
  uint3 grid_size() const { return g_launch.grid; }
  uint3 thread_position_in_grid() const { return global; }
  uint3 thread_position_in_threadgroup() const { return local; }
  uint3 threadgroup_position_in_grid() const { return g_group->pos; }
  uint3 threadgroups_per_grid() const { return g_launch.groups; }
  uint3 threads_per_grid() const { return g_launch.grid; }
  uint3 threads_per_threadgroup() const { return g_group->size; }
  uint dispatch_quadgroups_per_threadgroup() const { return (g_launch.tg_threads + 3) / 4; }
  uint dispatch_simdgroups_per_threadgroup() const {
    return (g_launch.tg_threads + kSimdWidth - 1) / kSimdWidth;
  }
  uint quadgroup_index_in_threadgroup() const { return t.index / 4; }
  uint quadgroups_per_threadgroup() const { return (g_group->count + 3) / 4; }
  uint simdgroup_index_in_threadgroup() const { return t.index / kSimdWidth; }
  uint simdgroups_per_threadgroup() const { return (g_group->count + kSimdWidth - 1) / kSimdWidth; }
  uint thread_execution_width() const { return kSimdWidth; }
  uint thread_index_in_quadgroup() const { return t.index % 4; }
  uint thread_index_in_simdgroup() const { return t.lane; }
  uint thread_index_in_threadgroup() const { return t.index; }
  uint threads_per_simdgroup() const { return kSimdWidth; }
};

// The driver's main: `spec` lists the launch and the buffers (see runner.rs).
inline int run_main(int argc, char** argv, unsigned nbuffers, LaunchFn fn) {
  if (argc != 2) fail("usage: %s SPEC", argv[0]);
  FILE* spec = std::fopen(argv[1], "r");
  if (!spec) fail("cannot open %s", argv[1]);
  constexpr size_t kGuard = 64;
  constexpr unsigned char kGuardByte = 0xA5;
  std::vector<unsigned char*> buf(nbuffers, nullptr);
  std::vector<size_t> size(nbuffers, 0);
  std::vector<std::string> name(nbuffers), out_path(nbuffers);
  Launch& L = g_launch;
  L.timeout_ms = 5000;
  char key[64], nm[256], path[4096];
  unsigned a, b, c;
  size_t n;
  while (std::fscanf(spec, "%63s", key) == 1) {
    if (!std::strcmp(key, "grid") && std::fscanf(spec, "%u %u %u", &a, &b, &c) == 3) {
      L.grid = uint3(a, b, c);
    } else if (!std::strcmp(key, "threadgroup") && std::fscanf(spec, "%u %u %u", &a, &b, &c) == 3) {
      L.tg = uint3(a, b, c);
    } else if (!std::strcmp(key, "timeout_ms") && std::fscanf(spec, "%u", &a) == 1) {
      L.timeout_ms = int(a);
    } else if (!std::strcmp(key, "buffer") &&
               std::fscanf(spec, "%u %255s %zu %4095s", &a, nm, &n, path) == 4 && a < nbuffers) {
      buf[a] = static_cast<unsigned char*>(std::aligned_alloc(64, (n + kGuard + 63) / 64 * 64));
      size[a] = n;
      name[a] = nm;
      std::memset(buf[a] + n, kGuardByte, kGuard);
      FILE* f = std::fopen(path, "rb");
      if (!f || std::fread(buf[a], 1, n, f) != n) fail("cannot read %zu bytes of %s from %s", n, nm, path);
      std::fclose(f);
    } else if (!std::strcmp(key, "output") && std::fscanf(spec, "%u %4095s", &a, path) == 2 && a < nbuffers) {
      out_path[a] = path;
    } else {
      fail("bad spec entry near '%s'", key);
    }
  }
  std::fclose(spec);
  for (unsigned i = 0; i < nbuffers; ++i)
    if (!buf[i]) fail("buffer %u missing from the spec", i);
  // MLX: dispatchThreads(grid, min(threadgroup, grid)).
  L.tg = uint3(std::min(L.tg.x, L.grid.x), std::min(L.tg.y, L.grid.y), std::min(L.tg.z, L.grid.z));
  L.tg_threads = L.tg.x * L.tg.y * L.tg.z;
  if (L.tg_threads > 1024) fail("threadgroup of %u threads, more than 1024", L.tg_threads);
  if (L.tg_threads > 0) {
    L.groups = uint3((L.grid.x + L.tg.x - 1) / L.tg.x, (L.grid.y + L.tg.y - 1) / L.tg.y,
                     (L.grid.z + L.tg.z - 1) / L.tg.z);
    dispatch(fn, reinterpret_cast<void* const*>(buf.data()));
  }
  for (unsigned i = 0; i < nbuffers; ++i) {
    for (size_t k = 0; k < kGuard; ++k)
      if (buf[i][size[i] + k] != kGuardByte)
        fail("the kernel wrote past the end of `%s` (%zu bytes): byte %zu after it changed",
             name[i].c_str(), size[i], k);
    if (out_path[i].empty()) continue;
    FILE* f = std::fopen(out_path[i].c_str(), "wb");
    if (!f || std::fwrite(buf[i], 1, size[i], f) != size[i]) fail("cannot write %s", out_path[i].c_str());
    std::fclose(f);
  }
  return 0;
}

}  // namespace metal_emu

// ---------------------------------------------------------------------------
// The Metal standard library subset.
// ---------------------------------------------------------------------------

#define METAL_FUNC inline
#define MLX_MTL_PRAGMA_UNROLL
#define MLX_METAL_JIT 1

constexpr float M_PI_F = 3.14159265358979323846f;
constexpr float M_PI_2_F = 1.57079632679489661923f;
constexpr float M_E_F = 2.71828182845904523536f;
constexpr float M_LN2_F = 0.693147180559945309417f;
constexpr float M_LN10_F = 2.30258509299404568402f;
constexpr float M_LOG2E_F = 1.44269504088896340736f;
constexpr float M_SQRT2_F = 1.41421356237309504880f;
constexpr float M_SQRT1_2_F = 0.707106781186547524401f;
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
constexpr half MAXHALF = half(65504.0f);

namespace metal {

template <typename T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half max() { return half(65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(INFINITY); }
  static constexpr half quiet_NaN() { return half(NAN); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bfloat max() { return std::bit_cast<bfloat>(uint16_t(0x7f7f)); }
  static constexpr bfloat min() { return std::bit_cast<bfloat>(uint16_t(0x0080)); }
  static constexpr bfloat lowest() { return std::bit_cast<bfloat>(uint16_t(0xff7f)); }
  static constexpr bfloat epsilon() { return std::bit_cast<bfloat>(uint16_t(0x3c00)); }
  static constexpr bfloat infinity() { return std::bit_cast<bfloat>(uint16_t(0x7f80)); }
  static constexpr bfloat quiet_NaN() { return std::bit_cast<bfloat>(uint16_t(0x7fc0)); }
};

template <typename T, typename U>
constexpr T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  return std::bit_cast<T>(u);
}

// Float math: half and bfloat compute in float and round back, as Metal's
// results are correctly rounded only to their own type.
template <typename T>
constexpr auto emu_wide(T v) {
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat>) {
    return float(v);
  } else {
    return v;
  }
}
#define EMU_MATH1(name, expr)                                                 \
  template <typename T>                                                       \
    requires is_float_like_v<T>                                               \
  inline T name(T v) {                                                        \
    auto x = emu_wide(v);                                                     \
    return T(expr);                                                           \
  }                                                                           \
  template <typename T, int N>                                                \
  inline vec<T, N> name(vec<T, N> v) {                                        \
    for (int i = 0; i < N; ++i) v[i] = name(v[i]);                            \
    return v;                                                                 \
  }
#define EMU_MATH_ALL(ns_open, ns_close)                                       \
  ns_open EMU_MATH1(sqrt, std::sqrt(x)) EMU_MATH1(rsqrt, 1 / std::sqrt(x))    \
      EMU_MATH1(exp, std::exp(x)) EMU_MATH1(exp2, std::exp2(x))               \
      EMU_MATH1(exp10, std::pow(decltype(x)(10), x))                          \
      EMU_MATH1(log, std::log(x)) EMU_MATH1(log2, std::log2(x))               \
      EMU_MATH1(log10, std::log10(x)) EMU_MATH1(sin, std::sin(x))             \
      EMU_MATH1(cos, std::cos(x)) EMU_MATH1(tan, std::tan(x))                 \
      EMU_MATH1(tanh, std::tanh(x)) EMU_MATH1(sinh, std::sinh(x))             \
      EMU_MATH1(cosh, std::cosh(x)) EMU_MATH1(asin, std::asin(x))             \
      EMU_MATH1(acos, std::acos(x)) EMU_MATH1(atan, std::atan(x))             \
      EMU_MATH1(floor, std::floor(x)) EMU_MATH1(ceil, std::ceil(x))           \
      EMU_MATH1(round, std::round(x)) EMU_MATH1(rint, std::rint(x))           \
      EMU_MATH1(trunc, std::trunc(x)) EMU_MATH1(fabs, std::fabs(x))           \
      EMU_MATH1(erf, std::erf(x)) EMU_MATH1(log1p, std::log1p(x))             \
      EMU_MATH1(expm1, std::expm1(x)) EMU_MATH1(fract, x - std::floor(x))     \
  ns_close
EMU_MATH_ALL(, )
namespace fast {
EMU_MATH_ALL(, )
}
namespace precise {
EMU_MATH_ALL(, )
}
#undef EMU_MATH_ALL
#undef EMU_MATH1

template <typename T>
  requires is_scalar_v<T>
inline T abs(T v) {
  return v < T(0) ? T(-v) : v;
}
template <typename T, typename U>
  requires(is_scalar_v<T> && is_scalar_v<U>)
inline auto pow(T a, U b) {
  if constexpr (is_float_like_v<T>) {
    return T(std::pow(emu_wide(a), float(emu_wide(b))));
  } else {
    return std::pow(a, b);
  }
}
template <typename T>
  requires is_scalar_v<T>
inline T max(T a, T b) {
  if constexpr (is_float_like_v<T>) {
    return T(std::fmax(emu_wide(a), emu_wide(b)));  // Metal's max ignores a NaN operand
  } else {
    return a < b ? b : a;
  }
}
template <typename T>
  requires is_scalar_v<T>
inline T min(T a, T b) {
  if constexpr (is_float_like_v<T>) {
    return T(std::fmin(emu_wide(a), emu_wide(b)));
  } else {
    return b < a ? b : a;
  }
}
template <typename T>
  requires is_scalar_v<T>
inline T fmax(T a, T b) {
  return max(a, b);
}
template <typename T>
  requires is_scalar_v<T>
inline T fmin(T a, T b) {
  return min(a, b);
}
template <typename T>
  requires is_scalar_v<T>
inline T clamp(T v, T lo, T hi) {
  return min(max(v, lo), hi);
}
template <typename T>
  requires is_float_like_v<T>
inline T saturate(T v) {
  return clamp(v, T(0), T(1));
}
template <typename T>
  requires is_float_like_v<T>
inline T fma(T a, T b, T c) {
  return T(std::fma(emu_wide(a), emu_wide(b), emu_wide(c)));
}
template <typename T>
  requires is_float_like_v<T>
inline T mix(T a, T b, T t) {
  return T(emu_wide(a) + (emu_wide(b) - emu_wide(a)) * emu_wide(t));
}
template <typename T>
  requires is_float_like_v<T>
inline T copysign(T a, T b) {
  return T(std::copysign(emu_wide(a), emu_wide(b)));
}
template <typename T>
  requires is_float_like_v<T>
inline T sign(T v) {
  auto x = emu_wide(v);
  return T(x > 0 ? 1 : x < 0 ? -1 : x);
}
template <typename T>
  requires is_float_like_v<T>
inline T atan2(T a, T b) {
  return T(std::atan2(emu_wide(a), emu_wide(b)));
}
template <typename T>
  requires is_float_like_v<T>
inline bool isnan(T v) {
  return std::isnan(emu_wide(v));
}
template <typename T>
  requires is_float_like_v<T>
inline bool isinf(T v) {
  return std::isinf(emu_wide(v));
}
template <typename T>
  requires is_float_like_v<T>
inline bool isfinite(T v) {
  return std::isfinite(emu_wide(v));
}
template <typename T>
  requires is_float_like_v<T>
inline bool signbit(T v) {
  return std::signbit(emu_wide(v));
}
template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
#define EMU_VEC2(name)                                                        \
  template <typename T, int N>                                                \
  inline vec<T, N> name(vec<T, N> a, vec<T, N> b) {                           \
    for (int i = 0; i < N; ++i) a[i] = name(a[i], b[i]);                      \
    return a;                                                                 \
  }
EMU_VEC2(max)
EMU_VEC2(min)
EMU_VEC2(fmax)
EMU_VEC2(fmin)
#undef EMU_VEC2
template <typename T, int N>
inline vec<T, N> abs(vec<T, N> v) {
  for (int i = 0; i < N; ++i) v[i] = abs(v[i]);
  return v;
}
template <typename T, int N>
inline T dot(vec<T, N> a, vec<T, N> b) {
  auto acc = emu_wide(a[0]) * emu_wide(b[0]);
  for (int i = 1; i < N; ++i) acc += emu_wide(a[i]) * emu_wide(b[i]);
  return T(acc);
}
template <typename T, int N>
inline T length(vec<T, N> a) {
  return sqrt(dot(a, a));
}
inline uint popcount(uint v) { return uint(std::popcount(v)); }
inline ulong popcount(ulong v) { return ulong(std::popcount(v)); }
inline uint clz(uint v) { return uint(std::countl_zero(v)); }
inline uint ctz(uint v) { return uint(std::countr_zero(v)); }
template <typename T>
  requires std::is_integral_v<T>
inline T mulhi(T a, T b) {
  using W = std::conditional_t<std::is_signed_v<T>, __int128, unsigned __int128>;
  return T((W(a) * W(b)) >> (8 * sizeof(T)));
}

// Synchronisation. Metal's only memory order for atomics is relaxed.
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

inline void threadgroup_barrier(mem_flags, std::source_location site = std::source_location::current()) {
  metal_emu::threadgroup_barrier_wait(site);
}
inline void simdgroup_barrier(mem_flags) {
  metal_emu::simd_exchange("simdgroup_barrier", 0, [](auto, uint64_t, unsigned) { return 0; });
}

enum memory_order { memory_order_relaxed, memory_order_seq_cst };

template <typename T>
struct atomic {
  std::atomic<T> v;
};
static_assert(sizeof(atomic<uint>) == sizeof(uint) && sizeof(atomic<float>) == sizeof(float));
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

template <typename T, typename U>
inline T atomic_fetch_add_explicit(atomic<T>* a, U v, memory_order) {
  return a->v.fetch_add(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline T atomic_fetch_sub_explicit(atomic<T>* a, U v, memory_order) {
  return a->v.fetch_sub(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline T atomic_fetch_and_explicit(atomic<T>* a, U v, memory_order) {
  return a->v.fetch_and(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline T atomic_fetch_or_explicit(atomic<T>* a, U v, memory_order) {
  return a->v.fetch_or(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline T atomic_fetch_xor_explicit(atomic<T>* a, U v, memory_order) {
  return a->v.fetch_xor(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline T atomic_fetch_max_explicit(atomic<T>* a, U v, memory_order) {
  T cur = a->v.load(std::memory_order_relaxed);
  while (cur < T(v) && !a->v.compare_exchange_weak(cur, T(v), std::memory_order_relaxed)) {
  }
  return cur;
}
template <typename T, typename U>
inline T atomic_fetch_min_explicit(atomic<T>* a, U v, memory_order) {
  T cur = a->v.load(std::memory_order_relaxed);
  while (T(v) < cur && !a->v.compare_exchange_weak(cur, T(v), std::memory_order_relaxed)) {
  }
  return cur;
}
template <typename T>
inline T atomic_load_explicit(const atomic<T>* a, memory_order) {
  return a->v.load(std::memory_order_relaxed);
}
template <typename T, typename U>
inline void atomic_store_explicit(atomic<T>* a, U v, memory_order) {
  a->v.store(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline T atomic_exchange_explicit(atomic<T>* a, U v, memory_order) {
  return a->v.exchange(T(v), std::memory_order_relaxed);
}
template <typename T, typename U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, U desired, memory_order,
                                                  memory_order) {
  return a->v.compare_exchange_weak(*expected, T(desired), std::memory_order_relaxed);
}

// SIMD-group functions (32 lanes). Reductions add in lane order.
template <typename T>
inline T simd_shuffle(T v, ushort lane) {
  return metal_emu::simd_exchange("simd_shuffle", v, [&](auto value, uint64_t mask, unsigned self) {
    return lane < 32 && (mask >> lane & 1) ? value(lane) : value(self);
  });
}
template <typename T>
inline T simd_broadcast(T v, ushort lane) {
  return metal_emu::simd_exchange("simd_broadcast", v, [&](auto value, uint64_t mask, unsigned self) {
    return lane < 32 && (mask >> lane & 1) ? value(lane) : value(self);
  });
}
template <typename T>
inline T simd_shuffle_xor(T v, ushort m) {
  return metal_emu::simd_exchange("simd_shuffle_xor", v, [&](auto value, uint64_t mask, unsigned self) {
    const unsigned src = self ^ m;
    return src < 32 && (mask >> src & 1) ? value(src) : value(self);
  });
}
template <typename T>
inline T simd_shuffle_down(T v, ushort delta) {
  return metal_emu::simd_exchange("simd_shuffle_down", v, [&](auto value, uint64_t mask, unsigned self) {
    const unsigned src = self + delta;
    return src < 32 && (mask >> src & 1) ? value(src) : value(self);
  });
}
template <typename T>
inline T simd_shuffle_up(T v, ushort delta) {
  return metal_emu::simd_exchange("simd_shuffle_up", v, [&](auto value, uint64_t mask, unsigned self) {
    return self >= delta && (mask >> (self - delta) & 1) ? value(self - delta) : value(self);
  });
}
template <typename T>
inline T simd_broadcast_first(T v) {
  return metal_emu::simd_exchange("simd_broadcast_first", v, [&](auto value, uint64_t mask, unsigned) {
    return value(unsigned(std::countr_zero(mask)));
  });
}
#define EMU_SIMD_REDUCE(name, init, step)                                          \
  template <typename T>                                                            \
  inline T name(T v) {                                                             \
    return metal_emu::simd_exchange(#name, v, [&](auto value, uint64_t mask, unsigned) { \
      bool first = true;                                                           \
      T acc{};                                                                     \
      for (unsigned l = 0; l < 32; ++l) {                                          \
        if (!(mask >> l & 1)) continue;                                            \
        T x = value(l);                                                            \
        acc = first ? x : T(step);                                                 \
        first = false;                                                             \
      }                                                                            \
      return acc;                                                                  \
    });                                                                            \
  }
EMU_SIMD_REDUCE(simd_sum, 0, acc + x)
EMU_SIMD_REDUCE(simd_product, 1, acc * x)
EMU_SIMD_REDUCE(simd_max, 0, max(acc, x))
EMU_SIMD_REDUCE(simd_min, 0, min(acc, x))
EMU_SIMD_REDUCE(simd_and, 0, acc & x)
EMU_SIMD_REDUCE(simd_or, 0, acc | x)
EMU_SIMD_REDUCE(simd_xor, 0, acc ^ x)
#undef EMU_SIMD_REDUCE
template <typename T>
inline T simd_prefix_exclusive_sum(T v) {
  return metal_emu::simd_exchange("simd_prefix_exclusive_sum", v, [&](auto value, uint64_t mask, unsigned self) {
    T acc = T(0);
    for (unsigned l = 0; l < self; ++l)
      if (mask >> l & 1) acc = T(acc + value(l));
    return acc;
  });
}
template <typename T>
inline T simd_prefix_inclusive_sum(T v) {
  return metal_emu::simd_exchange("simd_prefix_inclusive_sum", v, [&](auto value, uint64_t mask, unsigned self) {
    T acc = T(0);
    for (unsigned l = 0; l <= self; ++l)
      if (mask >> l & 1) acc = T(acc + value(l));
    return acc;
  });
}
template <typename T>
inline T simd_prefix_exclusive_product(T v) {
  return metal_emu::simd_exchange("simd_prefix_exclusive_product", v, [&](auto value, uint64_t mask, unsigned self) {
    T acc = T(1);
    for (unsigned l = 0; l < self; ++l)
      if (mask >> l & 1) acc = T(acc * value(l));
    return acc;
  });
}
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b) {
  return metal_emu::simd_exchange("simd_ballot", b, [&](auto value, uint64_t mask, unsigned) {
    uint64_t bits = 0;
    for (unsigned l = 0; l < 32; ++l)
      if ((mask >> l & 1) && value(l)) bits |= uint64_t(1) << l;
    return simd_vote{bits};
  });
}
inline bool simd_all(bool b) {
  return metal_emu::simd_exchange("simd_all", b, [&](auto value, uint64_t mask, unsigned) {
    for (unsigned l = 0; l < 32; ++l)
      if ((mask >> l & 1) && !value(l)) return false;
    return true;
  });
}
inline bool simd_any(bool b) {
  return metal_emu::simd_exchange("simd_any", b, [&](auto value, uint64_t mask, unsigned) {
    for (unsigned l = 0; l < 32; ++l)
      if ((mask >> l & 1) && value(l)) return true;
    return false;
  });
}
inline bool simd_is_first() {
  return metal_emu::simd_exchange("simd_is_first", 0, [&](auto, uint64_t mask, unsigned self) {
    return self == unsigned(std::countr_zero(mask));
  });
}

}  // namespace metal

using namespace metal;

// MLX utils.h helpers that custom kernels use.
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint3 elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_1(uint elem, const int64_t& stride) {
  return elem * IdxT(stride);
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_2(uint2 elem, const int64_t strides[2]) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc_3(uint3 elem, const int64_t strides[3]) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}
template <typename T, typename U>
inline T ceildiv(T n, U m) {
  return (n + m - 1) / m;
}

// Address spaces have no meaning on the CPU. `threadgroup` declarations are
// rewritten to `static` by runner.rs before compiling; what is left of the
// word is a qualifier of a pointer or reference.
#define device
#define constant
#define thread
#define threadgroup
#define ray_data
#define object_data
