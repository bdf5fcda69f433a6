// Linked into every test executable except test_cuda_ops: hides the GPUs
// from the test and from every trainrun process it starts (they inherit the
// environment), before main() runs. On a GPU machine the multi-rank CPU
// tests would otherwise move to `backend: auto` = CUDA and compare bf16
// runs against fp32 tolerances, and the "no usable GPU" fallback and the
// `backend: cuda` error would go untested. CUDA treats an empty
// CUDA_VISIBLE_DEVICES as "no devices".
#include <cstdlib>

namespace {
struct HideGpus {
  HideGpus() { ::setenv("CUDA_VISIBLE_DEVICES", "", 1); }
} hide_gpus;
}  // namespace
