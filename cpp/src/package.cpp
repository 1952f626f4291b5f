// Package: open (digests, weights checked and bound), run (inputs checked,
// state threaded). The checks mirror flashrt_build's Python loader
// (flashrt_build/runtime/load.py and checkpoint.py), messages included.
#include "internal.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/cuda.h>

#ifdef FLASHRT_WITH_CUDA
#include <cuda_runtime_api.h>  // the runtime API only: ATen's CUDA context needs the math libraries' headers too
#endif

#include <algorithm>
#include <chrono>
#include <set>

namespace flashrt {

using detail::Manifest;
using detail::WeightEntry;

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

bool same_device(const c10::Device& a, const c10::Device& b) {
  return a.type() == b.type() && (!a.is_cuda() || a.index() == b.index());
}

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

}  // namespace

namespace detail {

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

}  // namespace detail

namespace {

// A tensor read from a file (row-major) as the package reads it: its strides
// and its floating-point dtype (a bf16 checkpoint for a float32 package); a
// copy only where either differs.
at::Tensor laid_out(const at::Tensor& t, const WeightEntry& entry) {
  if (detail::same_layout(t.strides().vec(), entry) && t.scalar_type() == entry.dtype) return t;
  return at::empty_strided(t.sizes(), entry.stride, t.options().dtype(entry.dtype)).copy_(t);
}

// Weights to bind: the caller's tensors (borrowed, on the device already) or a file's.
struct Source {
  std::string description;
  TensorMap tensors;
  bool in_memory = false;  // the caller's: checked for their device, never moved
};

}  // namespace

struct Package::Impl {
  Manifest manifest;
  std::filesystem::path dir;
  c10::Device device{c10::kCPU};
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  detail::CallSpec call;
  std::vector<std::string> input_names;  // the order run() takes them in
  std::vector<std::string> state_names;  // manifest order
  TensorMap weights;  // what is bound, kept alive for the package
  TensorMap state;
  std::shared_ptr<SafetensorsFile> sidecar;  // read (and its digest checked) when first needed
  OpenStats stats;

  // Per flat input of the compiled code: an index into run()'s inputs (>= 0)
  // or into state_in (-1 - i).
  std::vector<int> slots;
  std::vector<at::Tensor> state_in;  // in call order
  std::vector<at::Tensor> state_out;  // in the order the package returns them
  size_t n_dims = 0;  // distinct dynamic dim names, numbered in dim_ids
  std::vector<std::vector<int>> dim_ids;  // per input, per dynamic dim
  std::vector<std::vector<std::pair<size_t, int64_t>>> static_axes;  // per input: (axis, size) of each static axis

  const SafetensorsFile& read_sidecar() {
    if (!sidecar) {
      // The digest first, as for the package: nothing of an altered file is parsed.
      const auto path = listed_file(dir, *manifest.weights_file);
      auto start = Clock::now();
      check_digest(path, *manifest.weights_file, "the weights");
      stats.weights_hash_s += since(start);
      stats.weights_bytes += std::filesystem::file_size(path);
      start = Clock::now();
      sidecar = std::make_shared<SafetensorsFile>(path);
      stats.weights_read_s += since(start);
    }
    return *sidecar;
  }

  Source file_source(const std::filesystem::path& checkpoint) {
    if (!std::filesystem::is_regular_file(checkpoint)) {
      throw Error(Error::Kind::Weights, "weights file " + checkpoint.string() + " does not exist");
    }
    auto start = Clock::now();
    SafetensorsFile file(checkpoint);
    stats.weights_read_s += since(start);
    stats.weights_bytes += file.bytes();
    return {checkpoint.string(), file.tensors(), false};
  }

  Source sidecar_source() {
    const SafetensorsFile& file = read_sidecar();
    return {file.path().string(), file.tensors(), false};
  }

