// One-line notices on stderr ("automoe: ..."): what the engine did on the user's behalf that they
// should know about (skipped tensors, dequantised weights), never per-step chatter.
#pragma once

#include <iostream>
#include <sstream>

namespace automoe {

template <class... Args>
void log_info(const Args&... args) {
  std::ostringstream s;
  s << "automoe: ";
  (s << ... << args);
  s << "\n";
  std::cerr << s.str() << std::flush;
}

}  // namespace automoe
