// Precompiled for every test translation unit: libtorch is the heavy part.
#pragma once
#include "doctest_torch.hpp"
#include "ddpkit/dist/compat.hpp"
