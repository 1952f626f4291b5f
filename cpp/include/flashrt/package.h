// flashrt: serve a flashrt_build package from C++ with the checks Python's
// `flashrt_build.load` makes.
//
//   auto pkg = flashrt::Package::open("outputs/gpt2_tiny/cpu-external-default");
//   std::vector<at::Tensor> out = pkg.run({input_ids});
//
//   auto lm = flashrt::Package::open("outputs/tiny_lm/cpu-external-default");
//   auto logits = lm.method("prefill").run({prompt}).at(0);  // fills the KV cache
//   auto next = lm.method("decode").run({token, position}).at(0);  // reads it
//
// open() checks the package's sha256 (and the sidecar's, when it reads it)
// against manifest.json before any of the package's code is loaded, checks
// every weight by name, shape and dtype before binding it, and run() checks
// every input against the manifest: libtorch's own loader runs a wrong weight
// or input shape silently.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace flashrt {

// Every refusal: an altered or incomplete artifact, weights that do not fit
// the package, inputs it was not built for. The message names the file, the
// tensor or the input, and the expected and actual values.
class Error : public std::runtime_error {
 public:
  enum class Kind {
    Artifact,  // a file missing, altered since its build, or unreadable
    Weights,   // weights whose names, shapes, dtypes or devices differ from the manifest's
    Input,     // inputs the package was not built for
  };
  Error(Kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const noexcept { return kind_; }

 private:
  Kind kind_;
};

// Tensors by name: weights by FQN, inputs by input name.
using TensorMap = std::unordered_map<std::string, at::Tensor>;

struct DynamicDim {
  int64_t axis;
  std::string name;  // dims of one name must agree across inputs
  int64_t min;
  int64_t max;
};

// One input of the package, as the manifest describes it.
struct InputSpec {
  std::string name;
  std::vector<int64_t> shape;  // the example shape; dynamic axes vary within their range
  at::ScalarType dtype;
  std::vector<DynamicDim> dynamic;
  bool positional;
  // The values an integer input may hold, [low, high) (a token id below the
  // vocabulary size); unset where the config declared none. Every call checks
  // them: a value outside would make the compiled code read out of bounds.
  std::optional<int64_t> low;
  std::optional<int64_t> high;
};

// Where open() spent its time, for logs and benchmarks.
struct OpenStats {
  uint64_t package_bytes = 0;
  double package_hash_s = 0;  // sha256 of model.pt2
  uint64_t weights_bytes = 0;  // bytes of the sidecar or checkpoint read (0: none read)
  double weights_hash_s = 0;  // sha256 of the sidecar (0: not read, or a checkpoint, which has no digest)
  double weights_read_s = 0;  // map the file and parse its header
  double load_s = 0;  // libtorch's loader: unpack the package, load its code (every method's)
  double bind_s = 0;  // check names, shapes, dtypes; copy to the device; bind
  double total_s = 0;
};

// How to open a package.
struct Options {
  std::optional<c10::Device> device;  // default: the build's target device
  // CUDA packages: capture each method in a CUDA graph and replay it (see
  // Method::run). Default: the manifest's serve.cuda_graphs.
  std::optional<bool> cuda_graphs;
  // Graphs a method with dynamic dims captures, one per distinct input shape;
  // other shapes then run without one. Default: the manifest's serve.max_graphs.
  std::optional<size_t> max_graphs;
};

class Package;

// One entry point of a package (its prefill, its decode); all of a package's
// methods share its weights and its state. Obtained from Package::method(),
// valid as long as the package.
class Method {
 public:
  // One call. Inputs in the order of inputs() (positional inputs, then keyword
  // ones), or by name. Returns the output tree's leaves in order (see
  // output_names()). State the package writes is written before it returns.
  // Non-contiguous inputs are copied to row-major first; contiguous ones are not.
  //
  // With CUDA graphs, the first call of a shape runs as it is (the warm-up),
  // the second captures a graph, which every later call of that shape
  // replays: the inputs are copied into the graph's own tensors and the
  // outputs copied out of them, so returned tensors are never overwritten.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs);
  std::vector<at::Tensor> run(const TensorMap& inputs);
  // run({a, b}): a list of tensors, not a map's iterator range.
  std::vector<at::Tensor> run(std::initializer_list<at::Tensor> inputs) { return run(std::vector<at::Tensor>(inputs)); }

  // run() without the check of declared value ranges, the one check that
  // waits for the device (each ranged input's min and max are copied to the
  // host), which stalls a loop that could queue its next step. Only for inputs
  // derived from the package's own outputs: a token argmax-ed over the
  // vocabulary, a position the caller counts. Shapes, dtypes and devices are
  // still checked.
  std::vector<at::Tensor> run_trusted(const std::vector<at::Tensor>& inputs);
  std::vector<at::Tensor> run_trusted(const TensorMap& inputs);
  std::vector<at::Tensor> run_trusted(std::initializer_list<at::Tensor> inputs) {
    return run_trusted(std::vector<at::Tensor>(inputs));
  }

  // Throws Error(Kind::Input) naming the first input that does not fit: its
  // dtype, device, rank, a static size, a dynamic size outside its range, two
  // inputs sharing a dynamic dim with different sizes, or a value outside its
  // declared range. run() calls it.
  void check_inputs(const std::vector<at::Tensor>& inputs) const;

