// Package: open (digests, weights checked and bound), run (inputs checked,
// state threaded). The checks mirror flashrt_build's Python loader
// (flashrt_build/runtime/load.py and checkpoint.py), messages included.
#include "internal.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#ifdef FLASHRT_WITH_CUDA
#include <cuda_runtime_api.h>  // the runtime API only: ATen's CUDA context needs the math libraries' headers too
#endif

#include <algorithm>
#include <chrono>
#include <set>

namespace flashrt {

using detail::join;
using detail::Manifest;
using detail::same_device;
using detail::WeightEntry;

namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace

namespace detail {

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
  detail::Shared shared;  // what every method reads: the manifest, device, state, the call lock
  std::vector<std::unique_ptr<Method>> methods;  // in the manifest's order
  std::vector<std::string> method_names;
  Method* default_method = nullptr;
  TensorMap weights;  // what is bound, kept alive for the package
  std::shared_ptr<SafetensorsFile> sidecar;  // read (and its digest checked) when first needed
  OpenStats stats;

  const Manifest& manifest() const { return shared.manifest; }

  const SafetensorsFile& read_sidecar() {
    if (!sidecar) {
      // The digest first, as for the package: nothing of an altered file is parsed.
      const auto path = listed_file(shared.dir, *manifest().weights_file);
      auto start = Clock::now();
      check_digest(path, *manifest().weights_file, "the weights");
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

  // Checks `source` against the manifest: the tensors to bind, by FQN.
  TensorMap check(Source source) {
    const Manifest& m = manifest();
    const c10::Device device = shared.device;
    for (const auto& e : m.state) source.tensors.erase(e.fqn);  // the state, bound apart
    detail::Table table;
    for (const auto& [name, t] : source.tensors) {
      table[name] = {t.sizes().vec(), t.scalar_type(),
                     source.in_memory ? std::optional<c10::Device>(t.device()) : std::nullopt,
                     source.in_memory ? std::optional<std::vector<int64_t>>(t.strides().vec()) : std::nullopt};
    }
    std::map<std::string, std::string> chosen;
    auto problems = detail::compare(m.weights, table, m.unused, device, chosen);
    if (!problems.empty()) throw Error(Error::Kind::Weights, mismatch(source.description, problems));
    std::map<std::string, const WeightEntry*> by_fqn;
    for (const auto& e : m.weights) by_fqn[e.fqn] = &e;
    TensorMap bound;
    for (const auto& [fqn, name] : chosen) bound.emplace(fqn, laid_out(source.tensors.at(name).to(device), *by_fqn.at(fqn)));
    if (m.external && bound.size() < m.weights.size()) {
      // Constants of the forward's code, non-persistent buffers: the build's values.
      const SafetensorsFile& defaults = read_sidecar();
      std::vector<std::string> absent;
      for (const auto& e : m.weights) {
        if (bound.count(e.fqn)) continue;
        if (!defaults.contains(e.fqn)) {
          absent.push_back(e.fqn);
        } else {
          bound.emplace(e.fqn, laid_out(defaults.tensor(e.fqn).to(device), e));
        }
      }
      if (!absent.empty()) throw Error(Error::Kind::Weights, mismatch(defaults.path().string(), {{"missing", absent}}));
    }
    return bound;
  }

  // Binds `bound` (and the state the package writes in place) into every
  // method's model, each by the names it binds them by: one copy for all.
  void bind_all(TensorMap bound) {
    const Manifest& m = manifest();
    for (const auto& method : methods) {
      Method::Impl& impl = method->impl();
      TensorMap handles;
      for (const auto& e : m.weights) {
        const std::string* name = e.bound_by(impl.spec->name);
        auto it = bound.find(e.fqn);
        if (name != nullptr && it != bound.end()) handles.emplace(*name, it->second);
      }
      if (m.state_in_place) {
        for (const auto& fqn : impl.loader->get_constant_fqns()) {
          auto it = shared.state.find(fqn);
          if (it != shared.state.end()) handles.emplace(fqn, it->second);
        }
      }
      if (handles.empty()) continue;
      impl.loader->load_constants(handles, /*use_inactive=*/false, /*check_full_update=*/m.external,
                                  /*user_managed=*/true);
      impl.drop_graphs();  // they hold the addresses of what was bound before
    }
    if (!bound.empty()) weights = std::move(bound);
  }

  void bind(Source source) {
    const auto start = Clock::now();
    const double reading = stats.weights_read_s + stats.weights_hash_s;  // a sidecar read for defaults is not binding
    TensorMap bound = check(std::move(source));
    std::lock_guard<std::mutex> lock(shared.calls);
    bind_all(std::move(bound));
    stats.bind_s += since(start) - (stats.weights_read_s + stats.weights_hash_s - reading);
  }

  // The state file's tensors, checked against the manifest.
  TensorMap initial_state() {
    const Manifest& m = manifest();
    const auto path = listed_file(shared.dir, *m.state_file);
    check_digest(path, *m.state_file, "the state");
    SafetensorsFile file(path);
    TensorMap out;
    for (const auto& e : m.state) {
      if (!file.contains(e.fqn) || file.shape(e.fqn) != e.shape || file.dtype(e.fqn) != e.dtype) {
        throw Error(Error::Kind::Artifact, path.string() + " does not hold " + e.fqn + " " +
                                               detail::shape_str(e.shape) + " " + dtype_name(e.dtype) +
                                               " as the manifest lists it");
      }
      out[e.fqn] = file.tensor(e.fqn);
    }
    return out;
  }

  // The state buffers: the caller's (updated in place), or state.safetensors's initial values.
  void init_state(const TensorMap* given) {
    const Manifest& m = manifest();
    if (m.state.empty()) return;
    const c10::Device device = shared.device;
    const bool all_given = given != nullptr && std::all_of(m.state.begin(), m.state.end(), [&](const auto& e) {
                             return given->count(e.fqn) > 0;
                           });
    if (all_given) {
      std::vector<std::string> wrong;
      for (const auto& e : m.state) {
        const at::Tensor& t = given->at(e.fqn);
        if (t.sizes().vec() != e.shape || t.scalar_type() != e.dtype || !same_device(t.device(), device)) {
          wrong.push_back(e.fqn + " " + detail::shape_str(t.sizes().vec()) + " " + dtype_name(t.scalar_type()) +
                          " on " + t.device().str() + " (package expects " + detail::shape_str(e.shape) + " " +
                          dtype_name(e.dtype) + " on " + device.str() + ")");
        } else if (m.state_in_place && !t.is_contiguous()) {
          wrong.push_back(e.fqn + " is not contiguous (the package writes it row-major)");
        }
        shared.state[e.fqn] = t;
      }
      if (!wrong.empty()) {
        throw Error(Error::Kind::Weights, "state from the given tensors does not fit the package: " + join(wrong));
      }
    } else {
      // Owned: written by every call.
      for (auto& [fqn, t] : initial_state()) shared.state[fqn] = t.to(device, /*non_blocking=*/false, /*copy=*/true);
    }
  }

  void load_methods(const std::filesystem::path& package) {
    const Manifest& m = manifest();
    const c10::DeviceIndex index = shared.device.is_cuda() ? shared.device.index() : -1;
    for (const auto& spec : m.methods) {
      auto impl = std::make_unique<Method::Impl>();
      impl->spec = &spec;
      impl->shared = &shared;
      try {
        // One runner; single-threaded when graphs are captured (the default one cannot be).
        impl->loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package.string(), spec.model,
                                                                                 shared.graphs, 1, index);
      } catch (const c10::Error& e) {
        throw Error(Error::Kind::Artifact,
                    package.string() + " cannot be loaded by libtorch: " + e.what_without_backtrace());
      }
      // The manifest lists exactly the tensors the compiled code binds (and the state it writes in place).
      const auto fqns = impl->loader->get_constant_fqns();
      std::set<std::string> binds, listed;
      for (const auto& fqn : fqns) {
        if (!(m.state_in_place && std::any_of(m.state.begin(), m.state.end(), [&](const auto& e) { return e.fqn == fqn; }))) {
          binds.insert(fqn);
        }
      }
      for (const auto& e : m.weights) {
        if (const std::string* name = e.bound_by(spec.name)) listed.insert(*name);
      }
      if (binds != listed) {
        std::vector<std::string> extra, absent;
        std::set_difference(binds.begin(), binds.end(), listed.begin(), listed.end(), std::back_inserter(extra));
        std::set_difference(listed.begin(), listed.end(), binds.begin(), binds.end(), std::back_inserter(absent));
        throw Error(Error::Kind::Artifact, package.string() + " (" + spec.name + ") binds other tensors than " +
                                               m.path.string() + " lists: not listed: " + join(extra) +
                                               "; not bound: " + join(absent));
      }
      impl->call = detail::parse_call_spec(impl->loader->get_call_spec(), spec, m);
      methods.push_back(std::make_unique<Method>(std::move(impl)));
      method_names.push_back(spec.name);
      if (spec.name == m.default_method) default_method = methods.back().get();
    }
  }

  static std::unique_ptr<Impl> open(const std::filesystem::path& dir, const Options& options, const TensorMap* given,
                                    const std::filesystem::path* checkpoint);
};

namespace {

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

}  // namespace

std::unique_ptr<Package::Impl> Package::Impl::open(const std::filesystem::path& dir, const Options& options,
                                                   const TensorMap* given, const std::filesystem::path* checkpoint) {
  const auto start = Clock::now();
  auto impl = std::make_unique<Impl>();
  Impl& p = *impl;
  p.shared.dir = dir;
  p.shared.manifest = detail::read_manifest(dir);
  const Manifest& m = p.shared.manifest;
  p.shared.device = resolve_device(m, options.device);
  const bool graphs = options.cuda_graphs.value_or(m.cuda_graphs);
  if (graphs && !p.shared.device.is_cuda()) {
    if (options.cuda_graphs) {
      throw Error(Error::Kind::Input, "CUDA graphs need a CUDA package; " + dir.string() + " runs on " +
                                          p.shared.device.str());
    }
  } else {
    p.shared.graphs = graphs;
  }
#ifndef FLASHRT_WITH_CUDA
  if (p.shared.graphs) throw Error(Error::Kind::Input, "this flashrt library was built without CUDA: no CUDA graphs");
#endif
  p.shared.max_graphs = options.max_graphs.value_or(m.max_graphs);

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
  TensorMap bound;
  if (source) {
    t = Clock::now();
    const double reading = p.stats.weights_read_s + p.stats.weights_hash_s;
    bound = p.check(std::move(*source));
    p.stats.bind_s += since(t) - (p.stats.weights_read_s + p.stats.weights_hash_s - reading);
  }
  p.init_state(given);

  t = Clock::now();
  load_libraries(m);
  p.load_methods(package);
  p.stats.load_s = since(t);
  t = Clock::now();
  p.bind_all(std::move(bound));
  p.stats.bind_s += since(t);
  for (auto& method : p.methods) method->impl().plan();
  if (p.shared.device.is_cuda() && m.target_dtype == "float32") {
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
  return Package(Impl::open(dir, Options{device, {}, {}}, nullptr, nullptr));
}

Package Package::open(const std::filesystem::path& dir, const Options& options) {
  return Package(Impl::open(dir, options, nullptr, nullptr));
}

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device, const TensorMap& weights) {
  return Package(Impl::open(dir, Options{device, {}, {}}, &weights, nullptr));
}

Package Package::open(const std::filesystem::path& dir, const Options& options, const TensorMap& weights) {
  return Package(Impl::open(dir, options, &weights, nullptr));
}

Package Package::open(const std::filesystem::path& dir, std::optional<c10::Device> device,
                      const std::filesystem::path& checkpoint) {
  return Package(Impl::open(dir, Options{device, {}, {}}, nullptr, &checkpoint));
}

Package Package::open(const std::filesystem::path& dir, const Options& options,
                      const std::filesystem::path& checkpoint) {
  return Package(Impl::open(dir, options, nullptr, &checkpoint));
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

void Package::reset_state() {
  if (impl_->shared.manifest.state.empty()) return;
  TensorMap initial = impl_->initial_state();
  std::lock_guard<std::mutex> lock(impl_->shared.calls);
  at::NoGradGuard no_grad;
  for (auto& [fqn, t] : impl_->shared.state) t.copy_(initial.at(fqn));
}

Method& Package::method(const std::string& name) {
  const auto& names = impl_->method_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    throw Error(Error::Kind::Input, impl_->shared.dir.string() + " has no method '" + name + "'; its methods: " +
                                        join(names));
  }
  return *impl_->methods[it - names.begin()];
}

const std::vector<std::string>& Package::method_names() const { return impl_->method_names; }
const std::string& Package::default_method() const { return impl_->default_method->name(); }

std::vector<at::Tensor> Package::run(const std::vector<at::Tensor>& inputs) { return impl_->default_method->run(inputs); }
std::vector<at::Tensor> Package::run(const TensorMap& inputs) { return impl_->default_method->run(inputs); }
void Package::check_inputs(const std::vector<at::Tensor>& inputs) const { impl_->default_method->check_inputs(inputs); }
const std::vector<InputSpec>& Package::inputs() const { return impl_->default_method->inputs(); }
const std::vector<std::string>& Package::output_names() const { return impl_->default_method->output_names(); }
std::vector<std::string> Package::constant_fqns() const { return impl_->default_method->constant_fqns(); }

const std::string& Package::name() const { return impl_->shared.manifest.name; }
const std::filesystem::path& Package::dir() const { return impl_->shared.dir; }
c10::Device Package::device() const { return impl_->shared.device; }
bool Package::external() const { return impl_->shared.manifest.external; }
bool Package::cuda_graphs() const { return impl_->shared.graphs; }
const std::string& Package::state_mode() const {
  static const std::string none, in_place = "in_place", threaded = "threaded";
  const Manifest& m = impl_->shared.manifest;
  return m.state.empty() ? none : m.state_in_place ? in_place : threaded;
}
const TensorMap& Package::weights() const { return impl_->weights; }
const TensorMap& Package::state() const { return impl_->shared.state; }
const OpenStats& Package::open_stats() const { return impl_->stats; }

}  // namespace flashrt
