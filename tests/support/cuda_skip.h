// The skip of a CUDA test where no GPU is usable: prints "SKIPPED: no usable
// GPU: <reason>" and returns without assertions; CTest counts the test as
// skipped (SKIP_REGULAR_EXPRESSION on the test_cuda_* executables in
// CMakeLists.txt: keep the two in step). tests/test_cuda_ops.cpp has its own
// copy of the same macro.
#pragma once
#include <catch2/catch.hpp>

#include <string>

#include "kernels/backend_factory.h"

namespace trainrun::test {

// The GPU count, or 0 with the reason.
inline int usable_gpus(std::string* reason) {
  static std::string why;
  static const int n = cuda_device_count(&why);
  *reason = why;
  return n;
}

}  // namespace trainrun::test

#define TR_CUDA_TEST_OR_SKIP()                                   \
  std::string skip_reason_;                                      \
  if (::trainrun::test::usable_gpus(&skip_reason_) == 0) {       \
    WARN("SKIPPED: no usable GPU: " << skip_reason_);            \
    return;                                                      \
  }
