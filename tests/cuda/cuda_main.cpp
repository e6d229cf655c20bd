// Entry point of the GPU tests: exit 77 (ctest's SKIP_RETURN_CODE) with a visible SKIP line when
// there is no usable CUDA device, so a GPU-less machine reports them as skipped, never as passed.
#define CATCH_CONFIG_RUNNER
#include <cstdio>

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

int main(int argc, char** argv) {
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
