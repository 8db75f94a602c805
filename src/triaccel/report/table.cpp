#include "triaccel/report/table.h"

#include <cstdio>

namespace triaccel {
namespace {

// RFC 4180: a field holding a comma, a quote or a line break is quoted, its quotes doubled.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string csv_number(const std::optional<double>& v) {
  if (!v) return "";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", *v);
  return buf;
}

}  // namespace

std::string table_csv(const std::vector<RunModel>& runs) {
  std::string out = std::string(kTableCsvHeader) + "\n";
  for (const auto& m : runs) {
    const TableRow& r = m.row;
    out += csv_field(r.run) + "," + csv_field(r.method) + "," + csv_field(r.model) + "," + csv_field(r.dataset) + "," +
           csv_field(r.precision) + "," + (r.epochs ? std::to_string(*r.epochs) : "") + "," + csv_number(r.test_acc) +
           "," + csv_number(r.epoch_s) + "," + csv_number(r.peak_gb) + "," + csv_number(r.eff_score) + "," +
           table_source_name(r.source) + "," + std::to_string(r.ranks) + "\n";
  }
  return out;
}

}  // namespace triaccel
