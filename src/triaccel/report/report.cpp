#include "triaccel/report/report.h"

#include "triaccel/core/errors.h"
#include "triaccel/core/io.h"
#include "triaccel/report/page_assets.h"
#include "triaccel/report/run_events.h"
#include "triaccel/report/table.h"

#include <filesystem>

namespace triaccel {
namespace {

namespace fs = std::filesystem;

// Installed before the page's script so that even a syntax error in it lands in #page-errors (the browser test
// requires that element to stay empty).
constexpr const char* kErrorCaptureJs = R"JS((function () {
  var box = document.getElementById('page-errors');
  function add(text) { box.textContent += text + '\n'; }
  window.addEventListener('error', function (e) {
    add('error: ' + (e.message || e) + (e.filename ? ' (' + e.filename + ':' + e.lineno + ')' : ''));
  });
  var original = console.error;
  console.error = function () {
    add('console.error: ' + Array.prototype.map.call(arguments, String).join(' '));
    return original.apply(console, arguments);
  };
})();)JS";

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// JSON inside <script>: '<' only occurs in strings, where \u003c means the same and cannot close the element.
std::string json_for_script(const Json& j) {
  const std::string text = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (char c : text) out += c == '<' ? std::string("\\u003c") : std::string(1, c);
  return out;
}

void write_output(const std::string& path, const std::string& bytes, const char* flag) {
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  TRIACCEL_CHECK_INPUT(parent.empty() || fs::is_directory(parent, ec), "cannot write ", path, ": folder ",
                       parent.string(), " does not exist; create it or choose another ", flag);
  TRIACCEL_CHECK_INPUT(!fs::is_directory(path, ec), "cannot write ", path, ": it is a folder; give a file name to ",
                       flag, " (e.g. ", (fs::path(path) / "report.html").string(), ")");
  try {
    file_write_atomic(path, bytes);
  } catch (const UserError& e) {
    throw UserError(std::string(e.what()) + " (the file given to " + flag + ")");
  }
}

std::string html_page(const std::vector<RunModel>& runs, const std::string& title, const std::string& csv_name) {
  Json data{{"title", title}, {"csv", csv_name}, {"runs", Json::array()}};
  for (const auto& r : runs) data["runs"].push_back(run_model_json(r));
  const std::string t = html_escape(title);
  std::string inputs;
  for (const auto& r : runs) inputs += (inputs.empty() ? "" : ", ") + r.name;
  return "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
         "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
         "<meta name=\"generator\" content=\"triaccel report\">\n<title>" + t + "</title>\n<style>\n" +
         kReportPageCss + "</style>\n</head>\n<body data-rendered=\"no\">\n<header>\n<h1>" + t +
         "</h1>\n<p class=\"sub\">" + std::to_string(runs.size()) + " run" + (runs.size() == 1 ? "" : "s") + ": " +
         html_escape(inputs) + "</p>\n</header>\n<main>\n<pre id=\"page-errors\"></pre>\n<script>\n" +
         kErrorCaptureJs +
         "\n</script>\n<noscript><p>This report draws its charts with JavaScript; allow scripts for this file. The "
         "table is also in " + html_escape(csv_name) + ".</p></noscript>\n"
         "<section id=\"problems\"></section>\n<section>\n<h2>Runs side by side</h2>\n<div id=\"table\"></div>\n"
         "</section>\n<div id=\"charts\"></div>\n</main>\n<footer>Written by <code>triaccel report</code>; one "
         "self-contained file (no network). Hover a point, bar or cell for its value.</footer>\n"
         "<script type=\"application/json\" id=\"report-data\">" + json_for_script(data) + "</script>\n<script>\n" +
         kReportPageJs + "</script>\n</body>\n</html>\n";
}

}  // namespace

void ReportOptions::validate() const {
  TRIACCEL_CHECK_INPUT(!runs.empty(), "report needs at least one RUN_DIR (a folder written by `triaccel train --out`, "
                                      "or its events.jsonl): triaccel report RUN_DIR... -o report.html");
  TRIACCEL_CHECK_INPUT(!html.empty(), "-o must name the HTML file to write, e.g. -o report.html");
  TRIACCEL_CHECK_INPUT(csv_path() != html, "--csv ", csv_path(), " is the same file as -o; give the table another name");
}

std::string ReportOptions::csv_path() const {
  if (!csv.empty()) return csv;
  fs::path p(html);
  return p.replace_extension(".csv").string();
}

std::string report_html(const std::vector<RunModel>& runs, const std::string& title) {
  return html_page(runs, title, "report.csv");
}

ReportResult report_write(const ReportOptions& options) {
  options.validate();
  std::vector<RunEvents> events;
  for (const auto& path : options.runs) events.push_back(run_events_read(path));
  run_names_make_unique(events);
  ReportResult result;
  for (const auto& e : events) result.runs.push_back(run_model_build(e));
  result.html_path = options.html;
  result.csv_path = options.csv_path();
  write_output(result.csv_path, table_csv(result.runs), options.csv.empty() ? "-o" : "--csv");
  write_output(result.html_path, html_page(result.runs, options.title, fs::path(result.csv_path).filename().string()),
               "-o");
  return result;
}

}  // namespace triaccel
