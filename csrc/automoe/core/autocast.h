// torch.autocast as the engine sees it: the dtype in effect for a device type, and a scope that
// sets (or clears) it and restores what was there.
#pragma once

#include <ATen/autocast_mode.h>

#include <optional>

namespace automoe {

// The autocast dtype for `device` when torch.autocast is on there, else nullopt.
inline std::optional<c10::ScalarType> autocast_dtype(c10::DeviceType device) {
  if (!at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::autocast::get_autocast_dtype(device);
}

class AutocastGuard {
 public:
  // `dtype`: autocast on with that dtype for the scope; nullopt: autocast off.
  AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype)
      : device_(device),
        was_enabled_(at::autocast::is_autocast_enabled(device)),
        was_dtype_(at::autocast::get_autocast_dtype(device)) {
    at::autocast::set_autocast_enabled(device_, dtype.has_value());
    if (dtype) at::autocast::set_autocast_dtype(device_, *dtype);
  }
  ~AutocastGuard() {
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, was_dtype_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  c10::ScalarType was_dtype_;
};

}  // namespace automoe
