// Names of enum values as users write them, declared once per enum next to the enum:
//   template <> struct EnumNames<LrDecay> {
//     static constexpr EnumName<LrDecay> kNames[] = {{LrDecay::kCosine, "cosine"}, {LrDecay::kLinear, "linear"}};
//   };
// The first name of a value is its canonical spelling (enum_name, JSON, --help); later entries with the same value
// are accepted aliases. Past parsing, code holds the enum, never the string.
#pragma once

#include "triaccel/core/errors.h"

#include <string>
#include <vector>

namespace triaccel {

template <typename E>
struct EnumName {
  E value;
  const char* name;
};

template <typename E>
struct EnumNames;  // specialized next to each enum

template <typename E>
const char* enum_name(E value) {
  for (const auto& n : EnumNames<E>::kNames) {
    if (n.value == value) return n.name;
  }
  return "?";
}

// The canonical names, in declaration order.
template <typename E>
std::vector<std::string> enum_names() {
  std::vector<std::string> out;
  std::vector<E> seen;
  for (const auto& n : EnumNames<E>::kNames) {
    bool alias = false;
    for (E s : seen) alias = alias || s == n.value;
    if (alias) continue;
    seen.push_back(n.value);
    out.emplace_back(n.name);
  }
  return out;
}

// "a, b or c": a list of choices for a message.
inline std::string choices_text(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  return out;
}

template <typename E>
std::string enum_choices() {
  return choices_text(enum_names<E>());
}

template <typename E>
bool enum_try_parse(const std::string& text, E* out) {
  for (const auto& n : EnumNames<E>::kNames) {
    if (text == n.name) {
      *out = n.value;
      return true;
    }
  }
  return false;
}

// UserError naming the option (`key`, a configuration key) and its choices for an unknown name.
template <typename E>
E enum_parse(const std::string& text, const std::string& key) {
  E value{};
  TRIACCEL_CHECK_INPUT(enum_try_parse(text, &value), option_ref(key), " must be ", enum_choices<E>(), ", got '", text,
                       "'");
  return value;
}

}  // namespace triaccel