  // Checks `source` against the manifest and binds it in place (user_managed).
  void bind(Source source) {
    const auto start = Clock::now();
    const double reading = stats.weights_read_s + stats.weights_hash_s;  // a sidecar read for defaults is not binding
    for (const auto& name : state_names) source.tensors.erase(name);  // threaded as state, not bound
    detail::Table table;
    for (const auto& [name, t] : source.tensors) {
      table[name] = {t.sizes().vec(), t.scalar_type(),
                     source.in_memory ? std::optional<c10::Device>(t.device()) : std::nullopt,
                     source.in_memory ? std::optional<std::vector<int64_t>>(t.strides().vec()) : std::nullopt};
    }
    std::map<std::string, std::string> chosen;
    auto problems = detail::compare(manifest.weights, table, manifest.unused, device, chosen);
    if (!problems.empty()) throw Error(Error::Kind::Weights, mismatch(source.description, problems));
    std::map<std::string, const WeightEntry*> by_fqn;
    for (const auto& e : manifest.weights) by_fqn[e.fqn] = &e;
    TensorMap bound;
    for (const auto& [fqn, name] : chosen) bound.emplace(fqn, laid_out(source.tensors.at(name).to(device), *by_fqn.at(fqn)));
    if (manifest.external && bound.size() < manifest.weights.size()) {
      // Constants of the forward's code, non-persistent buffers: the build's values.
      const SafetensorsFile& defaults = read_sidecar();
      std::vector<std::string> absent;
      for (const auto& e : manifest.weights) {
        if (bound.count(e.fqn)) continue;
        if (!defaults.contains(e.fqn)) {
          absent.push_back(e.fqn);
        } else {
          bound.emplace(e.fqn, laid_out(defaults.tensor(e.fqn).to(device), e));
        }
      }
      if (!absent.empty()) throw Error(Error::Kind::Weights, mismatch(defaults.path().string(), {{"missing", absent}}));
    }
    if (!bound.empty()) {
      // A copy of the map: libtorch's signature takes it by reference.
      TensorMap handles = bound;
      loader->load_constants(handles, /*use_inactive=*/false, /*check_full_update=*/manifest.external,
                             /*user_managed=*/true);
    }
    weights = std::move(bound);
    stats.bind_s += since(start) - (stats.weights_read_s + stats.weights_hash_s - reading);
  }

  // The threaded buffers: the caller's (updated in place), or state.safetensors's initial values.
  void init_state(const TensorMap* given) {
    if (manifest.state.empty()) return;
    const bool all_given = given != nullptr && std::all_of(state_names.begin(), state_names.end(),
                                                            [&](const std::string& n) { return given->count(n); });
    if (all_given) {
      std::vector<std::string> wrong;
      for (const auto& e : manifest.state) {
        const at::Tensor& t = given->at(e.fqn);
        if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype || !same_device(t.device(), device)) {
          wrong.push_back(e.fqn + " " + detail::shape_str(t.sizes().vec()) + " " + dtype_name(t.scalar_type()) +
                          " on " + t.device().str() + " (package expects " + detail::shape_str(e.shape) + " " +
                          dtype_name(e.dtype) + " on " + device.str() + ")");
        }
        state[e.fqn] = t;
      }
      if (!wrong.empty()) {
        throw Error(Error::Kind::Weights, "state from the given tensors does not fit the package: " + join(wrong));
      }
    } else {
      const auto path = listed_file(dir, *manifest.state_file);
      check_digest(path, *manifest.state_file, "the state");
      SafetensorsFile file(path);
      for (const auto& e : manifest.state) {
        if (!file.contains(e.fqn) || file.shape(e.fqn) != e.shape || file.dtype(e.fqn) != e.dtype) {
          throw Error(Error::Kind::Artifact, path.string() + " does not hold " + e.fqn + " " +
                                                 detail::shape_str(e.shape) + " " + dtype_name(e.dtype) +
                                                 " as the manifest lists it");
        }
        // Owned: written after every call.
        state[e.fqn] = file.tensor(e.fqn).to(device, /*non_blocking=*/false, /*copy=*/true);
      }
    }
    for (const auto& name : call.state_outputs) state_out.push_back(state.at(name));
  }

  void plan_call() {
    const auto& inputs = manifest.inputs;
    for (const auto& name : call.order) {
      const std::string prefix = std::string(detail::kStateKwarg) + ".";
      if (name.rfind(prefix, 0) == 0) {
        slots.push_back(-1 - static_cast<int>(state_in.size()));
        state_in.push_back(state.at(name.substr(prefix.size())));
        continue;
      }
      auto it = std::find_if(inputs.begin(), inputs.end(), [&](const InputSpec& s) { return s.name == name; });
      slots.push_back(static_cast<int>(it - inputs.begin()));
    }
    std::vector<std::string> dims;
    for (const auto& spec : inputs) {
      static_axes.emplace_back();
      for (size_t axis = 0; axis < spec.shape.size(); ++axis) {
        const bool dynamic = std::any_of(spec.dynamic.begin(), spec.dynamic.end(),
                                         [&](const DynamicDim& d) { return d.axis == static_cast<int64_t>(axis); });
        if (!dynamic) static_axes.back().emplace_back(axis, spec.shape[axis]);
      }
      dim_ids.emplace_back();
      for (const auto& d : spec.dynamic) {
        auto it = std::find(dims.begin(), dims.end(), d.name);
        dim_ids.back().push_back(static_cast<int>(it - dims.begin()));
        if (it == dims.end()) dims.push_back(d.name);
      }
    }
    n_dims = dims.size();
  }

  static std::unique_ptr<Impl> open(const std::filesystem::path& dir, std::optional<c10::Device> requested,
                                    const TensorMap* given, const std::filesystem::path* checkpoint);
};

