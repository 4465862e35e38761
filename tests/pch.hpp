// Precompiled for every test translation unit: libtorch is the heavy part.
#pragma once
#include "ddpkit/detail/compat.hpp"
#include "doctest_torch.hpp"
