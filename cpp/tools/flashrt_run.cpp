// flashrt-run: one call of a flashrt_build package, inputs and outputs as safetensors.
//
//   flashrt-run DIR --inputs in.safetensors --out out.safetensors [--method NAME]
//               [--device cuda:0] [--weights checkpoint.safetensors] [--calls N] [--cuda-graphs]
//
// Exit codes: 0 the outputs are written; 1 the package, its weights or the
// inputs were refused (one line on stderr says why), or the call failed;
// 2 the command line is wrong.
#include <flashrt/package.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

namespace {

const char* kUsage =
    "usage: flashrt-run DIR --inputs IN.safetensors --out OUT.safetensors [--method NAME] [--device DEVICE] "
    "[--weights CHECKPOINT.safetensors] [--calls N] [--cuda-graphs]\n"
    "  DIR        a flashrt_build output directory (model.pt2, manifest.json, ...)\n"
    "  --inputs   the inputs by name, as the manifest lists them\n"
    "  --out      written with the outputs by path in the output tree ('output' for a lone tensor)\n"
    "  --method   the method to call (default: the package's default, its forward)\n"
    "  --device   default: the build's target device\n"
    "  --weights  bind this checkpoint instead of the package's own weights\n"
    "  --calls    call N times (a stateful module advances its state); the last outputs are written\n"
    "  --cuda-graphs  replay each call from a CUDA graph (CUDA packages; default: the manifest's serve.cuda_graphs)\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "flashrt-run: " << message << "\n" << kUsage;
  std::exit(2);
}

struct Args {
  std::string dir, inputs, out, weights, method;
  std::optional<std::string> device;
  std::optional<bool> cuda_graphs;
  long calls = 1;
};

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--inputs") {
      args.inputs = value();
    } else if (arg == "--out") {
      args.out = value();
    } else if (arg == "--device") {
      args.device = value();
    } else if (arg == "--weights") {
      args.weights = value();
    } else if (arg == "--method") {
      args.method = value();
    } else if (arg == "--cuda-graphs") {
      args.cuda_graphs = true;
    } else if (arg == "--calls") {
      const std::string n = value();
      char* end = nullptr;
      args.calls = std::strtol(n.c_str(), &end, 10);
      if (*end != '\0' || args.calls < 1) usage_error("--calls takes a positive integer, not '" + n + "'");
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option " + arg);
    } else if (args.dir.empty()) {
      args.dir = arg;
    } else {
      usage_error("one package directory only; got " + args.dir + " and " + arg);
    }
  }
  if (args.dir.empty()) usage_error("no package directory given");
  if (args.inputs.empty()) usage_error("--inputs is required");
  if (args.out.empty()) usage_error("--out is required");
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    std::optional<c10::Device> device;
    if (args.device) {
      try {
        device = c10::Device(*args.device);
      } catch (const c10::Error&) {
        usage_error("--device '" + *args.device + "' is not a device (cpu, cuda, cuda:1)");
      }
    }
    const flashrt::Options options{device, args.cuda_graphs, {}};
    flashrt::Package pkg = args.weights.empty()
                               ? flashrt::Package::open(args.dir, options)
                               : flashrt::Package::open(args.dir, options, std::filesystem::path(args.weights));
    flashrt::Method& method = pkg.method(args.method.empty() ? pkg.default_method() : args.method);
    flashrt::TensorMap inputs;
    for (auto& [name, tensor] : flashrt::SafetensorsFile(args.inputs).tensors()) {
      inputs.emplace(name, tensor.to(pkg.device()));
    }
    std::vector<at::Tensor> outputs;
    for (long i = 0; i < args.calls; ++i) outputs = method.run(inputs);
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined()) named.emplace_back(method.output_names().at(i), outputs[i]);  // a None leaf: no tensor
    }
    flashrt::save_safetensors(args.out, named);
    std::cout << pkg.name() << (pkg.method_names().size() > 1 ? "." + method.name() : "") << " on " << pkg.device()
              << ": " << args.calls << (args.calls == 1 ? " call" : " calls");
    for (const auto& [name, t] : named) {
      std::cout << ", " << name << " " << t.sizes() << " " << flashrt::dtype_name(t.scalar_type());
    }
    std::cout << " -> " << args.out << "\n";
    return 0;
  } catch (const flashrt::Error& e) {
    std::cerr << "flashrt-run: error: " << e.what() << "\n";
  } catch (const c10::Error& e) {
    std::cerr << "flashrt-run: the call failed: " << e.what_without_backtrace() << "\n";
  }
  return 1;
}
