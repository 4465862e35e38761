// libtorch (c10/util/logging) defines CHECK, CHECK_EQ, ... as aborting
// macros. Tests include torch first, drop those, then take doctest's.
#pragma once
#include <torch/torch.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