std::unique_ptr<Package::Impl> Package::Impl::open(const std::filesystem::path& dir,
                                                   std::optional<c10::Device> requested, const TensorMap* given,
                                                   const std::filesystem::path* checkpoint) {
  const auto start = Clock::now();
  auto impl = std::make_unique<Impl>();
  Impl& p = *impl;
  p.dir = dir;
  p.manifest = detail::read_manifest(dir);
  const Manifest& m = p.manifest;
  for (const auto& e : m.state) p.state_names.push_back(e.fqn);
  for (const auto& spec : m.inputs) p.input_names.push_back(spec.name);
  p.device = resolve_device(m, requested);

  // The package's digest before any of its code is loaded.
  const auto package = listed_file(dir, m.package);
  auto t = Clock::now();
  check_digest(package, m.package, "the package");
  detail::check_contract(package, m);
  p.stats.package_hash_s = since(t);
  p.stats.package_bytes = std::filesystem::file_size(package);

  // The weights, read and checked before the package is loaded: a file that
  // does not fit fails fast. The caller's tensors are borrowed as they are.
  std::optional<Source> source;
  if (given != nullptr) {
    source = Source{"the given tensors", *given, true};
  } else if (checkpoint != nullptr) {
    source = p.file_source(*checkpoint);
  } else if (m.external) {
    source = p.sidecar_source();
  }

  t = Clock::now();
  try {
    const c10::DeviceIndex index = p.device.is_cuda() ? p.device.index() : -1;
    p.loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package.string(), "model", false, 1, index);
  } catch (const c10::Error& e) {
    throw Error(Error::Kind::Artifact,
                package.string() + " cannot be loaded by libtorch: " + e.what_without_backtrace());
  }
  p.stats.load_s = since(t);

  // The manifest lists exactly the tensors the compiled code binds.
  const auto fqns = p.loader->get_constant_fqns();
  std::set<std::string> binds(fqns.begin(), fqns.end()), listed;
  for (const auto& e : m.weights) listed.insert(e.fqn);
  if (binds != listed) {
    std::vector<std::string> extra, absent;
    std::set_difference(binds.begin(), binds.end(), listed.begin(), listed.end(), std::back_inserter(extra));
    std::set_difference(listed.begin(), listed.end(), binds.begin(), binds.end(), std::back_inserter(absent));
    throw Error(Error::Kind::Artifact, package.string() + " binds other tensors than " + m.path.string() +
                                           " lists: not listed: " + join(extra) + "; not bound: " + join(absent));
  }
  p.call = detail::parse_call_spec(p.loader->get_call_spec(), m);

  if (source) p.bind(std::move(*source));
  p.init_state(given);
  p.plan_call();
  if (p.device.is_cuda() && m.target_dtype == "float32") {
    // cuBLAS and cuDNN read these on every call; process-wide in C++.
    at::globalContext().setAllowTF32CuBLAS(m.tf32.value_or(false));
    at::globalContext().setAllowTF32CuDNN(m.tf32.value_or(false));
  }
  p.stats.total_s = since(start);
  return impl;
}

