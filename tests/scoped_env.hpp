// ScopedEnv: sets (or unsets) an environment variable for one scope, for tests.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace dptrain {

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  // Unsets it for the scope.
  ScopedEnv(const char* name, std::nullopt_t) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace dptrain
