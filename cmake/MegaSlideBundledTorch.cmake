# Where installed binaries find LibTorch. The bootstrap's LibTorch lives inside the checkout
# (.deps/python), which an install must not depend on: moving or deleting the clone would break every
# installed library and driver. With MEGASLIDE_INSTALL_LIBTORCH (AUTO: on exactly when LibTorch lies
# in the source tree) `cmake --install` copies LibTorch's C++ part (lib/, include/, share/ of the torch
# folder, and the wheel's nvidia/ folder its libraries' RPATH names) into <libdir>/megaslide/, and the
# installed RPATHs and MegaSlideConfig.cmake point there, relative to the prefix. Off, they name the
# LibTorch the build used, where it is (a LibTorch the user keeps in place).
set(MEGASLIDE_INSTALL_LIBTORCH AUTO CACHE STRING "Copy LibTorch into the install prefix: AUTO (when it lies in the source tree), ON, OFF")
set_property(CACHE MEGASLIDE_INSTALL_LIBTORCH PROPERTY STRINGS AUTO ON OFF)
include(GNUInstallDirs)

get_filename_component(MEGASLIDE_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(MEGASLIDE_TORCH_ROOT "${MEGASLIDE_TORCH_LIB_DIR}" DIRECTORY)  # holds lib/ include/ share/
if(MEGASLIDE_INSTALL_LIBTORCH STREQUAL "AUTO")
  cmake_path(IS_PREFIX PROJECT_SOURCE_DIR "${MEGASLIDE_TORCH_ROOT}" NORMALIZE MEGASLIDE_BUNDLE_TORCH)
elseif(MEGASLIDE_INSTALL_LIBTORCH)
  set(MEGASLIDE_BUNDLE_TORCH ON)
else()
  set(MEGASLIDE_BUNDLE_TORCH OFF)
endif()

# The installed library's folder as seen from bin/ (lib, or lib/<multiarch> under /usr).
file(RELATIVE_PATH _megaslide_bin_to_lib "/prefix/${CMAKE_INSTALL_BINDIR}" "/prefix/${CMAKE_INSTALL_LIBDIR}")
if(MEGASLIDE_BUNDLE_TORCH)
  set(MEGASLIDE_BUNDLED_TORCH_DIR "${CMAKE_INSTALL_LIBDIR}/megaslide/torch")  # relative to the prefix
  # One list for every installed target: the drivers in bin/ and the library in the library folder.
  set(CMAKE_INSTALL_RPATH "$ORIGIN/${_megaslide_bin_to_lib}" "$ORIGIN/${_megaslide_bin_to_lib}/megaslide/torch/lib"
                          "$ORIGIN/megaslide/torch/lib")
  message(STATUS "LibTorch: ${MEGASLIDE_TORCH_ROOT} (copied into the install prefix, MEGASLIDE_INSTALL_LIBTORCH=${MEGASLIDE_INSTALL_LIBTORCH})")
else()
  set(CMAKE_INSTALL_RPATH "$ORIGIN/${_megaslide_bin_to_lib}" "$ORIGIN" "${MEGASLIDE_TORCH_LIB_DIR}")
  message(STATUS "LibTorch: ${MEGASLIDE_TORCH_ROOT} (installed binaries use it in place, MEGASLIDE_INSTALL_LIBTORCH=${MEGASLIDE_INSTALL_LIBTORCH})")
endif()
