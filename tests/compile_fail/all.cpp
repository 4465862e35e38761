// Every compile-fail case in one translation unit: ddpkit's and libtorch's
// headers are parsed once instead of once per case (CI time). Each case's
// declaration fails on its own; tests/compile_fail/expect.cmake looks for
// each case's diagnostic in the compiler's output.
#define t t_syncbn_single
#include "syncbn_single.cpp"
#undef t
#define t t_distributed_single
#include "distributed_single.cpp"
#undef t
#define t t_sequential_ddp
#include "sequential_ddp.cpp"
#undef t
#define t t_not_a_policy
#include "not_a_policy.cpp"
#undef t
#define t t_not_a_model
#include "not_a_model.cpp"
#undef t
#define t t_engine_without_zero_grad
#include "engine_without_zero_grad.cpp"
#undef t
#define t t_misspelt_callback
#include "misspelt_callback.cpp"
#undef t
#define t t_misspelt_capability
#include "misspelt_capability.cpp"
#undef t
#define t t_not_a_task
#include "not_a_task.cpp"
#undef t
#define t t_random_zero
#include "random_zero.cpp"
#undef t
