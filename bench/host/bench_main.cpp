// Benchmark entry point: the console shows ratio counters (x_*) as plain numbers. They are
// computed as rates so that Google Benchmark divides them by the measured time, and the console
// reporter would otherwise print them with a "/s" suffix.
#include <string_view>
#include <vector>

#include <benchmark/benchmark.h>

namespace {

class ratio_reporter : public benchmark::ConsoleReporter {
public:
  ratio_reporter() : ConsoleReporter(OO_None) {} // plain text, one line a benchmark: fit for logs

  void ReportRuns(const std::vector<Run>& runs) override {
    std::vector<Run> shown = runs;
    for (Run& run : shown) {
      for (auto& [name, counter] : run.counters) {
        if (std::string_view(name).starts_with("x_")) {
          counter.flags = benchmark::Counter::kDefaults; // already divided by the time
        }
      }
    }
    ConsoleReporter::ReportRuns(shown);
  }
};

} // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
#if defined(NDEBUG)
  benchmark::AddCustomContext("kvkit_assertions", "off");
#elif defined(KVKIT_BENCH_GPU)
  // The GPU rows time kernels and their launchers, which hold no assertions: their figures do not
  // depend on the build type (device code is optimized either way).
  benchmark::AddCustomContext("kvkit_assertions", "on in host code, none on the timed GPU path");
#else
  benchmark::AddCustomContext("kvkit_assertions", "on (a debug build: figures not comparable)");
#endif
  ratio_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
