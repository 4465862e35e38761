// doctest's implementation, in a translation unit of its own without
// libtorch: main.cpp and the suites then all use the precompiled header
// (main.cpp compiled without it cost a full libtorch parse).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