Package::Package(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Package::Package(Package&&) noexcept = default;
Package& Package::operator=(Package&&) noexcept = default;
Package::~Package() = default;

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device) {
  return Package(Impl::open(dir, device, nullptr, nullptr));
}

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device, const TensorMap& weights) {
  return Package(Impl::open(dir, device, &weights, nullptr));
}

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device,
                      const std::filesystem::path& checkpoint) {
  return Package(Impl::open(dir, device, nullptr, &checkpoint));
}

void Package::bind(const TensorMap& weights) {
  const OpenStats opened = impl_->stats;  // they describe the open
  impl_->bind({"the given tensors", weights, true});
  impl_->stats = opened;
}

void Package::bind(const std::filesystem::path& checkpoint) {
  const OpenStats opened = impl_->stats;
  impl_->bind(impl_->file_source(checkpoint));
  impl_->stats = opened;
}

void Package::check_inputs(const std::vector<at::Tensor>& inputs) const {
  const Impl& p = *impl_;
  const auto& specs = p.manifest.inputs;
  if (inputs.size() != specs.size()) {
    throw Error(Error::Kind::Input, "the package takes " + std::to_string(specs.size()) + " inputs (" +
                                        join(p.input_names) + "), got " + std::to_string(inputs.size()));
  }
  // Per dynamic dim name: the first size seen and the input it was seen on.
  // On the stack for the usual few dims: a call allocates nothing here.
  constexpr size_t kFew = 8;
  std::pair<int64_t, size_t> few[kFew];
  std::vector<std::pair<int64_t, size_t>> many(p.n_dims > kFew ? p.n_dims : 0);
  std::pair<int64_t, size_t>* seen = p.n_dims > kFew ? many.data() : few;
  std::fill(seen, seen + p.n_dims, std::pair<int64_t, size_t>{-1, 0});
  for (size_t i = 0; i < specs.size(); ++i) {
    const InputSpec& spec = specs[i];
    const at::Tensor& value = inputs[i];
    const std::string& name = spec.name;
    if (!value.defined()) {
      throw Error(Error::Kind::Input, "input '" + name + "' must be a tensor, got an undefined one");
    }
    if (value.scalar_type() != spec.dtype) {
      throw Error(Error::Kind::Input, "input '" + name + "' has dtype " + dtype_name(value.scalar_type()) +
                                          "; the package takes " + dtype_name(spec.dtype));
    }
    if (!same_device(value.device(), p.device)) {
      throw Error(Error::Kind::Input,
                  "input '" + name + "' is on " + value.device().str() + "; the package runs on " + p.device.str());
    }
    const auto shape = value.sizes();
    if (shape.size() != spec.shape.size()) {
      throw Error(Error::Kind::Input, "input '" + name + "' has " + std::to_string(shape.size()) + " dims " +
                                          detail::shape_str(shape.vec()) + "; expected " +
                                          std::to_string(spec.shape.size()) + " like " + detail::shape_str(spec.shape));
    }
    for (const auto& [axis, size] : p.static_axes[i]) {
      if (shape[axis] != size) {
        throw Error(Error::Kind::Input,
                    "input '" + name + "' has size " + std::to_string(shape[axis]) + " on axis " +
                        std::to_string(axis) + "; the package was built for " + std::to_string(size) +
                        " (the axis is static; make it dynamic in module.inputs." + name + ".dynamic)");
      }
    }
    for (size_t k = 0; k < spec.dynamic.size(); ++k) {
      const DynamicDim& d = spec.dynamic[k];
      const int64_t size = shape[d.axis];
      if (size < d.min || size > d.max) {
        throw Error(Error::Kind::Input, "input '" + name + "' has size " + std::to_string(size) + " on axis " +
                                            std::to_string(d.axis) + " ('" + d.name + "'); the package accepts " +
                                            std::to_string(d.min) + " to " + std::to_string(d.max));
      }
      auto& first = seen[p.dim_ids[i][k]];
      if (first.first < 0) {
        first = {size, i};
      } else if (first.first != size) {
        throw Error(Error::Kind::Input, "inputs '" + specs[first.second].name + "' and '" + name + "' share dim '" +
                                            d.name + "' but have sizes " + std::to_string(first.first) + " and " +
                                            std::to_string(size));
      }
    }
  }
  for (size_t i = 0; i < specs.size(); ++i) {  // after every shape is known good: one pass over each ranged input
    const InputSpec& spec = specs[i];
    if ((!spec.low && !spec.high) || inputs[i].numel() == 0) continue;
    const auto [smallest_t, largest_t] = at::aminmax(inputs[i]);
    const int64_t smallest = smallest_t.item<int64_t>(), largest = largest_t.item<int64_t>();
    if ((spec.low && smallest < *spec.low) || (spec.high && largest >= *spec.high)) {
      const std::string accepted = (spec.low ? std::to_string(*spec.low) : "-inf") + " to " +
                                   (spec.high ? std::to_string(*spec.high - 1) : "inf");
      throw Error(Error::Kind::Input, "input '" + spec.name + "' holds values from " + std::to_string(smallest) +
                                          " to " + std::to_string(largest) + "; the package accepts " + accepted +
                                          " (module.inputs." + spec.name +
                                          ".low/high): a value outside would make its code read out of bounds");
    }
  }
}

