// What the command-line tools share: the options every one takes (the package
// directory, --device, --weights, --cuda-graphs), their usage errors (exit 2),
// opening the package they name and reporting a refusal (exit 1).
#pragma once

#include <flashrt/package.h>

#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <string>

namespace flashrt::tools {

struct Tool {
  const char* name;   // "flashrt-run"
  const char* usage;  // printed after a usage error and for --help
};

[[noreturn]] inline void usage_error(const Tool& tool, const std::string& message) {
  std::cerr << tool.name << ": " << message << "\n" << tool.usage;
  std::exit(2);
}

// An integer option's value, at least `least`.
inline long integer(const Tool& tool, const std::string& option, const std::string& text, long least) {
  char* end = nullptr;
  const long n = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || n < least) {
    usage_error(tool, option + " takes an integer >= " + std::to_string(least) + ", not '" + text + "'");
  }
  return n;
}

// A number option's value, in [least, most] (finite: NaN is refused).
inline double number(const Tool& tool, const std::string& option, const std::string& text, double least, double most,
                     const std::string& expected) {
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(x >= least && x <= most)) {
    usage_error(tool, option + " takes " + expected + ", not '" + text + "'");
  }
  return x;
}

struct PackageArgs {
  std::string dir, weights;
  std::optional<std::string> device;
  std::optional<bool> cuda_graphs;
};

// A tool's own option: true when it took `arg` (reading its value with `value()`).
using OwnOption = std::function<bool(const std::string& arg, const std::function<std::string()>& value)>;

inline PackageArgs parse(int argc, char** argv, const Tool& tool, const OwnOption& own) {
  PackageArgs args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::cout << tool.usage;
      std::exit(0);
    }
    const std::function<std::string()> value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(tool, arg + " needs a value");
      return argv[++i];
    };
    if (own(arg, value)) continue;
    if (arg == "--device") {
      args.device = value();
    } else if (arg == "--weights") {
      args.weights = value();
    } else if (arg == "--cuda-graphs") {
      args.cuda_graphs = true;
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error(tool, "unknown option " + arg);
    } else if (args.dir.empty()) {
      args.dir = arg;
    } else {
      usage_error(tool, "one package directory only; got " + args.dir + " and " + arg);
    }
  }
  if (args.dir.empty()) usage_error(tool, "no package directory given");
  return args;
}

inline Package open_package(const Tool& tool, const PackageArgs& args) {
  std::optional<c10::Device> device;
  if (args.device) {
    try {
      device = c10::Device(*args.device);
    } catch (const c10::Error&) {
      usage_error(tool, "--device '" + *args.device + "' is not a device (cpu, cuda, cuda:1)");
    }
  }
  const Options options{device, args.cuda_graphs, {}};
  return args.weights.empty() ? Package::open(args.dir, options)
                              : Package::open(args.dir, options, std::filesystem::path(args.weights));
}

// Runs `body`; a refusal (flashrt::Error) or a failed call (c10::Error) is one line on stderr and exit 1.
inline int run(const Tool& tool, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::cerr << tool.name << ": error: " << e.what() << "\n";
  } catch (const c10::Error& e) {
    std::cerr << tool.name << ": the call failed: " << e.what_without_backtrace() << "\n";
  }
  return 1;
}

}  // namespace flashrt::tools