  const std::string& name() const;  // as the manifest names it ("decode")
  const std::vector<InputSpec>& inputs() const;
  // Output leaves by path in the output tree: "output" for a lone tensor,
  // else keys and indices joined by "." ("logits", "0.hidden").
  const std::vector<std::string>& output_names() const;
  // The FQNs this method's compiled code binds, as libtorch reports them.
  std::vector<std::string> constant_fqns() const;
  size_t graphs() const;  // CUDA graphs captured so far

  Method(const Method&) = delete;
  Method& operator=(const Method&) = delete;
  ~Method();

  // The library's own (opaque outside it).
  struct Impl;
  explicit Method(std::unique_ptr<Impl> impl);
  Impl& impl() { return *impl_; }

 private:
  void check_shapes(const std::vector<at::Tensor>& inputs) const;
  void check_values(const std::vector<at::Tensor>& inputs) const;
  std::vector<at::Tensor> ordered(const TensorMap& inputs) const;
  std::vector<at::Tensor> call(const std::vector<at::Tensor>& inputs);

  std::unique_ptr<Impl> impl_;
};

// A loaded, checked package. Movable, not copyable. Calls are serialized: one
// lock per package, held while a call is launched (on a GPU the work itself
// runs on after the call returns), so several threads may call any methods
// of one package; bind() takes the same lock.
class Package {
 public:
  // The package in `dir` (a flashrt_build output directory). An external-
  // weights package binds its sidecar, weights.safetensors; a baked one keeps its weights.
  static Package open(const std::filesystem::path& dir, std::optional<c10::Device> device = std::nullopt);
  static Package open(const std::filesystem::path& dir, const Options& options);
  // ... binding the caller's tensors (a state dict), borrowed: no weight is
  // copied, and an in-place edit of one shows in the next call's output. The
  // tensors must be on the device. Names may be the module's FQNs or tied
  // aliases; constants of the forward's own code and non-persistent buffers
  // may be left out (the sidecar's values are bound). For a stateful module,
  // tensors named like its state become the state, updated in place.
  static Package open(const std::filesystem::path& dir, std::optional<c10::Device> device, const TensorMap& weights);
  static Package open(const std::filesystem::path& dir, const Options& options, const TensorMap& weights);
  // ... binding a safetensors checkpoint, memory-mapped (on the CPU, bound
  // without a copy).
  static Package open(const std::filesystem::path& dir, std::optional<c10::Device> device,
                      const std::filesystem::path& checkpoint);
  static Package open(const std::filesystem::path& dir, const Options& options,
                      const std::filesystem::path& checkpoint);

  Package(Package&&) noexcept;
  Package& operator=(Package&&) noexcept;
  ~Package();

  // Binds other weights, checked the same way; drops every CUDA graph (they
  // hold the old tensors' addresses).
  void bind(const TensorMap& weights);
  void bind(const std::filesystem::path& checkpoint);
  // Puts the state back to the build's initial values, in place: graphs stay valid.
  void reset_state();

  // A method by name; throws Error(Kind::Input) listing the package's methods.
  Method& method(const std::string& name);
  const std::vector<std::string>& method_names() const;  // in the manifest's order
  // What run() calls: the method that runs the module's forward, else the first.
  const std::string& default_method() const;

  // The default method's call, checks, inputs and outputs.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs);
  std::vector<at::Tensor> run(const TensorMap& inputs);
  std::vector<at::Tensor> run(std::initializer_list<at::Tensor> inputs) { return run(std::vector<at::Tensor>(inputs)); }
  void check_inputs(const std::vector<at::Tensor>& inputs) const;
  const std::vector<InputSpec>& inputs() const;
  const std::vector<std::string>& output_names() const;
  std::vector<std::string> constant_fqns() const;

  const std::string& name() const;  // the module's name
  const std::filesystem::path& dir() const;
  c10::Device device() const;
  bool external() const;  // weights=external: code only, weights bound at open
  bool cuda_graphs() const;  // methods replay CUDA graphs
  // "in_place": the compiled code writes the state where it is bound;
  // "threaded": every call passes it in and copies the new values back; "" stateless.
  const std::string& state_mode() const;
  // The tensors bound, by the package's FQN (empty when the baked ones are kept).
  const TensorMap& weights() const;
  // A stateful module's buffers by FQN (a decoder's KV cache), shared by every method.
  const TensorMap& state() const;
  const OpenStats& open_stats() const;

  struct Impl;

 private:
  explicit Package(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A safetensors file, memory-mapped. Tensors are views of the mapping, which
// stays alive as long as any of them does; writing to one changes this
// process's copy only (the mapping is private).
class SafetensorsFile {
 public:
  // Throws Error(Kind::Artifact) naming the file when it is not valid safetensors.
  explicit SafetensorsFile(const std::filesystem::path& path);
  const std::filesystem::path& path() const;
  const std::vector<std::string>& names() const;  // in file order
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const;  // a CPU view, no copy
  TensorMap tensors() const;
  uint64_t bytes() const;  // the file's size

 private:
  struct Mapped;
  std::shared_ptr<Mapped> mapped_;
};

// Writes tensors (any device; copied to the CPU) as safetensors, in the given order.
void save_safetensors(const std::filesystem::path& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors);

// The manifest's dtype name of a scalar type ("float32", "int64", "bfloat16").
std::string dtype_name(at::ScalarType dtype);

// The lowercase hex sha256 of a file, read in large blocks.
std::string file_sha256(const std::filesystem::path& path);

}  // namespace flashrt