std::vector<at::Tensor> Package::run(const std::vector<at::Tensor>& inputs) {
  check_inputs(inputs);
  Impl& p = *impl_;
  std::vector<at::Tensor> flat;
  flat.reserve(p.slots.size());
  for (int slot : p.slots) flat.push_back(slot >= 0 ? inputs[slot] : p.state_in[-1 - slot]);
  std::vector<at::Tensor> out = p.loader->boxed_run(std::move(flat));
  if (!p.state_out.empty()) {
    const size_t n = out.size() - p.state_out.size();
    at::NoGradGuard no_grad;  // the caller's buffers may belong to a module that tracks gradients
    for (size_t i = 0; i < p.state_out.size(); ++i) p.state_out[i].copy_(out[n + i]);
    out.resize(n);
  }
  return out;
}

std::vector<at::Tensor> Package::run(const TensorMap& inputs) {
  const auto& names = impl_->input_names;
  for (const auto& [key, _] : inputs) {
    if (std::find(names.begin(), names.end(), key) != names.end()) continue;
    const auto& constants = impl_->manifest.constant_kwargs;
    if (std::find(constants.begin(), constants.end(), key) != constants.end()) {
      throw Error(Error::Kind::Input, "'" + key + "' is a constant keyword argument fixed at build time " +
                                          "(module.kwargs." + key + "), not an input");
    }
    throw Error(Error::Kind::Input, "input '" + key + "' is not an input of the package; inputs: " + join(names));
  }
  std::vector<at::Tensor> ordered;
  std::vector<std::string> missing;
  for (const auto& name : names) {
    auto it = inputs.find(name);
    if (it == inputs.end()) {
      missing.push_back(name);
    } else {
      ordered.push_back(it->second);
    }
  }
  if (!missing.empty()) throw Error(Error::Kind::Input, "missing inputs: " + join(missing));
  return run(ordered);
}

const std::string& Package::name() const { return impl_->manifest.name; }
const std::filesystem::path& Package::dir() const { return impl_->dir; }
c10::Device Package::device() const { return impl_->device; }
bool Package::external() const { return impl_->manifest.external; }
const std::vector<InputSpec>& Package::inputs() const { return impl_->manifest.inputs; }
const std::vector<std::string>& Package::output_names() const { return impl_->call.outputs; }
const TensorMap& Package::weights() const { return impl_->weights; }
const TensorMap& Package::state() const { return impl_->state; }
std::vector<std::string> Package::constant_fqns() const { return impl_->loader->get_constant_fqns(); }
const OpenStats& Package::open_stats() const { return impl_->stats; }

}  // namespace flashrt
