# ctest -P script: the compiler's output (LOG, from build.cmake) has an error
# in compile_fail/CASE.cpp itself, and within the first lines of that
# error's own diagnostic (up to the next case's error) one line names the
# concept EXPECT describes. All cases share one translation unit, so a
# concept named only in another case's diagnostic must not count.
set(max_lines 20)
# One line: ".+" in EXPECT must not run on into the next line.
set(shown "${EXPECT}")
string(REPLACE ".+" "[^\n]+" EXPECT "${EXPECT}")
file(READ ${LOG} text)
string(REGEX MATCH "[^\n]*compile_fail/${CASE}\\.cpp:[0-9]+:[0-9]+: error[^\n]*"
       first "${text}")
if(NOT first)
  message(FATAL_ERROR "no error reported in compile_fail/${CASE}.cpp: it "
                      "compiled, but must be rejected (output in ${LOG})")
endif()
string(FIND "${text}" "${first}" at)
string(SUBSTRING "${text}" ${at} -1 block)
# The block ends where another case's error begins.
string(LENGTH "${first}" first_len)
string(SUBSTRING "${block}" ${first_len} -1 after)
string(REGEX MATCH "\n[^\n]*compile_fail/[a-z_]+\\.cpp:[0-9]+:[0-9]+: error"
       next "${after}")
if(next)
  string(FIND "${after}" "${next}" cut)
  math(EXPR cut "${cut} + ${first_len}")
  string(SUBSTRING "${block}" 0 ${cut} block)
endif()
# Its first max_lines lines.
set(head "")
set(rest "${block}")
foreach(i RANGE 1 ${max_lines})
  string(FIND "${rest}" "\n" nl)
  if(nl EQUAL -1)
    string(APPEND head "${rest}")
    break()
  endif()
  math(EXPR take "${nl} + 1")
  string(SUBSTRING "${rest}" 0 ${take} line)
  string(APPEND head "${line}")
  string(SUBSTRING "${rest}" ${take} -1 rest)
endforeach()
if(NOT head MATCHES "required for the satisfaction of [^\n]*${EXPECT}")
  if(block MATCHES "required for the satisfaction of [^\n]*${EXPECT}")
    set(where "further down its diagnostic than the first ${max_lines} lines")
  elseif(text MATCHES "required for the satisfaction of [^\n]*${EXPECT}")
    set(where "only in another case's diagnostic")
  else()
    set(where "nowhere")
  endif()
  message(FATAL_ERROR "compile_fail/${CASE}.cpp was rejected, but its "
                      "diagnostic does not name the concept within its first "
                      "${max_lines} lines: expected 'required for the "
                      "satisfaction of ... ${shown}' on one line; found it "
                      "${where} (output in ${LOG})")
endif()
message(STATUS "compile_fail/${CASE}.cpp rejected, naming the concept in its "
               "own diagnostic")
