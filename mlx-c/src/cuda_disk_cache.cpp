// Keeps the machine code of custom CUDA kernels on disk, where MLX looks.
//
// MLX compiles a custom kernel with NVRTC in every process and never writes it
// to its kernel cache (CustomKernel::eval_gpu asks get_jit_module for no disk
// cache), so each process paid seconds before its first token. MLX does read
// that cache for every module, custom ones included: a module named
// `<kernel name>_<hex std::hash of its source>` is loaded from
// `<cache>/<module>.ptx` (machine code) and `<module>.txt` (kernel name, tab,
// mangled name) when both are there. So the first time a process applies a
// kernel, this file compiles the source MLX generated, exactly as MLX would,
// and writes those two files; MLX then loads them at evaluation instead of
// compiling, in this process and every later one.
//
// Anything that goes wrong here (no NVRTC loaded, a compile error, a
// read-only directory) leaves MLX to compile as before, with one warning per
// process.
#include "cuda_disk_cache.h"
#include "mlxc/veloxquant_ext.h"
#include "nvrtc_headers.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_set>

#include "mlx/fast_primitives.h"
#include "mlx/version.h"

namespace mlxc {

namespace {

namespace fs = std::filesystem;

// The few NVRTC and driver entry points used, from the libraries libmlx
// already loaded (their C ABI is stable across CUDA versions).
struct Nvrtc {
  using Program = void*;
  int (*version)(int*, int*);
  int (*create)(Program*, const char*, const char*, int, const char* const*, const char* const*);
  int (*destroy)(Program*);
  int (*add_name)(Program, const char*);
  int (*compile)(Program, int, const char* const*);
  int (*log_size)(Program, size_t*);
  int (*log)(Program, char*);
  int (*lowered_name)(Program, const char*, const char**);
  int (*cubin_size)(Program, size_t*);
  int (*cubin)(Program, char*);
  int (*ptx_size)(Program, size_t*);
  int (*ptx)(Program, char*);
  int (*cu_init)(unsigned);
  int (*cu_device_get)(int*, int);
  int (*cu_attribute)(int*, int, int);
};

template <typename F>
bool bind(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(lib ? dlsym(lib, name) : nullptr);
  return f != nullptr;
}

const Nvrtc* nvrtc() {
  static std::optional<Nvrtc> api = []() -> std::optional<Nvrtc> {
    void* rtc = nullptr;
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) {
      if ((rtc = dlopen(name, RTLD_NOW | RTLD_NOLOAD))) break;
    }
    void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    Nvrtc n{};
    bool ok = bind(rtc, "nvrtcVersion", n.version) && bind(rtc, "nvrtcCreateProgram", n.create) &&
              bind(rtc, "nvrtcDestroyProgram", n.destroy) && bind(rtc, "nvrtcAddNameExpression", n.add_name) &&
              bind(rtc, "nvrtcCompileProgram", n.compile) && bind(rtc, "nvrtcGetProgramLogSize", n.log_size) &&
              bind(rtc, "nvrtcGetProgramLog", n.log) && bind(rtc, "nvrtcGetLoweredName", n.lowered_name) &&
              bind(rtc, "nvrtcGetCUBINSize", n.cubin_size) && bind(rtc, "nvrtcGetCUBIN", n.cubin) &&
              bind(rtc, "nvrtcGetPTXSize", n.ptx_size) && bind(rtc, "nvrtcGetPTX", n.ptx) &&
              bind(cu, "cuInit", n.cu_init) && bind(cu, "cuDeviceGet", n.cu_device_get) &&
              bind(cu, "cuDeviceGetAttribute", n.cu_attribute);
    if (!ok) return std::nullopt;
    return n;
  }();
  return api ? &*api : nullptr;
}

// MLX's ptx_cache_dir(): MLX_PTX_CACHE_DIR, else $TMPDIR/mlx/<version>/ptx.
fs::path cache_dir() {
  if (const char* dir = std::getenv("MLX_PTX_CACHE_DIR"); dir && *dir) return dir;
  return fs::temp_directory_path() / "mlx" / mx::version() / "ptx";
}

// MLX's get_ptx_path(): names past 245 characters become nested directories.
fs::path module_path(const fs::path& dir, const std::string& module) {
  constexpr size_t max_len = 245;
  fs::path path = dir;
  size_t offset = 0;
  while (module.size() - offset > max_len) {
    path /= module.substr(offset, max_len);
    offset += max_len;
  }
  return path / (module.substr(offset) + ".ptx");
}

// MLX's include paths for NVRTC, found from where libmlx lives: its bundled
// headers (and CCCL among them), then the CUDA runtime headers of the
// `nvidia` Python package beside it, else CUDA_HOME / CUDA_PATH /
// /usr/local/cuda.
std::vector<std::string> include_args() {
  std::vector<std::string> args;
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&mx::version), &info) || !info.dli_fname) return args;
  fs::path root = fs::path(info.dli_fname).parent_path().parent_path();
  for (const fs::path& p : {root / "include", root / "include" / "cccl"}) {
    if (fs::exists(p)) args.push_back("--include-path=" + p.string());
  }
  fs::path runtime = root.parent_path() / "nvidia" / "cu13" / "include";
  if (!fs::exists(runtime)) {
    const char* home = std::getenv("CUDA_HOME");
    if (!home) home = std::getenv("CUDA_PATH");
    runtime = fs::path(home ? home : "/usr/local/cuda") / "include";
  }
  if (fs::exists(runtime)) args.push_back("--include-path=" + runtime.string());
  return args;
}

