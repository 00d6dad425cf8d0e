// A minimal check macro for the torch-free C++ tests run by ctest: a failed
// check prints where and why, and main() returns the number of failures.
#pragma once

#include <cmath>
#include <cstdio>

static int g_failures = 0;

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                      \
    }                                                                    \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                                  \
  do {                                                                                         \
    const double va_ = (a), vb_ = (b);                                                         \
    if (!(std::fabs(va_ - vb_) <= (tol))) {                                                    \
      std::fprintf(stderr, "%s:%d: %s = %.9g vs %s = %.9g (tol %g)\n", __FILE__, __LINE__, #a, \
                   va_, #b, vb_, static_cast<double>(tol));                                    \
      ++g_failures;                                                                            \
    }                                                                                          \
  } while (0)
