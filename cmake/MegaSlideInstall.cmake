# Install and export: after `cmake --install build --prefix P`, an outside project does
#   find_package(MegaSlide CONFIG REQUIRED)   # with CMAKE_PREFIX_PATH=P (and LibTorch's cmake prefix
#   target_link_libraries(app PRIVATE MegaSlide::megaslide)   # when it was not copied into P)
# and gets LibTorch's include paths, flags and libraries through the imported target.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MEGASLIDE_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/MegaSlide)

install(TARGETS megaslide EXPORT MegaSlideTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# umT5's tokenizer opens SentencePiece's module from libmegaslide's own folder.
if(TARGET megaslide_sentencepiece)
  install(TARGETS megaslide_sentencepiece LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/megaslide DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT MegaSlideTargets NAMESPACE MegaSlide:: DESTINATION ${MEGASLIDE_CMAKE_INSTALL_DIR})

if(MEGASLIDE_BUILD_TOOLS)
  install(TARGETS megaslide-train megaslide-sample megaslide-eval megaslide-plan megaslide-plot megaslide-ablate megaslide-cache
                  megaslide-encode
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/ DESTINATION ${CMAKE_INSTALL_DATADIR}/megaslide/configs)

# LibTorch's C++ part beside the library (cmake/MegaSlideBundledTorch.cmake decides), in the layout its
# libraries' RPATHs expect: torch/lib next to the wheel's nvidia/ folder.
if(MEGASLIDE_BUNDLE_TORCH)
  foreach(part lib include share)
    install(DIRECTORY ${MEGASLIDE_TORCH_ROOT}/${part} DESTINATION ${MEGASLIDE_BUNDLED_TORCH_DIR} USE_SOURCE_PERMISSIONS)
  endforeach()
  get_filename_component(_megaslide_torch_parent "${MEGASLIDE_TORCH_ROOT}" DIRECTORY)
  if(IS_DIRECTORY "${_megaslide_torch_parent}/nvidia")
    install(DIRECTORY ${_megaslide_torch_parent}/nvidia DESTINATION ${CMAKE_INSTALL_LIBDIR}/megaslide USE_SOURCE_PERMISSIONS)
  endif()
endif()
set(MEGASLIDE_CONFIG_TORCH_DIR "${CMAKE_INSTALL_LIBDIR}/megaslide/torch/share/cmake/Torch")  # read only when bundled

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/MegaSlideConfig.cmake.in
  ${PROJECT_BINARY_DIR}/MegaSlideConfig.cmake INSTALL_DESTINATION ${MEGASLIDE_CMAKE_INSTALL_DIR}
  PATH_VARS MEGASLIDE_CONFIG_TORCH_DIR)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/MegaSlideConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/MegaSlideConfig.cmake ${PROJECT_BINARY_DIR}/MegaSlideConfigVersion.cmake
        DESTINATION ${MEGASLIDE_CMAKE_INSTALL_DIR})
