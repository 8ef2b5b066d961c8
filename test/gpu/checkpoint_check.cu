// The device trainer's checkpoints on a GPU (a plain main; the GPU-check build): the cuda
// trainer (GPT d 256, 4 layers, T 128, B 8, AdamW) in f32 and bf16 trains 3 steps, saves, and 2
// more; a fresh cuda trainer loads the save and trains 2 steps: its losses and parameters are
// the unbroken run's bit for bit. (The host trainer reading a device's files is tested on the
// emulated device, device.checkpoint: the host trainer does not compile under nvcc.) Without a
// device it exits 77.
#include "trainer_run.hpp"

#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/gemm.hpp>
#include <strata/core/cuda/launch.cuh>
#include <strata/io/device_checkpoint.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

namespace st = strata;
namespace gt = strata::test::gpu_trainer;
namespace fs = std::filesystem;

int checks = 0, failures = 0;

void check(bool ok, std::string const& what) {
  ++checks;
  if (!ok)
    ++failures;
  std::printf("  %-6s %s\n", ok ? "ok" : "FAILED", what.c_str());
}

template <class Trainer>
std::map<std::string, std::vector<double>> values_of(Trainer& t) {
  using E = typename Trainer::value_type;
  std::map<std::string, std::vector<double>> out;
  t.read_back();
  for (auto const& name : t.parameter_names()) {
    auto const v = t.values_of(name);
    auto& d = out[name];
    for (auto x : v)
      d.push_back(st::element_cast<double>(x));
  }
  return out;
}

template <class Plan>
void round_trip(char const* name, gt::token_data const& d) {
  using dev_t = st::trainer<st::models::gpt_model<float>, Plan, st::cuda>;
  fs::path const root = fs::temp_directory_path() /
                        ("strata_gpu_ckpt_" + std::string(name) + "_" + std::to_string(::getpid()));
  fs::remove_all(root);
  st::models::gpt_model<float> m{gt::config()};
  dev_t a(m, gt::make_optimizer<float>(true), gt::options(true),
          {.sequences = gt::batch, .seq = gt::seq});
  std::vector<double> whole;
  for (int k = 0; k < 3; ++k)
    whole.push_back(a.step(d.view<float>()).loss);
  (void)st::io::save(a, root);
  for (int k = 0; k < 2; ++k)
    whole.push_back(a.step(d.view<float>()).loss);
  auto const at5 = values_of(a);
  dev_t b(m, gt::make_optimizer<float>(true), gt::options(true),
          {.sequences = gt::batch, .seq = gt::seq});
  std::int64_t const step = st::io::load(b, root / "step-00000003");
  check(step == 3, std::string(name) + ": the load returns step 3");
  std::vector<double> resumed;
  for (int k = 0; k < 2; ++k)
    resumed.push_back(b.step(d.view<float>()).loss);
  check(resumed[0] == whole[3] && resumed[1] == whole[4],
        std::string(name) + ": steps 4 and 5 after the load have the unbroken run's losses");
  check(values_of(b) == at5,
        std::string(name) + ": the parameters after step 5 are the unbroken run's bit for bit");
  fs::remove_all(root);
}

} // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device on this machine (gpu test: the device trainer's "
                "checkpoints)\n");
    return 77;
  }
  try {
    gt::token_data const d(0xc4e6);
    round_trip<st::plan<>>("f32", d);
    round_trip<st::plan<st::precision::bf16>>("bf16", d);
  } catch (std::exception const& e) {
    std::printf("FAILED: the checkpoint checks threw: %s\n", e.what());
    ++failures;
  }
  std::printf("gpu checkpoint: %d checks, %d failed\n%s\n", checks, failures,
              failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
