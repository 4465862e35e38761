# ctest -P script: the compiler's output (LOG, from build.cmake) has an error
# in compile_fail/CASE.cpp itself and names the concept EXPECT describes.
file(READ ${LOG} text)
if(NOT text MATCHES "compile_fail/${CASE}\\.cpp:[0-9]+:[0-9]+: error")
  message(FATAL_ERROR "no error reported in compile_fail/${CASE}.cpp: it "
                      "compiled, but must be rejected (output in ${LOG})")
endif()
if(NOT text MATCHES "required for the satisfaction of .+${EXPECT}")
  message(FATAL_ERROR "compile_fail/${CASE}.cpp was rejected, but the "
                      "output does not name the concept: expected "
                      "'required for the satisfaction of ... ${EXPECT}' "
                      "(output in ${LOG})")
endif()
message(STATUS "compile_fail/${CASE}.cpp rejected, naming the concept")
