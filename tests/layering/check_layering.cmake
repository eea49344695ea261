# The folders' dependency rule (docs/architecture.md): every folder of src/ and include/megaslide/ has a
# place in MEGASLIDE_LAYERS, lowest first, and a file may include the project's headers of its own folder
# and of folders below it, never of one above. A folder not in the list is an error too (a new folder
# must be given its place). The umbrella header include/megaslide/megaslide.h is above every folder.
#
#   cmake -DROOT=<source tree> -P check_layering.cmake
#
# Prints every offending include as "file:line: folder includes 'header' of a folder above it (other)"
# and fails when there is one.
cmake_minimum_required(VERSION 3.20)
if(NOT DEFINED ROOT)
  message(FATAL_ERROR "check_layering.cmake: pass -DROOT=<source tree>")
endif()
set(MEGASLIDE_LAYERS util io config offload attention model data diffusion train plan eval)

string(REPLACE ";" " < " order "${MEGASLIDE_LAYERS}")
set(problems 0)
set(checked 0)
foreach(tree src include/megaslide)
  file(GLOB_RECURSE files RELATIVE "${ROOT}/${tree}" "${ROOT}/${tree}/*.h" "${ROOT}/${tree}/*.cpp" "${ROOT}/${tree}/*.cuh"
       "${ROOT}/${tree}/*.cu" "${ROOT}/${tree}/*.inc")
  foreach(file IN LISTS files)
    if(NOT file MATCHES "/")
      continue()  # the umbrella header and files at the top sit above every folder
    endif()
    string(REGEX REPLACE "/.*" "" folder "${file}")
    list(FIND MEGASLIDE_LAYERS "${folder}" own)
    if(own EQUAL -1)
      message("${tree}/${file}: folder '${folder}' has no place in the dependency rule (tests/layering/check_layering.cmake)")
      math(EXPR problems "${problems} + 1")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    file(STRINGS "${ROOT}/${tree}/${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" header "${line}")
      set(target "")
      if(header MATCHES "^megaslide/([^/]+)/")
        set(target "${CMAKE_MATCH_1}")
      elseif(header MATCHES "^([^/]+)/")
        set(target "${CMAKE_MATCH_1}")  # a private header under src/ ("offload/streams.h")
      endif()
      if(target STREQUAL "")
        continue()
      endif()
      list(FIND MEGASLIDE_LAYERS "${target}" theirs)
      if(theirs EQUAL -1)
        continue()  # not one of ours (a dependency's "fmt/format.h", "c10/...")
      endif()
      if(theirs GREATER own)
        message("${tree}/${file}: ${folder} includes '${header}' of a folder above it (${target})")
        math(EXPR problems "${problems} + 1")
      endif()
    endforeach()
  endforeach()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "check_layering.cmake: no files under ${ROOT}/src or ${ROOT}/include/megaslide")
endif()
if(problems GREATER 0)
  message(FATAL_ERROR "${problems} include(s) break the dependency rule ${order} (docs/architecture.md)")
endif()
message("dependency rule holds: ${checked} files, folders ${order}")
