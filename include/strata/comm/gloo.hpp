// The gloo backend: one rank per process over Gloo's TCP transport, formed through strata's
// TCP store (gloo::make_world, gloo::communicator). Needs Gloo (Debian: libgloo-dev; link
// -lgloo -pthread, or strata::gloo in CMake).
#pragma once

#if !__has_include(<gloo/rendezvous/context.h>)
#error                                                                                             \
    "strata/comm/gloo.hpp needs Gloo's headers: install libgloo-dev (Debian) and link strata::gloo (-lgloo -pthread)"
#endif

#include <strata/comm/gloo/communicator.hpp>
#include <strata/comm/gloo/store.hpp>
#include <strata/comm/gloo/world.hpp>
