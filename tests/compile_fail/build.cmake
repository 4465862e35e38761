# ctest -P script: compiles compile_fail/all.cpp, which must fail, and keeps
# the compiler's output in LOG for the per-case checks (expect.cmake).
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR}
                        --target compile_fail_all
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
file(WRITE ${LOG} "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "tests/compile_fail/all.cpp compiled, but every case "
                      "in it must be rejected (output in ${LOG})")
endif()
message(STATUS "compile_fail/all.cpp was rejected, as it must be; output in ${LOG}")
