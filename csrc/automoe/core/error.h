// automoe::Error and the AUTOMOE_CHECK macro: every input-dependent failure in the engine
// (a malformed file, an unknown config value, a shape mismatch) is reported through these, with
// a message that names the file / key / tensor, what was expected and what was found.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace automoe {

class Error : public std::runtime_error {
 public:
  explicit Error(std::string msg) : std::runtime_error(std::move(msg)) {}
};

namespace detail {
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Builds a message from any streamable pieces: AUTOMOE_ERROR("file ", path, ": bad header").
template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(detail::cat(std::forward<Args>(args)...));
}

}  // namespace automoe

// AUTOMOE_CHECK(cond, "what was expected", value...) — throws automoe::Error when cond is false.
#define AUTOMOE_CHECK(cond, ...)               \
  do {                                         \
    if (!(cond)) ::automoe::fail(__VA_ARGS__); \
  } while (0)
