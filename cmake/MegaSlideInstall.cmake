# Install and export: after `cmake --install build --prefix P`, an outside project does
#   find_package(MegaSlide CONFIG REQUIRED)   # with CMAKE_PREFIX_PATH="P;<LibTorch's cmake prefix>"
#   target_link_libraries(app PRIVATE MegaSlide::megaslide)
# and gets LibTorch's include paths, flags and libraries through the imported target.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MEGASLIDE_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/MegaSlide)

install(TARGETS megaslide EXPORT MegaSlideTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/megaslide DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT MegaSlideTargets NAMESPACE MegaSlide:: DESTINATION ${MEGASLIDE_CMAKE_INSTALL_DIR})

if(MEGASLIDE_BUILD_TOOLS)
  install(TARGETS megaslide-train megaslide-sample megaslide-eval megaslide-plan megaslide-plot megaslide-ablate megaslide-cache
                  megaslide-encode
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/ DESTINATION ${CMAKE_INSTALL_DATADIR}/megaslide/configs)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/MegaSlideConfig.cmake.in
  ${PROJECT_BINARY_DIR}/MegaSlideConfig.cmake INSTALL_DESTINATION ${MEGASLIDE_CMAKE_INSTALL_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/MegaSlideConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/MegaSlideConfig.cmake ${PROJECT_BINARY_DIR}/MegaSlideConfigVersion.cmake
        DESTINATION ${MEGASLIDE_CMAKE_INSTALL_DIR})
