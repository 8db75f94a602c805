#include "triaccel/train/checkpoint.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/core/torch_file.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <torch/autograd.h>
#include <torch/utils.h>
#include <zlib.h>

#include <filesystem>
#include <map>

namespace triaccel {
namespace {

using GenericDict = c10::impl::GenericDict;

uint32_t crc_update(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    crc = static_cast<uint32_t>(crc32(crc, p, chunk));
    p += chunk;
    n -= chunk;
  }
  return crc;
}

uint32_t crc_string(uint32_t crc, const std::string& s) {
  crc = crc_update(crc, s.data(), s.size());
  return crc_update(crc, "\0", 1);
}

uint32_t crc_tensors(uint32_t crc, const NamedTensors& tensors) {
  for (const auto& [name, t] : tensors) {
    crc = crc_string(crc, name);
    const at::Tensor c = t.contiguous();
    crc = crc_update(crc, c.data_ptr(), c.numel() * c.element_size());
  }
  return crc;
}

uint32_t checkpoint_checksum(const Checkpoint& c) {
  uint32_t crc = 0;
  crc = crc_string(crc, c.config.dump());
  crc = crc_string(crc, c.model_arch);
  crc = crc_string(crc, c.progress.dump());
  for (const NamedTensors* group : {&c.model, &c.optimizer, &c.scaler, &c.rng}) crc = crc_tensors(crc, *group);
  return crc;
}

NamedTensors to_cpu(const NamedTensors& in) {
  NamedTensors out;
  out.reserve(in.size());
  for (const auto& [name, t] : in) out.emplace_back(name, t.detach().to(at::kCPU).contiguous().clone());
  return out;
}

c10::Dict<std::string, at::Tensor> to_dict(const NamedTensors& tensors) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [name, t] : tensors) d.insert(name, t);
  return d;
}

}  // namespace

std::string checkpoint_path(const std::string& dir_or_file) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir_or_file, ec)) {
    return (std::filesystem::path(dir_or_file) / kCheckpointFile).string();
  }
  return dir_or_file;
}

void checkpoint_write(const std::string& path, const Checkpoint& checkpoint) {
  Checkpoint c = checkpoint;
  c.model = to_cpu(c.model);
  c.optimizer = to_cpu(c.optimizer);
  c.scaler = to_cpu(c.scaler);
  c.rng = to_cpu(c.rng);
  GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", std::string(kCheckpointFormat));
  d.insert("version", kCheckpointVersion);
  d.insert("config", c.config.dump());
  d.insert("model_arch", c.model_arch);
  d.insert("model", to_dict(c.model));
  d.insert("optimizer", to_dict(c.optimizer));
  d.insert("scaler", to_dict(c.scaler));
  d.insert("rng", to_dict(c.rng));
  d.insert("progress", c.progress.dump());
  d.insert("checksum", static_cast<int64_t>(checkpoint_checksum(c)));
  file_write_atomic(path, torch_save_bytes(c10::IValue(d)));
}

Checkpoint checkpoint_read(const std::string& path) {
  const std::string bytes = file_read_all(path);
  TRIACCEL_CHECK_INPUT(!bytes.empty(), "checkpoint ", path, " is empty; resume from another run folder");
  c10::IValue root;
  try {
    root = torch_load_bytes(bytes);
  } catch (const std::exception& e) {
    throw UserError("checkpoint " + path + " is corrupt or truncated (" + error_one_line(e) +
                    "); resume from another checkpoint or start afresh");
  }
  const auto fail = [&](const std::string& why) {
    throw UserError("checkpoint " + path + " is not a triaccel checkpoint: " + why);
  };
  if (!root.isGenericDict()) fail("top level is not a dict");
  const GenericDict d = root.toGenericDict();
  const auto entry = [&](const char* key) -> c10::IValue {
    if (!d.contains(key)) fail(std::string("missing entry '") + key + "'");
    return d.at(key);
  };
  const auto str = [&](const char* key) {
    const c10::IValue v = entry(key);
    if (!v.isString()) fail(std::string("entry '") + key + "' is not a string");
    return v.toStringRef();
  };
  const auto tensors = [&](const char* key) {
    const c10::IValue v = entry(key);
    if (!v.isGenericDict()) fail(std::string("entry '") + key + "' is not a dict");
    NamedTensors out;
    for (const auto& kv : v.toGenericDict()) {
      if (!kv.key().isString() || !kv.value().isTensor()) fail(std::string("entry '") + key + "' holds a non-tensor");
      // checkpoint_write stores contiguous tensors; a strided view could claim far more elements than its record
      // holds (a stride of 0), which the checksum below would materialize.
      if (!kv.value().toTensor().is_contiguous()) {
        fail(std::string("tensor '") + kv.key().toStringRef() + "' of entry '" + key + "' is not contiguous");
      }
      out.emplace_back(kv.key().toStringRef(), kv.value().toTensor());
    }
    return out;
  };
  if (str("format") != kCheckpointFormat) fail("format is '" + str("format") + "'");
  const c10::IValue version = entry("version");
  if (!version.isInt() || version.toInt() != kCheckpointVersion) {
    throw UserError("checkpoint " + path + " has format version " +
                    (version.isInt() ? std::to_string(version.toInt()) : "?") + ", this build reads version " +
                    std::to_string(kCheckpointVersion));
  }
  Checkpoint c;
  try {
    c.config = Json::parse(str("config"));
    c.progress = Json::parse(str("progress"));
  } catch (const Json::exception&) {
    fail("config or progress is not valid JSON");
  }
  c.model_arch = str("model_arch");
  c.model = tensors("model");
  c.optimizer = tensors("optimizer");
  c.scaler = tensors("scaler");
  c.rng = tensors("rng");
  const c10::IValue stored = entry("checksum");
  if (!stored.isInt()) fail("checksum is not an integer");
  const auto expected = static_cast<int64_t>(checkpoint_checksum(c));
  TRIACCEL_CHECK_INPUT(stored.toInt() == expected, "checkpoint ", path, " is corrupt: checksum ", stored.toInt(),
                       " != computed ", expected, "; resume from another checkpoint or start afresh");
  return c;
}


std::optional<Checkpoint> checkpoint_for_resume(const std::string& resume, const std::string& model, std::string* file) {
  if (resume.empty()) return std::nullopt;
  *file = checkpoint_path(resume);
  Checkpoint ckpt = checkpoint_read(*file);
  TRIACCEL_CHECK_INPUT(ckpt.model_arch == model, "checkpoint ", *file, " holds model ", ckpt.model_arch,
                       ", this run trains ", model);
  return ckpt;
}

}  // namespace triaccel
