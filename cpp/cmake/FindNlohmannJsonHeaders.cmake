# NLOHMANN_JSON_INCLUDE_DIR: the directory holding nlohmann/json.hpp.
#
# Set it to use any copy. Otherwise it is looked for in the Python environment
# torch came from (the nlohmann-json wheel ships the headers in
# site-packages/nlohmann_json/include), then by asking Python3_EXECUTABLE (or
# the python3 on PATH), then in the system's include directories.
set(_flashrt_json_hints)
if(Torch_DIR)
  # <site-packages>/torch/share/cmake/Torch
  get_filename_component(_flashrt_site "${Torch_DIR}/../../../.." ABSOLUTE)
  list(APPEND _flashrt_json_hints "${_flashrt_site}/nlohmann_json/include")
endif()
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  # find_spec, not import: the wheel's __init__ imports a package it does not declare.
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import importlib.util, os; s = importlib.util.find_spec('nlohmann_json'); print(os.path.join(s.submodule_search_locations[0], 'include') if s else '')"
    OUTPUT_VARIABLE _flashrt_py_json OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_flashrt_py_json)
    list(APPEND _flashrt_json_hints "${_flashrt_py_json}")
  endif()
endif()
find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp HINTS ${_flashrt_json_hints}
  DOC "Directory holding nlohmann/json.hpp")
if(NOT NLOHMANN_JSON_INCLUDE_DIR)
  message(FATAL_ERROR "nlohmann/json.hpp not found: `pip install nlohmann-json==3.12.0` into the environment "
                      "torch is installed in, or pass -DNLOHMANN_JSON_INCLUDE_DIR=<dir holding nlohmann/json.hpp>")
endif()
message(STATUS "nlohmann/json: ${NLOHMANN_JSON_INCLUDE_DIR}")
