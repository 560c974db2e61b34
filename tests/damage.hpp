// Damaging files on purpose, for the tests of everything that must notice.
#pragma once

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "core/checkpoint.hpp"

namespace dptrain::test {

// XORs one byte of `file` at `offset`, in place.
inline void flip_byte(const std::filesystem::path& file, std::streamoff offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x5a));
}

// What edit_meta does with the checksum meta.json records of itself ("meta_checksum").
enum class Seal {
  keep,       // left as it was: the edit shows as a mismatch
  recompute,  // recorded anew for the edited content, as a careful forger would
  remove,     // dropped, as in checkpoints written before dptrain recorded one
};

// Rewrites checkpoint_dir/meta.json through `edit` (pretty-printed, as dptrain writes it).
inline void edit_meta(const std::filesystem::path& checkpoint_dir,
                      const std::function<void(nlohmann::json&)>& edit, Seal seal = Seal::keep) {
  const auto file = checkpoint_dir / "meta.json";
  std::ifstream in(file, std::ios::binary);
  nlohmann::json meta = nlohmann::json::parse(
      std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  in.close();
  edit(meta);
  if (seal == Seal::remove && meta.is_object()) meta.erase("meta_checksum");
  if (seal == Seal::recompute) meta["meta_checksum"] = meta_json_checksum(meta.dump());
  std::ofstream(file, std::ios::binary | std::ios::trunc) << meta.dump(2) << "\n";
}

}  // namespace dptrain::test