// In place of MLX's device headers: the few types the kernels use
// (cuda/nvrtc/), about four times quicker to compile. A kernel that needed more
// fails to compile here, and MLX compiles it itself.
constexpr const char* header_names[] = {"mlx/backend/cuda/device/utils.cuh", "cooperative_groups.h"};
constexpr const char* headers[] = {kNvrtcUtils, kNvrtcCooperativeGroups};

void write_atomically(const fs::path& path, const std::string& data) {
  fs::path tmp = path;
  tmp += ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!f) throw std::runtime_error("cannot write " + tmp.string());
  }
  fs::rename(tmp, path);
}

// Compiles `source` as MLX's jit_module compile() does (same options, same
// target) and writes the module's two files. Throws on any failure.
void compile_to_disk(const Nvrtc& n, int device, const std::string& module, const std::string& kernel,
                     const std::string& source, const fs::path& path) {
  int major = 0, minor = 0, cc_major = 0, cc_minor = 0, dev = 0;
  n.version(&major, &minor);
  if (n.cu_init(0) != 0 || n.cu_device_get(&dev, device) != 0 || n.cu_attribute(&cc_major, 75, dev) != 0 ||
      n.cu_attribute(&cc_minor, 76, dev) != 0) {
    throw std::runtime_error("cannot read the GPU's compute capability");
  }
  // MLX's compiler_supports_device_sass() for the NVRTC versions MLX supports.
  bool sass = major > 11 || (major == 11 && minor >= 8);
  std::string arch = std::string("--gpu-architecture=") + (sass ? "sm_" : "compute_") + std::to_string(cc_major) +
                     std::to_string(cc_minor) + (cc_major >= 9 ? "a" : "");
  std::vector<std::string> includes = include_args();
  std::vector<const char*> args{"--device-as-default-execution-space", arch.c_str()};
  for (const auto& a : includes) args.push_back(a.c_str());

  Nvrtc::Program prog = nullptr;
  if (n.create(&prog, source.c_str(), (module + ".cu").c_str(), 2, headers, header_names) != 0) {
    throw std::runtime_error("nvrtcCreateProgram failed");
  }
  struct Free {
    const Nvrtc& n;
    Nvrtc::Program& p;
    ~Free() { n.destroy(&p); }
  } free_prog{n, prog};
  n.add_name(prog, kernel.c_str());
  if (n.compile(prog, static_cast<int>(args.size()), args.data()) != 0) {
    size_t size = 0;
    n.log_size(prog, &size);
    std::string log(size, '\0');
    n.log(prog, log.data());
    throw std::runtime_error("NVRTC: " + log);
  }
  const char* mangled = nullptr;
  if (n.lowered_name(prog, kernel.c_str(), &mangled) != 0 || !mangled) {
    throw std::runtime_error("no lowered name for " + kernel);
  }
  size_t size = 0;
  std::string code;
  if (sass ? n.cubin_size(prog, &size) : n.ptx_size(prog, &size)) throw std::runtime_error("no code size");
  code.resize(size);
  if (sass ? n.cubin(prog, code.data()) : n.ptx(prog, code.data())) throw std::runtime_error("no code");

  fs::create_directories(path.parent_path());
  fs::path names = path;
  names.replace_extension(".txt");
  // The names first: MLX takes a module whose .ptx exists as complete.
  write_atomically(names, kernel + "\t" + mangled + "\n");
  write_atomically(path, code);
}

bool enabled() {
  const char* v = std::getenv("VELOXQUANT_KERNEL_DISK_CACHE");
  return !(v && std::string(v) == "0");
}

}  // namespace

}  // namespace mlxc

extern "C" int vq_kernel_cache_dir(mlx_string* res) {
  return mlxc::guard([&] {
    if (!res) throw std::invalid_argument("null result pointer");
    delete static_cast<std::string*>(res->ctx);
    res->ctx = new std::string(std::filesystem::absolute(mlxc::cache_dir()).string());
  });
}

namespace mlxc {

void keep_cuda_kernel_on_disk(const std::string& key, const mx::array& output) {
  static std::mutex mutex;
  static std::unordered_set<std::string> seen;
  {
    std::lock_guard lock(mutex);
    if (!seen.insert(key).second) return;
  }
  if (!enabled() || !output.has_primitive()) return;
  // By name: libmlx exports no type information for CustomKernel.
  if (std::string_view(output.primitive().name()) != "CustomKernel") return;
  auto* prim = static_cast<mx::fast::CustomKernel*>(&output.primitive());
  const Nvrtc* n = nvrtc();
  if (!n) return;
  const auto state = prim->state();
  const std::string& name = std::get<0>(state);
  const std::string& source = std::get<1>(state);
  if (std::get<8>(state)) return;  // precompiled: MLX has the code already
  char hash[32];
  std::snprintf(hash, sizeof hash, "%zx", std::hash<std::string>{}(source));
  const std::string module = name + "_" + hash;
  try {
    fs::path path = module_path(cache_dir(), module);
    if (fs::exists(path)) return;
    compile_to_disk(*n, prim->stream().device.index, module, "mlx::core::cu::" + name, source, path);
  } catch (const std::exception& e) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      std::fprintf(stderr, "veloxquant: CUDA kernel %s not kept on disk, MLX compiles it in each process (%s)\n",
                   name.c_str(), e.what());
    });
  }
}

}  // namespace mlxc
