// What a package is held against before anything of it is bound or run:
// its files' digests, its device, the custom operators' libraries, and the
// weights given to it (names, shapes, dtypes, devices, layouts), with the
// Python loader's messages (flashrt_build/runtime/load.py, checkpoint.py).
#include "package_impl.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>
#include <torch/cuda.h>

#ifdef FLASHRT_WITH_CUDA
#include <cuda_runtime_api.h>  // the runtime API only: ATen's CUDA context needs the math libraries' headers too
#endif

#include <algorithm>
#include <set>

namespace flashrt::detail {

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Refuses a file the manifest lists unless its bytes are the build's; `what`
// says which ("the package").
void check_digest(const std::filesystem::path& path, const detail::FileRecord& record, const char* what) {
  const std::string digest = detail::altered_digest(path, record);
  if (!digest.empty()) {
    throw Error(Error::Kind::Artifact, path.string() + " (" + what + ") was altered after its build: sha256 " + digest +
                                           " differs from the manifest's " + record.sha256 + "; refusing to load it");
  }
}

std::filesystem::path listed_file(const std::filesystem::path& dir, const detail::FileRecord& record) {
  std::filesystem::path path = dir / record.file;
  if (!std::filesystem::is_regular_file(path)) throw Error(Error::Kind::Artifact, path.string() + " is missing");
  return path;
}

// The device a package runs on: the caller's, or the build's target.
c10::Device resolve_device(const Manifest& m, std::optional<c10::Device> requested) {
  c10::Device device = requested.value_or(c10::Device(m.target_device));
  if (device.is_cuda() && !device.has_index()) device = c10::Device(c10::kCUDA, 0);
  const c10::Device built(m.target_device);
  if (built.type() != device.type()) {
    throw Error(Error::Kind::Artifact, m.path.parent_path().string() + " was built for " + m.target_device +
                                           "; it cannot run on " + device.str());
  }
  if (!device.is_cuda()) return device;
  const std::string gpu = m.gpu_name.value_or("a GPU");
  if (!torch::cuda::is_available() || device.index() >= torch::cuda::device_count()) {
    throw Error(Error::Kind::Artifact,
                "the package was built for CUDA (" + gpu + ") but " + device.str() + " is not available");
  }
#ifdef FLASHRT_WITH_CUDA
  if (m.gpu_capability) {
    cudaDeviceProp props{};
    if (cudaGetDeviceProperties(&props, device.index()) != cudaSuccess) {
      throw Error(Error::Kind::Artifact, "cannot read the properties of " + device.str());
    }
    const std::string running = std::to_string(props.major) + "." + std::to_string(props.minor);
    if (running != *m.gpu_capability) {
      throw Error(Error::Kind::Artifact, "the package was compiled for compute capability " + *m.gpu_capability +
                                             " (" + gpu + "), but " + device.str() + " is " + props.name +
                                             " (compute capability " + running +
                                             "): rebuild it with target=cuda on this kind of GPU");
    }
  }
#endif
  return device;
}

// Problems as the Python side's WeightsMismatch prints them.
std::string mismatch(const std::string& source,
                     const std::vector<std::pair<std::string, std::vector<std::string>>>& problems) {
  std::vector<std::string> parts;
  for (const auto& [kind, names] : problems) parts.push_back(kind + ": " + join(names));
  return "weights from " + source + " do not fit the package: " + join(parts, "; ");
}

// A tensor read from a file (row-major) as the package reads it: its strides
// and its floating-point dtype (a bf16 checkpoint for a float32 package); a
// copy only where either differs.
at::Tensor laid_out(const at::Tensor& t, const WeightEntry& entry) {
  if (detail::same_layout(t.strides().vec(), entry) && t.scalar_type() == entry.dtype) return t;
  return at::empty_strided(t.sizes(), entry.stride, t.options().dtype(entry.dtype)).copy_(t);
}


// The custom operators a package calls must be registered before it loads:
// each shared library the build recorded is opened unless all its operators
// are there already (the process linked it).
void load_libraries(const Manifest& m) {
  for (const auto& [path, ops] : m.libraries) {
    bool present = true;
    for (const auto& op : ops) {
      const auto dot = op.find('.');
      const std::string name = op.substr(0, dot), overload = dot == std::string::npos ? "" : op.substr(dot + 1);
      present = present && c10::Dispatcher::singleton().findSchema({name, overload == "default" ? "" : overload});
    }
    if (!present && dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      throw Error(Error::Kind::Artifact, "the package's custom operators come from " + path +
                                             ", which cannot be loaded: " + dlerror());
    }
  }
}


std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

bool same_device(const c10::Device& a, const c10::Device& b) {
  return a.type() == b.type() && (!a.is_cuda() || a.index() == b.index());
}

bool same_layout(const std::vector<int64_t>& stride, const WeightEntry& entry) {
  for (size_t axis = 0; axis < entry.shape.size(); ++axis) {
    if (entry.shape[axis] > 1 && stride.at(axis) != entry.stride.at(axis)) return false;
  }
  return true;
}

std::vector<std::pair<std::string, std::vector<std::string>>> compare(const std::vector<WeightEntry>& entries,
                                                                      const Table& table,
                                                                      const std::vector<std::string>& unused,
                                                                      std::optional<c10::Device> device,
                                                                      std::map<std::string, std::string>& chosen) {
  // Pair each FQN with the table's name for it: its own, its export name, or a tied alias.
  std::set<std::string> known(unused.begin(), unused.end());
  std::vector<std::string> missing, unexpected, shape, dtype, wrong_device, strides;
  for (const auto& e : entries) {
    known.insert(e.names.begin(), e.names.end());
    auto found = std::find_if(e.names.begin(), e.names.end(), [&](const std::string& n) { return table.count(n); });
    if (found != e.names.end()) {
      chosen[e.fqn] = *found;
    } else if (e.required()) {
      missing.push_back(e.fqn);
    }
  }
  for (const auto& [name, _] : table) {  // a std::map: sorted, as the Python side sorts them
    if (!known.count(name)) unexpected.push_back(name);
  }
  std::map<std::string, const WeightEntry*> by_fqn;
  for (const auto& e : entries) by_fqn[e.fqn] = &e;
  for (const auto& [fqn, name] : chosen) {  // sorted by FQN
    const TableEntry& got = table.at(name);
    const WeightEntry& want = *by_fqn.at(fqn);
    if (got.shape != want.shape) {
      shape.push_back(name + " " + shape_str(got.shape) + " (package expects " + shape_str(want.shape) + ")");
    }
    // A file's floating-point tensors are cast when read; the caller's own (bound as they are) are not.
    const bool cast = !got.device && at::isFloatingType(got.dtype) && at::isFloatingType(want.dtype);
    if (got.dtype != want.dtype && !cast) {
      dtype.push_back(name + " " + dtype_name(got.dtype) + " (package expects " + dtype_name(want.dtype) + ")");
    }
    if (device && got.device && !same_device(*got.device, *device)) {
      wrong_device.push_back(name + " on " + got.device->str() + " (package runs on " + device->str() + ")");
    }
    if (got.stride && got.shape == want.shape && !same_layout(*got.stride, want)) {
      strides.push_back(name + " strides " + shape_str(*got.stride) + " (package expects " + shape_str(want.stride) +
                        ": bind a .contiguous() copy, or the build's layout)");
    }
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> problems;
  for (auto& [kind, names] : {std::pair<const char*, std::vector<std::string>&>{"missing", missing},
                              {"unexpected", unexpected},
                              {"wrong shape", shape},
                              {"wrong dtype", dtype},
                              {"wrong device", wrong_device},
                              {"wrong strides", strides}}) {
    if (!names.empty()) problems.emplace_back(kind, std::move(names));
  }
  return problems;
}


}  // namespace flashrt::detail
