// Entry point of the GPU tests: exit 77 (ctest's SKIP_RETURN_CODE) with a visible SKIP line when
// there is no usable CUDA device, so a GPU-less machine reports them as skipped, never as passed.
// `--host-only` runs just the cases tagged [host] (the launchers' argument checks, which return
// before any CUDA call), with or without a device, so that they run wherever the tests are built.
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <string_view>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  bool host_only = false;
  for (auto it = args.begin() + 1; it != args.end();) {
    if (std::string_view(*it) == "--host-only") {
      host_only = true;
      it = args.erase(it);
    } else {
      ++it;
    }
  }
  if (host_only) {
    // The tag first (an option that takes a value cannot swallow it), and a run that matches no
    // case fails (-w NoTests) rather than passing with nothing run.
    static char host_tag[] = "[host]";
    static char warn[] = "-w";
    static char no_tests[] = "NoTests";
    args.insert(args.begin() + 1, {host_tag, warn, no_tests});
    return Catch::Session().run(static_cast<int>(args.size()), args.data());
  }
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("SKIP: no usable CUDA device (%s); GPU tests not run\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("GPU tests on %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  }
  return Catch::Session().run(argc, argv);
}
