// A shared library opened with dlopen on first use, and its entry points bound by dlsym to typed
// function pointers. For the GPU libraries (NCCL, cuBLASLt): the binary starts, and trains on
// the CPU, where they are not installed, and loading them costs nothing until a GPU needs them.
// Header-only, as kernels/ may use it.
#pragma once

#include <dlfcn.h>

#include <cstring>
#include <string>
#include <utility>

namespace dptrain {

class DynamicLibrary {
 public:
  // dlopen(name, RTLD_NOW | RTLD_LOCAL), searched as dlopen searches (LD_LIBRARY_PATH, the
  // binary's RUNPATH, the loader's cache). Never closed: these libraries keep threads and state
  // for the life of the process. Check loaded() and, when it is false, problem().
  explicit DynamicLibrary(std::string name) : name_(std::move(name)) {
    dlerror();
    handle_ = dlopen(name_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      const char* why = dlerror();
      open_error_ = why != nullptr ? why : "unknown error";
    }
  }

  const std::string& name() const { return name_; }
  bool loaded() const { return handle_ != nullptr; }

  // Binds `symbol` to `out`; a symbol the library lacks leaves `out` null, and the first one
  // missing is what problem() names.
  template <typename Function>
  void bind(const char* symbol, Function& out) {
    void* address = find(symbol);
    static_assert(sizeof(out) == sizeof(address));
    std::memcpy(&out, &address, sizeof out);  // object pointer -> function pointer, as POSIX allows
  }

  // The same for a symbol the library may lack (another version's): `out` stays null, and
  // problem() does not name it.
  template <typename Function>
  void bind_optional(const char* symbol, Function& out) {
    void* address = handle_ != nullptr ? dlsym(handle_, symbol) : nullptr;
    static_assert(sizeof(out) == sizeof(address));
    std::memcpy(&out, &address, sizeof out);
  }

  // Empty when the library loaded and every bound symbol was found; else "NAME could not be
  // loaded: <dlerror>" or "NAME has no SYMBOL".
  std::string problem() const {
    if (handle_ == nullptr) return name_ + " could not be loaded: " + open_error_;
    if (!missing_.empty()) return name_ + " has no " + missing_;
    return {};
  }

 private:
  void* find(const char* symbol) {
    if (handle_ == nullptr) return nullptr;
    void* address = dlsym(handle_, symbol);
    if (address == nullptr && missing_.empty()) missing_ = symbol;
    return address;
  }

  std::string name_;
  void* handle_ = nullptr;
  std::string open_error_;
  std::string missing_;  // the first symbol not found
};

}  // namespace dptrain
